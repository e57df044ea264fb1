"""The parent's side of one harness run: jobs sent one at a time, the protocol followed
message by message, and how the process ended, read as the verdict it would be.

A job's line is written only when the previous call is complete, so future inputs never
exist in the process; anything out of protocol (a forged, repeated or misordered message)
ends the run as tampering. Nor is it written while the process has more threads than OpenMP
may leave behind (``ThreadCount``): a thread the kernel started and left running ends the
run, and its frame says so. Nothing here judges results: that is ``steps``.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcrl_benchmarker import gemm, sandbox
from hpcrl_benchmarker.exitcodes import HARNESS_REFUSALS, HarnessExit
from hpcrl_benchmarker.steps import InternalError, Phase, StepFailure, sizes_text

FrameWatch = Callable[[gemm.Frame], bool]
# How long threads above the limit get to end before they count as left running. Only the
# surplus threads that libgomp lets go when a team is smaller than its pool (told to exit
# at the start of that team, at least the harness's 2 ms settle before this) could still be
# ending, on a loaded node; a thread that ends within it has ended before the next job's
# inputs exist, so waiting costs nothing but wall time, and only when the count is over.
STRAY_GRACE_S = 0.05
# How long a harness run's sandbox may take to start (to its first mark) before the kernel's
# wall limit runs. On an idle node it takes milliseconds; on one whose cores are saturated
# (vLLM sampling beside the benchmarker, in the demo) seconds were seen, and they used to be
# charged to the kernel: a correct kernel was judged a timeout.
START_LIMIT_S = 60.0


@dataclass(frozen=True)
class HarnessRun:
    """The calls that completed, in order, and how the process ended before the last job,
    if it did (timeout, crash, early exit, tampering), as the verdict that would be."""

    frames: list[gemm.Frame]
    failure: StepFailure | None
    started: float  # monotonic
    wall_s: float
    phase_started: float | None  # monotonic time the second phase began

    @property
    def phase_one_s(self) -> float:
        return self._boundary - self.started

    @property
    def phase_two_s(self) -> float:
        return self.started + self.wall_s - self._boundary

    @property
    def _boundary(self) -> float:
        if self.phase_started is None:
            return self.started + self.wall_s
        return self.phase_started

    def whole(self) -> Phase:
        """The run as one phase."""
        return Phase(self.frames, self.failure)

    def phases(self, verify_runs: int) -> tuple[Phase, Phase | None]:
        """The first ``verify_runs`` calls and the rest; no second phase when the process
        ended before the first was complete."""
        verify = [f for f in self.frames if f.job < verify_runs]
        if len(verify) < verify_runs:
            return Phase(verify, self.failure), None
        rest = [dataclasses.replace(f, job=f.job - verify_runs) for f in self.frames
                if f.job >= verify_runs]
        return Phase(verify, None), Phase(rest, self.failure)


class ThreadCount:
    """The sandboxed command's threads above ``limit``, counted from the host's /proc.

    The kernel runs in the harness's process and can rewrite any of its memory, so the
    harness could not report this figure (a thread it should count could rewrite the count);
    the host kernel's own count, read from outside, it cannot touch. The limit is the run's
    OpenMP threads: the main thread and libgomp's pool together never exceed
    OMP_THREAD_LIMIT, which the run sets to that number (nested teams included). A thread
    started any other way (a raw clone) that is still alive after the call is over it,
    unless the kernel first shrank the pool (a smaller team) to make room: a count cannot
    tell such a thread from libgomp's, which the README records as what remains."""

    def __init__(self, limit: int, grace_s: float = STRAY_GRACE_S) -> None:
        self.limit = limit
        self.grace_s = grace_s
        self._root: int | None = None
        self._command: tuple[int, int] | None = None  # (pid, its parent)

    def started(self, root: int) -> None:
        """The sandbox's root pid (``sandbox.run``'s ``started``)."""
        self._root = root

    def stray(self) -> int:
        """Threads above the limit that are still alive ``grace_s`` after the first look; 0
        when there are none (or the process has ended: a dead process has no threads)."""
        deadline = time.monotonic() + self.grace_s
        pause = 0.0005
        while (extra := self._count() - self.limit) > 0 and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return max(0, extra)

    def _count(self) -> int:
        if self._command is None:
            if self._root is None:
                raise InternalError("the sandbox's process was never reported")
            try:
                found = sandbox.command_process(self._root)
            except (RuntimeError, OSError) as exc:
                raise InternalError(f"cannot find the harness process: {exc}") from None
            if found is None:
                return 0
            self._command = found
        try:
            return sandbox.thread_count(*self._command)
        except (RuntimeError, OSError) as exc:
            raise InternalError(f"cannot count the harness's threads: {exc}") from None


