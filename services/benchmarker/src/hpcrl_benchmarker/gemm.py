"""The trusted side of the GEMM harness: inputs, the job protocol and the reference.

The sandboxed harness regenerates the same pseudo-random inputs from a seed, runs the kernel
and streams each C back; here the reference is computed with OpenBLAS ``cblas_dgemm`` (through
ctypes, in this trusted process, so nothing the kernel does can touch it) and compared.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hpcrl_benchmarker.host import openblas_coretype
from hpcrl_common.task import Sizes

MARK = struct.Struct("<QIIQQ")  # nonce, job, type, value, count
MARK_BEGIN, MARK_RESULT, MARK_CHECK, MARK_READY, MARK_END = 1, 2, 3, 4, 0x80000000
GO_LINE = b"g\n"  # the parent's answer to READY: the call may begin
FLAG_INPUTS_MODIFIED = 1
FLAG_CHANGED_AFTER_RETURN = 2
FLAG_PARALLEL_LEFT_OPEN = 4
# How much later than the harness's reported end of a call the host's kernel may stamp the
# RESULT mark (it is sent right after the call returns; ~20 us is typical); a run is never
# counted as shorter than (stamp - slack) - start, so a kernel that forges the end time gains
# at most this much. Honest runs exceed it only when the harness is preempted in between.
END_SLACK_NS = 250_000
# Clock reads on either side of a message: what "before" may be off by (clock granularity
# and the REALTIME -> MONOTONIC conversion of the stamps).
CLOCK_TOLERANCE_NS = 50_000
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
        # Read once, when the library loads; an operator's own setting wins.
        core = openblas_coretype()
        if core is not None:
            os.environ.setdefault("OPENBLAS_CORETYPE", core)
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
        """Two lines: the sizes (the harness allocates the buffers), then the seed."""
        return f"{self.kind} {self.sizes['M']} {self.sizes['N']} {self.sizes['K']}\n{self.seed}"


@dataclass(frozen=True)
class Frame:
    """One completed call: C and the clocks around it (all CLOCK_MONOTONIC ns)."""

    job: int
    flags: int
    c: np.ndarray
    t0_ns: int = 0  # harness: just before the call (sent out before the kernel ran)
    t1_ns: int = 0  # harness: just after the call
    sent_ns: int = 0  # parent: when the job was sent (its inputs did not exist before)
    # parent: when it let the call begin, after READY (0: a run without the handshake)
    go_ns: int = 0
    begin_ns: int = 0  # host kernel: when the BEGIN mark was queued
    result_ns: int = 0  # host kernel: when the RESULT mark was queued
    # parent: threads of the process beyond what OpenMP may leave, still alive after the
    # call (counted from the host's /proc before the next job was sent; runner.ThreadCount)
    stray_threads: int = 0

    @property
    def seconds(self) -> float:
        """The harness's own measurement."""
        return (self.t1_ns - self.t0_ns) / 1e9

    def timing_problem(self) -> str:
        """'' when the reported clocks are possible, else why not: the start must lie between
        the parent's send and the BEGIN stamp, the end between the start and the RESULT
        stamp. Breaking this takes a forged or rewritten time."""
        tol = CLOCK_TOLERANCE_NS
        dispatch = max(self.sent_ns, self.go_ns)  # with the handshake, the go
        if not dispatch - tol <= self.t0_ns <= self.begin_ns + tol:
            return (f"the reported start of the call is not between the job's dispatch and "
                    f"its start message ({(self.t0_ns - dispatch) / 1e6:.3f} ms after "
                    f"dispatch, {(self.t0_ns - self.begin_ns) / 1e6:.3f} ms after the message)")
        if not self.t0_ns <= self.t1_ns <= self.result_ns + tol:
            return (f"the reported end of the call is not between its start and its result "
                    f"message ({(self.t1_ns - self.t0_ns) / 1e6:.3f} ms after the start, "
                    f"{(self.t1_ns - self.result_ns) / 1e6:.3f} ms after the message)")
        return ""

    def effective_seconds(self, slack_ns: int = END_SLACK_NS) -> float:
        """The measured time, but never shorter than the host kernel's stamps allow: the end
        is at least the RESULT stamp minus ``slack_ns``."""
        end = max(self.t1_ns, self.result_ns - slack_ns)
        return (end - self.t0_ns) / 1e9


