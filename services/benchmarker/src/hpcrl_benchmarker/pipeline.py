"""The verdict pipeline: extract, check, compile, run, verify, time; the reward follows.

``evaluate(completion, stage=..., opt_level=..., task=...)`` is the whole thing for one
candidate; the CLI's ``check`` and the service's handler both call it. Every step that
touches the untrusted code runs in the sandbox (``sandbox.run``); the checks and the
reference are computed here, in the trusted process. Each step returns its product or raises
``steps.StepFailure``; the verdict is built once, from what the steps found, at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcrl_benchmarker import (
    build,
    checks,
    cpuset,
    harnesses,
    protocol,
    runner,
    sandbox,
    steps,
    timinglock,
    verify,
)
from hpcrl_benchmarker.build import Compiled
from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import HostProfile, detect, reuse_freed_memory
from hpcrl_benchmarker.metrics import LOCK_TIMEOUTS, LOCK_WAIT, RETIMED, SANDBOX_START
from hpcrl_benchmarker.reference import (
    References,
    ReferenceUnavailable,
    time_reference,
    time_triad,
)
from hpcrl_benchmarker.runner import FrameWatch, HarnessRun
from hpcrl_benchmarker.steps import InternalError, Measurement, Phase, StepFailure
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.messages import HostInfo, Timing
from hpcrl_common.stages import OPENMP, Stage
from hpcrl_common.stages import stage as stage_of
from hpcrl_common.task import TaskSpec

ERROR_CHARS = 60_000  # a failed verdict's error text is cut here
# In a harness run's environment: READY before every call and a go from the parent, which
# first checks that no other thread worked since the job was sent (runner.IdleThreads). Not
# in harness_env: the bench's bare floor sends every job at once and answers no READY.
READY_ENV = "HPCRL_READY"
HARNESS_ARGV = ("./run", "{fd}", "{marks}")  # the harness linked in the scratch directory


@dataclass
class Events:
    """Hooks for metrics; the service fills them, the CLI leaves them empty."""

    sandbox_kills: list[str] = field(default_factory=list)
    # Every timing attempt's statistics, in order (the verdict keeps the steadiest one).
    timings: list[Timing] = field(default_factory=list)


@dataclass(frozen=True)
class _Candidate:
    """What one evaluation is about."""

    task: TaskSpec
    policy: Stage
    flags: list[str]
    events: Events

    @property
    def threads(self) -> bool:
        """Whether the kernel may run threads: only at a stage that allows OpenMP. Where it
        may not, the harness process cannot create one (its seccomp filter)."""
        return OPENMP in self.policy.allowed


@dataclass
class _Findings:
    """What the steps found so far; the verdict is made from it once, at the end."""

    durations: dict[str, float] = field(default_factory=dict)
    source: str | None = None
    compile_flags: list[str] = field(default_factory=list)
    techniques: set[str] = field(default_factory=set)
    generalizes: bool | None = None
    note: str = ""  # what a success still reports (it does not generalise)
    measurement: Measurement | None = None

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.durations[step] = time.monotonic() - started

    def verdict(self, host: HostInfo, failure: StepFailure | None) -> Verdict:
        verdict = Verdict(
            status="success",
            host=host,
            techniques=sorted(self.techniques),
            generalizes=self.generalizes,
            error=self.note,
            source=self.source,
            compile_flags=self.compile_flags,
            durations_s=self.durations,
        )
        if failure is not None:
            verdict.status, verdict.error = failure.status, failure.error[:ERROR_CHARS]
        elif self.measurement is not None:
            verdict.timing, verdict.gflops = self.measurement.timing, self.measurement.gflops
        return verdict


@dataclass
class _Plan:
    verify: list[protocol.Job]  # the reward size, then every extra verification size
    timing: list[protocol.Job]  # warm-up, timed runs, final verification
    expected: Future[list[verify.Expected]]  # for verify + timing, in order


class Benchmarker:
    def __init__(
        self,
        settings: BenchmarkerSection | None = None,
        host: HostProfile | None = None,
        *,
        keep_scratch: bool = False,
    ) -> None:
        self.settings = settings or BenchmarkerSection()
        self.host = host or detect()
        reuse_freed_memory()
        self.keep_scratch = keep_scratch  # for debugging: leave each candidate's files
        private_dir(self.settings.work_dir)
        self.cpus = own_cpus(self.settings.cpus)  # () = no set: the whole node
        self._harness_lock = threading.Lock()
        self.lock_wait_since: float | None = None  # monotonic; None when nobody waits
        self._references = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reference")

    # --- the pipeline -----------------------------------------------------------------

    def evaluate(
        self,
        completion: str,
        *,
        stage: int,
        opt_level: str,
        task: TaskSpec,
        events: Events | None = None,
    ) -> Verdict:
        flags = task.compile_flags(opt_level)
        candidate = _Candidate(task, stage_of(stage), flags, events or Events())
        found = _Findings()
        failure = None
        try:
            code = self._extract(completion, candidate, found)
            self._check(code, candidate, found)
            with contextlib.ExitStack() as stack:
                scratch = stack.enter_context(self._scratch())
                # The compile is the critical path: its sandbox is set up first, then what
                # must only be ready after it (the harness's sandbox, the references).
                began = time.monotonic()
                compiling = stack.enter_context(self.start_compile(scratch, code, task, flags))
                harness = stack.enter_context(
                    self.start_run(scratch, task, two_phases=True, threads=candidate.threads)
                )
                plan = self._plan(task)
                stack.callback(plan.expected.cancel)  # an early verdict makes it useless
                self._compile_and_check(scratch, candidate, found, compiling, began)
                expected = self._expected(task, plan)
                watch = steps.EarlyVerdict(task, expected, len(plan.verify))
                run = self._run(scratch, candidate, plan, expected, watch, found, harness)
                timing = self._verify(candidate, plan, run, watch, found)
                self._time(scratch, candidate, plan, timing, expected, found)
        except StepFailure as exc:
            failure = exc
        return found.verdict(self.host.info(), failure)

    def _extract(self, completion: str, candidate: _Candidate, found: _Findings) -> str:
        with found.timed("extract"):
            code = steps.extract_kernel(completion, candidate.task)
        found.source = code
        found.compile_flags = [candidate.task.compile.compiler, *candidate.flags]
        return code

    def _check(self, code: str, candidate: _Candidate, found: _Findings) -> None:
        with found.timed("checks"):
            found.techniques = checks.detect_techniques(code)
            steps.check_source(code, found.techniques, candidate.policy)

    def _compile_and_check(
        self,
        scratch: Path,
        candidate: _Candidate,
        found: _Findings,
        compiling: sandbox.Pending,
        began: float,
    ) -> None:
        """Compile, then the checks again on the preprocessed lines and the object."""
        task = candidate.task
        compiled = self.finish_compile(compiling, scratch, task, candidate.events)
        found.durations["compile"] = time.monotonic() - began
        preprocessed = steps.within_limit(compiled.preprocessed)
        found.techniques |= steps.compiled_techniques(preprocessed, compiled.listing)
        steps.check_compiled(
            preprocessed,
            compiled.listing,
            compiled.error,
            found.techniques,
            candidate.policy,
            function=task.function,
            runtime_symbols=build.runtime_symbols(),
        )

    def _run(
        self,
        scratch: Path,
        candidate: _Candidate,
        plan: _Plan,
        expected: list[verify.Expected],
        watch: steps.EarlyVerdict,
        found: _Findings,
        harness: sandbox.Pending,
    ) -> HarnessRun:
        """Verification at every size, then warm-up, timed runs and a last verification,
        in one harness process under the node's timing lock: one sandbox and one process
        start fewer than two processes, and no verification of another candidate on these
        cores while this one is timed. Each phase keeps its own wall limit; a kernel that
        fails the reward-size verification is stopped before it is timed. The sandbox was
        set up during the compile (``start_run``)."""
        with self.exclusive_timing():
            run = self.run(
                scratch,
                candidate.task,
                plan.verify + plan.timing,
                candidate.events,
                verify_runs=len(plan.verify),
                watch=watch,
                harness=harness,
                expected=expected,
                threads=candidate.threads,
            )
        found.durations["verify"] = run.phase_one_s
        return run

    def _verify(
        self,
        candidate: _Candidate,
        plan: _Plan,
        run: HarnessRun,
        watch: steps.EarlyVerdict,
        found: _Findings,
    ) -> Phase | None:
        """Judge the verification phase; the timing phase (None if the run never got to it)."""
        steps.check_clocks(run.frames)
        verification, timing = run.phases(len(plan.verify))
        problems = steps.verification_problems(plan.verify, verification, watch)
        found.generalizes = not problems
        found.note = steps.generalization_note(candidate.task, problems)
        if timing is not None:
            found.durations["time"] = run.phase_two_s
        return timing

    def _time(
        self,
        scratch: Path,
        candidate: _Candidate,
        plan: _Plan,
        timing: Phase | None,
        expected: list[verify.Expected],
        found: _Findings,
    ) -> None:
        if timing is None:
            # It ended at an extra size, which only decides `generalizes`: time it in a
            # process of its own, as if the verification had been separate.
            with self.exclusive_timing():
                run = self.run(
                    scratch,
                    candidate.task,
                    plan.timing,
                    candidate.events,
                    threads=candidate.threads,
                )
            found.durations["time"] = run.wall_s
            timing = run.whole()
        attempts = [
            steps.measure(
                candidate.task,
                plan.timing,
                timing,
                expected[len(plan.verify) :],
                self.peak_gflops(),
            )
        ]
        # Runs that disagree were disturbed (a busy node): time the verified kernel again,
        # in a fresh run with every check of the first, and keep the steadiest attempt.
        while (
            attempts[-1].timing.cv > self.settings.max_timing_cv
            and len(attempts) < self.settings.timing_attempts
        ):
            RETIMED.inc()
            attempts.append(self._retime(scratch, candidate, found))
        candidate.events.timings.extend(attempt.timing for attempt in attempts)
        found.measurement = steps.steadiest(attempts, self.settings.max_timing_cv)

    def _retime(self, scratch: Path, candidate: _Candidate, found: _Findings) -> Measurement:
        """One more timing attempt of the verified kernel: fresh seeds (their references
        computed first, never while a kernel is timed), a fresh harness process in the same
        sandbox with the same limits, under the timing lock; warm-up, timed runs and a final
        verification, every run verified and its clocks checked, as in the first attempt."""
        task = candidate.task
        jobs = self._timing_jobs(task)
        expected = self._expect(task, jobs)
        with self.exclusive_timing():
            run = self.run(
                scratch, task, jobs, candidate.events, expected=expected, threads=candidate.threads
            )
        found.durations["retime"] = found.durations.get("retime", 0.0) + run.wall_s
        return steps.measure(task, jobs, run.whole(), expected, self.peak_gflops())

    # --- the steps that run untrusted code (public: the tests drive them directly) -----

    def compile(
        self, scratch: Path, code: str, task: TaskSpec, flags: list[str], events: Events
    ) -> Compiled:
        """Compile ``code`` as kernel.c in ``scratch``, list its object, link the harness."""
        return self.finish_compile(
            self.start_compile(scratch, code, task, flags), scratch, task, events
        )

    def finish_compile(
        self, compiling: sandbox.Pending, scratch: Path, task: TaskSpec, events: Events
    ) -> Compiled:
        """Run the compile that ``start_compile`` set up and read what it left behind."""
        with compiling:
            outcome = compiling.run()
        if outcome.timed_out:
            events.sandbox_kills.append("compile_timeout")
        return build.result(outcome, scratch, task)

    def start_compile(
        self, scratch: Path, code: str, task: TaskSpec, flags: list[str]
    ) -> sandbox.Pending:
        """Write ``code`` as kernel.c in ``scratch`` and set up the compile's sandbox, for
        ``finish_compile``; killed unrun on leaving a ``with`` block."""
        (scratch / build.KERNEL_FILE).write_text(code)
        harness = self.harness_object(task)
        return sandbox.start(
            [
                "/bin/sh",
                "-c",
                build.script(task.compile.compiler, flags, harness, build.Outputs.of(scratch)),
            ],
            build.spec(
                scratch, task, harness, self.settings.address_space_mb, cpus=self.cpus or None
            ),
        )

    def run(
        self,
        scratch: Path,
        task: TaskSpec,
        jobs: list[protocol.Job],
        events: Events,
        *,
        verify_runs: int = 0,
        watch: FrameWatch | None = None,
        harness: sandbox.Pending | None = None,
        expected: Sequence[verify.Expected] | None = None,
        threads: bool = True,
    ) -> HarnessRun:
        """Run ``jobs`` in one harness process. With ``verify_runs`` (0 < n < len(jobs)) the
        run has two phases, the first n jobs and the rest, each with the task's full wall
        limit and CPU budget; ``watch`` sees each frame of the first phase as it arrives and
        may end the run (its outcome is known). ``harness``: its sandbox, if ``start_run``
        set it up ahead (one set up for another run is refused). ``expected`` (one per job):
        each C is checked as it arrives, while the harness waits before reporting the call
        complete (between calls), rather than after; the verdict reads the same check.
        ``threads`` False: a stage that forbids OpenMP, where the process cannot create a
        thread (an attempt kills it and is a ``stage_violation``)."""
        # No thread but the main one and OpenMP's pool may outlive a call: the run's OpenMP
        # threads, which OMP_THREAD_LIMIT caps (harness_env); none without threads.
        count = runner.ThreadCount(self._cpu_set()[0] if threads else 1)
        spec = self._run_spec(
            scratch, task, phases=2 if 0 < verify_runs < len(jobs) else 1, threads=threads
        )
        # The spec's HPCRL_READY=1 makes the harness wait for a go before every call: no
        # thread may work between a job's line and that go (runner.IdleThreads).
        idle = runner.IdleThreads(count) if spec.env.get(READY_ENV) == "1" else None
        conversation = runner.Conversation(
            jobs, verify_runs, watch, count, on_result=self._checker(task, expected), idle=idle
        )
        if harness is None:
            harness = sandbox.start(HARNESS_ARGV, spec)
        elif harness.spec != spec:
            harness.cancel()
            raise InternalError("the harness sandbox was set up for another run")
        started = time.monotonic()
        outcome = harness.run(
            stdin=conversation.opening(), watch=conversation.on_event, started=count.started
        )
        if outcome.start_s is not None:
            SANDBOX_START.observe(outcome.start_s)
        failure = runner.run_failure(
            outcome, conversation, task.timing.time_limit_s, threads=threads
        )
        if failure is not None and failure.status == "timeout":
            events.sandbox_kills.append("timeout")
        return HarnessRun(
            conversation.frames, failure, started, outcome.wall_s, outcome.phase_started
        )

    @staticmethod
    def _checker(
        task: TaskSpec,
        expected: Sequence[verify.Expected] | None,
    ) -> Callable[[int, np.ndarray], None] | None:
        if expected is None:
            return None
        tolerance = task.verification.rel_tolerance

        def check(job: int, output: np.ndarray) -> None:
            verify.check_expected(output, expected[job], tolerance)  # kept for the verdict

        return check

    def start_run(
        self, scratch: Path, task: TaskSpec, *, two_phases: bool, threads: bool = True
    ) -> sandbox.Pending:
        """Set up a harness run's sandbox now, for ``run(harness=...)`` to let it begin
        (``./run`` need not exist yet); killed unrun on leaving a ``with`` block."""
        return sandbox.start(
            HARNESS_ARGV,
            self._run_spec(scratch, task, phases=2 if two_phases else 1, threads=threads),
        )

    def _run_spec(
        self, scratch: Path, task: TaskSpec, phases: int, threads: bool = True
    ) -> sandbox.Spec:
        allow_threads = threads
        threads, cpus, allowed = self._cpu_set()
        limits = sandbox.Limits(
            wall_s=task.timing.time_limit_s,
            # Each phase gets the budget a process of its own had. Running on at most
            # `threads` CPUs (the CPU set below), no phase can use more than its wall
            # limit x threads of it, so no phase can borrow the other's share.
            cpu_s=phases * int(task.timing.time_limit_s * threads) + 2,
            address_space_mb=self.settings.address_space_mb,
        )
        confine = bool(self.cpus) or len(cpus) < len(allowed)
        env = {**self.harness_env(threads=allow_threads), READY_ENV: "1"}
        return sandbox.Spec(
            scratch,
            limits,
            env=env,
            cpus=tuple(cpus) if confine else None,
            extra_pipe=True,
            marks=True,
            marks_after_data=True,
            start_limit_s=runner.START_LIMIT_S,
        )

    # --- what the steps share -----------------------------------------------------------

    def harness_object(self, task: TaskSpec) -> Path:
        """The harness template compiled once per (task harness, function, compiler)."""
        return build.harness_object(
            task, self.settings.work_dir, self.host.compiler, self._harness_lock
        )

    def _plan(self, task: TaskSpec) -> _Plan:
        """Fresh seeds for every run, and their references computed in the background (they
        depend only on the seeds, so this overlaps with the compilation)."""
        harness = harnesses.for_task(task)
        reward = task.sizes.reward
        verifying = [
            harness.job("v", s, secrets.randbits(63)) for s in [reward, *task.sizes.verify]
        ]
        timing = self._timing_jobs(task)
        jobs = verifying + timing
        return _Plan(verifying, timing, self._references.submit(self._expect, task, jobs))

    @staticmethod
    def _timing_jobs(task: TaskSpec) -> list[protocol.Job]:
        """One timing attempt, with fresh seeds: warm-up, timed runs, final verification."""
        harness = harnesses.for_task(task)
        reward = task.sizes.reward
        jobs = [
            harness.job("w", reward, secrets.randbits(63)) for _ in range(task.timing.warmup_runs)
        ]
        jobs += [
            harness.job("t", reward, secrets.randbits(63)) for _ in range(task.timing.timed_runs)
        ]
        jobs.append(harness.job("v", reward, secrets.randbits(63)))
        return jobs

    @staticmethod
    def _expect(task: TaskSpec, jobs: list[protocol.Job]) -> list[verify.Expected]:
        # The check points are drawn here, in the trusted process, and never leave it.
        rng = np.random.default_rng(secrets.randbits(64))
        points = task.verification
        return [
            verify.with_bound(
                harnesses.get(job.harness.name).expect(
                    job, points.random_points, points.corners_and_centre, rng
                ),
                points.rel_tolerance,
            )
            for job in jobs
        ]

    def _expected(self, task: TaskSpec, plan: _Plan) -> list[verify.Expected]:
        if plan.expected.cancel():  # not started yet (the pool is busy): do it here
            return self._expect(task, plan.verify + plan.timing)
        return plan.expected.result()

    def reference(self, task: TaskSpec, runs: int = 9) -> References:
        """The task's performance references, timed now on this node as a kernel is (its
        CPUs and threads, under the timing lock; ``reference`` module): its OpenBLAS routine
        at the reward size (matmul, gemv), and for a memory-bound task (one whose harness
        counts the bytes a call moves: gemv, stencil, spmv) the node's memory bandwidth,
        STREAM's triad."""
        threads, cpus, _ = self._cpu_set()
        harness = harnesses.for_task(task)
        with self.exclusive_timing():
            try:
                openblas = (
                    time_reference(task, threads=threads, cpus=cpus, runs=runs)
                    if harness.timed_routine
                    else None
                )
                triad = (
                    time_triad(
                        compiler=task.compile.compiler,
                        flags=task.compile_flags("O3"),
                        env=self.harness_env(),
                        threads=threads,
                        cpus=cpus,
                    )
                    if harness.bytes_moved(task.sizes.reward) is not None
                    else None
                )
            except ReferenceUnavailable as exc:
                raise InternalError(str(exc)) from None
        return References(openblas, triad)

    def _cpu_set(self) -> tuple[int, list[int], list[int]]:
        """(OpenMP threads, the CPUs a kernel runs on, the CPUs this process may use).

        The kernel's CPUs are the first `threads` of the replica's set (`cpus`; without
        one, of this process's affinity); `threads` 0 is the whole set."""
        allowed = sorted(os.sched_getaffinity(0))
        owned = list(self.cpus) or allowed
        threads = self.settings.threads or len(owned)
        return threads, owned[:threads], allowed

    def peak_gflops(self) -> float:
        """The host's theoretical peak for the CPUs a kernel runs on: a run confined to k
        of the host's cores cannot beat k cores' peak."""
        _, cpus, _ = self._cpu_set()
        cores = max(1, self.host.cores)
        return self.host.peak_gflops * min(len(cpus), cores) / cores

    def confine(self) -> None:
        """Keep this whole process (checks, references, verification, the harness's parent)
        on its CPU set, so that it never runs on the CPUs another replica is timing on. For
        a serving replica; without a set, nothing changes. Threads started before (numpy's
        BLAS pool, at import) are moved too; later ones inherit the set."""
        if not self.cpus:
            return
        for task in sorted(Path("/proc/self/task").iterdir()):
            with contextlib.suppress(ProcessLookupError, ValueError):  # a thread that ended
                os.sched_setaffinity(int(task.name), self.cpus)
        os.sched_setaffinity(0, self.cpus)

    def harness_env(self, *, threads: bool = True) -> dict[str, str]:
        """The environment of a harness run (the bench's bare floor uses it too).

        ``threads`` False (a stage that forbids OpenMP): one OpenMP thread, and
        HPCRL_NO_THREADS=1 tells the harness to refuse every clone (seccomp), so that no
        thread can be made however the kernel reaches thread creation. OMP_THREAD_LIMIT stays
        the run's CPUs: a kernel that asks libgomp for a team by hand is then refused as it
        tries (a stage violation) rather than quietly given a team of one."""
        count, cpus, _ = self._cpu_set()
        # No team, nested ones included, gets more threads than the run has CPUs: a kernel
        # cannot oversubscribe its cores (num_threads(64) gets `threads`).
        env = {
            "OMP_NUM_THREADS": str(count if threads else 1),
            "OMP_THREAD_LIMIT": str(count),
            # Idle OpenMP threads sleep at once rather than spin for a while: a thread
            # that runs between calls is then the kernel's doing (runner.IdleThreads).
            "OMP_WAIT_POLICY": "passive",
            "GOMP_SPINCOUNT": "0",
        }
        if not threads:
            env["HPCRL_NO_THREADS"] = "1"
        if self.settings.pin_threads:
            # Explicit places: the sandbox has no /sys, so OMP_PLACES=cores would find no
            # topology and bind nothing. Bound threads do not migrate between timed runs.
            env["OMP_PROC_BIND"] = "close"
            env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus)
        return env

    @contextlib.contextmanager
    def exclusive_timing(self) -> Iterator[None]:
        """One timing at a time per node, or per CPU set (``timinglock``: replicas whose
        sets overlap take turns, disjoint ones time at once).

        The wait is bounded: whoever holds a lock (a stuck replica, anyone who could open
        the file) costs a retry of this candidate, never a silent stall.
        """
        settings = self.settings
        try:
            with timinglock.timing_locks(
                settings.lock_path, self.cpus, settings.timing_lock_timeout_s, waiting=self._waiting
            ) as waited:
                # The lock moves, so no one is stalled now; another waiter marks itself again.
                self.lock_wait_since = None
                LOCK_WAIT.observe(waited)
                yield
        except timinglock.LockTimeout as exc:
            LOCK_TIMEOUTS.inc()
            raise InternalError(str(exc)) from None

    def _waiting(self, started: float) -> None:
        if self.lock_wait_since is None:
            self.lock_wait_since = started

    def lock_stall(self) -> float:
        """Seconds the longest current wait for the timing lock has lasted (0: none)."""
        since = self.lock_wait_since
        return 0.0 if since is None else time.monotonic() - since

    def health(self) -> tuple[bool, dict[str, float]]:
        """Unhealthy while a timing waits on the lock past its timeout: no progress."""
        stall = self.lock_stall()
        return stall < self.settings.timing_lock_timeout_s, {"timing_lock_wait_s": round(stall, 1)}

    @contextlib.contextmanager
    def _scratch(self) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix="cand-", dir=self.settings.work_dir))
        path.chmod(0o700)
        try:
            yield path
        finally:
            if not self.keep_scratch:
                shutil.rmtree(path, ignore_errors=True)


