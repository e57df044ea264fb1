"""The store's named operations, on a real SQLite file, and the migration of old databases."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl_common.messages import GenerateRequest, RolloutBatch, encode
from hpcrl_scheduler import scheduler as scheduler_module
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.report import snapshot
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.selection import Program
from hpcrl_scheduler.store import GroupRow, Store

from .helpers import deliver, result

PROMPT = [{"role": "system", "content": "sys"}, {"role": "user", "content": "write it"}]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "s.sqlite")
    yield s
    s.close()


def plan(store: Store, iteration: int, ordinal: int, *, size: int = 3) -> str:
    group_id = f"x.s0.t{iteration}.g{ordinal:04d}"
    store.plan_group(
        group_id,
        iteration=iteration,
        ordinal=ordinal,
        parent_id="seed",
        mode="seed",
        target_stage=1,
        group_size=size,
        prompt=PROMPT,
    )
    return group_id


def close(store: Store, group_id: str, at: float, outcome: str = "sent") -> None:
    store.mark_closed(
        group_id,
        at=at,
        reason="complete",
        outcome=outcome,  # type: ignore[arg-type]
        host_class="x86-avx512",
        excluded=0,
        reward_mean=1.0,
        reward_max=2.0,
    )


def ids(groups: list[GroupRow]) -> list[str]:
    return [g.id for g in groups]


# --- the group life cycle -------------------------------------------------------------


def test_a_group_goes_from_planned_to_published_to_closed(store: Store):
    # planned out of order: admission still follows (iteration, ordinal)
    late, first, second = plan(store, 1, 0), plan(store, 0, 1), plan(store, 0, 0)
    assert ids(store.pending_groups()) == [second, first, late]
    assert store.count_pending_groups() == 3
    assert store.count_groups_by_state(0) == {"pending": 2, "published": 0, "closed": 0}
    planned = store.group(second)
    assert planned is not None and planned.state == "pending" and planned.prompt == PROMPT
    assert planned.published_at is None and planned.outcome is None

    store.mark_published(second, min_policy_version=4, at=100.0)
    group = store.group(second)
    assert group is not None and group.state == "published"
    assert (group.min_policy_version, group.published_at, group.last_progress_at) == (
        4,
        100.0,
        100.0,
    )
    assert ids(store.groups_in_flight()) == [second]
    assert store.count_groups_in_flight() == 1
    assert ids(store.pending_groups()) == [first, late]

    close(store, second, 150.0, "sent")
    closed = store.group(second)
    assert closed is not None and closed.state == "closed"
    assert (closed.closed_at, closed.close_reason, closed.outcome) == (150.0, "complete", "sent")
    assert (closed.host_class, closed.reward_mean, closed.reward_max) == ("x86-avx512", 1.0, 2.0)
    assert store.count_groups_in_flight() == 0
    assert store.count_groups_by_state(0) == {"pending": 1, "published": 0, "closed": 1}
    assert ids(store.groups_of_iteration(0)) == [second, first]
    assert ids(store.groups_of_iteration(1)) == [late]


def test_open_groups_and_batches_sent(store: Store):
    a, b, c = plan(store, 0, 0), plan(store, 0, 1), plan(store, 1, 0)
    assert (store.count_open_groups(0), store.count_open_groups(1)) == (2, 1)
    assert store.count_open_groups(2) == 0  # an iteration without groups has none open
    for group_id in (a, b):
        store.mark_published(group_id, min_policy_version=0, at=1.0)
    close(store, a, 2.0, "sent")
    assert store.count_open_groups(0) == 1  # a published group is still open
    close(store, b, 2.0, "no_rollout")
    assert store.count_open_groups(0) == 0 and store.count_open_groups(1) == 1
    # only a batch that went to the learner counts for pacing
    assert store.count_batches_sent() == 1
    store.mark_published(c, min_policy_version=0, at=3.0)
    close(store, c, 4.0, "sent")
    assert store.count_batches_sent() == 2


def test_deadlines_run_from_the_last_progress_and_restart_after_downtime(store: Store):
    quiet, busy, pending = plan(store, 0, 0), plan(store, 0, 1), plan(store, 0, 2)
    for group_id in (quiet, busy):
        store.mark_published(group_id, min_policy_version=0, at=100.0)
    store.note_progress(busy, 150.0)
    assert ids(store.overdue_groups(120.0)) == [quiet]
    assert ids(store.overdue_groups(160.0)) == [quiet, busy]
    assert store.overdue_groups(100.0) == []  # strictly older than the time given
    store.restart_deadlines(500.0)
    assert store.overdue_groups(160.0) == []
    assert {g.id: g.last_progress_at for g in store.groups_of_iteration(0)} == {
        quiet: 500.0,
        busy: 500.0,
        pending: None,
    }  # a pending group has no deadline yet
    close(store, quiet, 510.0)
    store.restart_deadlines(900.0)
    closed = store.group(quiet)
    assert closed is not None and closed.last_progress_at == 500.0  # closed: left alone


# --- results and what is read back from them --------------------------------------------


def test_rewards_are_recorded_per_result_and_summed_up_per_iteration(store: Store):
    g0, g1 = plan(store, 0, 0), plan(store, 1, 0)
    for group_id, index in ((g0, 0), (g0, 1), (g0, 2), (g1, 0)):
        store.add_result(result(group_id, index, gflops=1.0), received_at=1.0, late=False)
    store.add_result(result(g1, 1, gflops=1.0), received_at=2.0, late=True)
    assert store.rewards_of_iteration(0) == []  # rewards exist once a group is closed
    store.record_reward(f"{g0}/0", 100.0)
    store.record_reward(f"{g0}/1", -40.0)
    store.record_reward(f"{g1}/0", 50.0)
    assert sorted(store.rewards_of_iteration(0)) == [-40.0, 100.0]
    assert store.rewards_of_iteration(1) == [50.0]
    assert store.reward_stats_by_iteration() == {0: (30.0, 100.0), 1: (50.0, 50.0)}
    # a late result is stored but never counts
    assert store.count_results(g1) == 1 and [r.index for r in store.results_of(g1)] == [0]
    assert store.has_result(f"{g1}/1")


def test_gflops_are_read_back_by_iteration_and_stage(store: Store):
    store.add_program(
        Program(id="seed", stage=1, status="success", source="int s;", gflops=0.5), None
    )
    children = [
        ("a", 0, 1, 2.0),
        ("b", 0, 1, 3.0),
        ("c", 0, 2, 7.0),
        ("d", 1, 1, 4.0),
        ("e", 1, 1, None),
    ]
    for pid, iteration, stage, gflops in children:
        status = "success" if gflops is not None else "compile_error"
        store.add_program(
            Program(
                id=pid,
                stage=stage,
                status=status,
                source=f"int {pid};",
                gflops=gflops,
                iteration=iteration,
            ),
            "g",
        )
    by = store.gflops_by_iteration_and_stage()
    assert {key: sorted(values) for key, values in by.items()} == {
        (0, 1): [2.0, 3.0],
        (0, 2): [7.0],
        (1, 1): [4.0],
    }  # the seed is no child
    assert store.best_gflops_by_stage() == {1: 4.0, 2: 7.0}


# --- no SQL outside the store -----------------------------------------------------------


SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|WHERE|PRAGMA)\b")


def test_callers_cannot_hand_the_store_sql():
    for name in (
        "query",
        "execute",
        "scalar",
        "groups",
        "count_groups",
        "add_group",
        "update_group",
    ):
        assert not hasattr(Store, name), name
    package = Path(scheduler_module.__file__).parent
    for module in ("scheduler.py", "report.py", "service.py", "cli.py"):
        text = (package / module).read_text()
        assert not SQL.search(text), f"SQL in {module}: {SQL.search(text)}"


# --- databases written before `groups.batch` became `groups.outcome` ---------------------

# The schema as the scheduler wrote it before the rename, verbatim.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (
    id TEXT PRIMARY KEY, iteration INTEGER NOT NULL, stage INTEGER NOT NULL,
    key TEXT NOT NULL, source TEXT, parent_id TEXT, mode TEXT NOT NULL, status TEXT NOT NULL,
    gflops REAL, reward REAL, techniques TEXT NOT NULL DEFAULT '[]', error TEXT NOT NULL
    DEFAULT '', host_class TEXT NOT NULL DEFAULT '', group_id TEXT);
CREATE INDEX IF NOT EXISTS programs_iteration ON programs (iteration, stage);
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY, iteration INTEGER NOT NULL, ordinal INTEGER NOT NULL,
    parent_id TEXT NOT NULL, mode TEXT NOT NULL, target_stage INTEGER NOT NULL,
    group_size INTEGER NOT NULL, prompt TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    min_policy_version INTEGER, published_at REAL, last_progress_at REAL, closed_at REAL,
    close_reason TEXT, batch TEXT, host_class TEXT, excluded INTEGER NOT NULL DEFAULT 0,
    reward_mean REAL, reward_max REAL, UNIQUE (iteration, ordinal));
CREATE INDEX IF NOT EXISTS groups_state ON groups (state, iteration, ordinal);
CREATE TABLE IF NOT EXISTS results (
    id TEXT PRIMARY KEY, group_id TEXT NOT NULL, idx INTEGER NOT NULL, status TEXT NOT NULL,
    gflops REAL, reward REAL, host_class TEXT NOT NULL, late INTEGER NOT NULL DEFAULT 0,
    received_at REAL NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS results_group ON results (group_id);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, message_id TEXT NOT NULL,
    body BLOB NOT NULL, sent INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_unsent ON outbox (sent, seq);
"""

