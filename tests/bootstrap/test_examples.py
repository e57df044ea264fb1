"""SFT examples: the scheduler's own prompts, one ```c block of the target stage as answer."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from hpcrl_common.stages import stage
from hpcrl_common.task import load_task
from hpcrl_learner.bootstrap import corpus as cp
from hpcrl_learner.bootstrap.check import detect_techniques, extract_code
from hpcrl_learner.bootstrap.examples import make_examples

build_prompt = pytest.importorskip("hpcrl_scheduler.prompts").build_prompt
TASK = load_task("matmul")


@pytest.fixture(scope="module")
def examples() -> list:
    return make_examples(seed=0, count=400, task=TASK)


def test_examples_are_deterministic() -> None:
    again = make_examples(seed=0, count=30, task=TASK)
    assert [e.prompt for e in again] == [e.prompt for e in make_examples(0, 30, TASK)]
    assert [e.completion for e in again] != [e.completion for e in make_examples(1, 30, TASK)]


def test_prompts_are_exactly_the_schedulers(examples: list) -> None:
    for ex in examples[:60]:
        parent = ex.parent.source if ex.parent else None
        if ex.mode == "seed":
            assert ex.parent is None
            parent = None
            # Seed prompts may show the scheduler's seed program as the parent.
            if "```c" in ex.prompt[-1].content:
                continue
        expected = build_prompt(TASK, target_stage=ex.target_stage, mode=ex.mode,
                                parent_source=parent, error=ex.error, isa=ex.isa)
        assert list(ex.prompt) == expected


def test_every_mode_is_present_and_the_answer_is_one_c_block(examples: list) -> None:
    assert set(Counter(e.mode for e in examples)) == {"seed", "deepen", "improve", "repair"}
    for ex in examples:
        assert ex.completion.startswith("```c\n") and ex.completion.endswith("\n```")
        assert ex.completion.count("```") == 2
        assert extract_code(ex.completion).strip() == ex.target.source.strip()


def test_answers_are_of_the_target_stage_unless_they_carry_a_mistake(examples: list) -> None:
    for ex in examples:
        assert ex.target.stage == ex.target_stage
        violations = stage(ex.target_stage).violations(detect_techniques(ex.target.source))
        assert bool(violations) == (ex.target.mistake == cp.STAGE_VIOLATION)
    with_mistakes = sum(1 for e in examples if e.target.mistake) / len(examples)
    assert 0.1 < with_mistakes < 0.35


def test_deepen_adds_a_stage_and_repair_fixes_the_parents_mistake(examples: list) -> None:
    for ex in examples:
        if ex.mode == "deepen":
            assert ex.target_stage == min(ex.parent.stage + 1, 6)
            assert not stage(ex.parent.stage).violations(detect_techniques(ex.parent.source))
        if ex.mode == "repair":
            assert ex.parent.mistake is not None and ex.error
            if ex.parent.mistake == cp.COMPILE_ERROR:
                assert "error:" in ex.error
            if ex.parent.mistake not in (cp.STAGE_VIOLATION,) and ex.target.correct:
                # (race and off-by-one parents were written without unrolling)
                fixed = replace(ex.parent.spec.without_mistake(), unroll=ex.target.spec.unroll)
                assert ex.target.spec == fixed
            assert ex.error in ex.prompt[-1].content or "..." in ex.prompt[-1].content
