"""The scheduler's durable state in SQLite (WAL): pool, groups, results, outbox, counters,
the generator's commitments and the results that wait for theirs.

Every state change and the messages it causes are written in one transaction; messages go
to an outbox and are published from there (and marked sent after the broker's confirm), so
a kill -9 at any point loses nothing: after a restart the outbox is published again with
the same ids, which consumers deduplicate. A result is stored before its delivery is acked.

All SQL lives here, behind operations named in the scheduler's words; callers pass values,
never SQL or column names. A group's life cycle is ``plan_group`` (pending) →
``mark_published`` (its request is in the outbox; ``note_progress`` on each result) →
``mark_closed`` (rewards recorded, children filed, ``outcome`` says what became of its
rollout batch). A closed group never reopens.

Schema changes migrate on open (``_migrate``), in one transaction and idempotently, so a
run started by an older scheduler resumes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from hpcrl_common.messages import BenchResult, Message, decode, encode
from hpcrl_common.topology import REASON_HEADER
from hpcrl_scheduler.selection import SEED_ID, Program

GroupState = Literal["pending", "published", "closed"]
GROUP_STATES: tuple[GroupState, ...] = ("pending", "published", "closed")
CloseReason = Literal["complete", "deadline"]
# What became of a closed group's rollout batch: published to the learner, not sent because
# no kept result had token data, or not sent because the group closed with no kept result.
BatchOutcome = Literal["sent", "no_rollout", "empty", "below_train_stage"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (
    id TEXT PRIMARY KEY, iteration INTEGER NOT NULL, stage INTEGER NOT NULL,
    key TEXT NOT NULL, source TEXT, parent_id TEXT, mode TEXT NOT NULL, status TEXT NOT NULL,
    gflops REAL, reward REAL, techniques TEXT NOT NULL DEFAULT '[]', error TEXT NOT NULL
    DEFAULT '', host_class TEXT NOT NULL DEFAULT '', group_id TEXT,
    task TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS programs_iteration ON programs (iteration, stage);
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY, iteration INTEGER NOT NULL, ordinal INTEGER NOT NULL,
    parent_id TEXT NOT NULL, mode TEXT NOT NULL, target_stage INTEGER NOT NULL,
    group_size INTEGER NOT NULL, prompt TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    min_policy_version INTEGER, published_at REAL, last_progress_at REAL, closed_at REAL,
    close_reason TEXT, outcome TEXT, host_class TEXT, excluded INTEGER NOT NULL DEFAULT 0,
    reward_mean REAL, reward_max REAL, task TEXT NOT NULL DEFAULT '',
    UNIQUE (iteration, ordinal));
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
CREATE TABLE IF NOT EXISTS outbox_headers (seq INTEGER PRIMARY KEY, headers TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commitments (
    candidate_id TEXT NOT NULL, rollout_sha256 TEXT NOT NULL, completion_sha256 TEXT NOT NULL,
    group_id TEXT NOT NULL, received_at REAL NOT NULL, completion TEXT,
    PRIMARY KEY (candidate_id, rollout_sha256, completion_sha256));
CREATE INDEX IF NOT EXISTS commitments_group ON commitments (group_id);
CREATE TABLE IF NOT EXISTS held_results (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, group_id TEXT NOT NULL,
    rollout_sha256 TEXT NOT NULL, publisher TEXT, held_since REAL NOT NULL,
    body BLOB NOT NULL, UNIQUE (id, rollout_sha256));
CREATE INDEX IF NOT EXISTS held_results_group ON held_results (group_id);
"""

# Columns renamed since a run could have started: (table, old name, new name). Applied in
# order on every writable open; each step is a no-op once done.
RENAMED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # It held "sent" / "no_rollout" / "empty", never a batch.
    ("groups", "batch", "outcome"),
)
# Columns added since a run could have started: (table, column, declaration). Added on a
# writable open where the table exists without them (SCHEMA creates new tables whole).
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # The committed text (candidate-commitment/2); NULL where a /1 carried hashes only.
    ("commitments", "completion", "TEXT"),
    # The task of a program and of a group (experiment.tasks, issue 30); a database of a
    # single-task run gets its one task (meta "task") in every row (TASK_FILLED).
    ("programs", "task", "TEXT NOT NULL DEFAULT ''"),
    ("groups", "task", "TEXT NOT NULL DEFAULT ''"),
)
# Tables whose ``task`` column, once added, is filled with the database's task.
TASK_FILLED: tuple[str, ...] = ("programs", "groups")


