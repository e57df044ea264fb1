"""Several tasks in one experiment (issue 30): one SQD pool per (task, stage), the node
budget split by weight, groups that never mix tasks, and the store's task column."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Reject
from hpcrl_common.messages import BenchSpec, Candidate, GenerateRequest
from hpcrl_common.task import load_task
from hpcrl_scheduler import confirm
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.report import export, snapshot
from hpcrl_scheduler.scheduler import Scheduler, SchedulerError
from hpcrl_scheduler.selection import Program, Ratios, dedupe, select, select_tasks, split_budget
from hpcrl_scheduler.store import Store

from .helpers import deliver, result
from .test_store import DONE_T0, IN_FLIGHT, PENDING, write_old_database
from .test_store import Clock as StoreClock
from .test_store import resume as resume_single_task

RATIOS = Ratios()


def prog(task: str, pid: str, stage: int = 1, status: str = "success", gflops=1.0) -> Program:
    return Program(
        id=f"{task}/{pid}",
        stage=stage,
        status=status,
        source=f"int v_{task}_{pid};",
        gflops=gflops if status == "success" else None,
        task=task,
        iteration=0,
        mode="seed",
    )


def seed(task: str) -> Program:
    return Program(id=f"seed.{task}", stage=1, status="success", source="int s;", task=task)


# --- the budget split (pure) --------------------------------------------------------------


def test_the_budget_is_split_by_weight():
    caps = {"a": 100, "b": 100, "c": 100}
    split = split_budget(8, {"a": 1, "b": 1, "c": 2}, caps, seed=0, iteration=0)
    assert split == {"a": 2, "b": 2, "c": 4}
    split = split_budget(10, {"a": 3, "b": 1, "c": 1}, caps, seed=0, iteration=0)
    assert split == {"a": 6, "b": 2, "c": 2}


def test_a_share_a_task_cannot_use_goes_to_the_others():
    # a has one candidate only: the rest of its share is shared by b and c by weight
    split = split_budget(
        9, {"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 50, "c": 50}, seed=0, iteration=0
    )
    assert split == {"a": 1, "b": 4, "c": 4}
    # nobody has candidates: nothing is spent
    assert split_budget(5, {"a": 1, "b": 1}, {"a": 0, "b": 0}, seed=0, iteration=0) == {
        "a": 0,
        "b": 0,
    }


def test_an_odd_unit_goes_by_a_seeded_hash_not_by_the_order_tasks_are_named():
    caps = {"a": 9, "b": 9}
    winners = {
        max(split, key=split.get)
        for t in range(12)
        for split in [split_budget(1, {"a": 1, "b": 1}, caps, seed=3, iteration=t)]
    }
    assert winners == {"a", "b"}  # over iterations each gets the odd unit sometimes
    once = split_budget(1, {"b": 1, "a": 1}, caps, seed=3, iteration=5)
    assert once == split_budget(1, {"a": 1, "b": 1}, caps, seed=3, iteration=5)
    assert sum(once.values()) == 1


# --- selection per (task, stage) (pure) ---------------------------------------------------


def pools_of_two() -> dict[str, list[Program]]:
    return {
        "a": [prog("a", str(i), gflops=float(i + 1)) for i in range(5)]
        + [prog("a", "f", status="compile_error")],
        "b": [prog("b", str(i), stage=2, gflops=float(i + 1)) for i in range(5)],
    }


def test_every_node_is_of_its_parents_task_and_every_task_expands_its_seed():
    pools = pools_of_two()
    nodes = select_tasks(
        pools,
        {"a": seed("a"), "b": seed("b")},
        {"a": 1.0, "b": 1.0},
        iteration=1,
        budget=4,
        ratios=RATIOS,
        seed=0,
    )
    assert [(n.mode, n.task) for n in nodes[:2]] == [("seed", "a"), ("seed", "b")]
    assert len(nodes) == 2 + 4
    for node in nodes[2:]:
        assert node.parent.id.startswith(f"{node.task}/") and node.parent.task == node.task
    # the others interleaved by task: a, b, a, b
    assert [n.task for n in nodes[2:]] == ["a", "b", "a", "b"]
    # b's nodes are planned on b's own pool only: its stage-2 successes, ranked among b
    deepened_b = [n for n in nodes if n.task == "b" and n.mode == "deepen"]
    assert deepened_b and deepened_b[0].parent.id == "b/4" and deepened_b[0].target_stage == 3


def test_a_task_with_no_share_expands_its_seed_only_not_its_whole_pool():
    nodes = select_tasks(
        pools_of_two(),
        {"a": seed("a"), "b": seed("b")},
        {"a": 1.0, "b": 1.0},
        iteration=1,
        budget=1,
        ratios=RATIOS,
        seed=0,
    )
    # one seed each plus the single budgeted node (0 must not read as "unbounded")
    assert len(nodes) == 3
    assert sum(n.mode == "seed" for n in nodes) == 2


def test_weights_shape_the_plan_and_unbounded_expands_every_candidate():
    pools, seeds = pools_of_two(), {"a": seed("a"), "b": seed("b")}
    heavy_a = select_tasks(
        pools, seeds, {"a": 3.0, "b": 1.0}, iteration=1, budget=4, ratios=RATIOS, seed=0
    )
    assert sum(n.task == "a" and n.mode != "seed" for n in heavy_a) == 3
    unbounded = select_tasks(
        pools, seeds, {"a": 1.0, "b": 1.0}, iteration=1, budget=0, ratios=RATIOS, seed=0
    )
    expected = sum(
        len(select(pools[t], seeds[t], iteration=1, budget=0, ratios=RATIOS, seed=0))
        for t in ("a", "b")
    )
    assert len(unbounded) == expected


def test_one_task_plans_exactly_as_select():
    pool = pools_of_two()["a"]
    alone = select_tasks(
        {"a": pool}, {"a": seed("a")}, {"a": 1.0}, iteration=2, budget=3, ratios=RATIOS, seed=9
    )
    assert alone == select(pool, seed("a"), iteration=2, budget=3, ratios=RATIOS, seed=9)


def test_the_same_program_in_two_tasks_is_two_nodes():
    a = prog("a", "x")
    b = Program(**{**a.__dict__, "id": "b/x", "task": "b"})
    assert a.key == b.key
    assert {p.id for p in dedupe([a, b])} == {"a/x", "b/x"}


# --- the scheduler over a real SQLite file ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, tasks: dict[str, float], db: str = "s.sqlite", **section) -> Scheduler:
    defaults = {
        "iterations": 2,
        "group_size": 2,
        "node_budget": 2,
        "max_staleness": 0,
        "metrics_port": 0,
        "confirm_winners": False,
        "require_commitments": False,
        "checkpoint_dir": tmp_path / "store",
    }
    config = SchedulerConfig(
        experiment={"name": "multi", "seed": 7, "tasks": tasks},
        scheduler=SchedulerSection(**{**defaults, **section}),
    )
    return Scheduler(config, Store(tmp_path / db), clock=Clock())


def requests(s: Scheduler) -> list[GenerateRequest]:
    return [m for _, _, m in s.store.unsent() if isinstance(m, GenerateRequest)]


FUNCTION = {name: load_task(name).function for name in ("matmul", "gemv", "stencil", "spmv")}


def answer(s: Scheduler, request: GenerateRequest, statuses, *, task: str | None = None) -> None:
    """Results judged as the request asked (or, ``task``, as another task)."""
    for index, status in enumerate(statuses):
        res = result(
            request.id,
            index,
            status,
            2.0 + index if status == "success" else None,
            stage=request.bench.stage,
            source=f"void {FUNCTION[request.bench.task]}() {{}} /* {request.id} {index} */",
            error="" if status == "success" else "x.c:1: error: boom",
        )
        bench = BenchSpec(task=task or request.bench.task, stage=request.bench.stage)
        deliver(s, res.model_copy(update={"bench": bench}))


def assert_one_task_per_request(request: GenerateRequest) -> str:
    """The request's task: its BenchSpec's, which its prompt describes and no other."""
    task = request.bench.task
    user = request.prompt[1].content
    assert FUNCTION[task] in user, (task, user[:300])
    assert not [f for t, f in FUNCTION.items() if t != task and f in user]
    return task


def test_two_tasks_one_pool_each_groups_never_mix(tmp_path):
    s = make(tmp_path, {"matmul": 1, "gemv": 1})
    s.step()
    first = requests(s)
    # iteration 0: each task's seed, in task order; ids as a single-task run numbers them
    assert [r.id for r in first] == ["multi.s7.t0.g0000", "multi.s7.t0.g0001"]
    assert [assert_one_task_per_request(r) for r in first] == ["gemv", "matmul"]
    assert {r.parent_id for r in first} == {"seed.gemv", "seed.matmul"}
    for request in first:
        answer(s, request, ["success", "success"])
    s.step()
    second = [r for r in requests(s) if r.iteration == 1]
    assert len(second) == 2 + 2  # two seeds and the budget of 2, one node per task
    for request in second:
        task = assert_one_task_per_request(request)
        group = s.store.group(request.id)
        assert group is not None and group.task == task
        parent = s.store.program(request.parent_id or "")
        assert parent is not None and parent.task == task  # never another task's program
    # a result judged as another task than its group's is refused, not filed
    deepen = next(r for r in second if r.mode == "deepen" and r.bench.task == "gemv")
    with pytest.raises(Reject, match="judged as task 'matmul'"):
        answer(s, deepen, ["success"], task="matmul")
    for request in second:
        answer(s, request, ["success", "compile_error"])
    assert s.done()
    # children are filed under their group's task, and per task the view keeps them apart
    assert {p.task for p in s.store.pool(1)} == {"gemv", "matmul"}
    for program in s.store.pool(1):
        group = s.store.group(program.id.rsplit("/", 1)[0])
        assert group is not None and program.task == group.task
    data = snapshot(s.store)
    assert data["tasks"] == ["gemv", "matmul"]
    assert set(data["by_task"]) == {"gemv", "matmul"}
    for it in data["iterations"]:  # each iteration's pool per task, stages counted apart
        counts = {t: sum(v["count"] for v in pool.values()) for t, pool in it["by_task"].items()}
        assert counts == {
            t: len(dedupe([p for p in s.store.pool(it["iteration"]) if p.task == t]))
            for t in ("gemv", "matmul")
        }
        # and its groups and rewards per task: the task's own, together all of them
        groups = s.store.groups_of_iteration(it["iteration"])
        pooled = []
        for t in ("gemv", "matmul"):
            rewards = s.store.rewards_of_iteration(it["iteration"], t)
            pooled += rewards
            mine = it["groups_by_task"][t]
            assert mine["groups"] == sum(g.task == t for g in groups) > 0
            assert mine["reward_max"] == (max(rewards) if rewards else None)
        assert sorted(pooled) == sorted(s.store.rewards_of_iteration(it["iteration"]))
        assert pooled  # not vacuous: the rewards were split, not lost
    best = data["by_task"]["gemv"]["best"]
    assert best is not None and s.store.program(best["id"]).task == "gemv"  # type: ignore[union-attr]
    index = export(s.store, tmp_path / "out")
    assert set(index["by_task"]) == {"gemv", "matmul"}
    for task, part in index["by_task"].items():
        assert part["lineage"][0]["id"] == f"seed.{task}"
        assert all(e["task"] == task for e in part["lineage"])
        assert (tmp_path / "out" / part["lineage"][-1]["file"]).parent.name == task


def test_metrics_per_stage_carry_the_task(tmp_path):
    s = make(tmp_path, {"matmul": 1, "gemv": 1})
    s.step()
    for request in requests(s):
        answer(s, request, ["success", "success"])
    s.refresh_metrics()
    for task in ("matmul", "gemv"):
        value = REGISTRY.get_sample_value(
            "hpcrl_scheduler_best_gflops_overall", {"task": task, "stage": "1"}
        )
        assert value == pytest.approx(3.0)


def test_the_winners_second_measurement_is_judged_as_its_groups_task(tmp_path):
    s = make(tmp_path, {"matmul": 1, "gemv": 1}, confirm_winners=True)
    s.step()
    gemv = next(r for r in requests(s) if r.bench.task == "gemv")
    results = [
        result(
            gemv.id,
            i,
            gflops=2.0 + i,
            source=f"void gemv_optimized() {{}} /* {i} */",
        ).model_copy(update={"bench": BenchSpec(task="gemv", stage=1)})
        for i in range(2)
    ]
    for res in results:  # each after its candidate's commitment
        deliver(s, res)
    [confirmation] = [m for _, _, m in s.store.unsent() if isinstance(m, Candidate)]
    assert confirmation.bench.task == "gemv"
    # what the scheduler asks for whatever task a winner reports (one judged as another
    # task is refused before it can win, so the flow above cannot show it)
    claimed = results[1].model_copy(update={"bench": BenchSpec(task="matmul", stage=1)})
    assert confirm.confirmation(claimed, gemv.id, 1, "x", task="gemv").bench.task == "gemv"


def test_a_single_task_run_is_unchanged(tmp_path):
    one = make(tmp_path, {}, db="one.sqlite")
    alone = make(tmp_path, {"matmul": 1}, db="alone.sqlite")
    for s in (one, alone):
        s.step()
    [a], [b] = requests(one), requests(alone)
    assert a.id == "multi.s7.t0.g0000" and a.parent_id == "seed"
    assert (a.id, a.parent_id, a.prompt, a.sampling, a.bench) == (
        b.id,
        b.parent_id,
        b.prompt,
        b.sampling,
        b.bench,
    )
    assert one.store.get("task") == "matmul"


def test_a_database_belongs_to_its_tasks(tmp_path):
    make(tmp_path, {"matmul": 1, "gemv": 1}).store.close()
    with pytest.raises(SchedulerError, match="belongs to"):
        make(tmp_path, {"matmul": 1, "gemv": 1, "spmv": 1})
    with pytest.raises(SchedulerError, match="belongs to"):
        make(tmp_path, {})
    # weights may change on a restart; the tasks may not
    make(tmp_path, {"gemv": 3, "matmul": 1}).store.close()


@pytest.mark.parametrize(
    ("tasks", "section", "expected"),
    [
        ({"matmul": 1, "dgemm": 1}, {}, "experiment task 'dgemm' does not load"),
        (
            {"matmul": 1, "libs/common/src/hpcrl_common/tasks/matmul.toml": 1},
            {},
            "are the same task 'matmul'",
        ),
        ({"matmul": 1, "gemv": 1}, {"seed_program": "x.c"}, "scheduler.seed_program"),
    ],
)
def test_bad_tasks_are_refused_by_name(tmp_path, tasks, section, expected):
    with pytest.raises(SchedulerError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        make(tmp_path, tasks, **section)


# --- a database of the single-task scheduler --------------------------------------------


def columns(path: Path, table: str) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    finally:
        db.close()


def test_an_old_database_gets_its_one_task_in_every_row(tmp_path):
    path = tmp_path / "old.sqlite"
    write_old_database(path)
    assert "task" not in columns(path, "programs") | columns(path, "groups")
    read_only = Store(path, read_only=True)  # reads the task without adding the column
    try:
        assert read_only.group(IN_FLIGHT).task == "matmul"  # type: ignore[union-attr]
        assert read_only.seed_programs()["matmul"].id == "seed"
    finally:
        read_only.close()
    assert "task" not in columns(path, "groups")
    s = resume_single_task(path, StoreClock())
    assert "task" in columns(path, "programs") and "task" in columns(path, "groups")
    db = sqlite3.connect(path)
    try:
        tasks = {
            row[0] for row in db.execute("SELECT task FROM programs UNION SELECT task FROM groups")
        }
    finally:
        db.close()
    assert tasks == {"matmul"}
    for group_id in (DONE_T0, IN_FLIGHT, PENDING):
        assert s.store.group(group_id).task == "matmul"  # type: ignore[union-attr]
    s.step()  # the pending group's request is judged as the run's task
    [request] = requests(s)
    assert request.id == PENDING and request.bench.task == "matmul"
    assert json.loads(json.dumps(snapshot(s.store)["tasks"])) == ["matmul"]
    s.store.close()
