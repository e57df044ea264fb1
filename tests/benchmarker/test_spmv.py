"""The SpMV task (y = A x, CSR) end to end in the benchmarker: every reward row and the
hostile kernels, with real gcc, bubblewrap and a numpy reference (issue 30). Kernels:
tests/benchmarker/kernels/spmv/.

The harness is harness/spmv.c over harness/harness.h (fresh inputs and a NaN output per
call, guard zones around rowptr, col, val, x and y, jobs one at a time, every run verified,
seccomp, READY/go), and spmv.py (the same irregular matrix from the seed, the reference, the
check points, the bytes a call moves).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcrl_benchmarker import harnesses, spmv, verify
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec, builtin_seed, load_task

from .conftest import KERNELS, run_check, task_judge
from .test_pipeline import assert_status

Judge = Callable[..., Verdict]
SPMV_KERNELS = KERNELS / "spmv"
REWARD = {"M": 20011, "N": 19997, "NNZ": 700001}
AT = "wrong result at 20011x19997x700001: "


@pytest.fixture(scope="session")
def spmv_task() -> TaskSpec:
    return load_task("spmv")


@pytest.fixture(scope="session")
def judge_spmv(bench: Benchmarker, spmv_task: TaskSpec) -> Judge:
    return task_judge(bench, spmv_task, SPMV_KERNELS, default_stage=1)


# --- the task and its matrices, without a sandbox -------------------------------------------


def test_the_task_its_flops_and_its_bytes(spmv_task: TaskSpec) -> None:
    assert spmv_task.sizes.reward == REWARD
    assert spmv_task.flop_count(REWARD) == 2 * 700001
    harness = harnesses.for_task(spmv_task)
    assert harness is spmv.SPMV and not harness.timed_routine
    assert harness.bytes_moved(REWARD) == 12 * 700001 + 4 * 20012 + 8 * 19997 + 8 * 20011
    job = harness.job("t", REWARD, 42)
    assert job.line() == "t 20011 19997 700001\n42" and job.output_shape == (20011,)


def test_the_matrices_leave_no_shortcut() -> None:
    a = spmv.matrix(REWARD, 2024)
    lengths = np.diff(a.rowptr)
    assert a.rowptr[0] == 0 and a.rowptr[-1] == 700001 and lengths.min() == 0
    assert 0.1 < np.mean(lengths == 0) < 0.3  # many empty rows
    assert lengths.max() > 40 * lengths.mean()  # and some very long ones
    assert a.col.dtype == np.int32 and a.col.min() >= 0 and a.col.max() < 19997
    diagonal = np.repeat(np.arange(20011) * 19997 // 20011, lengths)
    near = np.abs(a.col.astype(np.int64) - diagonal) <= 16
    assert 0.2 < near.mean() < 0.35  # a quarter near the diagonal, the rest anywhere
    rows = np.split(a.col, a.rowptr[1:-1])
    unsorted = sum(bool(np.any(np.diff(r) < 0)) for r in rows)
    repeated = sum(len(np.unique(r)) < len(r) for r in rows)
    assert unsorted > 1000 and repeated > 10
    # A fresh matrix per seed: another seed, another structure.
    assert not np.array_equal(spmv.matrix(REWARD, 2025).rowptr, a.rowptr)


def test_the_reference_is_the_csr_product() -> None:
    sizes = {"M": 41, "N": 23, "NNZ": 300}
    job = spmv.SPMV.job("v", sizes, 777)
    rowptr, col, val, x = spmv.inputs(sizes, 777)
    loops, term_sizes = np.zeros(41), np.zeros(41)
    for i in range(41):
        for k in range(rowptr[i], rowptr[i + 1]):
            loops[i] += val[k] * x[col[k]]
            term_sizes[i] += abs(val[k] * x[col[k]])
    # The reference sums each row in storage order as the loops do (numpy's fallback
    # pairwise): equal to rounding.
    rounding = 1e-14 * term_sizes
    out = np.full(41, np.nan)
    spmv.SPMV.reference_into((rowptr, col, val, x), out)
    assert np.all(np.abs(out - loops) <= rounding)
    expected = spmv.SPMV.expect(job, 100, True, np.random.default_rng(3))
    assert np.array_equal(expected.full, out)
    (points,) = expected.points
    assert points[:3].tolist() == [0, 40, 20]
    assert verify.check_expected(expected.full.copy(), expected, 1e-6) == ""
    empty = int(np.flatnonzero(np.diff(rowptr) == 0)[0])
    bad = expected.full.copy()
    bad[empty] = 1e-9  # an empty row must be 0
    assert f"y[{empty}] = 1e-09" in verify.check_expected(bad, expected, 1e-6)


def test_the_templates_own_reference_is_numpys_to_rounding(spmv_task: TaskSpec) -> None:
    """The parent's reference is harness/spmv.c's own loop (in its trusted library): numpy's
    pairwise products to rounding at every size of the task, an empty row exactly 0; what
    does not fit its template is refused, never written past."""
    assert harnesses.native_library("spmv") is not None  # gcc is here: it must build
    for sizes in (spmv_task.sizes.reward, *spmv_task.sizes.verify, {"M": 3, "N": 2, "NNZ": 40000}):
        for seed in (5, 2**63 - 1):
            rowptr, col, val, x = spmv.inputs(sizes, seed)
            a = spmv.Matrix(rowptr, col, val)
            ours = np.full(a.m, np.nan)
            dims = [sizes[d] for d in spmv.SPMV.dims]
            assert harnesses.native_reference("spmv", dims, (rowptr, col, val, x), ours)
            numpy_y, term_sizes = spmv.products(a, x)
            # Rows in storage order against pairwise: both within L u of the row's size.
            lengths = np.diff(rowptr)
            assert np.all(np.abs(ours - numpy_y) <= 2 * lengths * 2.0**-53 * term_sizes)
            assert np.all(ours[lengths == 0] == 0.0)
            assert np.array_equal(spmv.reference(a, x), ours)
    rowptr, col, val, x = spmv.inputs(REWARD, 1)
    dims = [REWARD[d] for d in spmv.SPMV.dims]
    with pytest.raises(harnesses.HarnessError, match="output"):
        harnesses.native_reference("spmv", dims, (rowptr, col, val, x), np.empty(20010))
    with pytest.raises(harnesses.HarnessError, match="input 1"):
        harnesses.native_reference("spmv", dims, (rowptr, col[:-1], val, x), np.empty(20011))
    with pytest.raises(harnesses.HarnessError, match="inputs"):
        harnesses.native_reference("spmv", dims, (rowptr, col, val), np.empty(20011))
    # A template without a reference of its own: the description's numpy one is used.
    assert not harnesses.native_reference("gemv", [3, 4], (np.empty(12), np.empty(4)), np.empty(3))


# --- every reward row, real kernels ---------------------------------------------------------


def test_the_seed_succeeds_and_a_slow_kernel_gets_fewer_gflops(judge_spmv: Judge) -> None:
    seed = builtin_seed("spmv")
    assert seed is not None
    verdict = judge_spmv(f"```c\n{seed}```")
    assert_status(verdict, "success")
    assert verdict.timing is not None and len(verdict.timing.runs_s) == 3
    assert verdict.gflops == pytest.approx(2 * 700001 / verdict.timing.mean_s / 1e9)
    assert verdict.generalizes is True and verdict.techniques == []
    slow = judge_spmv("slow.c")
    assert_status(slow, "success")
    assert slow.gflops is not None and slow.gflops < 0.5 * verdict.gflops


@pytest.mark.parametrize(
    "name",
    [
        "ignores_col.c",  # x read as if each row were dense from column 0
        "assumes_band.c",  # only the entries within 16 of the diagonal
        "equal_rows.c",  # rowptr[M] / M entries a row
        "sorted_cols.c",  # stops at the first column not above the one before
        "off_by_one.c",  # one entry too many a row: past col and val in the last
        "reads_past_val.c",  # four at a time without a remainder
        "float_precision.c",  # fine at most rows, not where a row cancels
    ],
)
def test_kernels_that_take_a_shortcut_fail_verification(judge_spmv: Judge, name: str) -> None:
    verdict = judge_spmv(name)
    assert_status(verdict, "verification_error")
    assert verdict.error.startswith(AT + "y[") and "relative error" in verdict.error


def test_format_library_compile_runtime_and_timeout_rows(
    judge_spmv: Judge, spmv_task: TaskSpec
) -> None:
    seed = builtin_seed("spmv") or ""
    verdict = judge_spmv(seed.replace("int M, int N", "int M, int N, int NNZ"))
    assert_status(verdict, "format_violation")
    assert "spmv_optimized" in verdict.error
    mkl = "#include <mkl_spblas.h>\n" + seed
    assert_status(judge_spmv(mkl), "library_violation")
    assert_status(judge_spmv(seed.replace("y[i] = sum;", "y[i] = sum")), "compile_error")
    crash = seed.replace("y[i] = sum;", "y[i] = sum + x[col[0] - (1 << 30)];")
    assert_status(judge_spmv(crash), "runtime_error")
    quick = spmv_task.model_copy(
        update={"timing": spmv_task.timing.model_copy(update={"time_limit_s": 1.0})}
    )
    spin = seed.replace("y[i] = sum;", "y[i] = sum;\n        while (i == M - 1) {\n        }")
    assert_status(judge_spmv(spin, task=quick), "timeout")


# --- hostile kernels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("writes_past_y.c", "wrote outside its arrays"),
        ("sorts_cols.c", "modified its inputs rowptr, col, val or x"),  # y right, col sorted
    ],
)
def test_writes_outside_y_are_caught(judge_spmv: Judge, name: str, why: str) -> None:
    verdict = judge_spmv(name)
    assert_status(verdict, "verification_error")
    assert verdict.error.startswith(AT) and why in verdict.error


def test_a_result_cached_across_calls_fails_on_fresh_inputs(judge_spmv: Judge) -> None:
    verdict = judge_spmv("cached.c")
    assert_status(verdict, "verification_error")
    assert "wrong result in the warm-up run: y[" in verdict.error


def test_right_only_at_the_reward_size_is_reported(judge_spmv: Judge, spmv_task: TaskSpec) -> None:
    verdict = judge_spmv("fixed_size.c")
    assert_status(verdict, "success")
    assert verdict.generalizes is False and "257x129x3001" in verdict.error
    strict = spmv_task.model_copy(update={"penalize_generalization": True})
    assert judge_spmv("fixed_size.c", task=strict).status in (
        "verification_error",
        "runtime_error",  # the flat loop runs past col and val: a crash or a wrong y
    )


def test_openmp_only_where_the_stage_allows_it(judge_spmv: Judge) -> None:
    verdict = judge_spmv("omp.c", stage=2)
    assert_status(verdict, "stage_violation")
    verdict = judge_spmv("omp.c", stage=4)
    assert_status(verdict, "success")
    assert "openmp" in verdict.techniques


# --- the CLI, with the memory roof ------------------------------------------------------------


def test_check_judges_an_spmv_kernel_against_the_memory_roof(tmp_path: Path) -> None:
    seed = tmp_path / "seed.c"
    seed.write_text(builtin_seed("spmv") or "")
    out = run_check(seed, "--task", "spmv", "--stage", "1", "--reference", work_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(":", 1) for line in out.stdout.splitlines() if ":" in line)
    assert lines["status"].strip() == "success"
    assert "MB moved per call at least" in lines["bandwidth"]
    assert "STREAM triad" in lines["memory roof"] and "% of it" in lines["memory roof"]
    assert "reference" not in lines  # no OpenBLAS routine for SpMV