# An outbox row for ``<queue>`` + this goes to that queue's dead letters (its inbox).
DEAD_LETTER_SUFFIX = ".dlq"


@dataclass(frozen=True)
class HeldResult:
    """A result waiting for its candidate's commitment (``held_results``)."""

    seq: int
    result: BenchResult
    publisher: str | None
    held_since: float


@dataclass(frozen=True)
class GroupRow:
    id: str
    iteration: int
    ordinal: int
    parent_id: str
    mode: str
    target_stage: int
    group_size: int
    prompt: list[dict[str, str]]
    state: GroupState
    min_policy_version: int | None
    published_at: float | None
    last_progress_at: float | None
    closed_at: float | None
    close_reason: CloseReason | None
    outcome: BatchOutcome | None
    host_class: str | None
    excluded: int
    reward_mean: float | None
    reward_max: float | None
    task: str

    @classmethod
    def of(cls, row: sqlite3.Row) -> GroupRow:
        data = dict(row)
        data["prompt"] = json.loads(data["prompt"])
        return cls(**data)


def program_of(row: sqlite3.Row, legacy_task: str = "") -> Program:
    """``legacy_task``: the task of a database opened read-only before it had the column."""
    return Program(
        id=row["id"],
        stage=row["stage"],
        status=row["status"],
        source=row["source"],
        gflops=row["gflops"],
        reward=row["reward"],
        error=row["error"],
        parent_id=row["parent_id"],
        mode=row["mode"],
        iteration=row["iteration"],
        host_class=row["host_class"],
        techniques=tuple(json.loads(row["techniques"])),
        key=row["key"],
        # sqlite3.Row's `in` looks at the values, not the column names.
        task=row["task"] if "task" in row.keys() else legacy_task,  # noqa: SIM118
    )


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a database written by an older scheduler up to SCHEMA's column names."""
    # IMMEDIATE takes the write lock before looking, so two processes opening the same
    # file cannot both decide to rename.
    db.execute("BEGIN IMMEDIATE")
    try:
        for table, old, new in RENAMED_COLUMNS:
            present = _columns(db, table)
            if old in present and new not in present:
                db.execute(f"ALTER TABLE {table} RENAME COLUMN {old} TO {new}")
        for table, column, declaration in ADDED_COLUMNS:
            present = _columns(db, table)
            if present and column not in present:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
                if column == "task" and table in TASK_FILLED:
                    # Written before several tasks could share a run: every row is of the
                    # run's one task.
                    db.execute(f"UPDATE {table} SET task = ?", (_single_task(db),))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _single_task(db: sqlite3.Connection) -> str:
    """The task of a database written by a single-task scheduler (its meta ``task``)."""
    if not _columns(db, "meta"):
        return ""
    row = db.execute("SELECT value FROM meta WHERE key = 'task'").fetchone()
    task = json.loads(row[0]) if row else ""
    return task if isinstance(task, str) else ""


def _group_select(db: sqlite3.Connection) -> str:
    """The select list that reads a groups row into a GroupRow."""
    present = _columns(db, "groups")
    if "task" not in present:
        # A read-only open of a database from before the column: its one task.
        task = _single_task(db).replace("'", "''")
        return ", ".join(
            f"'{task}' AS task" if f.name == "task" else _renamed(f.name, present)
            for f in fields(GroupRow)
        )
    return ", ".join(_renamed(f.name, present) for f in fields(GroupRow))


def _renamed(name: str, present: set[str]) -> str:
    # A read-only open cannot migrate: read an old database's columns under their new names.
    renamed = {
        new: old
        for table, old, new in RENAMED_COLUMNS
        if table == "groups" and new not in present and old in present
    }
    return f"{renamed[name]} AS {name}" if name in renamed else name


