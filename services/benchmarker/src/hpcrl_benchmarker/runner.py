"""The parent's side of one harness run: jobs sent one at a time, the protocol followed
message by message, and how the process ended, read as the verdict it would be.

A job's line is written only when the previous call is complete, so future inputs never
exist in the process; anything out of protocol (a forged, repeated or misordered message)
ends the run as tampering. Nor is it written while the process has more threads than OpenMP
may leave behind (``ThreadCount``): a thread the kernel started and left running ends the
run, and its frame says so. With the handshake (the pipeline's runs) the harness fills a
call's inputs, sends READY and waits; the call may begin only when the host's /proc shows
that no thread but the harness's own has used CPU time since the previous call ended
(``IdleThreads``): a thread that works on the next call's inputs before its clock starts
ends the run as the rule violation it is. Nothing here judges results: that is ``steps``.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcrl_benchmarker import protocol, sandbox
from hpcrl_benchmarker.exitcodes import HARNESS_REFUSALS, HarnessExit
from hpcrl_benchmarker.steps import InternalError, Phase, StepFailure, sizes_text

FrameWatch = Callable[[protocol.Frame], bool]
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
# CPU time that the harness's other threads may use, all together, between the end of one
# call (its C is here) and the next call's go. Idle OpenMP workers sleep
# (OMP_WAIT_POLICY=passive, harness_env) and use none: 0 ns in every one of 624 gaps
# measured (6 kernels, 2 and 4 threads). A thread left behind that works on the next inputs,
# or wakes once to plant something, uses more.
IDLE_LIMIT_NS = 20_000
# How long the parent waits for the threads to be off the CPUs before it reads their time
# (exact then; a thread on a CPU is counted only up to its last tick or switch, and one that
# has just decided to sleep reads S while its last slice is still uncounted: a libgomp worker
# docking after the call was read 0.09-0.5 ms short, on a loaded node, and that slice of
# in-call work then counted as work between the calls; sandbox.unsettled_threads). Honest
# threads are asleep at once (the main one in its 2 ms pause, or waiting for the go); one
# still runnable after this was either working (its time has grown by the ticks since) or
# waiting for a CPU on a busy node (it has not). Only a run with such a thread pays the wait.
SETTLE_GRACE_S = 0.2
SETTLE_SPIN_S = 0.0005


@dataclass(frozen=True)
class HarnessRun:
    """The calls that completed, in order, and how the process ended before the last job,
    if it did (timeout, crash, early exit, tampering), as the verdict that would be."""

    frames: list[protocol.Frame]
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
        rest = [
            dataclasses.replace(f, job=f.job - verify_runs)
            for f in self.frames
            if f.job >= verify_runs
        ]
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

    def process(self) -> int | None:
        """The harness's host pid; None once it has ended (or its number was reused)."""
        if self._count() == 0 or self._command is None:
            return None
        return self._command[0]

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


class IdleThreads:
    """CPU time that the harness's threads other than its main one use between two calls,
    read from the host (the process's CPU clock, which counts threads that have ended too,
    and the main thread's schedstat), where nothing in the sandbox can change it.

    ``baseline`` is read when a call's C is here (the call is over: OpenMP's teams, and any
    thread joined within the call, were done before it returned), ``used`` when the next
    call's READY comes (its inputs are filled and the harness waits for the go). Each first
    waits until the threads are off the CPUs, so that their times are exact (a thread on a
    CPU is counted only up to its last tick or switch). ``used`` is then what the other
    threads used in between, whichever they are: OpenMP's pool, a raw clone, one that
    ended meanwhile."""

    def __init__(self, count: ThreadCount, grace_s: float = SETTLE_GRACE_S) -> None:
        self.count = count
        self.grace_s = grace_s
        self._base: int | None = None

    def baseline(self) -> None:
        self._base = self._others()

    def used(self) -> int | None:
        """ns used by the other threads since ``baseline``; None if it cannot be known (the
        process ended, or there was no baseline)."""
        if self._base is None:
            return None
        now = self._others()
        return None if now is None else now - self._base

    def _others(self) -> int | None:
        pid = self.count.process()
        if pid is None:
            return None
        started = time.monotonic()
        pause = 0.0001
        while sandbox.unsettled_threads(pid) and (now := time.monotonic()) < started + self.grace_s:
            # The main thread is usually on its way to its read or its pause: look again at
            # once (a look takes ~30 us) for a while, then sleep between looks.
            if now > started + SETTLE_SPIN_S:
                time.sleep(pause)
                pause = min(2 * pause, 0.005)
        return _others_cpu_ns(pid)


