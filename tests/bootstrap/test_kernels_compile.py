"""Corpus kernels compile with gcc and compute C = A * B; its mistakes really are mistakes."""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcrl_learner.bootstrap import corpus as cp
from hpcrl_learner.bootstrap.check import check_kernel, host_has_avx512

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc"),
]
AVX512 = host_has_avx512()


def _check_all(sources: list[str]) -> list:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda s: check_kernel(s, time_limit_s=10.0), sources))


def test_a_sample_of_correct_kernels_is_correct_at_odd_sizes() -> None:
    specs = list(cp.iter_specs_for_tests(seed=11, count=30))
    runnable = [(s, n, isa) for s, n, isa in specs if s.simd != "avx512" or AVX512]
    if len(runnable) < len(specs):
        print(f"skipped {len(specs) - len(runnable)} AVX-512 kernels: no avx512f on this host")
    verdicts = _check_all([cp.render(spec) for spec, _, _ in runnable])
    failures = [(spec, v) for (spec, _, _), v in zip(runnable, verdicts, strict=True)
                if v.status != "correct"]
    assert not failures, failures[:3]
    assert {n for _, n, _ in runnable} == set(range(1, 7))


@pytest.mark.skipif(not AVX512, reason="host has no avx512f in /proc/cpuinfo")
def test_avx512_kernels_are_correct() -> None:
    rng = random.Random(5)
    sources = [cp.render(cp.sample_spec(rng, stage, "avx512")) for stage in (3, 6, 3)]
    assert all("__m512d" in s for s in sources)
    assert [v.status for v in _check_all(sources)] == ["correct"] * 3


def test_mistakes_fail_to_compile_or_give_wrong_results() -> None:
    rng = random.Random(3)
    isa = "avx512" if AVX512 else "avx2"
    cases: list[tuple[str, str]] = []
    for kind in (cp.NO_ZERO, cp.OFF_BY_ONE, cp.COMPILE_ERROR, cp.NO_BOUNDARY, cp.WRONG_STRIDE):
        for _ in range(2):
            spec = cp.sample_spec(rng, rng.randint(1, 6), isa)
            while kind not in cp.applicable_mistakes(spec, 1):
                spec = cp.sample_spec(rng, rng.randint(1, 6), isa)
            cases.append((kind, cp.render(cp.with_mistake(rng, spec, 1, isa, kind))))
    verdicts = _check_all([source for _, source in cases])
    for (kind, source), verdict in zip(cases, verdicts, strict=True):
        expected = {"compile_error"} if kind == cp.COMPILE_ERROR else {
            "wrong", "runtime_error", "timeout"}
        assert verdict.status in expected, (kind, verdict, source)
