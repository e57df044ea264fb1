"""The stencil task (one Jacobi sweep of the 5-point Laplacian, the boundary copied) end to end
in the benchmarker: every reward row and the hostile kernels, with real gcc, bubblewrap and a
numpy reference (issue 30). Kernels: tests/benchmarker/kernels/stencil/.

The harness is harness/stencil.c over harness/harness.h (fresh inputs and a NaN output per
call, guard zones, jobs one at a time, every run verified, seccomp, READY/go), and
stencil.py (inputs, reference, check points, the bytes a call moves).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcrl_benchmarker import harnesses, stencil, verify
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec, builtin_seed, load_task

from .conftest import KERNELS, run_check, task_judge
from .test_pipeline import assert_status

Judge = Callable[..., Verdict]
STENCIL_KERNELS = KERNELS / "stencil"
REWARD = {"N": 1023, "M": 1021}


@pytest.fixture(scope="session")
def stencil_task() -> TaskSpec:
    return load_task("stencil")


@pytest.fixture(scope="session")
def judge_stencil(bench: Benchmarker, stencil_task: TaskSpec) -> Judge:
    return task_judge(bench, stencil_task, STENCIL_KERNELS, default_stage=1)


# --- the task and its description, without a sandbox ----------------------------------------


def test_the_task_its_flops_and_its_bytes(stencil_task: TaskSpec) -> None:
    assert stencil_task.sizes.reward == REWARD
    assert stencil_task.flop_count(REWARD) == 4 * 1021 * 1019
    harness = harnesses.for_task(stencil_task)
    assert harness is stencil.STENCIL and not harness.timed_routine
    assert harness.bytes_moved(REWARD) == 16 * 1023 * 1021
    job = harness.job("t", REWARD, 42)
    assert job.line() == "t 1023 1021\n42" and job.output_shape == (1023, 1021)
    sizes = [stencil_task.sizes.reward, *stencil_task.sizes.verify]
    assert all(s["N"] % 8 or s["M"] % 8 for s in sizes)
    assert {"N": 1, "M": 1} in sizes and {"N": 3, "M": 3} in sizes  # all boundary; one point


def test_the_reference_is_the_sweep_with_the_boundary_copied() -> None:
    job = stencil.STENCIL.job("v", {"N": 9, "M": 7}, 12345)
    (u,) = stencil.inputs(job.sizes, job.seed)
    ref = stencil.reference(u)
    loops = u.copy()
    for i in range(1, 8):
        for j in range(1, 6):
            loops[i, j] = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
    assert np.array_equal(ref, loops)  # the same order of additions: bit for bit
    assert np.array_equal(stencil.reference(u[:2]), u[:2])  # two rows: all boundary
    expected = stencil.STENCIL.expect(job, 100, True, np.random.default_rng(3))
    rows, cols = expected.points
    assert list(zip(rows[:5].tolist(), cols[:5].tolist(), strict=True)) == [
        (0, 0),
        (0, 6),
        (8, 0),
        (8, 6),
        (4, 3),
    ]  # corners, centre, then 100 drawn
    assert verify.check_expected(expected.full.copy(), expected, 1e-6) == ""
    assert verify.check_expected(expected.full * (1 + 1e-12), expected, 1e-6) == ""
    drawn = set(zip(rows.tolist(), cols.tolist(), strict=True))
    missed = next((i, j) for i in range(9) for j in range(7) if (i, j) not in drawn)
    bad = expected.full.copy()
    bad[missed] += 1.0
    assert verify.check_expected(bad, expected, 1e-6).endswith(
        "; 1 of 63 elements are wrong (full-grid check; the 105 check points passed)"
    )


# --- every reward row, real kernels ---------------------------------------------------------


def test_the_seed_succeeds_and_a_slow_kernel_gets_fewer_gflops(judge_stencil: Judge) -> None:
    seed = builtin_seed("stencil")
    assert seed is not None
    verdict = judge_stencil(f"```c\n{seed}```")
    assert_status(verdict, "success")
    assert verdict.timing is not None and len(verdict.timing.runs_s) == 3
    assert verdict.gflops == pytest.approx(4 * 1021 * 1019 / verdict.timing.mean_s / 1e9)
    assert verdict.generalizes is True and verdict.techniques == []
    slow = judge_stencil("slow.c")
    assert_status(slow, "success")
    assert slow.gflops is not None and slow.gflops < 0.5 * verdict.gflops


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("skips_boundary.c", "v[0][0] = nan"),  # the corners are check points
        ("zero_boundary.c", "v[0][0] = 0.0"),
        ("overwrites_boundary.c", "relative error"),
        ("float_precision.c", "relative error"),  # fine at most points, not where v cancels
    ],
)
def test_wrong_kernels_fail_verification(judge_stencil: Judge, name: str, why: str) -> None:
    verdict = judge_stencil(name)
    assert_status(verdict, "verification_error")
    assert "wrong result at 1023x1021: v[" in verdict.error and why in verdict.error


def test_reading_past_the_grid_fails(judge_stencil: Judge) -> None:
    # The last row swept as if interior: its southern neighbours lie up to a row past u. The
    # first 512 are the guard zone (NaN); farther ones are another buffer or unmapped memory,
    # so the run ends wrong or killed, depending on what lies there.
    verdict = judge_stencil("reads_past_u.c")
    assert verdict.status in ("verification_error", "runtime_error"), verdict
    assert "1023x1021" in verdict.error


def test_format_library_compile_runtime_and_timeout_rows(
    judge_stencil: Judge, stencil_task: TaskSpec
) -> None:
    seed = builtin_seed("stencil") or ""
    verdict = judge_stencil(seed.replace("int N, int M", "int N, long M"))
    assert_status(verdict, "format_violation")
    assert "stencil_optimized" in verdict.error
    lib = "#include <cblas.h>\n" + seed.replace(
        "for (int i = 1;", "cblas_dcopy(1, u, 1, v, 1);\n    for (int i = 1;"
    )
    assert_status(judge_stencil(lib), "library_violation")
    assert_status(
        judge_stencil(seed.replace("v[i * M + j] = u[i * M + j];", "v[i * M + j] = u[i * M + j]")),
        "compile_error",
    )
    crash = seed.replace("for (int i = 1;", "*(volatile double *)0 = 1.0;\n    for (int i = 1;")
    assert_status(judge_stencil(crash), "runtime_error")
    quick = stencil_task.model_copy(
        update={"timing": stencil_task.timing.model_copy(update={"time_limit_s": 1.0})}
    )
    spin = seed.replace(
        "for (int i = 1;", "for (volatile int s = 1; s;) {\n    }\n    for (int i = 1;"
    )
    verdict = judge_stencil(spin, task=quick)
    assert_status(verdict, "timeout")


# --- hostile kernels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("writes_past_v.c", "wrote outside its arrays"),
        ("in_place.c", "modified its inputs u"),  # u used as the sweep's scratch
    ],
)
def test_writes_outside_v_are_caught(judge_stencil: Judge, name: str, why: str) -> None:
    verdict = judge_stencil(name)
    assert_status(verdict, "verification_error")
    assert why in verdict.error


def test_a_grid_cached_across_calls_fails_on_fresh_inputs(judge_stencil: Judge) -> None:
    verdict = judge_stencil("cached.c")
    assert_status(verdict, "verification_error")
    assert "wrong result in the warm-up run: v[" in verdict.error


def test_right_only_at_the_reward_size_is_reported(
    judge_stencil: Judge, stencil_task: TaskSpec
) -> None:
    verdict = judge_stencil("fixed_size.c")
    assert_status(verdict, "success")
    assert verdict.generalizes is False and "257x129" in verdict.error
    strict = stencil_task.model_copy(update={"penalize_generalization": True})
    assert_status(judge_stencil("fixed_size.c", task=strict), "verification_error")


def test_openmp_only_where_the_stage_allows_it(judge_stencil: Judge) -> None:
    verdict = judge_stencil("omp.c", stage=3)
    assert_status(verdict, "stage_violation")
    assert verdict.error.endswith("forbids openmp, which the code uses")
    verdict = judge_stencil("omp.c", stage=4)
    assert_status(verdict, "success")
    assert "openmp" in verdict.techniques


# --- the CLI, with the memory roof ------------------------------------------------------------


def test_check_judges_a_stencil_and_measures_the_memory_roof(tmp_path: Path) -> None:
    seed = tmp_path / "seed.c"
    seed.write_text(builtin_seed("stencil") or "")
    args = ("--task", "stencil", "--stage", "1", "--json", "--reference")
    out = run_check(seed, *args, work_dir=tmp_path / "work")
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["status"] == "success" and verdict["gflops"] > 0
    assert verdict["gbytes_per_s"] == pytest.approx(
        verdict["gflops"] * 16 * 1023 * 1021 / (4 * 1021 * 1019)
    )
    assert verdict["reference"]["openblas"] is None  # numpy verifies; nothing to time
    triad = verdict["reference"]["triad"]
    assert triad["gbytes_per_s"] >= triad["median_gbytes_per_s"] > 0
    assert triad["elements"] * 8 >= 64 * 2**20 and len(triad["runs_s"]) == 10
    assert verdict["roof_share"] == pytest.approx(verdict["gbytes_per_s"] / triad["gbytes_per_s"])