def _others_cpu_ns(pid: int, tries: int = 5) -> int | None:
    """The process's CPU time less its main thread's, from two clocks read one after the
    other: the main thread's is read before and after, and the pair is taken only when it
    did not move between (a main thread woken meanwhile, its time counted in one read and
    not the other, made honest workers look 0.1-0.55 ms busy on a loaded node)."""
    for _ in range(tries):
        before = sandbox.thread_cpu_ns(pid, pid)
        total = sandbox.process_cpu_ns(pid)
        after = sandbox.thread_cpu_ns(pid, pid)
        if before is None or total is None or after is None:
            return None
        if before == after:
            break
    return total - after


class Conversation:
    """Feeds the harness its jobs one at a time and reads its marks and results; ``watch``
    sees each call of the first ``verify_runs`` as it completes and may end the run.
    With ``threads``, each completed call is followed by a count of the process's threads
    before the next line is sent; a thread left running stops the run. With ``idle`` (the
    harness runs with HPCRL_READY=1), each call begins only when the parent's go answers its
    READY, after ``IdleThreads`` found that the other threads did not work meanwhile.
    ``on_result`` sees each output as soon as it is here (``protocol.RunReader``): work done
    then is off the run's critical path."""

    def __init__(
        self,
        jobs: list[protocol.Job],
        verify_runs: int,
        watch: FrameWatch | None,
        threads: ThreadCount | None = None,
        on_result: Callable[[int, np.ndarray], None] | None = None,
        idle: IdleThreads | None = None,
    ) -> None:
        self.jobs = jobs
        self.verify_runs = verify_runs
        self.two_phases = 0 < verify_runs < len(jobs)
        self.watch = watch
        self.threads = threads
        self.idle = idle
        self.nonce = secrets.randbits(64)
        self.on_result = on_result
        self.reader = protocol.RunReader(self.nonce, jobs, self._result, handshake=idle is not None)
        self.tampered = ""
        self.worked_outside = ""  # why the run was stopped at a READY, if it was

    @property
    def frames(self) -> list[protocol.Frame]:
        """The completed calls; none once the output was tampered with (none can be trusted)."""
        return [] if self.tampered else self.reader.frames

    def opening(self) -> bytes:
        return protocol.header(self.nonce) + self.dispatch(0)

    def dispatch(self, job: int) -> bytes:
        """The next line for the harness: a job (its inputs exist from now on) or the end."""
        if job == len(self.jobs):
            return protocol.END_LINE
        self.reader.sent(job, time.monotonic_ns())
        return protocol.job_line(self.jobs[job])

    def _result(self, job: int, output: np.ndarray) -> None:
        """The output of ``job`` is here: the call is over (its threads were joined before it
        returned), and the harness checks its inputs and sleeps before it reports the call
        complete."""
        if self.on_result is not None:
            self.on_result(job, output)
        if self.idle is not None and job + 1 < len(self.jobs):
            # From now until the next call's go, no thread but the main one may run.
            self.idle.baseline()

    def on_ready(self, job: int) -> sandbox.Reply:
        """The harness has filled job ``job``'s inputs and waits: let the call begin, unless
        another thread worked since the job was sent."""
        used = self.idle.used() if self.idle is not None and job > 0 else None
        if used is not None and used > IDLE_LIMIT_NS:
            self.worked_outside = (
                f"a thread of the kernel worked outside its calls: threads other than the "
                f"harness's own used {used / 1e6:.3f} ms of CPU time between the end of one "
                f"call and the start of the next, {_where(self, 'before')}, where the next "
                f"call's inputs existed before its clock started (at most "
                f"{IDLE_LIMIT_NS / 1e6:g} ms is allowed: idle OpenMP threads sleep). A "
                f"thread may work only within a call, at any stage: one left running (an "
                f"OpenMP region never closed, a thread made by hand) is refused, whatever "
                f"the thread count and omp_in_parallel() say"
            )
            return sandbox.Reply(stop=True)
        self.reader.go(job, time.monotonic_ns())
        # The call runs now: read no marks until its C comes (not on the kernel's cores).
        return sandbox.Reply(send=protocol.GO_LINE, marks_after_data=True)

    def on_event(self, channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        try:
            if channel == sandbox.MARK:
                frames = self.reader.mark(payload, at_ns)
            else:
                frames = self.reader.data(payload)
        except protocol.ProtocolError as exc:
            self.tampered = self.tampered or str(exc)
            return sandbox.Reply(stop=True)
        if self.reader.ready is not None:
            return self.on_ready(self.reader.ready)
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
            # With the handshake the next mark is READY, which must be read as it comes.
            return sandbox.Reply(
                new_phase=new_phase,
                send=self.dispatch(frame.job + 1),
                marks_after_data=(frame.job + 1 < len(self.jobs) and self.idle is None),
            )
        return None


def run_failure(
    outcome: sandbox.Outcome,
    conversation: Conversation,
    time_limit_s: float,
    *,
    threads: bool = True,
) -> StepFailure | None:
    """None when the run ended as planned (all jobs done, or stopped by the watcher), else
    why it did not. A harness that refuses to start is the benchmarker's failure. Without
    ``threads`` (a stage that forbids OpenMP), SIGSYS is the seccomp filter killing the
    process as it tried to create a thread: a stage violation."""
    if conversation.tampered:
        return StepFailure(
            "runtime_error", f"the harness's output was tampered with: {conversation.tampered}"
        )
    if conversation.worked_outside:
        # A rule broken, not a wrong result: no OpenMP pragma leaves a thread working after
        # its call; it takes libgomp's entry points called by hand, its thread-local state
        # rewritten or a thread made by hand. Like threads at a stage that forbids them.
        return StepFailure("stage_violation", conversation.worked_outside)
    reader = conversation.reader
    if outcome.stopped or (reader.finished and outcome.returncode == 0 and not outcome.timed_out):
        return None
    if outcome.never_started:
        # Not one mark: the kernel never ran (the harness marks each call before making
        # it). The node could not even start the sandbox in time; the candidate goes back.
        raise InternalError(
            f"the sandbox did not start the harness within "
            f"{START_LIMIT_S:g} s (the node's cores are saturated?)"
        )
    where = _where(conversation)
    if (
        outcome.timed_out
        and outcome.schedule is not None
        and outcome.schedule.starved(time_limit_s)
    ):
        # Not the kernel's timeout: the node's other work had the CPUs. The candidate goes
        # back (retried, up to the broker's delivery limit).
        raise InternalError(
            f"the harness was starved of CPU {where}"
            f"{_cpu_share(outcome.schedule)}: the node's cores are saturated"
        )
    if outcome.timed_out:
        return StepFailure(
            "timeout",
            f"did not finish within {time_limit_s:g} s {where}; "
            f"the process group was killed{_cpu_share(outcome.schedule)}",
        )
    if (sig := outcome.signal) == signal.SIGSYS and not threads:
        return StepFailure(
            "stage_violation",
            f"tried to create a thread {where}, at a stage "
            "that forbids OpenMP (threads are refused there however they are "
            "reached: pragmas, libgomp or libc called by hand, raw clone)",
        )
    if sig is not None:
        hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
        return StepFailure("runtime_error", f"killed by {_signal_name(sig)}{hint} {where}")
    if outcome.returncode == HarnessExit.OUT_OF_MEMORY:
        return StepFailure("runtime_error", f"out of memory {where}")
    if outcome.returncode in HARNESS_REFUSALS and not conversation.reader.kernel_ran:
        # Once a call began, the kernel could have called exit() with the harness's own
        # refusal status: handed back, it would never be judged (nor penalised).
        raise InternalError(
            f"harness refused to start (rc {outcome.returncode}): "
            f"{outcome.stderr[-1000:].decode(errors='replace')}"
        )
    return StepFailure(
        "runtime_error",
        f"the process exited early with status "
        f"{outcome.returncode} {where} (exit() in the kernel?)",
    )


def _cpu_share(got: sandbox.Schedule | None) -> str:
    """What the run's threads had of the CPUs: a kernel that spins shows its time on a CPU;
    one that waited on a busy node shows its wait for one (then the verdict is in doubt)."""
    if got is None:
        return ""
    return f" ({got.text()})"


def _where(conversation: Conversation, when: str = "during") -> str:
    """Which call of which phase the process was in when it ended."""
    jobs, done = conversation.jobs, len(conversation.reader.frames)
    first, total = (
        (0, conversation.verify_runs)
        if done < conversation.verify_runs
        else (conversation.verify_runs, len(jobs))
    )
    current = min(done, len(jobs) - 1)
    return (
        f"{when} run {current - first + 1} of {total - first} ({sizes_text(jobs[current].sizes)})"
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