NOW = 1_000_000.0
DONE_T0 = "unit.s7.t0.g0000"  # iteration 0's group: closed, its batch sent
IN_FLIGHT = "unit.s7.t1.g0000"  # published, 1 of 3 results in
PENDING = "unit.s7.t1.g0001"  # planned, not yet requested


def write_old_database(path: Path) -> None:
    """A run killed in iteration 1 of 2 by a scheduler that still wrote ``groups.batch``."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(OLD_SCHEMA)
    meta = {
        "experiment": "unit",
        "seed": 7,
        "task": "matmul",
        "iteration": 1,
        "created_at": NOW - 3600,
        "iterations": 2,
        "reward_mode": "group_normalized",
    }
    db.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [(key, json.dumps(value)) for key, value in meta.items()],
    )
    db.execute(
        "INSERT INTO programs (id, iteration, stage, key, source, mode, status) "
        "VALUES ('seed', -1, 1, 'seedkey', 'void matmul_optimized(){}', 'seed', "
        "'success')"
    )
    columns = (
        "id, iteration, ordinal, parent_id, mode, target_stage, group_size, prompt, "
        "state, min_policy_version, published_at, last_progress_at, closed_at, "
        "close_reason, batch, host_class, reward_mean, reward_max"
    )
    prompt = json.dumps(PROMPT)
    db.executemany(
        f"INSERT INTO groups ({columns}) VALUES "
        "(?, ?, ?, 'seed', ?, ?, 3, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                DONE_T0,
                0,
                0,
                "seed",
                1,
                prompt,
                "closed",
                0,
                NOW - 3000,
                NOW - 2000,
                NOW - 2000,
                "complete",
                "sent",
                "x86-avx512",
                30.0,
                100.0,
            ),
            (
                IN_FLIGHT,
                1,
                0,
                "seed",
                1,
                prompt,
                "published",
                0,
                NOW - 600,
                NOW - 500,
                None,
                None,
                None,
                None,
                None,
                None,
            ),
            (
                PENDING,
                1,
                1,
                "deepen",
                2,
                prompt,
                "pending",
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
            ),
        ],
    )
    first = result(IN_FLIGHT, 0, gflops=2.0)
    db.execute(
        "INSERT INTO results (id, group_id, idx, status, gflops, host_class, late, "
        "received_at, body) VALUES (?, ?, 0, 'success', 2.0, 'x86-avx512', 0, ?, ?)",
        (first.id, IN_FLIGHT, NOW - 500, encode(first)),
    )
    db.close()


def columns_of_groups(path: Path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {row[1] for row in db.execute("PRAGMA table_info(groups)")}
    finally:
        db.close()


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def resume(path: Path, clock: Clock) -> Scheduler:
    config = SchedulerConfig(
        experiment={"name": "unit", "seed": 7},
        scheduler=SchedulerSection(
            iterations=2,
            group_size=3,
            node_budget=2,
            max_staleness=0,
            confirm_winners=False,
            metrics_port=0,
        ),
    )
    return Scheduler(config, Store(path), clock=clock)


def test_a_run_started_with_the_old_schema_resumes_after_the_rename(tmp_path: Path):
    path = tmp_path / "old.sqlite"
    write_old_database(path)
    assert "batch" in columns_of_groups(path)
    clock = Clock()
    s = resume(path, clock)
    assert {"outcome"} <= columns_of_groups(path) and "batch" not in columns_of_groups(path)

    # the closed group's value is intact under its new name, and pacing counts it
    done = s.store.group(DONE_T0)
    assert done is not None and done.outcome == "sent" and done.close_reason == "complete"
    assert s.pacing_state().batches_published == 1
    # the group in flight kept its state; its deadline restarted at the resume
    flight = s.store.group(IN_FLIGHT)
    assert flight is not None and flight.state == "published" and flight.outcome is None
    assert (flight.published_at, flight.last_progress_at) == (NOW - 600, NOW)

    s.step()  # admits the pending group, plans nothing (iteration 1 is open)
    assert s.iteration() == 1
    assert [m.id for _, _, m in s.store.unsent() if isinstance(m, GenerateRequest)] == [PENDING]

    deliver(s, result(IN_FLIGHT, 0, gflops=9.0))  # redelivered: already filed
    for index, gflops in ((1, 4.0), (2, 1.0)):
        deliver(s, result(IN_FLIGHT, index, gflops=gflops))
    closed = s.store.group(IN_FLIGHT)
    assert closed is not None and closed.state == "closed" and closed.outcome == "sent"
    [batch] = [m for _, _, m in s.store.unsent() if isinstance(m, RolloutBatch)]
    # the result filed before the migration is in the batch, with its original GFLOPS
    assert [x.reward for x in batch.samples] == [50.0, 100.0, 25.0]

    for index in range(3):
        deliver(s, result(PENDING, index, gflops=1.0 + index, stage=2))
    assert s.done()
    data = snapshot(s.store)
    assert data["done"] and [it["batches_sent"] for it in data["iterations"]] == [1, 2]
    s.store.close()

    again = resume(path, clock)  # opening a migrated database again changes nothing
    assert again.store.count_batches_sent() == 3 and again.done()
    again.store.close()


def test_a_read_only_open_reads_an_old_database_without_changing_it(tmp_path: Path):
    path = tmp_path / "old.sqlite"
    write_old_database(path)
    store = Store(path, read_only=True)
    try:
        done = store.group(DONE_T0)
        assert done is not None and done.outcome == "sent"
        assert store.count_groups_in_flight() == 1 and store.count_pending_groups() == 1
        data = snapshot(store)
        assert [it["batches_sent"] for it in data["iterations"]] == [1, 0]
    finally:
        store.close()
    assert "batch" in columns_of_groups(path) and "outcome" not in columns_of_groups(path)


def test_the_migration_is_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "old.sqlite"
    write_old_database(path)
    import hpcrl_scheduler.store as store_module

    # A second rename that fails (not a valid name) after the first one ran: the first
    # must be rolled back with it.
    monkeypatch.setattr(
        store_module,
        "RENAMED_COLUMNS",
        (*store_module.RENAMED_COLUMNS, ("groups", "ordinal", "two words")),
    )
    with pytest.raises(sqlite3.OperationalError):
        Store(path)
    assert "batch" in columns_of_groups(path) and "outcome" not in columns_of_groups(path)
