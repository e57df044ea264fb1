import pytest

from hpcrl_scheduler.groups import close_group, compute_rewards, majority_class
from hpcrl_scheduler.pacing import PacingState, hold_reason, outstanding

from .helpers import result

G = "exp.s0.t1.g0001"


def test_raw_rewards_are_gflops_and_penalties():
    results = [
        result(G, 0, gflops=12.5),
        result(G, 1, "compile_error"),
        result(G, 2, "verification_error"),
        result(G, 3, "stage_violation"),
    ]
    rewards = compute_rewards(results, "raw")
    assert rewards == {f"{G}/0": 12.5, f"{G}/1": -40.0, f"{G}/2": -10.0, f"{G}/3": -100.0}


def test_group_normalized_success_is_share_of_the_best_times_100():
    results = [result(G, 0, gflops=10.0), result(G, 1, gflops=40.0), result(G, 2, "timeout")]
    rewards = compute_rewards(results, "group_normalized")
    assert rewards[f"{G}/0"] == pytest.approx(25.0)
    assert rewards[f"{G}/1"] == pytest.approx(100.0)
    assert rewards[f"{G}/2"] == -30.0


def test_batch_carries_tokens_rewards_and_mode():
    results = [result(G, 1, "compile_error"), result(G, 0, gflops=8.0)]
    closed = close_group(G, results, experiment="exp", iteration=1, reward_mode="group_normalized")
    batch = closed.batch
    assert batch is not None and batch.id == G and batch.reward_mode == "group_normalized"
    assert [s.candidate_id for s in batch.samples] == [f"{G}/0", f"{G}/1"]
    assert [s.reward for s in batch.samples] == [100.0, -40.0]
    assert [s.status for s in batch.samples] == ["success", "compile_error"]
    assert list(batch.prompt_token_ids.numpy()) == [1, 2, 3]
    assert list(batch.samples[1].completion_token_ids.numpy()) == [11, 11, 11]
    assert closed.reward_mean == pytest.approx(30.0)
    assert closed.reward_max == 100.0


def test_results_without_rollout_count_for_the_pool_but_not_the_learner():
    results = [
        result(G, 0, gflops=3.0, with_rollout=False),
        result(G, 1, "compile_error", with_rollout=False),
    ]
    closed = close_group(G, results, experiment="exp", iteration=0, reward_mode="raw")
    assert closed.batch is None
    assert len(closed.kept) == 2 and closed.skipped_no_rollout == 2
    partial = close_group(
        G,
        [result(G, 0, gflops=3.0, with_rollout=False), result(G, 1, "compile_error")],
        experiment="exp",
        iteration=0,
        reward_mode="raw",
    )
    assert partial.batch is not None and len(partial.batch.samples) == 1
    assert partial.skipped_no_rollout == 1


def test_mixed_host_classes_keep_the_majority_and_exclude_the_rest():
    results = [
        result(G, 0, gflops=10.0, host_class="a"),
        result(G, 1, gflops=99.0, host_class="b"),
        result(G, 2, gflops=5.0, host_class="a"),
    ]
    closed = close_group(G, results, experiment="exp", iteration=0, reward_mode="group_normalized")
    assert closed.host_class == "a"
    assert [r.index for r in closed.excluded] == [1]
    # The minority's 99 GFLOPS must not set the normalisation of the majority's results.
    assert closed.rewards == {f"{G}/0": 100.0, f"{G}/2": 50.0}
    assert closed.batch is not None and closed.batch.host_class == "a"


def test_host_class_ties_prefer_more_successes_then_name():
    assert (
        majority_class(
            [
                result(G, 0, "compile_error", host_class="a"),
                result(G, 1, gflops=1.0, host_class="b"),
            ]
        )
        == "b"
    )
    assert (
        majority_class(
            [result(G, 0, gflops=1.0, host_class="z"), result(G, 1, gflops=1.0, host_class="c")]
        )
        == "c"
    )


def test_an_empty_group_has_no_batch():
    closed = close_group(G, [], experiment="exp", iteration=0, reward_mode="raw")
    assert closed.batch is None and closed.reward_mean is None


def state(batches=0, in_flight=0, trained=0, per_step=1):
    return PacingState(batches, in_flight, trained, per_step)


def test_first_group_is_always_admitted():
    assert hold_reason(state(), max_staleness=2, max_groups_in_flight=64) is None
    assert hold_reason(state(), max_staleness=1, max_groups_in_flight=1) is None


def test_staleness_holds_until_the_learner_catches_up():
    assert (
        hold_reason(state(batches=1, in_flight=1), max_staleness=2, max_groups_in_flight=64)
        == "staleness"
    )
    assert (
        hold_reason(
            state(batches=1, in_flight=1, trained=1), max_staleness=2, max_groups_in_flight=64
        )
        is None
    )
    # A learner that takes 8 groups per step lets 16 be outstanding.
    assert (
        hold_reason(
            state(batches=10, in_flight=5, per_step=8), max_staleness=2, max_groups_in_flight=64
        )
        is None
    )
    assert (
        hold_reason(
            state(batches=10, in_flight=6, per_step=8), max_staleness=2, max_groups_in_flight=64
        )
        == "staleness"
    )
    assert outstanding(state(batches=3, in_flight=2, trained=4)) == 1


def test_in_flight_bound_and_off_switch():
    assert (
        hold_reason(state(batches=100, in_flight=3), max_staleness=0, max_groups_in_flight=4)
        is None
    )
    assert hold_reason(state(in_flight=4), max_staleness=0, max_groups_in_flight=4) == "in_flight"
    assert hold_reason(state(in_flight=400), max_staleness=0, max_groups_in_flight=0) is None
