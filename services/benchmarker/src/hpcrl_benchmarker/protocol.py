"""The job protocol between the parent and a sandboxed harness, the same for every task.

The parent sends jobs (sizes, then a seed) one at a time; the harness (``harness/harness.h``
with a task's template) answers each call with small timestamped marks on one socket and the
call's output (doubles) on its own pipe. What differs between tasks (the sizes on a job's
line, the output's shape) is the job's ``harness`` description (``harnesses.Harness``).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hpcrl_common.task import Sizes

MARK = struct.Struct("<QIIQQ")  # nonce, job, type, value, count
MARK_BEGIN, MARK_RESULT, MARK_CHECK, MARK_READY, MARK_END = 1, 2, 3, 4, 0x80000000
GO_LINE = b"g\n"  # the parent's answer to READY: the call may begin
FLAG_INPUTS_MODIFIED = 1
FLAG_CHANGED_AFTER_RETURN = 2
FLAG_PARALLEL_LEFT_OPEN = 4
FLAG_OUTSIDE_WRITTEN = 8  # a guard zone before or after an input or the output changed
# How much later than the harness's reported end of a call the host's kernel may stamp the
# RESULT mark (it is sent right after the call returns; ~20 us is typical); a run is never
# counted as shorter than (stamp - slack) - start, so a kernel that forges the end time gains
# at most this much. Honest runs exceed it only when the harness is preempted in between.
END_SLACK_NS = 250_000
# Clock reads on either side of a message: what "before" may be off by (clock granularity
# and the REALTIME -> MONOTONIC conversion of the stamps).
CLOCK_TOLERANCE_NS = 50_000


class Layout(Protocol):
    """What the protocol needs of a harness: the sizes on a job's line, in the order its
    template reads them, and the shape of a call's output."""

    name: str
    dims: tuple[str, ...]

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Job:
    kind: str  # v: verify, w: warm-up, t: timed
    sizes: Sizes
    seed: int
    harness: Layout

    def line(self) -> str:
        """Two lines: the sizes (the harness allocates the buffers), then the seed."""
        dims = " ".join(str(self.sizes[d]) for d in self.harness.dims)
        return f"{self.kind} {dims}\n{self.seed}"

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.harness.output_shape(self.sizes)

    @property
    def output_count(self) -> int:
        return math.prod(self.output_shape)


@dataclass(frozen=True)
class Frame:
    """One completed call: its output and the clocks around it (all CLOCK_MONOTONIC ns)."""

    job: int
    flags: int
    output: np.ndarray
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
            return (
                f"the reported start of the call is not between the job's dispatch and "
                f"its start message ({(self.t0_ns - dispatch) / 1e6:.3f} ms after "
                f"dispatch, {(self.t0_ns - self.begin_ns) / 1e6:.3f} ms after the message)"
            )
        if not self.t0_ns <= self.t1_ns <= self.result_ns + tol:
            return (
                f"the reported end of the call is not between its start and its result "
                f"message ({(self.t1_ns - self.t0_ns) / 1e6:.3f} ms after the start, "
                f"{(self.t1_ns - self.result_ns) / 1e6:.3f} ms after the message)"
            )
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
    """Follows one harness run: marks (small timestamped messages) and data (each call's
    output, in order, on its own pipe).

    ``sent(job, at_ns)`` records that the parent sent a job; ``mark`` and ``data`` return the
    frames completed by an event; with ``handshake``, each job's READY comes before its BEGIN
    (``ready`` is then the job waiting for its go) and ``go(job, at_ns)`` records the go,
    before which no BEGIN may come; ``on_result(job, output)`` sees each output as soon as
    all of it is here (the harness then still checks its inputs and waits 2 ms before it
    reports the call complete: time in which no call runs). Anything out of protocol raises
    ProtocolError: a wrong size or nonce, a mark for a job not sent yet, marks out of order
    or repeated (a forged mark cannot replace the harness's own, which still follows), data
    beyond the announced output, an early or late end.
    """

    def __init__(
        self,
        nonce: int,
        jobs: list[Job],
        on_result: Callable[[int, np.ndarray], None] | None = None,
        *,
        handshake: bool = False,
    ) -> None:
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
        self._count = 0  # doubles of the output still owed for the current job
        self._output: np.ndarray | None = None  # the current job's, once all of it is here

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
            if (
                self._expect != self._first
                or job != len(self.frames)
                or len(self.frames) != len(self.jobs)
                or self._payload
            ):
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
            if count != self.jobs[job].output_count:
                raise ProtocolError("result stream corrupted (wrong output size)")
            self._current.update(t1=value, result=at_ns)
            self._count = count
            self._expect = MARK_CHECK
            self._result_complete()
        else:
            self._current["flags"] = value
            self._expect = -1  # the output data, then the next job
        return self._complete()

    def amend(self, **changes: int) -> Frame:
        """The last completed frame with what the parent saw after it (not the harness)."""
        frame = self.frames[-1] = dataclasses.replace(self.frames[-1], **changes)
        return frame

    def data(self, chunk: bytes) -> list[Frame]:
        # The pipe and the socket are read in whatever order the selector reports them, so
        # the output may be here before its RESULT mark: bound it by the current job's size.
        job = len(self.frames)
        limit = 8 * self.jobs[job].output_count if job < len(self.jobs) else 0
        if (
            self.finished
            or self._output is not None  # all of this output came already
            or len(self._payload) + len(chunk) > limit
        ):
            raise ProtocolError("result stream corrupted (unexpected data)")
        self._payload += chunk
        self._result_complete()
        return self._complete()

    def _result_complete(self) -> None:
        """Make the output once its RESULT mark and all of its data are here, and show it."""
        if self._output is not None or not self._count or len(self._payload) < 8 * self._count:
            return
        job = len(self.frames)
        # The output owns this buffer from now on: the next job's data starts a new one.
        # Read-only: its check is remembered (verify.check_expected) for the array it was
        # made on.
        self._output = np.frombuffer(self._payload, dtype="<f8").reshape(
            self.jobs[job].output_shape
        )
        self._output.flags.writeable = False
        self._payload = bytearray()
        if self.on_result is not None:
            self.on_result(job, self._output)

    def _complete(self) -> list[Frame]:
        if self._expect != -1 or self._output is None:
            return []
        job, cur = len(self.frames), self._current
        frame = Frame(
            job,
            cur["flags"],
            self._output,
            t0_ns=cur["t0"],
            t1_ns=cur["t1"],
            sent_ns=self._sent[job],
            go_ns=self._go[job] if self.handshake else 0,
            begin_ns=cur["begin"],
            result_ns=cur["result"],
        )
        self.frames.append(frame)
        self._output = None
        self._count = 0
        self._expect = self._first
        return [frame]


def is_finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0
