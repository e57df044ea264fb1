"""The scheduler's state machine on a real SQLite file, fed messages directly (no broker)."""

from __future__ import annotations

import pytest

from hpcrl_common.broker import Ignore, Reject
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import GenerateRequest, RolloutBatch
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.report import export, snapshot
from hpcrl_scheduler.scheduler import Scheduler, SchedulerError
from hpcrl_scheduler.store import Store

from .helpers import deliver, needs_contract, result


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, clock=None, **section) -> Scheduler:
    # Winners' second measurements (confirm_winners) are tested in test_trust.py.
    defaults = {
        "iterations": 2,
        "group_size": 3,
        "node_budget": 2,
        "max_staleness": 0,
        "metrics_port": 0,
        "confirm_winners": False,
        "checkpoint_dir": tmp_path / "store",
    }
    config = SchedulerConfig(
        experiment={"name": "unit", "seed": 7},
        scheduler=SchedulerSection(**{**defaults, **section}),
    )
    return Scheduler(config, Store(tmp_path / "s.sqlite"), clock=clock or Clock())


def outbox(s: Scheduler):
    return [(queue, m) for _, queue, m in s.store.unsent()]


def requests(s: Scheduler) -> list[GenerateRequest]:
    return [m for q, m in outbox(s) if isinstance(m, GenerateRequest)]


def batches(s: Scheduler) -> list[RolloutBatch]:
    return [m for q, m in outbox(s) if isinstance(m, RolloutBatch)]


STAGE1_OK = "void matmul_optimized(double*A,double*B,double*C,int M,int N,int K){/*ok*/}"


def answer(s: Scheduler, request: GenerateRequest, statuses) -> None:
    for index, status in enumerate(statuses):
        gflops = 2.0 + index if status == "success" else None
        deliver(
            s,
            result(
                request.id,
                index,
                status,
                gflops,
                stage=request.bench.stage,
                source=f"{STAGE1_OK} /* {request.id} {index} */ int v{index};",
                error="x.c:1: error: boom" if status != "success" else "",
            ),
        )


def test_iteration_zero_expands_the_seed(tmp_path):
    s = make(tmp_path)
    s.step()
    [request] = requests(s)
    assert request.id == "unit.s7.t0.g0000"
    assert request.mode == "seed" and request.bench.stage == 1 and request.group_size == 3
    assert "matmul_optimized" in request.prompt[1].content
    assert request.min_policy_version == 0
    assert request.sampling.seed is not None


def test_a_complete_group_becomes_a_batch_and_children_then_the_next_iteration(tmp_path):
    s = make(tmp_path)
    s.step()
    [request] = requests(s)
    answer(s, request, ["success", "compile_error", "verification_error"])
    [batch] = batches(s)
    assert batch.id == request.id and batch.iteration == 0
    assert [x.reward for x in batch.samples] == [100.0, -40.0, -10.0]
    pool = s.store.pool(0)
    assert sorted(p.status for p in pool) == ["compile_error", "success", "verification_error"]
    assert all(p.parent_id == "seed" and p.stage == 1 for p in pool)
    s.step()
    assert s.iteration() == 1
    modes = [(r.mode, r.bench.stage) for r in requests(s) if r.iteration == 1]
    # budget 2 besides the seed: the one success is deepened, the best failure repaired
    assert modes == [("seed", 1), ("deepen", 2), ("repair", 1)]
    repair = next(r for r in requests(s) if r.mode == "repair")
    assert repair.parent_id == f"{request.id}/2"  # verification error before compile error
    assert "verification error: x.c:1: error: boom" in repair.prompt[1].content
    assert not s.done()