class ProtocolError(ValueError):
    pass


def request(nonce: int, jobs: list[Job]) -> bytes:
    """The whole stdin stream at once (the bench's bare floor); the pipeline sends
    ``header`` first and each ``Job.line`` only when the previous call is complete."""
    return header(nonce) + b"".join(job_line(job) for job in jobs) + END_LINE


def header(nonce: int) -> bytes:
    return f"{nonce}\n".encode()


def job_line(job: Job) -> bytes:
    return (job.line() + "\n").encode()


END_LINE = b"e\n"


class RunReader:
    """Follows one harness run: marks (small timestamped messages) and data (the C matrices,
    in order, on their own pipe).

    ``sent(job, at_ns)`` records that the parent sent a job; ``mark`` and ``data`` return the
    frames completed by an event; with ``handshake``, each job's READY comes before its BEGIN
    (``ready`` is then the job waiting for its go) and ``go(job, at_ns)`` records the go,
    before which no BEGIN may come; ``on_result(job, c)`` sees each C as soon as all of it
    is here (the harness then still checks its inputs and waits 2 ms before it reports the
    call complete: time in which no call runs). Anything out of protocol raises
    ProtocolError: a wrong size or nonce, a mark for a job not sent yet, marks out of order
    or repeated (a forged mark cannot replace the harness's own, which still follows), data
    beyond the announced C, an early or late end.
    """

    def __init__(self, nonce: int, jobs: list[Job],
                 on_result: Callable[[int, np.ndarray], None] | None = None,
                 *, handshake: bool = False) -> None:
        self.nonce = nonce
        self.jobs = jobs
        self.on_result = on_result
        self.handshake = handshake
        self.frames: list[Frame] = []
        self.finished = False
        self.ready: int | None = None  # the job whose READY came and that has no go yet
        self._sent: list[int] = []
        self._go: list[int] = []
        self._first = MARK_READY if handshake else MARK_BEGIN  # each job's first mark
        self._expect = self._first
        self._current: dict[str, int] = {}
        self._payload = bytearray()
        self._count = 0  # doubles of C still owed for the current job
        self._c: np.ndarray | None = None  # the current job's C, once all of it is here

    def sent(self, job: int, at_ns: int) -> None:
        assert job == len(self._sent)
        self._sent.append(at_ns)

    @property
    def kernel_ran(self) -> bool:
        """Whether the kernel may have run: a call had its go. Without the handshake the
        parent cannot tell, and says no (the bench's bare floor only)."""
        return self.handshake and bool(self._go)

    def go(self, job: int, at_ns: int) -> None:
        assert self.ready == job == len(self._go)
        self._go.append(at_ns)
        self.ready = None

    def mark(self, message: bytes, at_ns: int) -> list[Frame]:
        if self.finished:
            raise ProtocolError("result stream corrupted (message after the end)")
        if len(message) != MARK.size:
            raise ProtocolError("result stream corrupted (bad message size)")
        nonce, job, kind, value, count = MARK.unpack(message)
        if nonce != self.nonce:
            raise ProtocolError("result stream corrupted (wrong nonce)")
        if kind == MARK_END:
            if (self._expect != self._first or job != len(self.frames)
                    or len(self.frames) != len(self.jobs) or self._payload):
                raise ProtocolError("result stream corrupted (bad end marker)")
            self.finished = True
            return []
        if job != len(self.frames) or job >= len(self._sent) or kind != self._expect:
            raise ProtocolError("result stream corrupted (messages out of order)")
        if kind == MARK_READY:
            self.ready = job
            self._expect = MARK_BEGIN
        elif kind == MARK_BEGIN:
            if self.handshake and job >= len(self._go):
                raise ProtocolError("result stream corrupted (a call began before its go)")
            self._current = {"t0": value, "begin": at_ns}
            self._expect = MARK_RESULT
        elif kind == MARK_RESULT:
            sizes = self.jobs[job].sizes
            if count != sizes["M"] * sizes["N"]:
                raise ProtocolError("result stream corrupted (wrong matrix size)")
            self._current.update(t1=value, result=at_ns)
            self._count = count
            self._expect = MARK_CHECK
            self._result_complete()
        else:
            self._current["flags"] = value
            self._expect = -1  # the C data, then the next job
        return self._complete()

    def amend(self, **changes: int) -> Frame:
        """The last completed frame with what the parent saw after it (not the harness)."""
        frame = self.frames[-1] = dataclasses.replace(self.frames[-1], **changes)
        return frame

    def data(self, chunk: bytes) -> list[Frame]:
        # The pipe and the socket are read in whatever order the selector reports them, so C
        # may be here before its RESULT mark: bound it by the current job's size instead.
        job = len(self.frames)
        limit = 8 * self.jobs[job].sizes["M"] * self.jobs[job].sizes["N"] if job < len(
            self.jobs) else 0
        if (self.finished or self._c is not None  # all of this C came already
                or len(self._payload) + len(chunk) > limit):
            raise ProtocolError("result stream corrupted (unexpected data)")
        self._payload += chunk
        self._result_complete()
        return self._complete()

    def _result_complete(self) -> None:
        """Make C once its RESULT mark and all of its data are here, and show it."""
        if self._c is not None or not self._count or len(self._payload) < 8 * self._count:
            return
        job = len(self.frames)
        sizes = self.jobs[job].sizes
        # C owns this buffer from now on: the next job's data starts a new one. Read-only:
        # its check is remembered (check_expected) for the C it was made on.
        self._c = np.frombuffer(self._payload, dtype="<f8").reshape(sizes["M"], sizes["N"])
        self._c.flags.writeable = False
        self._payload = bytearray()
        if self.on_result is not None:
            self.on_result(job, self._c)

    def _complete(self) -> list[Frame]:
        if self._expect != -1 or self._c is None:
            return []
        job, cur = len(self.frames), self._current
        frame = Frame(job, cur["flags"], self._c, t0_ns=cur["t0"], t1_ns=cur["t1"],
                      sent_ns=self._sent[job], go_ns=self._go[job] if self.handshake else 0,
                      begin_ns=cur["begin"], result_ns=cur["result"])
        self.frames.append(frame)
        self._c = None
        self._count = 0
        self._expect = self._first
        return [frame]


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
    """What one job's C must hold, computed before the run (the inputs and the points depend
    only on the seed and the trusted process's own generator)."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray  # the reference at (rows, cols): the paper's check points
    scale: np.ndarray  # the denominator of the relative error at each point
    full: np.ndarray | None = None  # the whole reference
    inputs: tuple[np.ndarray, np.ndarray] | None = None  # A and B, with ``full``
    # The last check_expected: (C, tolerance, message); C is checked as it arrives, and
    # its frame's verdict, asked for later, is this one.
    checked: list[tuple[np.ndarray, float, str]] = field(
        default_factory=list, compare=False, repr=False)

    def scale_at(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """The full-matrix check's denominators at these elements (``full`` is set)."""
        assert self.full is not None and self.inputs is not None
        a, b = self.inputs
        if len(rows) > _GATHER_LIMIT:  # a whole |A| |B| costs less than gathering this much
            return _scale(self.full, reference(np.abs(a), np.abs(b)))[rows, cols]
        return _scale(self.full[rows, cols], _terms(a, b, rows, cols))