class Conversation:
    """Feeds the harness its jobs one at a time and reads its marks and results; ``watch``
    sees each call of the first ``verify_runs`` as it completes and may end the run.
    With ``threads``, each completed call is followed by a count of the process's threads
    before the next line is sent; a thread left running stops the run. ``on_result`` sees
    each C as soon as it is here (``gemm.RunReader``): work done then is off the run's
    critical path."""

    def __init__(self, jobs: list[gemm.Job], verify_runs: int,
                 watch: FrameWatch | None, threads: ThreadCount | None = None,
                 on_result: Callable[[int, np.ndarray], None] | None = None) -> None:
        self.jobs = jobs
        self.verify_runs = verify_runs
        self.two_phases = 0 < verify_runs < len(jobs)
        self.watch = watch
        self.threads = threads
        self.nonce = secrets.randbits(64)
        self.reader = gemm.RunReader(self.nonce, jobs, on_result)
        self.tampered = ""

    @property
    def frames(self) -> list[gemm.Frame]:
        """The completed calls; none once the output was tampered with (none can be trusted)."""
        return [] if self.tampered else self.reader.frames

    def opening(self) -> bytes:
        return gemm.header(self.nonce) + self.dispatch(0)

    def dispatch(self, job: int) -> bytes:
        """The next line for the harness: a job (its inputs exist from now on) or the end."""
        if job == len(self.jobs):
            return gemm.END_LINE
        self.reader.sent(job, time.monotonic_ns())
        return gemm.job_line(self.jobs[job])

    def on_event(self, channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        try:
            if channel == sandbox.MARK:
                frames = self.reader.mark(payload, at_ns)
            else:
                frames = self.reader.data(payload)
        except gemm.ProtocolError as exc:
            self.tampered = self.tampered or str(exc)
            return sandbox.Reply(stop=True)
        for frame in frames:
            if self.threads is not None and (stray := self.threads.stray()):
                frame = self.reader.amend(stray_threads=stray)
            if frame.job < self.verify_runs and self.watch is not None and self.watch(frame):
                return sandbox.Reply(stop=True)
            if frame.stray_threads:
                # Its next inputs must never exist while such a thread runs: the frame's
                # verdict is known (steps.frame_message), and the run ends here.
                return sandbox.Reply(stop=True)
            new_phase = self.two_phases and frame.job == self.verify_runs - 1
            return sandbox.Reply(new_phase=new_phase, send=self.dispatch(frame.job + 1),
                                 marks_after_data=frame.job + 1 < len(self.jobs))
        return None


def ending(outcome: sandbox.Outcome, talk: Conversation,
           time_limit_s: float, *, threads: bool = True) -> StepFailure | None:
    """None when the run ended as planned (all jobs done, or stopped by the watcher), else
    why it did not. A harness that refuses to start is the benchmarker's failure. Without
    ``threads`` (a stage that forbids OpenMP), SIGSYS is the seccomp filter killing the
    process as it tried to create a thread: a stage violation."""
    if talk.tampered:
        return StepFailure("runtime_error",
                           f"the harness's output was tampered with: {talk.tampered}")
    reader = talk.reader
    if outcome.stopped or (reader.finished and outcome.returncode == 0
                           and not outcome.timed_out):
        return None
    if outcome.never_started:
        # Not one mark: the kernel never ran (the harness marks each call before making
        # it). The node could not even start the sandbox in time; the candidate goes back.
        raise InternalError(f"the sandbox did not start the harness within "
                            f"{START_LIMIT_S:g} s (the node's cores are saturated?)")
    where = _where(talk)
    if outcome.timed_out and outcome.schedule is not None and outcome.schedule.starved(
            time_limit_s):
        # Not the kernel's timeout: the node's other work had the CPUs. The candidate goes
        # back (retried, up to the broker's delivery limit).
        raise InternalError(f"the harness was starved of CPU {where}"
                            f"{_cpu_share(outcome.schedule)}: the node's cores are saturated")
    if outcome.timed_out:
        return StepFailure("timeout", f"did not finish within {time_limit_s:g} s {where}; "
                           f"the process group was killed{_cpu_share(outcome.schedule)}")
    if (sig := outcome.signal) == signal.SIGSYS and not threads:
        return StepFailure("stage_violation", f"tried to create a thread {where}, at a stage "
                           "that forbids OpenMP (threads are refused there however they are "
                           "reached: pragmas, libgomp or libc called by hand, raw clone)")
    if sig is not None:
        hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
        return StepFailure("runtime_error", f"killed by {_signal_name(sig)}{hint} {where}")
    if outcome.returncode == HarnessExit.OUT_OF_MEMORY:
        return StepFailure("runtime_error", f"out of memory {where}")
    if outcome.returncode in HARNESS_REFUSALS:
        raise InternalError(f"harness refused to start (rc {outcome.returncode}): "
                            f"{outcome.stderr[-1000:].decode(errors='replace')}")
    return StepFailure("runtime_error", f"the process exited early with status "
                       f"{outcome.returncode} {where} (exit() in the kernel?)")


def _cpu_share(got: sandbox.Schedule | None) -> str:
    """What the run's threads had of the CPUs: a kernel that spins shows its time on a CPU;
    one that waited on a busy node shows its wait for one (then the verdict is in doubt)."""
    if got is None:
        return ""
    return f" ({got.text()})"


def _where(talk: Conversation) -> str:
    """Which call of which phase the process was in when it ended."""
    jobs, done = talk.jobs, len(talk.reader.frames)
    first, total = ((0, talk.verify_runs) if done < talk.verify_runs
                    else (talk.verify_runs, len(jobs)))
    current = min(done, len(jobs) - 1)
    return (f"during run {current - first + 1} of {total - first} "
            f"({sizes_text(jobs[current].sizes)})")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
