"""The scheduler's durable state in SQLite (WAL): pool, groups, results, outbox, counters.

Every state change and the messages it causes are written in one transaction; messages go
to an outbox and are published from there (and marked sent after the broker's confirm), so
a kill -9 at any point loses nothing: after a restart the outbox is published again with
the same ids, which consumers deduplicate. A result is stored before its delivery is acked.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl_common.messages import BenchResult, Message, decode, encode
from hpcrl_scheduler.selection import SEED_ID, Program

SCHEMA = """
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
    state: str
    min_policy_version: int | None
    published_at: float | None
    last_progress_at: float | None
    closed_at: float | None
    close_reason: str | None
    batch: str | None
    host_class: str | None
    excluded: int
    reward_mean: float | None
    reward_max: float | None

    @classmethod
    def of(cls, row: sqlite3.Row) -> GroupRow:
        data = dict(row)
        data["prompt"] = json.loads(data["prompt"])
        return cls(**data)


def program_of(row: sqlite3.Row) -> Program:
    return Program(
        id=row["id"], stage=row["stage"], status=row["status"], source=row["source"],
        gflops=row["gflops"], reward=row["reward"], error=row["error"],
        parent_id=row["parent_id"], mode=row["mode"], iteration=row["iteration"],
        host_class=row["host_class"], techniques=tuple(json.loads(row["techniques"])),
        key=row["key"],
    )


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
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable against a killed process (what we must survive); FULL would
            # add an fsync per transaction only to survive power loss.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        self._db.row_factory = sqlite3.Row
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

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        with self._lock:
            self._db.execute(sql, params)

    def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self.query(sql, params)
        return rows[0][0] if rows else None

    # --- meta -------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        value = self.scalar("SELECT value FROM meta WHERE key = ?", (key,))
        return default if value is None else json.loads(value)

    def set(self, key: str, value: Any) -> None:
        self.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                     "SET value = excluded.value", (key, json.dumps(value)))

    # --- programs ---------------------------------------------------------------------

    def add_program(self, program: Program, group_id: str | None) -> None:
        self.execute(
            "INSERT OR IGNORE INTO programs (id, iteration, stage, key, source, parent_id, mode,"
            " status, gflops, reward, techniques, error, host_class, group_id)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (program.id, program.iteration, program.stage, program.key, program.source,
             program.parent_id, program.mode, program.status, program.gflops, program.reward,
             json.dumps(list(program.techniques)), program.error, program.host_class,
             group_id),
        )

    def program(self, program_id: str) -> Program | None:
        rows = self.query("SELECT * FROM programs WHERE id = ?", (program_id,))
        return program_of(rows[0]) if rows else None

    def seed_program(self) -> Program:
        seed = self.program(SEED_ID)
        if seed is None:
            raise LookupError("the database has no seed program")
        return seed

    def pool(self, iteration: int) -> list[Program]:
        rows = self.query("SELECT * FROM programs WHERE iteration = ? ORDER BY id", (iteration,))
        return [program_of(r) for r in rows]

    def all_programs(self) -> list[Program]:
        return [program_of(r) for r in self.query("SELECT * FROM programs ORDER BY id")]

    # --- groups -----------------------------------------------------------------------

    def add_group(self, **fields: Any) -> None:
        fields = {**fields, "prompt": json.dumps(fields["prompt"])}
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        self.execute(f"INSERT INTO groups ({names}) VALUES ({marks})", tuple(fields.values()))

    def update_group(self, group_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{name} = ?" for name in fields)
        self.execute(f"UPDATE groups SET {sets} WHERE id = ?", (*fields.values(), group_id))

    def group(self, group_id: str) -> GroupRow | None:
        rows = self.query("SELECT * FROM groups WHERE id = ?", (group_id,))
        return GroupRow.of(rows[0]) if rows else None

    def groups(self, where: str = "1", params: tuple[Any, ...] = ()) -> list[GroupRow]:
        rows = self.query(f"SELECT * FROM groups WHERE {where} ORDER BY iteration, ordinal",
                          params)
        return [GroupRow.of(r) for r in rows]

    def count_groups(self, where: str, params: tuple[Any, ...] = ()) -> int:
        return int(self.scalar(f"SELECT COUNT(*) FROM groups WHERE {where}", params))

    # --- results ----------------------------------------------------------------------

    def has_result(self, result_id: str) -> bool:
        return self.scalar("SELECT 1 FROM results WHERE id = ?", (result_id,)) is not None

    def add_result(self, result: BenchResult, *, received_at: float, late: bool) -> None:
        self.execute(
            "INSERT INTO results (id, group_id, idx, status, gflops, host_class, late,"
            " received_at, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (result.id, result.group_id, result.index, result.status, result.gflops,
             result.host.host_class, int(late), received_at, encode(result)),
        )

    def results_of(self, group_id: str) -> list[BenchResult]:
        rows = self.query("SELECT body FROM results WHERE group_id = ? AND late = 0 ORDER BY idx",
                          (group_id,))
        return [decode(bytes(r["body"]), BenchResult) for r in rows]

    def count_results(self, group_id: str) -> int:
        return int(self.scalar("SELECT COUNT(*) FROM results WHERE group_id = ? AND late = 0",
                               (group_id,)))

    # --- outbox -----------------------------------------------------------------------

    def enqueue(self, queue: str, message: Message) -> None:
        self.execute("INSERT INTO outbox (queue, message_id, body) VALUES (?, ?, ?)",
                     (queue, message.id, encode(message)))

    def unsent(self, limit: int = 500) -> list[tuple[int, str, Message]]:
        rows = self.query("SELECT seq, queue, body FROM outbox WHERE sent = 0 ORDER BY seq "
                          "LIMIT ?", (limit,))
        return [(r["seq"], r["queue"], decode(bytes(r["body"]))) for r in rows]

    def mark_sent(self, seq: int) -> None:
        self.execute("UPDATE outbox SET sent = 1 WHERE seq = ?", (seq,))

    def count_unsent(self) -> int:
        return int(self.scalar("SELECT COUNT(*) FROM outbox WHERE sent = 0"))
