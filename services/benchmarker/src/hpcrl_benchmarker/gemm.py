"""The GEMM harness's description (``harness/gemm.c``): C = A B, row-major, A M x K, B K x N.

The sandboxed harness regenerates the same pseudo-random inputs from a seed, runs the kernel
and streams each C back; here the reference is computed with OpenBLAS ``cblas_dgemm`` (through
ctypes, in this trusted process, so nothing the kernel does can touch it) and compared.
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
)
from hpcrl_benchmarker.harnesses import random_values as random_matrix
from hpcrl_benchmarker.protocol import (  # noqa: F401  (the protocol's names, as they were here)
    CLOCK_TOLERANCE_NS,
    END_LINE,
    END_SLACK_NS,
    FLAG_CHANGED_AFTER_RETURN,
    FLAG_INPUTS_MODIFIED,
    FLAG_OUTSIDE_WRITTEN,
    FLAG_PARALLEL_LEFT_OPEN,
    GO_LINE,
    MARK,
    MARK_BEGIN,
    MARK_CHECK,
    MARK_END,
    MARK_READY,
    MARK_RESULT,
    Frame,
    ProtocolError,
    RunReader,
    header,
    is_finite_positive,
    job_line,
    request,
)
from hpcrl_benchmarker.verify import Expected, Names, Points, check_expected, floored_scale
from hpcrl_benchmarker.verify import sample_points as _sample_points
from hpcrl_common.task import Sizes

_openblas = openblas  # the verifier's OpenBLAS (tests read its core name)

NAMES = Names(
    output="C",
    inputs="A or B",
    arrays="A, B or C",
    full_check="full-matrix check",
    points="the paper's",
)
# Elements whose term sizes are summed one by one; beyond, one dgemm of |A| |B| (~0.6 ms at
# the reward size) is cheaper than gathering their rows and columns.
_GATHER_LIMIT = 512


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    """A and B from the seed, made by the template's own code (``Harness.inputs``)."""
    return GEMM.inputs(sizes, seed)


def numpy_inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A and B from the seed with numpy, bit for bit the template's."""
    m, n, k = sizes["M"], sizes["N"], sizes["K"]
    a = random_matrix(seed, m * k).reshape(m, k)
    b = random_matrix(seed ^ SECOND_SALT, k * n).reshape(k, n)
    return a, b


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = A B with OpenBLAS ``cblas_dgemm`` (row-major), the task's reference."""
    c = np.zeros((a.shape[0], b.shape[1]))
    _dgemm(np.ascontiguousarray(a), np.ascontiguousarray(b), c)
    return c


def _dgemm(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    (m, k), n = a.shape, b.shape[1]
    openblas().cblas_dgemm(
        CBLAS_ROW_MAJOR,
        CBLAS_NO_TRANS,
        CBLAS_NO_TRANS,
        m,
        n,
        k,
        ctypes.c_double(1.0),
        pointer(a),
        k,
        pointer(b),
        n,
        ctypes.c_double(0.0),
        pointer(c),
        n,
    )


@dataclass(frozen=True)
class _Scales:
    """The full check's denominators at any elements: sum_k |a_ik b_kj|, the size of the
    terms, floors |ref| where cancellation makes it tiny."""

    a: np.ndarray
    b: np.ndarray
    full: np.ndarray

    def __call__(self, points: Points) -> np.ndarray:
        rows, cols = points
        if len(rows) > _GATHER_LIMIT:  # a whole |A| |B| costs less than gathering this much
            return floored_scale(self.full, reference(np.abs(self.a), np.abs(self.b)))[rows, cols]
        return floored_scale(self.full[rows, cols], _terms(self.a, self.b, rows, cols))


def _terms(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    return np.einsum("pk,kp->p", np.abs(a[rows]), np.abs(b[:, cols]))


def sample_points(
    m: int, n: int, random_points: int, corners_and_centre: bool, rng: np.random.Generator
) -> list[tuple[int, int]]:
    rows, cols = _sample_points((m, n), random_points, corners_and_centre, rng)
    return list(zip(rows.tolist(), cols.tolist(), strict=True))


def expected_at(
    ref: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    points: list[tuple[int, int]],
    *,
    full: bool = True,
) -> Expected:
    rows = np.fromiter((i for i, _ in points), dtype=np.intp, count=len(points))
    cols = np.fromiter((j for _, j in points), dtype=np.intp, count=len(points))
    values = ref[rows, cols]
    scale = floored_scale(values, _terms(a, b, rows, cols))
    if not full:
        return Expected((rows, cols), values, scale, NAMES)
    return Expected((rows, cols), values, scale, NAMES, ref, _Scales(a, b, ref))


def expect(
    job: protocol.Job, random_points: int, corners_and_centre: bool, rng: np.random.Generator
) -> Expected:
    """The reference (OpenBLAS) for one job: its check points and the whole matrix."""
    a, b = inputs(job.sizes, job.seed)
    ref = reference(a, b)
    points = sample_points(job.sizes["M"], job.sizes["N"], random_points, corners_and_centre, rng)
    return expected_at(ref, a, b, points)


def check(
    c: np.ndarray,
    ref: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    points: list[tuple[int, int]],
    tolerance: float,
) -> str:
    """``check_expected`` against a full reference matrix and explicit points."""
    return check_expected(c, expected_at(ref, a, b, points), tolerance)


class Gemm(Harness):
    name = "gemm"
    dims = ("M", "N", "K")
    names = NAMES
    routine = "cblas_dgemm"

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        return (sizes["M"], sizes["N"])

    def input_layout(self, sizes: Sizes) -> Layout:
        m, n, k = sizes["M"], sizes["N"], sizes["K"]
        return ((np.float64, (m, k)), (np.float64, (k, n)))

    def numpy_inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        return numpy_inputs(sizes, seed)

    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        _dgemm(*inputs, out)

    def expect(
        self,
        job: protocol.Job,
        random_points: int,
        corners_and_centre: bool,
        rng: np.random.Generator,
    ) -> Expected:
        return expect(job, random_points, corners_and_centre, rng)


GEMM = HARNESS = Gemm()


def Job(kind: str, sizes: Sizes, seed: int) -> protocol.Job:
    """A GEMM job (sizes M, N, K); the callers that built jobs here before there were other
    tasks still do."""
    return GEMM.job(kind, sizes, seed)