_DEFAULT: Benchmarker | None = None


def evaluate(
    completion: str,
    *,
    stage: int,
    opt_level: str,
    task: TaskSpec,
    benchmarker: Benchmarker | None = None,
) -> Verdict:
    """Judge one completion with a process-wide default Benchmarker."""
    global _DEFAULT
    if benchmarker is None:
        if _DEFAULT is None:
            _DEFAULT = Benchmarker()
        benchmarker = _DEFAULT
    return benchmarker.evaluate(completion, stage=stage, opt_level=opt_level, task=task)


def private_dir(path: Path) -> None:
    """Make ``path`` a directory only this user can enter (0700), or refuse one that another
    user owns or that is a symlink: a shared, predictable scratch directory lets anyone
    replace the cached harness or a candidate's files."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InternalError(f"work_dir {path} is not a directory (a symlink?)")
    if info.st_uid != os.geteuid():
        raise InternalError(
            f"work_dir {path} belongs to uid {info.st_uid}, not to this "
            f"service (uid {os.geteuid()}): choose a private directory"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def own_cpus(text: str) -> tuple[int, ...]:
    """The replica's CPU set (``benchmarker.cpus``), which must lie within this process's
    affinity; () when none is set."""
    try:
        cpus = cpuset.parse(text)
        cpuset.check_allowed(cpus, os.sched_getaffinity(0))
    except ValueError as exc:
        raise InternalError(str(exc)) from None
    return cpus
