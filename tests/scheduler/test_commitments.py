"""Issue 28: tokens are trained only as the generator sent them. On the real RabbitMQ, with the
scheduler service in process, the generator's commitments published onto
``candidate-commitments`` and results onto ``bench-results`` (as a generator and a
benchmarker would):

* a result whose rollout is the one committed to is filed and goes to the learner;
* one whose rollout, or judged text, is not is dead-lettered with the reason and counted,
  and its group takes the genuine result in its place;
* one that comes before its commitment is held, then filed or dead-lettered when the
  commitment comes, or dead-lettered when none comes in time;
* a restart of the scheduler between a commitment and its result, or while a result is
  held, loses neither.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.messages import (
    BenchResult,
    GenerateRequest,
    PackedArray,
    RolloutBatch,
    text_sha256,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    Topology,
)

from ..conftest import RunningConsumer
from ..support.waiting import wait_for
from .helpers import commitment, result
from .test_service_broker import take
from .test_trust import dead_letters, service

pytestmark = pytest.mark.broker

TOKENS_66 = [66] * 40


def ignored(reason: str) -> float:
    value = REGISTRY.get_sample_value("hpcrl_scheduler_results_ignored_total", {"reason": reason})
    return value or 0.0


def forged(genuine: BenchResult) -> BenchResult:
    """The genuine result with another rollout: 40 x token 66 (the issue's)."""
    assert genuine.rollout is not None
    rollout = genuine.rollout.model_copy(
        update={
            "completion_token_ids": PackedArray.of(TOKENS_66, "<i4"),
            "sampling_logprobs": PackedArray.of([-0.1] * len(TOKENS_66), "<f4"),
        }
    )
    return genuine.model_copy(update={"rollout": rollout})


def judged(res: BenchResult, text: str) -> BenchResult:
    return res.model_copy(update={"completion_sha256": text_sha256(text)})


def publish(publisher: Publisher, topology: Topology, *items: object) -> None:
    """Commitments and results, in the order given."""
    publisher.publish(
        *(
            Publish(
                topology.name(
                    BENCH_RESULTS if isinstance(item, BenchResult) else CANDIDATE_COMMITMENTS
                ),
                item,  # type: ignore[arg-type]
            )
            for item in items
        )
    )


def tokens_of(batch: RolloutBatch) -> dict[str, list[int]]:
    return {s.candidate_id: s.completion_token_ids.numpy().tolist() for s in batch.samples}


def test_a_committed_rollout_is_trained_and_any_other_refused(
    broker_settings, raw_channel, tmp_path
):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, _svc = service(
        broker_settings, tmp_path, "commit", reward_mode="group_normalized", confirm_winners=False
    )
    mismatches = ignored("rollout_mismatch")
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        texts = [f"```c\n/* kernel {i} */\n```" for i in range(2)]
        genuine = [
            judged(result(request.id, i, gflops=1.0 + i, source=f"int k{i};"), texts[i])
            for i in range(2)
        ]
        publish(publisher, topology, commitment(genuine, texts=dict(enumerate(texts))), genuine[0])
        # Candidate 1, an honest figure at the group's top, with the forger's tokens (and
        # the hash of their text); then with the genuine tokens but another judged text.
        steering = forged(genuine[1])
        other_text = judged(genuine[1], "```c\nvoid fast(void) {}\n```")
        publish(publisher, topology, steering)
        reasons = dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
        publish(publisher, topology, other_text)
        reasons += dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
        assert len(reasons) == 2, reasons
        assert (
            f"result {steering.id} refused (rollout_mismatch): its rollout (40 completion"
            in (reasons[0])
        )
        assert "is not the one the generator committed to" in reasons[0], reasons
        assert "the text it says it judged" in reasons[1], reasons
        assert "is not the text the generator sent" in reasons[1], reasons
        assert ignored("rollout_mismatch") - mismatches == 2
        # Neither took the slot: the group waits for the genuine result, then closes.
        assert scheduler.store.count_results(request.id) == 1
        publish(publisher, topology, genuine[1])
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
    assert tokens_of(batch) == {
        r.id: r.rollout.completion_token_ids.numpy().tolist()  # type: ignore[union-attr]
        for r in genuine
    }
    assert [s.reward for s in batch.samples] == [50.0, 100.0]
    assert [s.completion_sha256 for s in batch.samples] == [text_sha256(t) for t in texts]
    group = scheduler.store.group(request.id)
    assert group is not None and group.close_reason == "complete"


def test_a_result_before_its_commitment_is_held_then_decided(
    broker_settings, raw_channel, tmp_path
):
    """Both results of the group come first (one genuine, one forged): nothing is filed;
    the commitment files the genuine one and dead-letters the other through the outbox;
    the genuine result of that candidate then completes the group."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, svc = service(
        broker_settings, tmp_path, "held", reward_mode="raw", confirm_winners=False
    )
    held = REGISTRY.get_sample_value("hpcrl_scheduler_results_held_total") or 0.0
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        genuine = [result(request.id, i, gflops=1.0 + i, source=f"int k{i};") for i in range(2)]
        publish(publisher, topology, genuine[0], forged(genuine[1]))
        wait_for(lambda: scheduler.store.count_held() == 2, 10, "both results held")
        assert scheduler.store.count_results(request.id) == 0
        assert (REGISTRY.get_sample_value("hpcrl_scheduler_results_held_total") or 0) - held == 2
        publish(publisher, topology, commitment(genuine))
        [reason] = dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
        assert reason.startswith(f"result {genuine[1].id} refused (rollout_mismatch)"), reason
        assert scheduler.store.count_held() == 0
        assert [r.id for r in scheduler.store.results_of(request.id)] == [genuine[0].id]
        wait_for(lambda: not svc._pending and not scheduler.store.count_unsent(), 10, "sent")
        # Acked as held, not as handled: the same id is taken again.
        publish(publisher, topology, genuine[1])
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
    assert tokens_of(batch) == {
        r.id: r.rollout.completion_token_ids.numpy().tolist()  # type: ignore[union-attr]
        for r in genuine
    }


def test_no_commitment_in_time_is_refused_or_with_require_off_filed(
    broker_settings, raw_channel, tmp_path
):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    for require in (True, False):
        scheduler, consumer, _svc = service(
            broker_settings,
            tmp_path,
            f"late-{require}",
            reward_mode="raw",
            confirm_winners=False,
            commitment_wait_s=0.5,
            require_commitments=require,
        )
        with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
            [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
            res = result(request.id, 0, gflops=2.0, source="int k;")
            publish(publisher, topology, res)
            if require:
                [reason] = dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
                assert f"result {res.id} refused (no_commitment)" in reason, reason
                assert "commitment_wait_s 0.5 s" in reason, reason
                assert scheduler.store.count_results(request.id) == 0
            else:
                wait_for(
                    lambda s=scheduler, r=request: s.store.count_results(r.id) == 1,
                    10,
                    "the result filed unchecked",
                )
                # A commitment that does come is enforced even so.
                other = result(request.id, 1, gflops=1.0, source="int j;")
                publish(publisher, topology, commitment([res, other]), forged(other))
                [reason] = dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
                assert "(rollout_mismatch)" in reason, reason


@pytest.mark.parametrize("first", ["commitment", "result"])
def test_a_restart_between_commitment_and_result_loses_neither(
    broker_settings, raw_channel, tmp_path, first
):
    """The scheduler stops after the first of the two and a new one (same database) takes
    the second: the result is decided against the commitment all the same."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    name = f"restart-{first}"
    scheduler, consumer, _svc = service(
        broker_settings, tmp_path, name, reward_mode="raw", confirm_winners=False
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        genuine = [result(request.id, i, gflops=1.0 + i, source=f"int k{i};") for i in range(2)]
        if first == "commitment":
            publish(publisher, topology, commitment(genuine))
            wait_for(
                lambda: len(scheduler.store.commitments_of(genuine[1].id)) == 1,
                10,
                "the commitment filed",
            )
        else:
            publish(publisher, topology, genuine[0], forged(genuine[1]))
            wait_for(lambda: scheduler.store.count_held() == 2, 10, "both results held")
    scheduler.store.close()

    scheduler, consumer, _svc = service(
        broker_settings, tmp_path, name, reward_mode="raw", confirm_winners=False
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        if first == "commitment":
            publish(publisher, topology, genuine[0], forged(genuine[1]))
        else:
            assert scheduler.store.count_held() == 2
            publish(publisher, topology, commitment(genuine))
        [reason] = dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
        assert f"result {genuine[1].id} refused (rollout_mismatch)" in reason, reason
        publish(publisher, topology, genuine[1])
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
    assert tokens_of(batch) == {
        r.id: r.rollout.completion_token_ids.numpy().tolist()  # type: ignore[union-attr]
        for r in genuine
    }
    assert scheduler.store.count_held() == 0
