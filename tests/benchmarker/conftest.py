"""Fixtures for the benchmarker suite: a real Benchmarker (gcc, bubblewrap, OpenBLAS)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect, has_avx512
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec, load_task

KERNELS = Path(__file__).parent / "kernels"
HOST = detect()
HAS_AVX512 = has_avx512()
# The allowance is used only where AVX-512 is missing (CI/development hosts with AVX2).
ALLOW_ISA: list[str] = [] if HAS_AVX512 else ["avx2"]
needs_avx512 = pytest.mark.skipif(
    not HAS_AVX512, reason="AVX-512 intrinsics cannot run on this AVX2-only host"
)


def kernel(name: str) -> str:
    return (KERNELS / name).read_text()


@pytest.fixture(scope="session")
def task() -> TaskSpec:
    return load_task("matmul")


@pytest.fixture(scope="session")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Benchmarker:
    root = tmp_path_factory.mktemp("bench")
    return Benchmarker(
        BenchmarkerSection(work_dir=root / "work", lock_path=root / "timing.lock"), HOST
    )


@pytest.fixture(scope="session")
def judge(bench: Benchmarker, task: TaskSpec) -> Callable[..., Verdict]:
    def run(code: str, stage: int = 6, opt_level: str = "O3", **kwargs: object) -> Verdict:
        return bench.evaluate(code, stage=stage, opt_level=opt_level, task=kwargs.pop("task", task))  # type: ignore[arg-type]

    return run
