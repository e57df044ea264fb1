"""Restyled parents: other people's styles, the same programs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hpcrl_benchmarker.checks import detect_techniques
from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import host_isa
from hpcrl_bootstrap.corpus import Kernel
from hpcrl_bootstrap.restyle import restyle
from hpcrl_common.task import load_task

PLAN = catalogue.plan(0, host_isa(), {1: 6, 2: 6, 3: 4, 4: 3, 5: 2, 6: 2})


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


@pytest.mark.slow
def test_restyled_kernels_are_still_correct(tmp_path) -> None:
    """One restyled kernel of each stage, judged by the benchmarker's own pipeline."""
    rng = random.Random(3)
    kernels = []
    for number in range(1, 7):
        kernel = next(k for k in PLAN.targets if k.stage == number)
        text = kernel.source
        while text == kernel.source:
            text = restyle(kernel.source, rng)
        kernels.append(dataclasses.replace(kernel, source=text))
    measured, _ = catalogue.measure(kernels, load_task("matmul"), "O3", tmp_path)
    failed = [(m.status, m.error[:300], m.kernel.source) for m in measured if not m.ok]
    assert not failed, failed[:1]
    assert all(isinstance(m.kernel, Kernel) for m in measured)
