"""GEMV (y = A x), the first task beyond GEMM, end to end in the benchmarker: every reward row
and the hostile kernels, with real gcc, bubblewrap and OpenBLAS (issue 30).

The GEMV harness is harness/gemv.c (a few dozen lines) over harness/harness.h, which every
task shares, and gemv.py (inputs, reference, check points); so every guarantee of GEMM's
harness holds here without a line of its own: fresh inputs and a NaN output per call, jobs
one at a time, every run verified, the seccomp rules, the READY/go handshake and the
idle-thread rules. Kernels: tests/benchmarker/kernels/gemv/.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcrl_benchmarker import gemm, gemv, harnesses, protocol, verify
from hpcrl_benchmarker import reference as reference_module
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec, builtin_seed, load_task

from .conftest import KERNELS, kernel, run_check, task_judge
from .test_pipeline import assert_status

Judge = Callable[..., Verdict]
GEMV_KERNELS = KERNELS / "gemv"
REWARD = {"M": 1023, "N": 1021}


@pytest.fixture(scope="session")
def gemv_task() -> TaskSpec:
    return load_task("gemv")


@pytest.fixture(scope="session")
def judge_gemv(bench: Benchmarker, gemv_task: TaskSpec) -> Judge:
    return task_judge(bench, gemv_task, GEMV_KERNELS, default_stage=6)


# --- the task and its description, without a sandbox ----------------------------------------


def test_the_task_is_data_its_harness_a_template_and_a_description(gemv_task: TaskSpec) -> None:
    assert gemv_task.sizes.reward == REWARD
    assert gemv_task.flop_count(REWARD) == 2 * 1023 * 1021
    harness = harnesses.for_task(gemv_task)
    assert harness is gemv.GEMV and harness.routine == gemv_task.reference == "cblas_dgemv"
    assert harnesses.for_task(load_task("matmul")) is gemm.GEMM
    job = harness.job("t", REWARD, 42)
    assert job.line() == "t 1023 1021\n42" and job.output_shape == (1023,)
    # Sizes the harness does not take are refused before anything runs.
    wrong = gemv_task.model_copy(
        update={"sizes": gemv_task.sizes.model_copy(update={"reward": {"M": 8, "N": 8, "K": 8}})}
    )
    with pytest.raises(harnesses.HarnessError, match="takes sizes M, N"):
        harnesses.for_task(wrong)
    with pytest.raises(harnesses.HarnessError, match="no harness"):
        harnesses.for_task(gemv_task.model_copy(update={"harness": "no_such_harness"}))


def test_the_reference_and_the_check_name_y() -> None:
    job = gemv.GEMV.job("v", {"M": 37, "N": 29}, 12345)
    a, x = gemv.inputs(job.sizes, job.seed)
    assert np.allclose(gemv.reference(a, x), a @ x, rtol=1e-12, atol=1e-12)
    expected = gemv.GEMV.expect(job, 100, True, np.random.default_rng(3))
    (rows,) = expected.points
    assert len(rows) == 103 and rows[:3].tolist() == [0, 36, 18]  # ends, middle, 100 drawn
    assert verify.check_expected(expected.full.copy(), expected, 1e-6) == ""
    assert verify.check_expected(expected.full * (1 + 1e-12), expected, 1e-6) == ""
    bad = expected.full.copy()
    bad[int(rows[7])] += 1.0
    assert f"y[{int(rows[7])}] = " in verify.check_expected(bad, expected, 1e-6)
    missed = next(i for i in range(37) if i not in set(rows.tolist()))
    bad = expected.full.copy()
    bad[missed] = 0.0
    assert verify.check_expected(bad, expected, 1e-6).endswith(
        "; 1 of 37 elements are wrong (full-vector check; the 103 check points passed)"
    )
    bad = expected.full.copy()
    bad[0] = np.nan
    assert "y[0] = nan" in verify.check_expected(bad, expected, 1e-6)


def test_the_run_reader_takes_a_vector_per_call() -> None:
    jobs = [gemv.GEMV.job("v", {"M": 3, "N": 5}, 1)]
    reader = protocol.RunReader(7, jobs)
    reader.sent(0, 1000)
    reader.mark(protocol.MARK.pack(7, 0, protocol.MARK_BEGIN, 2000, 0), 2010)
    reader.mark(protocol.MARK.pack(7, 0, protocol.MARK_RESULT, 3000, 3), 3010)
    reader.data(np.arange(3.0).tobytes())
    [frame] = reader.mark(protocol.MARK.pack(7, 0, protocol.MARK_CHECK, 0, 0), 3020)
    assert frame.output.tolist() == [0.0, 1.0, 2.0]
    wrong = protocol.RunReader(7, jobs)
    wrong.sent(0, 1000)
    wrong.mark(protocol.MARK.pack(7, 0, protocol.MARK_BEGIN, 2000, 0), 2010)
    with pytest.raises(protocol.ProtocolError, match="wrong output size"):
        wrong.mark(protocol.MARK.pack(7, 0, protocol.MARK_RESULT, 3000, 15), 3010)


# --- every reward row, real kernels ---------------------------------------------------------


def test_the_seed_succeeds_with_gflops(judge_gemv: Judge, gemv_task: TaskSpec) -> None:
    seed = builtin_seed("gemv")
    assert seed is not None
    verdict = judge_gemv(f"```c\n{seed}```", stage=1)
    assert_status(verdict, "success")
    assert verdict.timing is not None and len(verdict.timing.runs_s) == 3
    assert verdict.gflops == pytest.approx(2 * 1023 * 1021 / verdict.timing.mean_s / 1e9)
    assert verdict.generalizes is True and verdict.techniques == []
    assert set(verdict.durations_s) >= {"compile", "verify", "time"}


def test_a_slow_correct_kernel_succeeds_with_fewer_gflops(judge_gemv: Judge) -> None:
    naive, slow = judge_gemv("naive.c", stage=1), judge_gemv("slow.c", stage=1)
    assert_status(naive, "success")
    assert_status(slow, "success")
    assert slow.gflops is not None and naive.gflops is not None
    assert slow.gflops < 0.5 * naive.gflops, (slow.gflops, naive.gflops)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("off_by_one.c", "relative error"),  # the last column never summed
        ("ignores_x.c", "relative error"),
        ("transposed.c", "relative error"),  # A read by columns
        ("float_precision.c", "relative error"),  # within 1e-6 at most elements, not all
        ("reads_past_x.c", "= nan"),  # x's guard zone reads as NaN
    ],
)
def test_wrong_kernels_fail_verification(judge_gemv: Judge, name: str, why: str) -> None:
    verdict = judge_gemv(name, stage=1)
    assert_status(verdict, "verification_error")
    assert "wrong result at 1023x1021: y[" in verdict.error and why in verdict.error


def test_format_library_and_compile_rows(judge_gemv: Judge) -> None:
    seed = builtin_seed("gemv") or ""
    verdict = judge_gemv(seed.replace("int M, int N", "int M, long N"))
    assert_status(verdict, "format_violation")
    assert "gemv_optimized" in verdict.error
    blas = (
        "#include <cblas.h>\n"
        "void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {\n"
        "    cblas_dgemv(CblasRowMajor, CblasNoTrans, M, N, 1.0, A, N, x, 1, 0.0, y, 1);\n"
        "}\n"
    )
    assert_status(judge_gemv(blas), "library_violation")
    assert_status(
        judge_gemv(seed.replace("double sum = 0.0;", "double sum = 0.0")), "compile_error"
    )
    crash = seed.replace("y[i] = sum;", "y[i] = sum + *(volatile double *)0;")
    assert_status(judge_gemv(crash, stage=1), "runtime_error")


# --- hostile kernels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("writes_past_y.c", "wrote outside its arrays"),  # y[M] cleared
        ("writes_before_y.c", "wrote outside its arrays"),  # a value stashed at y[-1]
        ("modifies_a.c", "modified its inputs A or x"),
        ("modifies_x.c", "modified its inputs A or x"),  # y exact: only the check of x sees it
    ],
)
def test_writes_outside_y_are_caught(judge_gemv: Judge, name: str, why: str) -> None:
    verdict = judge_gemv(name, stage=1)
    assert_status(verdict, "verification_error")
    assert why in verdict.error


def test_a_result_cached_across_calls_fails_on_fresh_inputs(judge_gemv: Judge) -> None:
    verdict = judge_gemv("cached.c", stage=1)
    assert_status(verdict, "verification_error")
    assert "wrong result in the warm-up run: y[" in verdict.error


def test_a_thread_left_running_is_caught(judge_gemv: Judge) -> None:
    verdict = judge_gemv("leftover_thread.c", stage=6)
    assert_status(verdict, "verification_error")
    assert "parallel region still open" in verdict.error
    # At a stage without OpenMP the GOMP entry point is the technique it is.
    verdict = judge_gemv("leftover_thread.c", stage=1)
    assert_status(verdict, "stage_violation")
    assert "openmp" in verdict.techniques


def test_openmp_only_where_the_stage_allows_it(judge_gemv: Judge) -> None:
    for stage in (1, 2, 3):
        verdict = judge_gemv("omp.c", stage=stage)
        assert_status(verdict, "stage_violation")
        assert verdict.error.endswith("forbids openmp, which the code uses")
    verdict = judge_gemv("omp.c", stage=4)
    assert_status(verdict, "success")
    assert "openmp" in verdict.techniques


def test_right_only_at_the_reward_size_is_reported(judge_gemv: Judge, gemv_task: TaskSpec) -> None:
    verdict = judge_gemv("fixed_size.c", stage=1)
    assert_status(verdict, "success")
    assert verdict.generalizes is False and "257x129" in verdict.error
    strict = gemv_task.model_copy(update={"penalize_generalization": True})
    assert_status(judge_gemv("fixed_size.c", stage=1, task=strict), "verification_error")


def test_the_guard_zones_are_every_harness_s(judge: Judge) -> None:
    # harness.h's, so GEMM's C has them too: one element written past C.
    code = kernel("naive.c").replace("C[i * N + j] = s;", "C[i * N + j] = s;\n    C[M * N] = 0;")
    assert code != kernel("naive.c")
    verdict = judge(code, stage=1)
    assert_status(verdict, "verification_error")
    assert "wrote outside its arrays (just before or after A, B or C" in verdict.error


# --- the performance reference, and the CLI ---------------------------------------------------


def test_openblas_dgemv_is_timed_as_the_reference(bench: Benchmarker, gemv_task: TaskSpec) -> None:
    references = bench.reference(gemv_task, runs=5)
    reference = references.openblas
    assert reference is not None
    assert reference.routine == "cblas_dgemv" and len(reference.runs_s) == 5
    assert reference.gflops == pytest.approx(2 * 1023 * 1021 / reference.median_s / 1e9)
    assert reference.gbytes_per_s == pytest.approx(
        8 * (1023 * 1021 + 1021 + 1023) / reference.median_s / 1e9
    )
    assert reference.core and reference.threads >= 1
    # GEMV is memory-bound: the node's bandwidth (STREAM's triad) comes with it.
    assert references.triad is not None and references.triad.gbytes_per_s > 0
    dgemm = bench.reference(load_task("matmul"), runs=3)
    assert dgemm.triad is None and dgemm.openblas is not None
    assert dgemm.openblas.routine == "cblas_dgemm" and dgemm.openblas.gflops > 0
    assert dgemm.openblas.gbytes_per_s is None
    # OpenBLAS's workers slept through every fill, as a kernel's OpenMP team must: no call
    # of the reference starts with a team already awake (spinning, 0.2-0.9 ms a gap here).
    for timed in (reference, dgemm.openblas):
        assert timed.workers_between_calls_ns < 50_000, timed


def test_the_workers_clock_sees_a_spinning_thread_and_not_a_sleeping_one() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    def sleep() -> None:
        stop.wait()

    for target, busy in ((sleep, False), (spin, True)):
        stop.clear()
        thread = threading.Thread(target=target)
        thread.start()
        before = reference_module.workers_cpu_ns()
        time.sleep(0.05)
        seen = reference_module.workers_cpu_ns() - before
        stop.set()
        thread.join()
        # The spinner has the GIL while this thread sleeps: nearly all of the 50 ms.
        assert (seen > 5_000_000) is busy, (target.__name__, seen)


def test_check_judges_a_gemv_kernel_and_times_the_reference(tmp_path: Path) -> None:
    seed = tmp_path / "seed.c"
    seed.write_text(builtin_seed("gemv") or "")
    work = tmp_path / "work"
    out = run_check(seed, "--task", "gemv", "--stage", "1", "--json", "--reference", work_dir=work)
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["status"] == "success" and verdict["gflops"] > 0
    assert verdict["gbytes_per_s"] == pytest.approx(
        verdict["gflops"] * 4 * (1023 * 1021 + 1021 + 1023) / (1023 * 1021)
    )
    assert verdict["reference"]["openblas"]["routine"] == "cblas_dgemv"
    assert verdict["reference"]["openblas"]["gflops"] > 0
    triad = verdict["reference"]["triad"]
    assert verdict["roof_share"] == pytest.approx(verdict["gbytes_per_s"] / triad["gbytes_per_s"])
    # A GEMM kernel is not a GEMV kernel.
    out = run_check(KERNELS / "naive.c", "--task", "gemv", "--json", work_dir=work)
    assert json.loads(out.stdout)["status"] == "format_violation"
