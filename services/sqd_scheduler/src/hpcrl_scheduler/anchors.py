"""Anchor nodes: prompts whose parent is a known kernel the policy did not write.

SQD's pool holds only the policy's own children, so after a few iterations GRPO trains on
extending its own programs and nothing else; measured on the fixed evaluation set (parents
written by hand), training bought speed on its own parents, not correctness on others'. An
anchor node asks for a deepen or improve child of a correct kernel of the bootstrap's
measured catalogue (``corpus.json`` beside the policy), at every stage in turn, so each
iteration also trains on parents the policy did not write.

Anchor children are rewarded and trained on like any group's, but they do not join the pool
(SQD's pool stays the policy's own lineage) and their parents carry no GFLOPS (they were timed
at build time, on another node perhaps), so no report counts a catalogue kernel as the run's.

Pure functions (no I/O but :func:`load_anchor_corpus`'s one read).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hpcrl_common.stages import FIRST_STAGE, LAST_STAGE
from hpcrl_scheduler.normalize import source_key
from hpcrl_scheduler.selection import Node, Program

ANCHOR_PREFIX = "anchor:"
# Anchors sit outside every iteration, apart from the seeds (iteration -1).
ANCHOR_ITERATION = -2
# A corpus row without a task is of the GEMM catalogue (written before several tasks).
DEFAULT_CORPUS_TASK = "matmul"


class AnchorError(ValueError):
    """The anchor corpus cannot be used."""


def is_anchor(program_id: str | None) -> bool:
    return bool(program_id) and program_id.startswith(ANCHOR_PREFIX)  # type: ignore[union-attr]


def anchors_from_rows(rows: list[dict], task: str, *, corpus_task: str) -> list[Program]:
    """The correct kernels of ``corpus_task`` among corpus rows, as parents of ``task``'s pool.

    One per normalised source; ids name the source's key, so they are stable across restarts.
    """
    anchors: dict[str, Program] = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("status") != "success":
            continue
        if row.get("task", DEFAULT_CORPUS_TASK) != corpus_task:
            continue
        source, stage = row.get("source"), row.get("stage")
        if not isinstance(source, str) or not source.strip():
            continue
        if not isinstance(stage, int) or not FIRST_STAGE <= stage <= LAST_STAGE:
            continue
        key = source_key(source)
        anchors.setdefault(
            key,
            Program(
                id=f"{ANCHOR_PREFIX}{stage}:{key[:16]}",
                stage=stage,
                status="success",
                source=source,
                mode="anchor",
                iteration=ANCHOR_ITERATION,
                key=key,
                task=task,
            ),
        )
    return sorted(anchors.values(), key=lambda p: p.id)


def load_anchor_corpus(path: Path, task: str, *, corpus_task: str) -> list[Program]:
    """:func:`anchors_from_rows` of a ``corpus.json``; an unreadable or empty one is an error."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AnchorError(f"scheduler.anchor_corpus {path}: cannot read it ({exc})") from exc
    if not isinstance(rows, list):
        raise AnchorError(f"scheduler.anchor_corpus {path}: expected a JSON list of rows")
    anchors = anchors_from_rows(rows, task, corpus_task=corpus_task)
    if not anchors:
        raise AnchorError(
            f"scheduler.anchor_corpus {path}: no correct kernel of task {corpus_task!r} "
            "with a source and a stage 1-6"
        )
    return anchors


def anchor_slots(stages: list[int]) -> list[tuple[int, str]]:
    """Every (parent stage, mode) an anchor can take: improve at each stage, deepen below the
    last (deepening the last stage would be an improve by another name)."""
    slots = []
    for stage in sorted(set(stages)):
        slots.append((stage, "improve"))
        if stage < LAST_STAGE:
            slots.append((stage, "deepen"))
    return slots


def _digest(*parts: object) -> str:
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()


def select_anchors(anchors: list[Program], count: int, *, iteration: int, seed: int) -> list[Node]:
    """``count`` anchor nodes of ``iteration``.

    The slots (stage, mode) are visited in one seeded order, ``count`` a iteration, so a run
    covers every stage and mode before it repeats one; within a slot the parent is drawn by a
    hash of (seed, iteration, place). Deterministic for a seed: two arms of a comparison ask
    the same prompts.
    """
    if count <= 0 or not anchors:
        return []
    by_stage: dict[int, list[Program]] = {}
    for anchor in anchors:
        by_stage.setdefault(anchor.stage, []).append(anchor)
    slots = sorted(anchor_slots(list(by_stage)), key=lambda s: _digest(seed, "slot", *s))
    nodes = []
    for place in range(count):
        stage, mode = slots[(iteration * count + place) % len(slots)]
        choices = sorted(by_stage[stage], key=lambda p: _digest(seed, iteration, place, p.id))
        target = min(stage + 1, LAST_STAGE) if mode == "deepen" else stage
        nodes.append(Node(choices[0], mode, target))
    return nodes
