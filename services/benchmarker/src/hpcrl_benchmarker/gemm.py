"""The trusted side of the GEMM harness: inputs, the job protocol and the reference.

The sandboxed harness regenerates the same pseudo-random inputs from a seed, runs the kernel
and streams each C back; here the reference is computed with OpenBLAS ``cblas_dgemm`` (through
ctypes, in this trusted process, so nothing the kernel does can touch it) and compared.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import struct
from dataclasses import dataclass

import numpy as np

from hpcrl_common.task import Sizes

FRAME = struct.Struct("<QIIdQ")
FLAG_INPUTS_MODIFIED = 1
FLAG_CHANGED_AFTER_RETURN = 2
FLAG_END = 0x80000000
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_B_SALT = 0x5DEECE66DA3B1F7F
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS = 101, 111


def random_matrix(seed: int, count: int) -> np.ndarray:
    """splitmix64 values in [-1, 1), bit-identical to the harness's ``fill``."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, np.ndarray]:
    m, n, k = sizes["M"], sizes["N"], sizes["K"]
    a = random_matrix(seed, m * k).reshape(m, k)
    b = random_matrix(seed ^ _B_SALT, k * n).reshape(k, n)
    return a, b


_BLAS: ctypes.CDLL | None = None


def _openblas() -> ctypes.CDLL:
    global _BLAS
    if _BLAS is None:
        name = ctypes.util.find_library("openblas") or "libopenblas.so.0"
        lib = ctypes.CDLL(name)
        lib.cblas_dgemm.restype = None
        # One thread: as fast at these sizes, and no OpenBLAS worker threads left spinning
        # on the cores a kernel is about to be timed on.
        if hasattr(lib, "openblas_set_num_threads"):
            lib.openblas_set_num_threads(1)
        _BLAS = lib
    return _BLAS


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = A B with OpenBLAS ``cblas_dgemm`` (row-major), the task's reference."""
    m, k = a.shape
    n = b.shape[1]
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    c = np.zeros((m, n))
    ptr = ctypes.POINTER(ctypes.c_double)
    _openblas().cblas_dgemm(
        _CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_NO_TRANS, m, n, k, ctypes.c_double(1.0),
        a.ctypes.data_as(ptr), k, b.ctypes.data_as(ptr), n, ctypes.c_double(0.0),
        c.ctypes.data_as(ptr), n,
    )
    return c


@dataclass(frozen=True)
class Job:
    kind: str  # v: verify, w: warm-up, t: timed
    sizes: Sizes
    seed: int

    def line(self) -> str:
        return f"{self.kind} {self.sizes['M']} {self.sizes['N']} {self.sizes['K']} {self.seed}"


@dataclass(frozen=True)
class Frame:
    job: int
    flags: int
    seconds: float
    c: np.ndarray


class ProtocolError(ValueError):
    pass


def request(nonce: int, jobs: list[Job]) -> bytes:
    return ("\n".join([f"{nonce} {len(jobs)}", *(job.line() for job in jobs)]) + "\n").encode()


class FrameReader:
    """Reads the harness's result stream incrementally, as it arrives.

    ``feed`` returns the frames completed by a chunk; it raises ProtocolError on a wrong
    nonce, frames out of order, a wrong matrix size, a bad end marker or data after it.
    """

    def __init__(self, nonce: int, jobs: list[Job]) -> None:
        self.nonce = nonce
        self.jobs = jobs
        self.frames: list[Frame] = []
        self.finished = False
        self._buffer = bytearray()
        self._header: tuple[int, int, float, int] | None = None  # job, flags, seconds, count

    def feed(self, chunk: bytes) -> list[Frame]:
        if self.finished and chunk:
            raise ProtocolError("result stream corrupted (bad end marker)")
        self._buffer += chunk
        new: list[Frame] = []
        while True:
            if self._header is None:
                if len(self._buffer) < FRAME.size:
                    break
                got_nonce, job, flags, seconds, count = FRAME.unpack_from(self._buffer, 0)
                del self._buffer[: FRAME.size]
                if got_nonce != self.nonce:
                    raise ProtocolError("result stream corrupted (wrong nonce)")
                if flags == FLAG_END:
                    if (job != len(self.jobs) or len(self.frames) != len(self.jobs)
                            or self._buffer):
                        raise ProtocolError("result stream corrupted (bad end marker)")
                    self.finished = True
                    break
                if job != len(self.frames) or job >= len(self.jobs):
                    raise ProtocolError("result stream corrupted (jobs out of order)")
                sizes = self.jobs[job].sizes
                if count != sizes["M"] * sizes["N"]:
                    raise ProtocolError("result stream corrupted (wrong matrix size)")
                self._header = (job, flags, seconds, count)
            job, flags, seconds, count = self._header
            if len(self._buffer) < 8 * count:
                break
            # A copy: the buffer keeps changing, and a frame must outlive it.
            with memoryview(self._buffer) as view:
                payload = bytes(view[: 8 * count])
            c = np.frombuffer(payload, dtype="<f8", count=count)
            del self._buffer[: 8 * count]
            sizes = self.jobs[job].sizes
            frame = Frame(job, flags, seconds, c.reshape(sizes["M"], sizes["N"]))
            self.frames.append(frame)
            new.append(frame)
            self._header = None
        return new