def test_duplicates_late_and_unknown_results(tmp_path):
    clock = Clock()
    s = make(tmp_path, clock, group_deadline_s=60)
    s.step()
    [request] = requests(s)
    deliver(s, result(request.id, 0, gflops=1.0))
    deliver(s, result(request.id, 0, gflops=9.0))  # redelivered copy: ignored
    assert s.store.count_results(request.id) == 1
    clock.now += 61
    s.step()  # the deadline closes the group short with what it has
    group = s.store.group(request.id)
    assert group.state == "closed" and group.close_reason == "deadline"
    [batch] = batches(s)
    assert len(batch.samples) == 1 and batch.samples[0].reward == 100.0
    deliver(s, result(request.id, 1, gflops=5.0))  # late: stored, not filed
    assert [p.id for p in s.store.pool(0)] == [f"{request.id}/0"]
    with pytest.raises(Reject):
        deliver(s, result("other.s0.t0.g0000", 0, gflops=1.0))
    with pytest.raises(Reject):
        deliver(s, result(request.id, 3, gflops=1.0))


def test_group_without_token_data_files_children_but_sends_no_batch(tmp_path):
    s = make(tmp_path, group_size=2)
    s.step()
    [request] = requests(s)
    for index in range(2):
        deliver(
            s,
            result(
                request.id, index, gflops=1.0 + index, with_rollout=False, source=f"int x{index};"
            ),
        )
    assert batches(s) == []
    assert s.store.group(request.id).outcome == "no_rollout"
    assert len(s.store.pool(0)) == 2


def test_groups_below_the_train_stage_fill_the_pool_but_send_no_batch(tmp_path):
    s = make(tmp_path, train_from_stage=2)
    s.step()
    [seed] = requests(s)
    answer(s, seed, ["success", "compile_error", "verification_error"])
    assert batches(s) == []  # stage 1: rewarded and filed, not trained on
    assert s.store.group(seed.id).outcome == "below_train_stage"
    assert [p.reward for p in sorted(s.store.pool(0), key=lambda p: p.id)] == [100.0, -40.0, -10.0]
    assert s.store.count_batches_sent() == 0
    s.step()
    deepen = next(r for r in requests(s) if r.mode == "deepen")
    answer(s, deepen, ["success", "success", "compile_error"])
    [batch] = batches(s)  # stage 2 reaches the learner
    assert batch.id == deepen.id and s.store.group(deepen.id).outcome == "sent"
    assert s.store.count_batches_sent() == 1


def test_run_to_the_end_then_done_and_report(tmp_path):
    s = make(tmp_path)
    for _ in range(4):
        s.step()
        for request in requests(s):
            if s.store.group(request.id).state == "published":
                answer(s, request, ["success", "stage_violation", "success"])
    assert s.done()
    data = snapshot(s.store)
    assert data["done"] and data["iterations_done"] == 2
    assert data["iterations"][1]["groups"] == 3
    assert set(data["pool"]) == {"1", "2"}  # the pool moved on to stage 2
    index = export(s.store, tmp_path / "out")
    assert set(index["best_per_stage"]) == {"1", "2"}
    assert index["lineage"][0]["id"] == "seed"
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "index.json" in files and "index.md" in files
    assert all(
        (tmp_path / "out" / e["file"]).read_text().startswith("/* hpcrl program")
        for e in index["lineage"]
    )


def commit(tmp_path, version: int, **pacing: int) -> CheckpointStore:
    """Version ``version`` in the learner's store the scheduler reads (make's checkpoint_dir)."""
    store = CheckpointStore(tmp_path / "store")
    staging = store.staging_dir(version)
    (staging / "w.bin").write_bytes(b"%d" % version)
    store.commit(
        staging, version, version - 1, "lora", metrics={k: float(v) for k, v in pacing.items()}
    )
    return store


def announce(
    s: Scheduler, store: CheckpointStore, stored: int, experiment: str = "unit", **changes
) -> int:
    """Announce version ``stored`` of the store, with ``changes`` (a forgery)."""
    update = store.get(stored).weight_update(store.root, run=f"{experiment}/{store.run_id}")
    s.handle_weight_update(update.model_copy(update=changes))
    return int(s.store.get("policy_version", 0))


