"""Fixtures for the benchmarker suite: a real Benchmarker (gcc, bubblewrap, OpenBLAS)."""

from __future__ import annotations

import subprocess
import sys
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


def task_judge(
    bench: Benchmarker, task: TaskSpec, kernels: Path, default_stage: int
) -> Callable[..., Verdict]:
    """Judges a kernel of ``task``: a file name under ``kernels``, or the code itself."""

    def run(
        name: str, stage: int = default_stage, opt_level: str = "O3", task: TaskSpec = task
    ) -> Verdict:
        code = (kernels / name).read_text() if name.endswith(".c") else name
        return bench.evaluate(code, stage=stage, opt_level=opt_level, task=task)

    return run


def run_check(path: Path, *args: str, work_dir: Path | None = None) -> subprocess.CompletedProcess:
    """``hpcrl-benchmarker check PATH ARGS``, with this host's ISA allowance."""
    isa = [arg for name in ALLOW_ISA for arg in ("--allow-isa", name)]
    work = ["--work-dir", str(work_dir)] if work_dir is not None else []
    return subprocess.run(
        [sys.executable, "-m", "hpcrl_benchmarker.cli", "check", str(path), *args, *isa, *work],
        capture_output=True,
        text=True,
        timeout=300,
    )


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