class Store:
    """One SQLite connection shared by the scheduler's threads behind a lock."""

    def __init__(self, path: Path | str, *, read_only: bool = False) -> None:
        self.path = Path(path)
        if read_only:
            if not self.path.exists():
                raise FileNotFoundError(f"no scheduler database at {self.path}")
            uri = f"file:{self.path.resolve()}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                self.path, check_same_thread=False, timeout=30, isolation_level=None
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable against a killed process (what we must survive); FULL would
            # add an fsync per transaction only to survive power loss.
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Before SCHEMA: its CREATE IF NOT EXISTS leaves an old table as it is, and a
            # later index on a renamed column would not find it.
            _migrate(self._db)
            self._db.executescript(SCHEMA)
        self._db.row_factory = sqlite3.Row
        self._group_columns = _group_select(self._db)
        self._legacy_task = (
            "" if "task" in _columns(self._db, "programs") else _single_task(self._db)
        )
        self._lock = threading.RLock()
        self._depth = 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def tx(self) -> Iterator[Store]:
        """A write transaction (re-entrant on the same thread)."""
        with self._lock:
            if self._depth == 0:
                self._db.execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield self
            except BaseException:
                self._depth -= 1
                if self._depth == 0:
                    self._db.execute("ROLLBACK")
                raise
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("COMMIT")

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        with self._lock:
            self._db.execute(sql, params)

    def _scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self._query(sql, params)
        return rows[0][0] if rows else None

    # --- meta -------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        value = self._scalar("SELECT value FROM meta WHERE key = ?", (key,))
        return default if value is None else json.loads(value)

    def items(self, prefix: str) -> list[tuple[str, Any]]:
        """The meta rows whose key starts with ``prefix``, in key order."""
        rows = self._query(
            "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ? ORDER BY key",
            (len(prefix), prefix),
        )
        return [(key, json.loads(value)) for key, value in rows]

    def set(self, key: str, value: Any) -> None:
        self._execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
            "SET value = excluded.value",
            (key, json.dumps(value)),
        )

    # --- programs ---------------------------------------------------------------------

    def add_program(self, program: Program, group_id: str | None) -> None:
        self._execute(
            "INSERT OR IGNORE INTO programs (id, iteration, stage, key, source, parent_id, mode,"
            " status, gflops, reward, techniques, error, host_class, group_id, task)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                program.id,
                program.iteration,
                program.stage,
                program.key,
                program.source,
                program.parent_id,
                program.mode,
                program.status,
                program.gflops,
                program.reward,
                json.dumps(list(program.techniques)),
                program.error,
                program.host_class,
                group_id,
                program.task,
            ),
        )

    def program(self, program_id: str) -> Program | None:
        rows = self._query("SELECT * FROM programs WHERE id = ?", (program_id,))
        return program_of(rows[0], self._legacy_task) if rows else None

    def seed_program(self) -> Program:
        seed = self.program(SEED_ID)
        if seed is None:
            raise LookupError("the database has no seed program")
        return seed

    def seed_programs(self) -> dict[str, Program]:
        """Task → its seed program (iteration -1; anchors, -2, are not seeds)."""
        rows = self._query("SELECT * FROM programs WHERE iteration = -1 ORDER BY id")
        return {p.task: p for p in (program_of(r, self._legacy_task) for r in rows)}

    def pool(self, iteration: int) -> list[Program]:
        rows = self._query("SELECT * FROM programs WHERE iteration = ? ORDER BY id", (iteration,))
        return [program_of(r, self._legacy_task) for r in rows]

    def all_programs(self) -> list[Program]:
        rows = self._query("SELECT * FROM programs ORDER BY id")
        return [program_of(r, self._legacy_task) for r in rows]

    def gflops_by_iteration_and_stage(self) -> dict[tuple[int, int], list[float]]:
        """GFLOPS of every measured child, by (iteration, stage); the seed is left out."""
        out: dict[tuple[int, int], list[float]] = {}
        for row in self._query(
            "SELECT iteration, stage, gflops FROM programs "
            "WHERE iteration >= 0 AND gflops IS NOT NULL"
        ):
            out.setdefault((row[0], row[1]), []).append(row[2])
        return out

    def best_gflops_by_stage(self) -> dict[int, float]:
        rows = self._query(
            "SELECT stage, MAX(gflops) FROM programs WHERE gflops IS NOT NULL GROUP BY stage"
        )
        return {row[0]: row[1] for row in rows}

    def gflops_by_task_iteration_and_stage(self) -> dict[tuple[str, int, int], list[float]]:
        """GFLOPS of every measured child, by (task, iteration, stage); seeds left out."""
        out: dict[tuple[str, int, int], list[float]] = {}
        for row in self._query(
            "SELECT task, iteration, stage, gflops FROM programs "
            "WHERE iteration >= 0 AND gflops IS NOT NULL"
        ):
            out.setdefault((row[0] or self._legacy_task, row[1], row[2]), []).append(row[3])
        return out

    def best_gflops_by_task_and_stage(self) -> dict[tuple[str, int], float]:
        rows = self._query(
            "SELECT task, stage, MAX(gflops) FROM programs WHERE gflops IS NOT NULL "
            "GROUP BY task, stage"
        )
        return {(row[0] or self._legacy_task, row[1]): row[2] for row in rows}

    # --- groups: the life cycle -------------------------------------------------------

    def plan_group(
        self,
        group_id: str,
        *,
        iteration: int,
        ordinal: int,
        parent_id: str,
        mode: str,
        target_stage: int,
        group_size: int,
        prompt: list[dict[str, str]],
        task: str = "",
    ) -> None:
        """File a node of iteration ``iteration`` to expand; it starts pending."""
        self._execute(
            "INSERT INTO groups (id, iteration, ordinal, parent_id, mode, target_stage,"
            " group_size, prompt, task) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                group_id,
                iteration,
                ordinal,
                parent_id,
                mode,
                target_stage,
                group_size,
                json.dumps(prompt),
                task,
            ),
        )

    def mark_published(self, group_id: str, *, min_policy_version: int, at: float) -> None:
        """Its request is in the outbox: the group is in flight and its deadline runs."""
        self._execute(
            "UPDATE groups SET state = 'published', min_policy_version = ?,"
            " published_at = ?, last_progress_at = ? WHERE id = ?",
            (min_policy_version, at, at, group_id),
        )

    def note_progress(self, group_id: str, at: float) -> None:
        """A result arrived: the group's deadline starts again from ``at``."""
        self._execute("UPDATE groups SET last_progress_at = ? WHERE id = ?", (at, group_id))

    def restart_deadlines(self, at: float) -> None:
        """Every group in flight counts its deadline from ``at`` (time spent down is free)."""
        self._execute("UPDATE groups SET last_progress_at = ? WHERE state = 'published'", (at,))

    def mark_closed(
        self,
        group_id: str,
        *,
        at: float,
        reason: CloseReason,
        outcome: BatchOutcome,
        host_class: str,
        excluded: int,
        reward_mean: float | None,
        reward_max: float | None,
    ) -> None:
        self._execute(
            "UPDATE groups SET state = 'closed', closed_at = ?, close_reason = ?, outcome = ?,"
            " host_class = ?, excluded = ?, reward_mean = ?, reward_max = ? WHERE id = ?",
            (at, reason, outcome, host_class, excluded, reward_mean, reward_max, group_id),
        )

    # --- groups: reading --------------------------------------------------------------

    def _groups(self, where: str, params: tuple[Any, ...] = ()) -> list[GroupRow]:
        rows = self._query(
            f"SELECT {self._group_columns} FROM groups WHERE {where} ORDER BY iteration, ordinal",
            params,
        )
        return [GroupRow.of(r) for r in rows]

    def group(self, group_id: str) -> GroupRow | None:
        rows = self._groups("id = ?", (group_id,))
        return rows[0] if rows else None

    def groups_of_iteration(self, iteration: int) -> list[GroupRow]:
        return self._groups("iteration = ?", (iteration,))

    def pending_groups(self) -> list[GroupRow]:
        """Groups planned but not yet requested, in the order they are to be admitted."""
        return self._groups("state = 'pending'")

    def groups_in_flight(self) -> list[GroupRow]:
        return self._groups("state = 'published'")

    def overdue_groups(self, no_progress_since: float) -> list[GroupRow]:
        """Groups in flight whose last result (or publication) is older than the time given."""
        return self._groups("state = 'published' AND last_progress_at < ?", (no_progress_since,))

    def count_open_groups(self, iteration: int) -> int:
        """Groups of the iteration not yet closed; 0 means the iteration is complete."""
        return int(
            self._scalar(
                "SELECT COUNT(*) FROM groups WHERE iteration = ? AND state != 'closed'",
                (iteration,),
            )
        )

    def count_groups_by_state(self, iteration: int) -> dict[GroupState, int]:
        """The iteration's groups per state (every state present, 0 where none)."""
        counts: dict[GroupState, int] = dict.fromkeys(GROUP_STATES, 0)
        for row in self._query(
            "SELECT state, COUNT(*) FROM groups WHERE iteration = ? GROUP BY state", (iteration,)
        ):
            counts[row[0]] = row[1]
        return counts

    def count_pending_groups(self) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM groups WHERE state = 'pending'"))

    def count_groups_in_flight(self) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM groups WHERE state = 'published'"))

    def count_batches_sent(self) -> int:
        """Closed groups whose rollout batch went to the learner (all iterations)."""
        return int(self._scalar("SELECT COUNT(*) FROM groups WHERE outcome = 'sent'"))

    # --- results ----------------------------------------------------------------------

    def has_result(self, result_id: str) -> bool:
        return self._scalar("SELECT 1 FROM results WHERE id = ?", (result_id,)) is not None

    def add_result(self, result: BenchResult, *, received_at: float, late: bool) -> None:
        self._execute(
            "INSERT INTO results (id, group_id, idx, status, gflops, host_class, late,"
            " received_at, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                result.id,
                result.group_id,
                result.index,
                result.status,
                result.gflops,
                result.host.host_class,
                int(late),
                received_at,
                encode(result),
            ),
        )

    def results_of(self, group_id: str) -> list[BenchResult]:
        """The group's results filed in time (late ones are kept but never count)."""
        rows = self._query(
            "SELECT body FROM results WHERE group_id = ? AND late = 0 ORDER BY idx", (group_id,)
        )
        return [decode(bytes(r["body"]), BenchResult) for r in rows]

    def count_results(self, group_id: str) -> int:
        return int(
            self._scalar(
                "SELECT COUNT(*) FROM results WHERE group_id = ? AND late = 0", (group_id,)
            )
        )

    def record_reward(self, result_id: str, reward: float) -> None:
        self._execute("UPDATE results SET reward = ? WHERE id = ?", (reward, result_id))

    def rewards_of_iteration(self, iteration: int, task: str | None = None) -> list[float]:
        """Rewards given to the results of the iteration's closed groups (of ``task`` only,
        if given)."""
        where, args = "g.iteration = ?", [iteration]
        if task is not None:
            where, args = where + " AND g.task = ?", [*args, task]
        rows = self._query(
            "SELECT r.reward FROM results r JOIN groups g ON g.id = r.group_id "
            f"WHERE {where} AND r.reward IS NOT NULL",
            tuple(args),
        )
        return [row[0] for row in rows]

    def reward_stats_by_iteration(self) -> dict[int, tuple[float, float]]:
        """Iteration → (mean, max) of its rewards; iterations with none are left out."""
        rows = self._query(
            "SELECT g.iteration, AVG(r.reward), MAX(r.reward) FROM results r "
            "JOIN groups g ON g.id = r.group_id WHERE r.reward IS NOT NULL "
            "GROUP BY g.iteration"
        )
        return {row[0]: (row[1], row[2]) for row in rows}

    # --- commitments (hpcrl_scheduler.commitments) -----------------------------------

    def add_commitment(
        self,
        candidate_id: str,
        *,
        group_id: str,
        rollout_sha256: str,
        completion_sha256: str,
        completion: str | None,
        at: float,
    ) -> bool:
        """File what the generator sent as ``candidate_id`` (``completion``: its text, None
        from a ``candidate-commitment/1``); False if it was filed already (with its text,
        where it has one now)."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO commitments (candidate_id, rollout_sha256, completion_sha256,"
                " group_id, received_at, completion) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (candidate_id, rollout_sha256, completion_sha256) DO UPDATE"
                " SET completion = excluded.completion"
                " WHERE completion IS NULL AND excluded.completion IS NOT NULL",
                (candidate_id, rollout_sha256, completion_sha256, group_id, at, completion),
            )
            return cursor.rowcount > 0

    def commitments_of(self, candidate_id: str) -> list[tuple[str, str]]:
        """(rollout_sha256, completion_sha256) of each candidate the generator committed to
        under this id (more than one when a request was sampled again)."""
        rows = self._query(
            "SELECT rollout_sha256, completion_sha256 FROM commitments WHERE candidate_id = ?"
            " ORDER BY received_at",
            (candidate_id,),
        )
        return [(r[0], r[1]) for r in rows]

    def committed_text(
        self, candidate_id: str, *, rollout_sha256: str | None, completion_sha256: str | None
    ) -> str | None:
        """The text the generator committed to as ``candidate_id``: of the commitment whose
        rollout and text hashes are the ones given (where given), else of its first one;
        None where no commitment of it carried a text."""
        rows = self._query(
            "SELECT completion FROM commitments WHERE candidate_id = ? AND completion IS NOT"
            " NULL ORDER BY rollout_sha256 IS NOT ?, completion_sha256 IS NOT ?, received_at"
            " LIMIT 1",
            (candidate_id, rollout_sha256, completion_sha256),
        )
        return rows[0][0] if rows else None

    def forget_commitments(self, group_id: str) -> None:
        """A closed group's commitments are of no more use (its later results are late)."""
        self._execute("DELETE FROM commitments WHERE group_id = ?", (group_id,))

    def hold_result(
        self, result: BenchResult, *, rollout_sha256: str, publisher: str | None, at: float
    ) -> bool:
        """Keep a result until its candidate's commitment comes; False if held already."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO held_results (id, group_id, rollout_sha256, publisher,"
                " held_since, body) VALUES (?, ?, ?, ?, ?, ?)",
                (result.id, result.group_id, rollout_sha256, publisher, at, encode(result)),
            )
            return cursor.rowcount > 0

    def _held(self, where: str, params: tuple[Any, ...]) -> list[HeldResult]:
        rows = self._query(
            f"SELECT seq, publisher, held_since, body FROM held_results WHERE {where} ORDER BY seq",
            params,
        )
        return [
            HeldResult(
                r["seq"], decode(bytes(r["body"]), BenchResult), r["publisher"], r["held_since"]
            )
            for r in rows
        ]

    def held_results_of(self, candidate_id: str) -> list[HeldResult]:
        return self._held("id = ?", (candidate_id,))

    def held_results_of_group(self, group_id: str) -> list[HeldResult]:
        return self._held("group_id = ?", (group_id,))

    def held_since_before(self, at: float) -> list[HeldResult]:
        return self._held("held_since < ?", (at,))

    def release_held(self, seq: int) -> bool:
        """Stop holding it; False if it was released already."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM held_results WHERE seq = ?", (seq,))
            return cursor.rowcount > 0

    def count_held(self) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM held_results"))

    def restart_holds(self, at: float) -> None:
        """Held results wait for their commitment from ``at`` (time spent down is free)."""
        self._execute("UPDATE held_results SET held_since = ?", (at,))

    # --- outbox -----------------------------------------------------------------------

    def enqueue(self, queue: str, message: Message) -> None:
        self._execute(
            "INSERT INTO outbox (queue, message_id, body) VALUES (?, ?, ?)",
            (queue, message.id, encode(message)),
        )

    def enqueue_dead_letter(self, base: str, message: Message, reason: str) -> None:
        """Dead-letter ``message`` of queue ``base`` (already acked: held, then refused)
        through the outbox, with the reason as a consumer's dead letter has it."""
        self.enqueue(base + DEAD_LETTER_SUFFIX, message)
        seq = self._scalar("SELECT last_insert_rowid()")
        self._execute(
            "INSERT INTO outbox_headers (seq, headers) VALUES (?, ?)",
            (seq, json.dumps({REASON_HEADER: reason[:4000]})),
        )

    def outbox_headers(self, seq: int) -> dict[str, str]:
        value = self._scalar("SELECT headers FROM outbox_headers WHERE seq = ?", (seq,))
        return {} if value is None else json.loads(value)

    def unsent(self, limit: int = 500) -> list[tuple[int, str, Message]]:
        rows = self._query(
            "SELECT seq, queue, body FROM outbox WHERE sent = 0 ORDER BY seq LIMIT ?", (limit,)
        )
        return [(r["seq"], r["queue"], decode(bytes(r["body"]))) for r in rows]

    def mark_sent(self, seq: int) -> None:
        self._execute("UPDATE outbox SET sent = 1 WHERE seq = ?", (seq,))

    def count_unsent(self) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM outbox WHERE sent = 0"))