def parse_frames(data: bytes, nonce: int, jobs: list[Job]) -> tuple[list[Frame], bool]:
    """The frames the harness completed, in order, and whether it reached its end marker."""
    reader = FrameReader(nonce, jobs)
    reader.feed(data)
    return reader.frames, reader.finished


def sample_points(m: int, n: int, random_points: int, corners_and_centre: bool,
                  rng: np.random.Generator) -> list[tuple[int, int]]:
    points = []
    if corners_and_centre:
        points += [(0, 0), (0, n - 1), (m - 1, 0), (m - 1, n - 1), (m // 2, n // 2)]
    rows = rng.integers(0, m, size=random_points)
    cols = rng.integers(0, n, size=random_points)
    points += list(zip(rows.tolist(), cols.tolist(), strict=True))
    return points


@dataclass(frozen=True)
class Expected:
    """What one job's C must hold at its check points, computed before the run (the inputs
    and the points depend only on the seed and the trusted process's own generator)."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray  # the reference at (rows, cols)
    scale: np.ndarray  # the denominator of the relative error at each point


def expected_at(ref: np.ndarray, a: np.ndarray, b: np.ndarray,
                points: list[tuple[int, int]]) -> Expected:
    rows = np.fromiter((i for i, _ in points), dtype=np.intp, count=len(points))
    cols = np.fromiter((j for _, j in points), dtype=np.intp, count=len(points))
    values = ref[rows, cols]
    # sum_k |a_ik b_kj| per point: the size of the terms, which floors the denominator where
    # cancellation makes |ref| tiny.
    terms = np.einsum("pk,kp->p", np.abs(a[rows]), np.abs(b[:, cols]))
    scale = np.maximum(np.maximum(np.abs(values), 1e-3 * terms), 1e-300)
    return Expected(rows, cols, values, scale)


def expect(job: Job, random_points: int, corners_and_centre: bool,
           rng: np.random.Generator) -> Expected:
    """The reference (OpenBLAS) for one job, reduced to its check points."""
    a, b = inputs(job.sizes, job.seed)
    ref = reference(a, b)
    points = sample_points(job.sizes["M"], job.sizes["N"], random_points, corners_and_centre,
                           rng)
    return expected_at(ref, a, b, points)


def check_expected(c: np.ndarray, expected: Expected, tolerance: float) -> str:
    """'' if C is right, else why not.

    The task's points use relative error |c - ref| / |ref|; where cancellation makes |ref|
    tiny the denominator is floored at 1e-3 of sum_k |a_ik b_kj| (the size of the terms), so
    a correct kernel that sums in another order never fails. Every element must also have
    been written (C starts as NaN).
    """
    got = c[expected.rows, expected.cols]
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(got - expected.values) / expected.scale
    bad = ~(error <= tolerance)  # NaN fails too
    if bad.any():
        p = int(np.argmax(bad))
        i, j = int(expected.rows[p]), int(expected.cols[p])
        return (f"C[{i}][{j}] = {float(got[p])!r} but the reference gives "
                f"{float(expected.values[p])!r} (relative error {float(error[p]):.3g} > "
                f"{tolerance:g})")
    unwritten = int(c.size - np.count_nonzero(np.isfinite(c)))
    if unwritten:
        return f"{unwritten} of {c.size} elements of C were not written (still NaN) or not finite"
    return ""


def check(c: np.ndarray, ref: np.ndarray, a: np.ndarray, b: np.ndarray,
          points: list[tuple[int, int]], tolerance: float) -> str:
    """``check_expected`` against a full reference matrix and explicit points."""
    return check_expected(c, expected_at(ref, a, b, points), tolerance)


def is_finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0
