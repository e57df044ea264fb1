"""Anchor nodes: parents from the policy's measured catalogue, trained on, kept out of the pool."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hpcrl_common.stages import LAST_STAGE
from hpcrl_scheduler.anchors import (
    ANCHOR_ITERATION,
    AnchorError,
    anchor_slots,
    anchors_from_rows,
    is_anchor,
    load_anchor_corpus,
    select_anchors,
)
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.scheduler import Scheduler, SchedulerError
from hpcrl_scheduler.store import Store

from .test_scheduler_state import TILED, answer, batches, make, requests

SIGNATURE = "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K)"


def kernel(stage: int, variant: int = 0) -> str:
    return f"{SIGNATURE} {{ /* stage {stage} */ int v{variant} = {stage}; (void)v{variant}; }}\n"


def rows_of_every_stage(per_stage: int = 2) -> list[dict]:
    return [
        {"stage": stage, "status": "success", "gflops": 1.0 + stage, "source": kernel(stage, n)}
        for stage in range(1, LAST_STAGE + 1)
        for n in range(per_stage)
    ]


def test_only_correct_kernels_of_the_task_with_a_stage_become_anchors():
    rows = [
        {"stage": 2, "status": "success", "source": TILED},
        {"stage": 2, "status": "success", "source": TILED + "\n\n"},  # same normalised source
        {"stage": 3, "status": "compile_error", "source": kernel(3)},
        {"stage": 3, "status": "success", "source": kernel(3), "task": "gemv"},
        {"stage": 9, "status": "success", "source": kernel(4)},
        {"stage": 4, "status": "success", "source": "  "},
        {"stage": "4", "status": "success", "source": kernel(4)},
        "not a row",
    ]
    [anchor] = anchors_from_rows(rows, "matmul", corpus_task="matmul")
    assert anchor.source == TILED and anchor.stage == 2
    assert is_anchor(anchor.id) and anchor.iteration == ANCHOR_ITERATION
    assert anchor.gflops is None  # no report counts a catalogue kernel as the run's
    [gemv] = anchors_from_rows(rows, "gemv", corpus_task="gemv")
    assert gemv.stage == 3 and gemv.task == "gemv"
    # Stable ids: a restart names the same parents.
    assert anchors_from_rows(rows, "matmul", corpus_task="matmul")[0].id == anchor.id


def test_a_run_visits_every_stage_and_mode_before_it_repeats_one():
    anchors = anchors_from_rows(rows_of_every_stage(), "matmul", corpus_task="matmul")
    slots = anchor_slots(list(range(1, LAST_STAGE + 1)))
    assert len(slots) == 2 * LAST_STAGE - 1  # the last stage is only improved
    count = 2
    visited = [
        (node.parent.stage, node.mode)
        for iteration in range(-(-len(slots) // count))
        for node in select_anchors(anchors, count, iteration=iteration, seed=3)
    ]
    assert sorted(set(visited[: len(slots)])) == sorted(slots)
    for iteration in range(12):
        for node in select_anchors(anchors, count, iteration=iteration, seed=3):
            expected = min(node.parent.stage + 1, LAST_STAGE)
            assert node.target_stage == (expected if node.mode == "deepen" else node.parent.stage)
            assert not (node.mode == "deepen" and node.parent.stage == LAST_STAGE)


def test_selection_is_seeded_and_deterministic():
    anchors = anchors_from_rows(rows_of_every_stage(3), "matmul", corpus_task="matmul")

    def plan(seed: int) -> list[tuple[str, str]]:
        return [
            (node.parent.id, node.mode)
            for t in range(9)
            for node in select_anchors(anchors, 2, iteration=t, seed=seed)
        ]

    assert plan(0) == plan(0)
    assert plan(0) != plan(1)
    assert select_anchors(anchors, 0, iteration=0, seed=0) == []
    assert select_anchors([], 2, iteration=0, seed=0) == []


def test_an_unusable_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(AnchorError, match="cannot read"):
        load_anchor_corpus(tmp_path / "missing.json", "matmul", corpus_task="matmul")
    (tmp_path / "dict.json").write_text(json.dumps({"stage": 1}))
    with pytest.raises(AnchorError, match="JSON list"):
        load_anchor_corpus(tmp_path / "dict.json", "matmul", corpus_task="matmul")
    (tmp_path / "broken.json").write_text(json.dumps([{"stage": 1, "status": "timeout"}]))
    with pytest.raises(AnchorError, match="no correct kernel"):
        load_anchor_corpus(tmp_path / "broken.json", "matmul", corpus_task="matmul")


def test_settings_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ValidationError, match="below node_budget"):
        SchedulerSection(node_budget=2, anchor_nodes=2)
    SchedulerSection(node_budget=0, anchor_nodes=2)  # unbounded: anchors come on top
    with pytest.raises(SchedulerError, match="anchor_corpus is not"):
        make(tmp_path / "none", anchor_nodes=1)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(rows_of_every_stage()))
    several = SchedulerConfig(
        experiment={"name": "unit", "tasks": {"matmul": 1, "gemv": 1}},
        scheduler=SchedulerSection(metrics_port=0, anchor_nodes=1, anchor_corpus=corpus),
    )
    with pytest.raises(SchedulerError, match="one task"):
        Scheduler(several, Store(tmp_path / "several.sqlite"))


def test_anchor_groups_are_trained_on_and_stay_out_of_the_pool(tmp_path):
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(rows_of_every_stage()))
    s = make(tmp_path, node_budget=3, anchor_nodes=1, anchor_corpus=corpus)
    s.step()
    seed, anchor = requests(s)
    assert seed.mode == "seed" and is_anchor(anchor.parent_id)
    parent = s.store.program(anchor.parent_id)
    assert parent is not None and parent.source in anchor.prompt[1].content
    assert anchor.bench.stage in (parent.stage, parent.stage + 1)
    assert s.store.seed_programs().keys() == {"matmul"}  # an anchor is not a seed
    answer(s, anchor, ["success", "compile_error", "success"])
    [batch] = batches(s)
    assert batch.id == anchor.id and sorted(x.reward for x in batch.samples)[0] == -40.0
    assert s.store.pool(0) == []  # the anchor's children do not join SQD's pool
    answer(s, seed, ["success", "success", "verification_error"])
    pool = s.store.pool(0)
    assert len(pool) == 3 and all(p.parent_id == "seed" for p in pool)
    assert s.store.best_gflops_by_stage() == {1: 3.0}  # the seed's children only
    s.step()
    planned = [r for r in requests(s) if r.iteration == 1]
    # budget 3: one anchor, the other two for the pool (both successes' nodes)
    assert len(planned) == 1 + 3
    assert sum(is_anchor(r.parent_id) for r in planned) == 1
    assert is_anchor(planned[-1].parent_id)  # last: the pool's nodes keep their ordinals
