"""Adding a task without touching the project's code (README, "Adding a task"): the four files
a task author writes, from a temporary directory, judged end to end by the real benchmarker
(gcc, bubblewrap, the shared harness's guarantees and run-time rules), and the prompt the
scheduler builds from the same TOML.

The task here is AXPY, z = 2.5 x + y: small enough to read in the test, and still a kernel
with a reward row per way to be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl_benchmarker import harnesses
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_common.prompts import build_prompt
from hpcrl_common.task import TaskError, TaskSpec, load_task, seed_program

from .conftest import run_check
from .test_pipeline import assert_status

TOML = '''
name = "axpy"
description = """Compute z = 2.5 * x + y for double-precision vectors x, y and z of N \
elements. Overwrite z; do not write to x or y, nor outside z."""
function = "axpy_optimized"
signature = "void axpy_optimized(const double *x, const double *y, double *z, int N)"
harness = "axpy.c"          # beside this file, with its description axpy.py
seed = "axpy.seed.c"
reference = "numpy"
flops = "2*N"

[sizes]
reward = { N = 1000003 }
verify = [{ N = 1 }, { N = 7 }, { N = 1001 }]

[verification]
rel_tolerance = 1e-12

[compile.opt_levels]
O0 = ["-O0"]
O3 = ["-O3"]
'''

TEMPLATE = r"""/* AXPY harness: z = 2.5 x + y. Job line: "<kind> <N>". */
#define HARNESS_DIMS 1
#define HARNESS_INPUTS 2
#define MAX_DIM (1 << 24) /* harness.h's default is 8192 */
#include "harness.h"

#ifndef KERNEL_NAME
#define KERNEL_NAME axpy_optimized
#endif
void KERNEL_NAME(const double *x, const double *y, double *z, int N);

static size_t input_bytes(int input, const int *d) {
    (void)input;
    return (size_t)d[0] * sizeof(double);
}

static size_t output_count(const int *d) {
    return (size_t)d[0];
}

static void fill_inputs(void *const *in, const int *d, uint64_t seed) {
    fill(in[0], (size_t)d[0], seed);
    fill(in[1], (size_t)d[0], seed ^ 0x5DEECE66DA3B1F7Full);
}

static void call_kernel(void *const *in, double *out, const int *d) {
    KERNEL_NAME(in[0], in[1], out, d[0]);
}
"""

DESCRIPTION = """
import numpy as np

from hpcrl_benchmarker.harnesses import SECOND_SALT, Harness, random_values
from hpcrl_benchmarker.verify import Expected, Names, floored_scale, sample_points

NAMES = Names(output="z", inputs="x or y", arrays="x, y or z", full_check="full-vector check",
              points="the")


class Axpy(Harness):
    name = "axpy"
    dims = ("N",)
    names = NAMES
    routine = "numpy"
    timed_routine = False

    def output_shape(self, sizes):
        return (sizes["N"],)

    def input_layout(self, sizes):
        return ((np.float64, (sizes["N"],)), (np.float64, (sizes["N"],)))

    def numpy_inputs(self, sizes, seed):
        n = sizes["N"]
        return random_values(seed, n), random_values(seed ^ SECOND_SALT, n)

    def reference_into(self, inputs, out):
        x, y = inputs
        np.multiply(x, 2.5, out=out)
        out += y

    def expect(self, job, random_points, corners_and_centre, rng):
        x, y = self.inputs(job.sizes, job.seed)
        ref = np.empty(x.shape)
        self.reference_into((x, y), ref)
        # With or without a fused multiply-add, z errs by at most ~1 ulp of 2.5|x| + |y|.
        terms = 2.5 * np.abs(x) + np.abs(y)
        points = sample_points(ref.shape, random_points, corners_and_centre, rng)
        return Expected(
            points, ref[points], floored_scale(ref[points], terms[points]), NAMES, ref,
            lambda at: floored_scale(ref, terms)[at],
        )

    def bytes_moved(self, sizes):
        return 24.0 * sizes["N"]


HARNESS = Axpy()
"""

SEED = """void axpy_optimized(const double *x, const double *y, double *z, int N) {
    for (int i = 0; i < N; i++) z[i] = 2.5 * x[i] + y[i];
}
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("axpy")
    for name, text in {
        "axpy.toml": TOML,
        "axpy.c": TEMPLATE,
        "axpy.py": DESCRIPTION,
        "axpy.seed.c": SEED,
    }.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture(scope="module")
def axpy(task_dir: Path) -> TaskSpec:
    return load_task(task_dir / "axpy.toml")


def test_the_task_loads_with_its_own_files(axpy: TaskSpec, task_dir: Path) -> None:
    assert axpy.harness == str(task_dir.resolve() / "axpy.c")
    assert seed_program(axpy) == SEED
    harness = harnesses.for_task(axpy)
    assert harness.dims == ("N",) and harness.name == axpy.harness
    prompt = build_prompt(
        axpy, target_stage=1, mode="seed", parent_source=None, error=None, isa="avx2"
    )
    text = " ".join(m.content for m in prompt)
    assert "z = 2.5 * x + y" in text and axpy.signature in text


def test_missing_files_are_named(task_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text(TOML)
    with pytest.raises(TaskError, match=r"harness file .*axpy\.c does not exist"):
        load_task(tmp_path / "t.toml")
    (tmp_path / "axpy.c").write_text(TEMPLATE)
    (tmp_path / "axpy.seed.c").write_text(SEED)
    with pytest.raises(harnesses.HarnessError, match="no description"):
        harnesses.for_task(load_task(tmp_path / "t.toml"))


OPENMP = SEED.replace("for (int i", '_Pragma("omp parallel for")\n    for (int i')
CASES = {  # id: (kernel, stage, status, words of the error)
    "seed": (SEED, 1, "success", ""),
    "wrong": (SEED.replace("2.5 * x[i]", "x[i]"), 1, "verification_error", "wrong result"),
    "past-the-end": (
        SEED.replace("}\n", "    z[N] = 0.0;\n}\n"),
        1,
        "verification_error",
        "wrote outside its arrays",
    ),
    "openmp-at-stage-1": (OPENMP, 1, "stage_violation", "openmp"),
    "openmp-at-stage-4": (OPENMP, 4, "success", ""),
    "writes-an-input": (
        SEED.replace("y[i];", "y[i];\n    ((double *)x)[0] = 0.0;"),
        1,
        "verification_error",
        "modified its inputs x or y",
    ),
    "does-not-compile": (SEED.replace("y[i];", "y[i]"), 1, "compile_error", "error"),
}


@pytest.mark.parametrize("case", CASES)
def test_every_guarantee_holds_for_the_new_task(
    bench: Benchmarker, axpy: TaskSpec, case: str
) -> None:
    code, stage, status, why = CASES[case]
    verdict = bench.evaluate(code, stage=stage, opt_level="O3", task=axpy)
    assert_status(verdict, status)
    assert why.lower() in verdict.error.lower()
    if status == "success":
        assert verdict.generalizes is True and verdict.gflops > 0


def test_the_cli_judges_it_by_the_toml_path(task_dir: Path) -> None:
    out = run_check(task_dir / "axpy.seed.c", "--task", str(task_dir / "axpy.toml"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "success"
