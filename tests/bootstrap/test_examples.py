"""SFT examples: the scheduler's own prompts, pairs made from measured speeds, and answers
that are always correct kernels of the target stage."""

from __future__ import annotations

from collections import Counter

import pytest

from hpcrl_benchmarker.checks import detect_techniques
from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import host_isa
from hpcrl_bootstrap.examples import IMPROVE_MARGIN, make_examples, pairs_from
from hpcrl_common.prompts import build_prompt, failure_text
from hpcrl_common.stages import stage
from hpcrl_common.task import load_task

TASK = load_task("matmul")
pytestmark = pytest.mark.slow  # the catalogue fixture runs the benchmarker


@pytest.fixture(scope="module")
def examples(small_pairs) -> list:
    return make_examples(seed=0, count=300, task=TASK, pairs=small_pairs, isa=host_isa())


def test_examples_are_deterministic(small_pairs) -> None:
    def make(seed: int) -> list:
        return make_examples(seed, 30, TASK, small_pairs, host_isa())

    assert [e.prompt for e in make(0)] == [e.prompt for e in make(0)]
    assert [e.completion for e in make(0)] != [e.completion for e in make(1)]


def test_prompts_are_exactly_the_schedulers(examples: list) -> None:
    restyled = 0
    for ex in examples[:80]:
        if ex.mode == "seed":
            continue  # seed prompts may show the task's seed program as the parent
        expected = build_prompt(
            TASK,
            target_stage=ex.target_stage,
            mode=ex.mode,
            parent_source=ex.shown_parent,
            error=ex.error,
            isa=ex.isa,
        )
        assert list(ex.prompt) == expected
        restyled += ex.shown_parent != ex.parent.source
    # Some parents are shown as the catalogue wrote them, some in another style.
    assert 0 < restyled < 80


def test_every_answer_is_a_correct_kernel_of_the_target_stage(examples, small_measured) -> None:
    verdicts = {catalogue.verdict_key(m.kernel): m for m in small_measured}
    assert set(Counter(e.mode for e in examples)) == {"seed", "deepen", "improve", "repair"}
    for ex in examples:
        assert ex.completion.startswith("```c\n") and ex.completion.endswith("\n```\n")
        assert ex.target.mistake is None and ex.target.stage == ex.target_stage
        assert verdicts[catalogue.verdict_key(ex.target)].ok
        assert not stage(ex.target_stage).violations(detect_techniques(ex.target.source))


def test_improve_answers_are_measurably_faster(examples, small_measured) -> None:
    speed = {catalogue.verdict_key(m.kernel): m.gflops for m in small_measured}
    improve = [e for e in examples if e.mode == "improve"]
    assert improve
    for ex in improve:
        slow = speed[catalogue.verdict_key(ex.parent)]
        fast = speed[catalogue.verdict_key(ex.target)]
        assert fast >= IMPROVE_MARGIN * slow


def test_deepen_adds_a_stage_and_repair_shows_the_benchmarkers_error(
    examples, small_measured
) -> None:
    verdicts = {catalogue.verdict_key(m.kernel): m for m in small_measured}
    for ex in examples:
        if ex.mode == "deepen":
            assert ex.target_stage == ex.parent.stage + 1
            assert verdicts[catalogue.verdict_key(ex.parent)].ok
        if ex.mode == "repair":
            broken = verdicts[catalogue.verdict_key(ex.parent)]
            assert not broken.ok and ex.parent.mistake is not None
            assert ex.error == failure_text(broken.status, broken.error)


def test_pairs_count_what_they_leave_out(small_plan, small_measured) -> None:
    verdicts = {catalogue.verdict_key(m.kernel): m for m in small_measured}
    pairs = pairs_from(small_plan, verdicts)
    kept = sum(len(v) for v in pairs.correct.values())
    targets_out = sum(n for k, n in pairs.left_out.items() if k.startswith("target_"))
    assert kept + targets_out == len(small_plan.targets)
    deepen = sum(len(v) for v in pairs.deepen.values())
    deepen_out = sum(n for k, n in pairs.left_out.items() if k.startswith("deepen_"))
    eligible = sum(
        1 for i in small_plan.parents if verdicts[catalogue.verdict_key(small_plan.targets[i])].ok
    )
    assert deepen + deepen_out == eligible