# Elements whose term sizes are summed one by one; beyond, one dgemm of |A| |B| (~0.6 ms at
# the reward size) is cheaper than gathering their rows and columns.
_GATHER_LIMIT = 512


def _scale(ref: np.ndarray, terms: np.ndarray) -> np.ndarray:
    # terms = sum_k |a_ik b_kj|, the size of the terms, floors the denominator where
    # cancellation makes |ref| tiny.
    return np.maximum(np.maximum(np.abs(ref), 1e-3 * terms), 1e-300)


def _terms(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    return np.einsum("pk,kp->p", np.abs(a[rows]), np.abs(b[:, cols]))


def expected_at(ref: np.ndarray, a: np.ndarray, b: np.ndarray,
                points: list[tuple[int, int]], *, full: bool = True) -> Expected:
    rows = np.fromiter((i for i, _ in points), dtype=np.intp, count=len(points))
    cols = np.fromiter((j for _, j in points), dtype=np.intp, count=len(points))
    values = ref[rows, cols]
    scale = _scale(values, _terms(a, b, rows, cols))
    return Expected(rows, cols, values, scale, *((ref, (a, b)) if full else ()))


def expect(job: Job, random_points: int, corners_and_centre: bool,
           rng: np.random.Generator) -> Expected:
    """The reference (OpenBLAS) for one job: its check points and the whole matrix."""
    a, b = inputs(job.sizes, job.seed)
    ref = reference(a, b)
    points = sample_points(job.sizes["M"], job.sizes["N"], random_points, corners_and_centre,
                           rng)
    return expected_at(ref, a, b, points)


def _mismatch(got: float, want: float, error: float, tolerance: float, where: str) -> str:
    return (f"{where} = {got!r} but the reference gives {want!r} (relative error "
            f"{error:.3g} > {tolerance:g})")


def check_expected(c: np.ndarray, expected: Expected, tolerance: float) -> str:
    """'' if C is right, else why not.

    First the task's points (the paper's check: 4 corners, centre, 100 random positions),
    then, stricter than the paper, every element of C against the whole reference. Relative
    error |c - ref| / |ref|, where cancellation makes |ref| tiny the denominator is floored
    at 1e-3 of sum_k |a_ik b_kj| (the size of the terms), so a correct kernel that sums in
    another order never fails. NaN (C starts as NaN: an element never written) fails.
    """
    for seen, at, message in expected.checked:
        if seen is c and at == tolerance:
            return message
    message = _check(c, expected, tolerance)
    expected.checked[:] = [(c, tolerance, message)]
    return message


def _check(c: np.ndarray, expected: Expected, tolerance: float) -> str:
    got = c[expected.rows, expected.cols]
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(got - expected.values) / expected.scale
    bad = ~(error <= tolerance)  # NaN fails too
    if bad.any():
        p = int(np.argmax(bad))
        i, j = int(expected.rows[p]), int(expected.cols[p])
        return _mismatch(float(got[p]), float(expected.values[p]), float(error[p]), tolerance,
                         f"C[{i}][{j}]")
    full = expected.full
    if full is None:
        return _unwritten(c)
    with np.errstate(invalid="ignore", over="ignore"):
        difference = np.abs(c - full)
        # |ref| alone as the denominator is stricter, and enough everywhere but where |ref|
        # is tiny (~1e-8 of the elements at the reward size) or C is wrong: the term sizes,
        # a second dgemm's work, are needed only there.
        fine = difference <= tolerance * np.abs(full)
    if fine.all():
        return ""
    if unwritten := _unwritten(c):
        return unwritten
    rows, cols = np.nonzero(~fine)
    with np.errstate(invalid="ignore", over="ignore"):
        error = difference[rows, cols] / expected.scale_at(rows, cols)
    wrong = int(np.count_nonzero(error > tolerance))
    if not wrong:
        return ""
    p = int(np.argmax(error))
    i, j = int(rows[p]), int(cols[p])
    return (_mismatch(float(c[i, j]), float(full[i, j]), float(error[p]), tolerance,
                      f"C[{i}][{j}]")
            + f"; {wrong} of {c.size} elements are wrong (full-matrix check; the paper's "
            f"{len(expected.rows)} check points passed)")


def _unwritten(c: np.ndarray) -> str:
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
