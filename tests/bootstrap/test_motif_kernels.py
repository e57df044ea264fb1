"""GEMV, stencil and SpMV kernels judged by the benchmarker's own pipeline (sandboxed gcc,
technique checks, verification at the task's sizes): a sample of every stage in this host's
ISA is correct and of its stage, so is every deepen parent, and every broken twin is rejected.
(The whole catalogues, 145-156 kernels a task, took 40-57 s a task here; this sample of ~26
a task takes ~25 s in all.)"""

from __future__ import annotations

import pytest

from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import host_isa
from hpcrl_common.task import load_task

pytestmark = pytest.mark.slow

SAMPLE = {1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1}


@pytest.fixture(scope="module", params=["gemv", "stencil", "spmv"])
def judged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[catalogue.Plan, dict[str, catalogue.Measured]]:
    task = request.param
    plan = catalogue.plan(0, host_isa(), SAMPLE, task=task)
    measured, _ = catalogue.measure(
        plan.all(), load_task(task), "O3", tmp_path_factory.mktemp(f"catalogue-{task}")
    )
    return plan, {catalogue.verdict_key(m.kernel): m for m in measured}


def test_every_kernel_is_correct_of_its_stage_and_timed(judged) -> None:
    plan, verdicts = judged
    kernels = plan.targets + list(plan.parents.values())
    failed = [
        (k.stage, v.status, v.error[:300], k.source)
        for k in kernels
        if not (v := verdicts[catalogue.verdict_key(k)]).ok or v.generalizes is not True
    ]
    assert not failed, failed[:2]
    assert {k.stage for k in plan.targets} == set(range(1, 7))


def test_every_broken_twin_is_rejected_with_the_benchmarkers_error(judged) -> None:
    plan, verdicts = judged
    passed = [
        (k.mistake, k.source) for k in plan.broken.values() if verdicts[catalogue.verdict_key(k)].ok
    ]
    assert not passed, passed[:2]
    assert all(verdicts[catalogue.verdict_key(k)].error for k in plan.broken.values())
