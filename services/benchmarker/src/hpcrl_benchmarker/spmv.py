"""The SpMV harness's description (``harness/spmv.c``): y = A x with A in CSR form (rowptr,
col, val; int32 indices, double values), M x N with NNZ stored entries.

The matrix from the seed exactly as the template builds it: each entry k falls in a row
drawn from a skewed law (the product of three uniform 21-bit numbers, so row lengths run
from empty to ~60x the mean, about a fifth of the rows empty) and the rows are scattered by
a bijection (r * 16777259 + offset) mod M; entries keep their order k within a row. A
quarter of the columns lie within 16 of the row's diagonal position i N / M, the rest are
uniform over N, in no order and possibly repeated, so a kernel that ignores ``col``, assumes
a band, equal row lengths or sorted columns computes something else. val and x are values in
[-1, 1). The reference is the template's own loop (``reference`` in ``harness/spmv.c``, each
row summed in storage order), built with its ``fill_inputs`` into the trusted parent's library
and never into the harness that runs a kernel (0.4 ms at the reward size, where numpy's gather
and row sums took 3); numpy's ``products`` (each row's products summed by ``np.add.reduceat``,
pairwise) where that library does not build, and for the full check's denominators (the sums
of |val x|), wanted only at the check points and at elements that fail |y| alone.

FLOPs: 2 NNZ (a multiply and an add per stored entry). Bytes a call must move at least:
val and col once (12 NNZ), rowptr once (4 (M + 1)), x at least once (8 N) and y written once
(8 M). x is gathered, so it is read more than once unless it stays in the caches (its 160 KB
fit the L2 here).

Why the task's tolerance (``spmv.toml``, 1e-6) is right for this arithmetic: y_i sums its
row's L_i products of values in [-1, 1). Any order of summation, with or without FMA, errs
by at most gamma_L = L u / (1 - L u) (u = 2^-53) of the terms' size sum |val x|, and the
denominator is |y_i| floored at 1e-3 of that size; the longest rows here hold ~2,150 entries
(L_i < 2^14 at every size of the task), so a correct kernel errs by less than 1.9e-9 of its
denominator, under 1e-6 by far (rows summed backwards against the pairwise reference: at most
1.5e-13, 5 seeds at the reward size). An empty row
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
from hpcrl_benchmarker.harnesses import (
    BLOCK,
    GOLDEN,
    Harness,
    Layout,
    mix_block,
    native_reference,
    random_values,
)
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

    @property
    def m(self) -> int:
        return len(self.rowptr) - 1


def matrix(sizes: Sizes, seed: int) -> Matrix:
    """The job's matrix, made by the template's own code (``Harness.inputs``)."""
    rowptr, col, val, _ = inputs(sizes, seed)
    return Matrix(rowptr, col, val)


def numpy_matrix(sizes: Sizes, seed: int) -> Matrix:
    """The job's matrix with numpy, bit for bit the template's. In blocks of ``BLOCK`` entries, each
    block's words and temporaries in cache (whole-array passes over 700,001 words went to
    memory once per operation), and every modulo by a constant done as x - (x // d) d
    (numpy divides an array by a scalar quickly, but its modulo is ~15x slower)."""
    m, n, nnz = sizes["M"], sizes["N"], sizes["NNZ"]
    u64 = np.uint64
    block = min(nnz, BLOCK)
    step = np.arange(1, block + 1, dtype=np.uint64)
    step *= u64(GOLDEN)
    z, t, tmp = np.empty_like(step), np.empty_like(step), np.empty_like(step)
    # The rows: entry k's value of the skewed law, t < M, is counted; row scatter[t] is its
    # row, and scatter is a bijection of the rows, so a row's count is its t's.
    by_law = np.zeros(m, dtype=np.intp)
    with np.errstate(over="ignore"):
        for begin in range(0, nnz, BLOCK):
            size = min(nnz, begin + BLOCK) - begin
            h, law, other = z[:size], t[:size], tmp[:size]
            mix_block((seed ^ ROW_SALT) + begin * GOLDEN, step[:size], h, other)
            np.right_shift(h, u64(43), out=law)
            np.right_shift(h, u64(22), out=other)
            other &= u64(0x1FFFFF)
            law *= other
            h >>= u64(1)
            h &= u64(0x1FFFFF)
            law *= h
            law >>= u64(42)
            law *= u64(m)
            law >>= u64(21)
            by_law += np.bincount(law.view(np.int64), minlength=m)
    # The scatter (r * SCATTER + offset) mod M, as a table of the M rows.
    scatter = np.arange(m, dtype=np.uint64) * u64(SCATTER) + u64(_mix(seed ^ ROW_SALT) % m)
    scatter -= scatter // u64(m) * u64(m)
    counts = np.empty(m, dtype=np.intp)
    counts[scatter.view(np.int64)] = by_law
    rowptr = np.zeros(m + 1, dtype=np.int32)
    np.cumsum(counts, out=rowptr[1:])
    rows = np.repeat(np.arange(m, dtype=np.intp), counts)
    # The columns, by position k in CSR order: a quarter near the row's diagonal position.
    diagonal = np.arange(m, dtype=np.uint64) * u64(n) // u64(m)
    col = np.empty(nnz, dtype=np.int32)
    with np.errstate(over="ignore"):
        for begin in range(0, nnz, BLOCK):
            size = min(nnz, begin + BLOCK) - begin
            h = z[:size]
            mix_block((seed ^ COL_SALT) + begin * GOLDEN, step[:size], h, tmp[:size])
            near = np.flatnonzero((h & u64(3)) == 0)
            close = h[near]
            close >>= u64(8)
            close -= close // u64(33) * u64(33)  # (h >> 8) % 33
            close += diagonal[rows[begin + near]]
            close += u64(16 * n - 16)
            close -= close // u64(n) * u64(n)  # (diagonal + ... + 16 n - 16) % n
            h >>= u64(32)
            h *= u64(n)
            h >>= u64(32)
            h[near] = close
            col[begin : begin + size] = h
    return Matrix(rowptr, col, random_values(seed ^ VAL_SALT, nnz))


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    """rowptr, col, val and x from the seed, made by the template's own code."""
    return SPMV.inputs(sizes, seed)


def numpy_inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    """The same with numpy, bit for bit."""
    a = numpy_matrix(sizes, seed)
    return a.rowptr, a.col, a.val, random_values(seed ^ X_SALT, sizes["N"])


def row_sums(terms: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's sum of its run of ``terms`` (the rows' runs back to back, the last one ending
    with ``terms``), 0 for an empty row. One ``np.add.reduceat`` over the non-empty rows: numpy
    sums each run pairwise, so a row's bits depend on its own terms alone."""
    sums = np.zeros(len(starts))
    filled = np.flatnonzero(lengths)
    if filled.size:
        sums[filled] = np.add.reduceat(terms, starts[filled])
    return sums


def row_term_sizes(
    rowptr: np.ndarray, col: np.ndarray, val: np.ndarray, x: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """sum |val[k] x[col[k]]| over each of ``rows``' entries (the same bits as ``products``'
    term sizes of those rows): the check points' denominators."""
    starts = rowptr[rows].astype(np.intp)
    lengths = rowptr[rows + 1] - starts
    total = int(lengths.sum())
    firsts = np.cumsum(lengths) - lengths
    entries = np.arange(total) - np.repeat(firsts, lengths) + np.repeat(starts, lengths)
    terms = x[col[entries]]
    terms *= val[entries]
    np.abs(terms, out=terms)
    return row_sums(terms, firsts, lengths)


def products(a: Matrix, x: np.ndarray, *, term_sizes: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(y, the term sizes): y_i = sum of val[k] x[col[k]] over row i's entries (empty rows:
    0), and sum |val[k] x[col[k]]| likewise (the full check's denominators; zeros without
    ``term_sizes``). ~3 ms at the reward size, where a ``np.bincount`` by row took 8 and
    the expectation of a candidate's twelve jobs outlasted its compile."""
    terms = np.empty(len(a.col))
    # mode="clip" skips numpy's bounds check (3x slower); the template's columns are < N.
    np.take(x, a.col, out=terms, mode="clip")
    terms *= a.val
    starts, lengths = a.rowptr[:-1], np.diff(a.rowptr)
    y, sizes = row_sums(terms, starts, lengths), np.zeros(a.m)
    if term_sizes:
        np.abs(terms, out=terms)
        sizes = row_sums(terms, starts, lengths)
    return y, sizes


def reference(a: Matrix, x: np.ndarray) -> np.ndarray:
    """y_i = sum of val[k] x[col[k]] over row i's entries (empty rows: 0): the template's own
    loop (``harnesses.native_reference``; inputs as its ``fill_inputs`` makes them), numpy's
    ``products`` where its library has not built."""
    y = np.empty(a.m)
    dims = (a.m, len(x), len(a.col))
    if native_reference(SPMV.name, dims, (a.rowptr, a.col, a.val, x), y):
        return y
    return products(a, x, term_sizes=False)[0]


@dataclass(frozen=True)
class _Scales:
    """The full check's denominators, wanted only where |y| alone fails (a wrong kernel's
    elements, in practice): the matrix made again from the seed (a job's is not kept)."""

    job: protocol.Job
    full: np.ndarray

    def __call__(self, points: Points) -> np.ndarray:
        rowptr, col, val, x = inputs(self.job.sizes, self.job.seed)
        return floored_scale(self.full, products(Matrix(rowptr, col, val), x)[1])[points]


class Spmv(Harness):
    name = "spmv"
    dims = ("M", "N", "NNZ")
    names = NAMES
    routine = "numpy"
    timed_routine = False

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        return (sizes["M"],)

    def input_layout(self, sizes: Sizes) -> Layout:
        m, n, nnz = sizes["M"], sizes["N"], sizes["NNZ"]
        return ((np.int32, (m + 1,)), (np.int32, (nnz,)), (np.float64, (nnz,)), (np.float64, (n,)))

    def numpy_inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        return numpy_inputs(sizes, seed)

    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        rowptr, col, val, x = inputs
        out[...] = reference(Matrix(rowptr, col, val), x)

    def expect(
        self,
        job: protocol.Job,
        random_points: int,
        corners_and_centre: bool,
        rng: np.random.Generator,
    ) -> Expected:
        rowptr, col, val, x = inputs(job.sizes, job.seed)
        ref = reference(Matrix(rowptr, col, val), x)
        points = sample_points(ref.shape, random_points, corners_and_centre, rng)
        (rows,) = points
        scale = floored_scale(ref[rows], row_term_sizes(rowptr, col, val, x, rows))
        return Expected(points, ref[points], scale, NAMES, ref, _Scales(job, ref))

    def bytes_moved(self, sizes: Sizes) -> float:
        """val and col (12 NNZ), rowptr (4 (M + 1)), x (8 N) read once, y written once (8 M)."""
        m, n, nnz = sizes["M"], sizes["N"], sizes["NNZ"]
        return 12.0 * nnz + 4.0 * (m + 1) + 8.0 * n + 8.0 * m


SPMV = HARNESS = Spmv()
