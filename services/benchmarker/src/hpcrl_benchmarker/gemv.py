"""The GEMV harness's description (``harness/gemv.c``): y = A x, row-major, A M x N.

Inputs from the seed as the template makes them (A from the seed, x from the seed xor the
second salt), the reference with OpenBLAS ``cblas_dgemv`` in this trusted process, and the
denominators of the relative error: the term sizes sum_j |a_ij x_j| at the check points (a
dgemv of those rows of |A|), and for the full check one dgemv of all of |A| and |x|, made only
where |y| alone fails (``verify``: a wrong output, in practice).

Why the task's tolerance (``gemv.toml``, 1e-6) is right for this arithmetic: y_i sums N
products of values in [-1, 1). Any order of summation, with or without FMA, blocked or not,
errs by at most gamma_N = N u / (1 - N u) times sum_j |a_ij x_j| (u = 2^-53), so at most
~2.3e-13 of the term sizes for N <= 2048, and the denominator is at least 1e-3 of the term
sizes: a correct kernel's relative error stays below ~2.3e-10, four orders under 1e-6 (the
rows summed backwards: at most 7e-14, 5 seeds at the reward size). What is wrong errs far
above it: one term dropped or counted twice moves y_i by ~|a x| ~ 0.25 against
|y_i| ~ 0.33 sqrt(N) ~ 10 (~2e-2); single-precision arithmetic (float products and sums) errs
by a median 5e-7 and up to 3-4e-5, so 225-258 of the 1023 elements of the reward size fail
(5 seeds; tests/benchmarker/kernels/gemv/float_precision.c).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from hpcrl_benchmarker import protocol
from hpcrl_benchmarker.harnesses import (
    CBLAS_NO_TRANS,
    CBLAS_ROW_MAJOR,
    SECOND_SALT,
    Harness,
    Layout,
    openblas,
    pointer,
    random_values,
)
from hpcrl_benchmarker.verify import Expected, Names, Points, floored_scale, sample_points
from hpcrl_common.task import Sizes

NAMES = Names(
    output="y", inputs="A or x", arrays="A, x or y", full_check="full-vector check", points="the"
)


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    """A and x from the seed, made by the template's own code (``Harness.inputs``)."""
    return GEMV.inputs(sizes, seed)


def numpy_inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A and x from the seed with numpy, bit for bit the template's."""
    m, n = sizes["M"], sizes["N"]
    return random_values(seed, m * n).reshape(m, n), random_values(seed ^ SECOND_SALT, n)


def _dgemv(a: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    m, n = a.shape
    openblas().cblas_dgemv(
        CBLAS_ROW_MAJOR,
        CBLAS_NO_TRANS,
        m,
        n,
        ctypes.c_double(1.0),
        pointer(a),
        n,
        pointer(x),
        1,
        ctypes.c_double(0.0),
        pointer(y),
        1,
    )


def reference(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = A x with OpenBLAS ``cblas_dgemv`` (row-major), the task's reference."""
    y = np.zeros(a.shape[0])
    _dgemv(np.ascontiguousarray(a), np.ascontiguousarray(x), y)
    return y


@dataclass(frozen=True)
class _Scales:
    """The full check's denominators, wanted only where |y| alone fails (a wrong kernel's
    elements, in practice): the term sizes sum_j |a_ij x_j| of every row are one dgemv of
    |A| and |x|, A made again from the seed (a job's A is not kept)."""

    job: protocol.Job
    full: np.ndarray

    def __call__(self, points: Points) -> np.ndarray:
        a, x = inputs(self.job.sizes, self.job.seed)
        return floored_scale(self.full, reference(np.abs(a), np.abs(x)))[points]


class Gemv(Harness):
    name = "gemv"
    dims = ("M", "N")
    names = NAMES
    routine = "cblas_dgemv"

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        return (sizes["M"],)

    def input_layout(self, sizes: Sizes) -> Layout:
        m, n = sizes["M"], sizes["N"]
        return ((np.float64, (m, n)), (np.float64, (n,)))

    def numpy_inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        return numpy_inputs(sizes, seed)

    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        _dgemv(*inputs, out)

    def expect(
        self,
        job: protocol.Job,
        random_points: int,
        corners_and_centre: bool,
        rng: np.random.Generator,
    ) -> Expected:
        a, x = inputs(job.sizes, job.seed)
        ref = reference(a, x)
        points = sample_points(ref.shape, random_points, corners_and_centre, rng)
        (rows,) = points
        # The term sizes at the check points only (|A| of 105 rows, not of all of A).
        scale = floored_scale(ref[points], reference(np.abs(a[rows]), np.abs(x)))
        return Expected(points, ref[points], scale, NAMES, ref, _Scales(job, ref))

    def bytes_moved(self, sizes: Sizes) -> float:
        """A read once, x read, y written: 8 (M N + N + M) bytes."""
        m, n = sizes["M"], sizes["N"]
        return 8.0 * (m * n + n + m)


GEMV = HARNESS = Gemv()