def test_pacing_holds_requests_until_the_learner_trains(tmp_path):
    s = make(tmp_path, max_staleness=1, node_budget=4, initial_groups_per_step=1)
    s.step()
    [request] = requests(s)
    answer(s, request, ["success", "success", "verification_error"])
    s.step()
    # 1 batch published, nothing trained: limit 1 x 1 group -> everything held
    assert [r.iteration for r in requests(s)] == [0]
    store = commit(tmp_path, 1, groups_trained=1, groups_per_step=2)
    assert announce(s, store, 1) == 1
    s.step()
    new = [r for r in requests(s) if r.iteration == 1]
    assert len(new) == 2  # limit 1 x 2 groups per step
    assert all(r.min_policy_version == 1 for r in new)
    # an older (or repeated) announcement changes nothing
    assert announce(s, store, 1, id="v0b", groups_trained=0) == 1
    assert s.store.get("groups_trained") == 1


def test_groups_the_learner_dropped_as_stale_count_as_done(tmp_path):
    """A dropped group never comes back: counting it as outstanding narrowed the window for
    the rest of the run, one group per drop."""
    s = make(tmp_path)
    s.step()
    [request] = requests(s)
    answer(s, request, ["success", "success", "verification_error"])  # one batch sent
    announce(s, commit(tmp_path, 1, groups_trained=0, groups_dropped=1), 1)
    assert s.pacing_state().groups_trained == 1


def test_only_this_runs_versions_set_the_floor(tmp_path):
    """A version of another experiment, or of another training run (an old durable
    subscription, a forged 2^30), would make generators wait for a version never made: the
    first is ignored (not ours), the others are refused (dead-lettered)."""
    s = make(tmp_path)
    store = commit(tmp_path, 1)
    with pytest.raises(Ignore):
        announce(s, store, 1, experiment="other-experiment")
    assert announce(s, store, 1) == 1  # the store's run is this experiment's
    with pytest.raises(Reject, match="other_run"):
        announce(s, commit(tmp_path, 2), 2, run="unit/r-old")
    with pytest.raises(Reject, match="not_in_store"):
        announce(s, store, 2, id="v1073741824", version=2**30)
    assert announce(s, store, 2) == 2
    assert announce(s, store, 1) == 2


def test_restart_resumes_and_a_different_experiment_is_refused(tmp_path):
    s = make(tmp_path)
    s.step()
    [request] = requests(s)
    deliver(s, result(request.id, 0, gflops=1.0))
    s.store.close()
    again = make(tmp_path)
    again.step()
    assert [r.id for r in requests(again)] == [request.id]  # not planned twice
    assert again.store.count_results(request.id) == 1
    again.store.close()
    config = SchedulerConfig(
        experiment={"name": "unit", "seed": 8}, scheduler=SchedulerSection(metrics_port=0)
    )
    with pytest.raises(SchedulerError, match="belongs to"):
        Scheduler(config, Store(tmp_path / "s.sqlite"))


def test_outbox_rows_are_valid_wire_messages(tmp_path):
    s = make(tmp_path)
    s.step()
    [(_seq, queue, message)] = s.store.unsent()  # decoded from the stored wire bytes
    assert queue == "generate-requests"
    assert isinstance(message, GenerateRequest) and message.experiment == "unit"


@needs_contract
def test_the_success_scale_reaches_the_batch_and_the_pool_not_the_penalties(tmp_path):
    s = make(tmp_path, success_scale=400.0)
    s.step()
    [seed] = requests(s)
    answer(s, seed, ["success", "success", "timeout"])  # 2 and 3 GFLOPS
    [batch] = batches(s)
    assert batch.reward_mode == "group_normalized"
    assert [x.reward for x in batch.samples] == pytest.approx([2 / 3 * 400, 400.0, -30.0])
    stored = {p.id: p.reward for p in s.store.all_programs() if p.parent_id is not None}
    assert stored == pytest.approx(
        {f"{seed.id}/0": 2 / 3 * 400, f"{seed.id}/1": 400.0, f"{seed.id}/2": -30.0}
    )


