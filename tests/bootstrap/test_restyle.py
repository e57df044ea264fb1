"""Restyled parents: other people's styles, the same programs."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from hpcrl_benchmarker.checks import detect_techniques
from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import host_isa
from hpcrl_bootstrap.corpus import Kernel
from hpcrl_common.restyle import restyle, restyle_for_task
from hpcrl_common.task import load_task, seed_program

PER_STAGE = {1: 6, 2: 6, 3: 4, 4: 3, 5: 2, 6: 2}
PLAN = catalogue.plan(0, host_isa(), PER_STAGE)
TASKS = ("matmul", "gemv", "stencil", "spmv")


def test_restyle_is_seeded_and_changes_the_text() -> None:
    source = PLAN.targets[8].source
    first = [restyle(source, random.Random(n)) for n in range(20)]
    assert first == [restyle(source, random.Random(n)) for n in range(20)]
    changed = [text for text in first if text != source]
    assert len(changed) >= 15 and len(set(changed)) >= 12


def test_restyle_keeps_the_signature_and_the_techniques() -> None:
    rng = random.Random(0)
    for kernel in PLAN.targets:
        for _ in range(5):
            text = restyle(kernel.source, rng)
            assert (
                "void matmul_optimized(double *A, double *B, double *C, int M, int N, "
                "int K)" in text
            )
            assert detect_techniques(text) == detect_techniques(kernel.source)


def test_a_kept_name_is_never_renamed() -> None:
    """A task whose signature named a parameter ``i`` or ``sum`` keeps it in every restyle."""
    source = seed_program(load_task("matmul"))
    assert {"i", "sum"} <= identifiers(source)
    renamed = 0
    for n in range(40):
        kept = restyle(source, random.Random(n), keep=frozenset({"i", "sum"}))
        assert {"i", "sum"} <= identifiers(kept)
        renamed += not {"i", "sum"} <= identifiers(restyle(source, random.Random(n)))
    assert renamed >= 20  # without ``keep`` the same draws rename them


def identifiers(text: str) -> set[str]:
    return set(re.findall(r"\b[A-Za-z_]\w*\b", text))


@pytest.mark.parametrize("task", TASKS)
def test_every_tasks_signature_survives_the_schedulers_restyle(task: str) -> None:
    spec = load_task(task)
    plan = catalogue.plan(0, host_isa(), PER_STAGE, task=task)
    rng = random.Random(task)
    changed = 0
    for kernel in plan.all():
        text = restyle_for_task(kernel.source, spec, rng)
        assert spec.signature in text or spec.signature not in kernel.source
        assert f"{spec.function}(" in text
        assert detect_techniques(text) == detect_techniques(kernel.source)
        assert task == "matmul" or "Matrix multiplication" not in text
        changed += text != kernel.source
    assert changed >= len(plan.all()) // 2


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_restyled_kernels_are_still_correct(tmp_path, task: str) -> None:
    """One restyled kernel of each stage of each task, as the scheduler restyles a parent,
    judged by the benchmarker's own pipeline."""
    rng = random.Random(3)
    spec = load_task(task)
    plan = PLAN if task == "matmul" else catalogue.plan(0, host_isa(), PER_STAGE, task=task)
    kernels = []
    for number in range(1, 7):
        kernel = next(k for k in plan.targets if k.stage == number)
        text = kernel.source
        while text == kernel.source:
            text = restyle_for_task(kernel.source, spec, rng)
        kernels.append(dataclasses.replace(kernel, source=text))
    measured, _ = catalogue.measure(kernels, spec, "O3", tmp_path)
    failed = [(m.status, m.error[:300], m.kernel.source) for m in measured if not m.ok]
    assert not failed, failed[:1]
    assert all(isinstance(m.kernel, Kernel) for m in measured)
