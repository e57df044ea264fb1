"""The SpMV harness's description (``harness/spmv.c``): y = A x with A in CSR form (rowptr,
col, val; int32 indices, double values), M x N with NNZ stored entries.

The matrix from the seed exactly as the template builds it: each entry k falls in a row
drawn from a skewed law (the product of three uniform 21-bit numbers, so row lengths run
from empty to ~60x the mean, about a fifth of the rows empty) and the rows are scattered by
a bijection (r * 16777259 + offset) mod M; entries keep their order k within a row. A
quarter of the columns lie within 16 of the row's diagonal position i N / M, the rest are
uniform over N, in no order and possibly repeated, so a kernel that ignores ``col``, assumes
a band, equal row lengths or sorted columns computes something else. val and x are values in
[-1, 1). The reference is numpy in this trusted process (``np.bincount`` of the products by
row), and the full check's denominators come with it (the same sums of |val x|).

FLOPs: 2 NNZ (a multiply and an add per stored entry). Bytes a call must move at least:
val and col once (12 NNZ), rowptr once (4 (M + 1)), x at least once (8 N) and y written once
(8 M). x is gathered, so it is read more than once unless it stays in the caches (its 160 KB
fit the L2 here).

Why the task's tolerance (``spmv.toml``, 1e-6) is right for this arithmetic: y_i sums its
row's L_i products of values in [-1, 1). Any order of summation, with or without FMA, errs
by at most gamma_L = L u / (1 - L u) (u = 2^-53) of the terms' size sum |val x|, and the
denominator is |y_i| floored at 1e-3 of that size; the longest rows here hold ~2,150 entries
(L_i < 2^14 at every size of the task), so a correct kernel errs by less than 1.9e-9 of its
denominator, under 1e-6 by far (rows summed backwards against the reference's order: at most
1.6e-13, 5 seeds at the reward size). An empty row
must give 0 (its denominator is floored at 1e-300: nothing but 0 passes). What is wrong errs
far above it: one entry dropped, or its column wrong, moves y_i by ~0.25 against
|y_i| ~ 0.33 sqrt(L_i) (~2e-2 and more); single precision (float products and sums) errs
by up to 4-7e-5 where a row cancels: 600-650 of the 20,011 elements of the reward size fail
(5 seeds; tests/benchmarker/kernels/spmv/float_precision.c).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcrl_benchmarker import protocol
from hpcrl_benchmarker.harnesses import Harness, random_values, random_words
from hpcrl_benchmarker.verify import Expected, Names, Points, floored_scale, sample_points
from hpcrl_common.task import Sizes

NAMES = Names(
    output="y",
    inputs="rowptr, col, val or x",
    arrays="rowptr, col, val, x or y",
    full_check="full-vector check",
    points="the",
)
# The template's salts and row scatter (harness/spmv.c).
ROW_SALT = 0x243F6A8885A308D3
COL_SALT = 0x13198A2E03707344
VAL_SALT = 0xA4093822299F31D0
X_SALT = 0x5DEECE66DA3B1F7F
SCATTER = 16777259
_MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class Matrix:
    rowptr: np.ndarray  # int32, M + 1
    col: np.ndarray  # int32, NNZ
    val: np.ndarray  # float64, NNZ
    rows: np.ndarray  # the row of each entry (intp), NNZ: not an input, the reference's

    @property
    def m(self) -> int:
        return len(self.rowptr) - 1


def matrix(sizes: Sizes, seed: int) -> Matrix:
    """The job's matrix, bit for bit the template's (the per-entry modulos done on the rows'
    tables or on the near-diagonal quarter only: numpy's uint64 modulo is slow)."""
    m, n, nnz = sizes["M"], sizes["N"], sizes["NNZ"]
    u64 = np.uint64
    h = random_words(seed ^ ROW_SALT, nnz)
    t = h >> u64(43)
    t *= (h >> u64(22)) & u64(0x1FFFFF)
    h >>= u64(1)
    h &= u64(0x1FFFFF)
    t *= h
    t >>= u64(42)
    t *= u64(m)
    t >>= u64(21)
    # The scatter (r * SCATTER + offset) mod M, as a table of the M rows.
    offset = u64(_mix(seed ^ ROW_SALT) % m)
    scatter = (np.arange(m, dtype=np.uint64) * u64(SCATTER) + offset) % u64(m)
    entry_rows = scatter.view(np.int64)[t.view(np.int64)]
    counts = np.bincount(entry_rows, minlength=m)
    rowptr = np.zeros(m + 1, dtype=np.int32)
    np.cumsum(counts, out=rowptr[1:])
    rows = np.repeat(np.arange(m, dtype=np.intp), counts)
    h = random_words(seed ^ COL_SALT, nnz)
    near = np.flatnonzero((h & u64(3)) == 0)
    close = h[near]
    close >>= u64(8)
    close %= u64(33)
    close += (np.arange(m, dtype=np.uint64) * u64(n) // u64(m))[rows[near]]
    close += u64(16 * n - 16)
    close %= u64(n)
    h >>= u64(32)
    h *= u64(n)
    h >>= u64(32)
    h[near] = close
    col = h.astype(np.int32)
    return Matrix(rowptr, col, random_values(seed ^ VAL_SALT, nnz), rows)


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    a = matrix(sizes, seed)
    return a.rowptr, a.col, a.val, random_values(seed ^ X_SALT, sizes["N"])


def reference(a: Matrix, x: np.ndarray) -> np.ndarray:
    """y_i = sum of val[k] x[col[k]] over row i's entries, in their order (empty rows: 0)."""
    return np.bincount(a.rows, weights=a.val * x[a.col], minlength=a.m)


@dataclass(frozen=True)
class _Scales:
    every: np.ndarray  # the denominator of every element

    def __call__(self, points: Points) -> np.ndarray:
        return self.every[points]


class Spmv(Harness):
    name = "spmv"
    dims = ("M", "N", "NNZ")
    names = NAMES
    routine = "numpy"
    timed_routine = False

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        return (sizes["M"],)

    def inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        return inputs(sizes, seed)

    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        rowptr, col, val, x = inputs
        rows = np.repeat(np.arange(len(rowptr) - 1), np.diff(rowptr))
        out[...] = reference(Matrix(rowptr, col, val, rows), x)

    def expect(
        self,
        job: protocol.Job,
        random_points: int,
        corners_and_centre: bool,
        rng: np.random.Generator,
    ) -> Expected:
        a = matrix(job.sizes, job.seed)
        x = random_values(job.seed ^ X_SALT, job.sizes["N"])
        terms = a.val * x[a.col]
        ref = np.bincount(a.rows, weights=terms, minlength=a.m)
        np.abs(terms, out=terms)
        every = floored_scale(ref, np.bincount(a.rows, weights=terms, minlength=a.m))
        points = sample_points(ref.shape, random_points, corners_and_centre, rng)
        return Expected(points, ref[points], every[points], NAMES, ref, _Scales(every))

    def bytes_moved(self, sizes: Sizes) -> float:
        """val and col (12 NNZ), rowptr (4 (M + 1)), x (8 N) read once, y written once (8 M)."""
        m, n, nnz = sizes["M"], sizes["N"], sizes["NNZ"]
        return 12.0 * nnz + 4.0 * (m + 1) + 8.0 * n + 8.0 * m


SPMV = HARNESS = Spmv()