@needs_contract
def test_parent_relative_groups_publish_rewards_against_their_parent(tmp_path):
    s = make(tmp_path, reward_mode="parent_relative")
    s.step()
    [seed] = requests(s)
    answer(s, seed, ["success", "compile_error", "verification_error"])
    # The seed has no GFLOPS, so its group falls back to group_normalized.
    assert [x.reward for x in batches(s)[0].samples] == [100.0, -40.0, -10.0]
    s.step()
    deepen = next(r for r in requests(s) if r.mode == "deepen")
    parent = s.store.program(deepen.parent_id)
    assert parent is not None and parent.source is not None and parent.gflops == 2.0
    copy = parent.source.replace("/*ok*/", "/* same code, new comment */\n")
    for index, (gflops, source) in enumerate(
        [(2.3, copy), (3.0, "int faster;"), (0.5, "int slower;")]
    ):
        deliver(s, result(deepen.id, index, gflops=gflops, stage=2, source=source))
    [batch] = [b for b in batches(s) if b.id == deepen.id]
    # copy -> 0 despite +15 % timing noise; 3 / 2 -> +50; 0.5 / 2 -> -75, clamped to -9
    assert batch.reward_mode == "parent_relative"
    assert [x.reward for x in batch.samples] == pytest.approx([0.0, 50.0, -9.0])
    assert {p.id: p.reward for p in s.store.pool(1) if p.parent_id == parent.id} == pytest.approx(
        {f"{deepen.id}/0": 0.0, f"{deepen.id}/1": 50.0, f"{deepen.id}/2": -9.0}
    )
    repair = next(r for r in requests(s) if r.mode == "repair")
    answer(s, repair, ["success", "success", "timeout"])  # 2 and 3 GFLOPS, parent failed
    [batch] = [b for b in batches(s) if b.id == repair.id]
    assert [x.reward for x in batch.samples] == pytest.approx([2 / 3 * 100, 100.0, -30.0])


TILED = """#define BM 32
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int ii = 0; ii < M; ii += BM) {
        int i_end = ii + BM < M ? ii + BM : M;
        for (int i = ii; i < i_end; i++) {
            for (int j = 0; j < N; j++) {
                double sum = 0.0;
                for (int k = 0; k < K; k++) {
                    sum += A[i * K + k] * B[k * N + j];
                }
                C[i * N + j] = sum;
            }
        }
    }
}
"""


def second_iteration_prompts(tmp_path, **section) -> dict[str, str]:
    """The user message of each mode of iteration 1, after the seed group wrote TILED."""
    s = make(tmp_path, **section)
    s.step()
    [seed] = requests(s)
    for index, status in enumerate(["success", "compile_error", "verification_error"]):
        source = TILED + f"int v{index};\n"
        deliver(
            s,
            result(
                seed.id,
                index,
                status,
                2.0 if status == "success" else None,
                source=source,
                error="" if status == "success" else "x.c:3: error: 'ii' undeclared",
            ),
        )
    s.step()
    return {r.mode: r.prompt[1].content for r in requests(s) if r.iteration == 1}


def test_restyled_parents_change_the_style_of_deepen_prompts_never_of_repair(tmp_path):
    plain = second_iteration_prompts(tmp_path / "plain")
    restyled = second_iteration_prompts(tmp_path / "restyled", restyle_parents=1.0)
    again = second_iteration_prompts(tmp_path / "again", restyle_parents=1.0)
    assert TILED in plain["deepen"] and TILED in plain["repair"]
    assert TILED not in restyled["deepen"]  # another style of the same program
    assert (
        "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K)"
        in (restyled["deepen"])
    )
    assert TILED in restyled["repair"]  # the error names the parent's own lines
    assert restyled == again  # seeded by the experiment: both arms of a bench see the same
