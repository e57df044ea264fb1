"""The verdict pipeline: extract, check, compile, verify, time, reward.

``evaluate(completion, stage=..., opt_level=..., task=...)`` is the whole thing for one
candidate; the CLI's ``check`` and the service's handler both call it. Every step that
touches the untrusted code runs in the sandbox (``sandbox.run``); the checks and the
reference are computed here, in the trusted process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import structlog

from hpcrl_benchmarker import checks, cscan, gemm, sandbox
from hpcrl_benchmarker.extract import ExtractError, extract
from hpcrl_benchmarker.host import HostProfile, detect
from hpcrl_benchmarker.verdict import Verdict, timing_stats
from hpcrl_common.stages import stage as stage_of
from hpcrl_common.task import TaskSpec

log = structlog.get_logger("hpcrl.benchmarker")

DIAGNOSTIC_LINES = 40
DIAGNOSTIC_CHARS = 4000
# The kernel's own lines after preprocessing (headers excluded); real kernels are far below.
PREPROCESSED_LIMIT = 2 * 1024 * 1024
_KERNEL_FILE = "kernel.c"


class InternalError(RuntimeError):
    """The benchmarker itself failed (not the candidate's fault): retry elsewhere."""


@dataclass
class Settings:
    work_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "hpcrl-bench")
    lock_path: Path = Path("/tmp/hpcrl-benchmarker-timing.lock")
    threads: int = 0  # OpenMP threads for the kernel; 0 = every core this process may use
    address_space_mb: int = 4096
    file_size_mb: int = 64
    open_files: int = 64
    keep_scratch: bool = False
    pin_threads: bool = True  # bind each OpenMP thread of a kernel to one CPU


@dataclass
class Events:
    """Hooks for metrics; the service fills them, the CLI leaves them empty."""

    sandbox_kills: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    verify: list[gemm.Job]  # the reward size, then every extra verification size
    timing: list[gemm.Job]  # warm-up, timed runs, final verification
    expected: Future[list[gemm.Expected]]  # for verify + timing, in order


@dataclass
class _Run:
    frames: list[gemm.Frame]
    status: str | None
    text: str
    wall_s: float
    phase_started: float | None  # monotonic time the second phase began


class Benchmarker:
    def __init__(self, settings: Settings | None = None, host: HostProfile | None = None) -> None:
        self.settings = settings or Settings()
        self.host = host or detect()
        self.settings.work_dir.mkdir(parents=True, exist_ok=True)
        self._harness_lock = threading.Lock()
        self._runtime_symbols: frozenset[str] | None = None
        self._references = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reference")

    # --- the pipeline -----------------------------------------------------------------

    def evaluate(self, completion: str, *, stage: int, opt_level: str, task: TaskSpec,
                 events: Events | None = None) -> Verdict:
        events = events or Events()
        durations: dict[str, float] = {}
        verdict = Verdict(status="success", host=self.host.info(), durations_s=durations)
        flags = task.compile_flags(opt_level)
        policy = stage_of(stage)
        started = time.monotonic()
        try:
            extracted = extract(completion, task.signature)
        except ExtractError as exc:
            return self._fail(verdict, "format_violation", str(exc))
        finally:
            durations["extract"] = time.monotonic() - started
        code = extracted.code
        verdict.source = code
        verdict.compile_flags = [task.compile.compiler, *flags]

        started = time.monotonic()
        techniques = checks.detect_techniques(code)
        verdict.techniques = sorted(techniques)
        reasons = checks.source_violations(code)
        durations["checks"] = time.monotonic() - started
        if reasons:
            return self._fail(verdict, "library_violation", "; ".join(reasons))
        if broken := policy.violations(techniques):
            return self._fail(verdict, "stage_violation", _stage_message(stage, broken))

        plan = self._plan(task)
        with self._scratch() as scratch, _cancelling(plan.expected):
            (scratch / _KERNEL_FILE).write_text(code)
            started = time.monotonic()
            compiled = self._compile(scratch, task, flags, events)
            durations["compile"] = time.monotonic() - started
            preprocessed = ""
            if (scratch / "kernel.i").is_file():
                preprocessed = cscan.main_file_lines(
                    (scratch / "kernel.i").read_text(errors="replace"), _KERNEL_FILE)
            if len(preprocessed) > PREPROCESSED_LIMIT:
                # The checks read every character of it (~1 s per MB, outside the sandbox's
                # limits): a macro bomb must not buy itself a minute of this process.
                return self._fail(verdict, "compile_error", (
                    f"the kernel expands to {len(preprocessed) / 2**20:.1f} MiB after "
                    f"preprocessing, above the {PREPROCESSED_LIMIT // 2**20} MiB limit"))
            techniques |= checks.detect_techniques("", preprocessed)
            verdict.techniques = sorted(techniques)
            reasons = checks.source_violations("", preprocessed)
            if compiled.object_ok:
                elf = _read(scratch / "elf.txt")
                undefined, defined, unreadable = checks.parse_readelf_symbols(elf)
                techniques |= checks.object_techniques(undefined)
                verdict.techniques = sorted(techniques)
                if unreadable:
                    reasons.append(f"the object's symbol table could not be read: "
                                   f"{unreadable[0][:200]}")
                reasons += checks.object_violations(
                    undefined, defined, checks.parse_sections(elf), function=task.function,
                    runtime_symbols=self.runtime_symbols())
                reasons += checks.layout_violations(elf)
            if reasons:
                return self._fail(verdict, "library_violation", "; ".join(reasons))
            if broken := policy.violations(techniques):
                return self._fail(verdict, "stage_violation", _stage_message(stage, broken))
            if compiled.error:
                return self._fail(verdict, "compile_error", compiled.error)

            failure = self._measure(scratch, task, plan, verdict, events)
            if failure:
                return self._fail(verdict, *failure)
        return verdict

    @staticmethod
    def _fail(verdict: Verdict, status: str, error: str) -> Verdict:
        verdict.status, verdict.error = status, error[:60_000]
        verdict.gflops, verdict.timing = None, None
        return verdict

    # --- compile ----------------------------------------------------------------------

    @dataclass
    class _Compiled:
        object_ok: bool
        error: str

    def _compile(self, scratch: Path, task: TaskSpec, flags: list[str],
                 events: Events) -> Benchmarker._Compiled:
        harness = self.harness_object(task)
        cc = task.compile.compiler
        quoted = " ".join(_shell_quote(f) for f in flags)
        # One sandbox for the whole step. The preprocessor's output, which the checks read,
        # comes from `gcc -E` with the same flags on the same file, run alongside the
        # compilation on another core (preprocessing is deterministic, so it is what cc1
        # compiled; -save-temps gave the same file but serialised it, ~70 ms more). Then
        # sections and symbols from one readelf (nm costs ~10x more: it loads the LTO
        # plugin), then the link with the harness.
        script = (
            f"{cc} {quoted} -fdiagnostics-color=never -E {_KERNEL_FILE} -o kernel.i "
            "2> cpp.txt & cpp=$!\n"
            f"{cc} {quoted} -fdiagnostics-color=never -c {_KERNEL_FILE} -o kernel.o "
            "2> cc.txt || { wait $cpp; exit 10; }\n"
            "wait $cpp || { cat cpp.txt >> cc.txt; exit 10; }\n"
            "readelf -S -s -W kernel.o > elf.txt || exit 11\n"
            # Full RELRO: the harness's GOT is read-only before the kernel first runs (and
            # the harness's seccomp filter refuses to remap it). The stack is never
            # executable, whatever the object asks for (the checks refuse such objects).
            f"{cc} {quoted} kernel.o /harness/{harness.name} -Wl,-z,relro,-z,now "
            "-Wl,-z,noexecstack -o run -lm "
            "2> ld.txt || exit 12\n"
        )
        limits = sandbox.Limits(
            wall_s=task.compile.time_limit_s, cpu_s=int(task.compile.time_limit_s) + 5,
            address_space_mb=max(self.settings.address_space_mb, 2048),
            file_size_mb=self.settings.file_size_mb, open_files=256,
        )
        outcome = sandbox.run(["/bin/sh", "-c", script], scratch, limits, writable=True,
                              ro_binds=[(harness.parent, "/harness")])
        if outcome.timed_out:
            events.sandbox_kills.append("compile_timeout")
            return self._Compiled(False, f"compilation did not finish within "
                                         f"{task.compile.time_limit_s:g} s")
        if outcome.returncode == 0:
            return self._Compiled(True, "")
        if outcome.returncode == 10:
            return self._Compiled(False, _diagnostics(_read(scratch / "cc.txt")))
        if outcome.returncode == 12:
            return self._Compiled(True, "link failed:\n" + _diagnostics(_read(scratch / "ld.txt")))
        if outcome.returncode == 11:
            return self._Compiled(False, "the object file could not be read")
        raise InternalError(f"compile sandbox failed (rc {outcome.returncode}): "
                            f"{outcome.stderr[-2000:].decode(errors='replace')}")

    def harness_object(self, task: TaskSpec) -> Path:
        """The harness template compiled once per (task harness, function, compiler)."""
        template = resources.files("hpcrl_benchmarker.harness") / f"{task.harness}.c"
        if not template.is_file():
            raise InternalError(f"no harness template {task.harness!r} for task {task.name!r}")
        text = template.read_bytes()
        flags = ["-O2", "-march=native", "-fopenmp", f"-DKERNEL_NAME={task.function}"]
        key = hashlib.sha256(text + repr((flags, self.host.compiler)).encode()).hexdigest()[:16]
        directory = self.settings.work_dir / f"harness-{key}"
        obj = directory / f"{task.harness}.o"
        with self._harness_lock:
            if not obj.is_file():
                directory.mkdir(parents=True, exist_ok=True)
                source = directory / f"{task.harness}.c"
                source.write_bytes(text)
                partial = directory / f".{task.harness}.o.{os.getpid()}"
                subprocess.run([task.compile.compiler, *flags, "-c", str(source), "-o",
                                str(partial)], check=True, capture_output=True)
                partial.replace(obj)
        return obj

    def runtime_symbols(self) -> frozenset[str]:
        """Names exported by libc, libm and libgomp: a kernel may not define (interpose) them."""
        if self._runtime_symbols is None:
            names: set[str] = set()
            for lib in ("libc.so.6", "libm.so.6", "libgomp.so.1"):
                path = _find_library(lib)
                if path is None:
                    continue
                out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                                     text=True).stdout
                names |= {line.split()[-1].split("@")[0] for line in out.splitlines()
                          if len(line.split()) == 3}
            self._runtime_symbols = frozenset(names)
        return self._runtime_symbols

    # --- run --------------------------------------------------------------------------

    def _plan(self, task: TaskSpec) -> _Plan:
        """Fresh seeds for every run, and their references computed in the background (they
        depend only on the seeds, so this overlaps with the compilation)."""
        reward = task.sizes.reward
        verify = [gemm.Job("v", s, secrets.randbits(63)) for s in [reward, *task.sizes.verify]]
        timing = [gemm.Job("w", reward, secrets.randbits(63))
                  for _ in range(task.timing.warmup_runs)]
        timing += [gemm.Job("t", reward, secrets.randbits(63))
                   for _ in range(task.timing.timed_runs)]
        timing.append(gemm.Job("v", reward, secrets.randbits(63)))
        jobs = verify + timing
        return _Plan(verify, timing, self._references.submit(self._expect, task, jobs))

    @staticmethod
    def _expect(task: TaskSpec, jobs: list[gemm.Job]) -> list[gemm.Expected]:
        # The check points are drawn here, in the trusted process, and never leave it.
        rng = np.random.default_rng(secrets.randbits(64))
        return [gemm.expect(job, task.verification.random_points,
                            task.verification.corners_and_centre, rng) for job in jobs]

    def _expected(self, task: TaskSpec, plan: _Plan) -> list[gemm.Expected]:
        if plan.expected.cancel():  # not started yet (the pool is busy): do it here
            return self._expect(task, plan.verify + plan.timing)
        return plan.expected.result()

    def _run_jobs(self, scratch: Path, task: TaskSpec, jobs: list[gemm.Job], events: Events,
                  *, verify_runs: int = 0,
                  watch: Callable[[gemm.Frame], bool] | None = None,
                  ) -> tuple[list[gemm.Frame], str | None, str]:
        """Run the harness; (frames completed, failure status or None, failure text)."""
        run = self._run(scratch, task, jobs, events, verify_runs=verify_runs, watch=watch)
        return run.frames, run.status, run.text

    def _run(self, scratch: Path, task: TaskSpec, jobs: list[gemm.Job], events: Events,
             *, verify_runs: int = 0,
             watch: Callable[[gemm.Frame], bool] | None = None) -> _Run:
        """Run ``jobs`` in one harness process. With ``verify_runs`` (0 < n < len(jobs)) the
        run has two phases, the first n jobs and the rest, each with the task's full wall
        limit and CPU budget; ``watch`` sees each frame of the first phase as it arrives and
        may end the run (its outcome is known)."""
        nonce = secrets.randbits(64)
        threads, cpus, allowed = self._cpu_set()
        phases = 2 if 0 < verify_runs < len(jobs) else 1
        limits = sandbox.Limits(
            wall_s=task.timing.time_limit_s,
            # Each phase gets the budget a process of its own had. Running on at most
            # `threads` CPUs (the CPU set below), no phase can use more than its wall
            # limit x threads of it, so no phase can borrow the other's share.
            cpu_s=phases * int(task.timing.time_limit_s * threads) + 2,
            address_space_mb=self.settings.address_space_mb,
            file_size_mb=self.settings.file_size_mb, open_files=self.settings.open_files,
        )
        reader = gemm.RunReader(nonce, jobs)
        tampered: list[str] = []

        def dispatch(job: int) -> bytes:
            """The next line for the harness: a job (its inputs exist from now on) or the end."""
            if job == len(jobs):
                return gemm.END_LINE
            reader.sent(job, time.monotonic_ns())
            return gemm.job_line(jobs[job])

        def on_event(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
            try:
                if channel == sandbox.MARK:
                    frames = reader.mark(payload, at_ns)
                else:
                    frames = reader.data(payload)
            except gemm.ProtocolError as exc:
                tampered.append(str(exc))
                return sandbox.Reply(stop=True)
            for frame in frames:
                if frame.job < verify_runs and watch is not None and watch(frame):
                    return sandbox.Reply(stop=True)
                new_phase = phases == 2 and frame.job == verify_runs - 1
                return sandbox.Reply(new_phase=new_phase, send=dispatch(frame.job + 1),
                                     marks_after_data=frame.job + 1 < len(jobs))
            return None

        first = gemm.header(nonce) + dispatch(0)
        outcome = sandbox.run(["./run", "{fd}", "{marks}"], scratch, limits, stdin=first,
                              env=self.harness_env(), extra_pipe=True, marks=True,
                              watch=on_event, cpus=cpus if len(cpus) < len(allowed) else None,
                              marks_after_data=True)
        run = _Run(reader.frames, None, "", outcome.wall_s, outcome.phase_started)
        if tampered:
            run.frames, run.status = [], "runtime_error"
            run.text = f"the harness's output was tampered with: {tampered[0]}"
            return run
        if outcome.stopped or (reader.finished and outcome.returncode == 0
                               and not outcome.timed_out):
            return run
        done = len(reader.frames)
        first, total = (0, verify_runs) if done < verify_runs else (verify_runs, len(jobs))
        failed_job = jobs[min(done, len(jobs) - 1)]
        where = (f"during run {min(done, len(jobs) - 1) - first + 1} of {total - first} "
                 f"({_sizes(failed_job.sizes)})")
        if outcome.timed_out:
            events.sandbox_kills.append("timeout")
            run.status, run.text = "timeout", (
                f"did not finish within {task.timing.time_limit_s:g} s {where}; the process "
                "group was killed")
            return run
        sig = outcome.signal
        if sig is not None:
            name = _signal_name(sig)
            hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
            run.status, run.text = "runtime_error", f"killed by {name}{hint} {where}"
            return run
        if outcome.returncode == 97:
            run.status, run.text = "runtime_error", f"out of memory {where}"
            return run
        if outcome.returncode in (96, 98):
            raise InternalError(f"harness refused to start (rc {outcome.returncode}): "
                                f"{outcome.stderr[-1000:].decode(errors='replace')}")
        run.status, run.text = "runtime_error", (
            f"the process exited early with status {outcome.returncode} {where} "
            "(exit() in the kernel?)")
        return run

    def _cpu_set(self) -> tuple[int, list[int], list[int]]:
        """(OpenMP threads, the CPUs a kernel runs on, the CPUs this process may use)."""
        threads = self.settings.threads or self.host.cores
        allowed = sorted(os.sched_getaffinity(0))
        return threads, allowed[:threads], allowed

    def harness_env(self) -> dict[str, str]:
        """The environment of a harness run (the bench's bare floor uses it too)."""
        threads, cpus, _ = self._cpu_set()
        # No team, nested ones included, gets more threads than the run has CPUs: a kernel
        # cannot oversubscribe its cores (num_threads(64) gets `threads`).
        env = {"OMP_NUM_THREADS": str(threads), "OMP_THREAD_LIMIT": str(threads)}
        if self.settings.pin_threads:
            # Explicit places: the sandbox has no /sys, so OMP_PLACES=cores would find no
            # topology and bind nothing. Bound threads do not migrate between timed runs.
            env["OMP_PROC_BIND"] = "close"
            env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus)
        return env

    @staticmethod
    def _message(frame: gemm.Frame, expected: gemm.Expected, tolerance: float) -> str:
        """'' when the frame's C is right, else why not."""
        if frame.flags & gemm.FLAG_INPUTS_MODIFIED:
            return "the kernel modified its inputs A or B"
        if frame.flags & gemm.FLAG_CHANGED_AFTER_RETURN:
            return "C was still being written after the kernel returned"
        if frame.flags & gemm.FLAG_PARALLEL_LEFT_OPEN:
            return ("the kernel returned with a parallel region still open (threads left "
                    "running after the call)")
        return gemm.check_expected(frame.c, expected, tolerance)

    def _measure(self, scratch: Path, task: TaskSpec, plan: _Plan, verdict: Verdict,
                 events: Events) -> tuple[str, str] | None:
        """Verification at every size, then warm-up, timed runs and a last verification,
        in one harness process under the node's timing lock: one sandbox and one process
        start fewer than two processes, and no verification of another candidate on these
        cores while this one is timed. Each phase keeps its own wall limit; a kernel that
        fails the reward-size verification is stopped before it is timed."""
        expected = self._expected(task, plan)
        tolerance = task.verification.rel_tolerance
        nverify = len(plan.verify)
        messages: dict[int, str] = {}

        def watch(frame: gemm.Frame) -> bool:
            messages[frame.job] = self._message(frame, expected[frame.job], tolerance)
            if frame.job == 0:
                return bool(messages[0])  # the verdict is a verification error: stop
            return (frame.job == nverify - 1 and task.penalize_generalization
                    and any(messages.values()))

        durations = verdict.durations_s
        with self.exclusive_timing():
            started = time.monotonic()
            run = self._run(scratch, task, plan.verify + plan.timing, events,
                            verify_runs=nverify, watch=watch)
        boundary = started + run.wall_s if run.phase_started is None else run.phase_started
        durations["verify"] = boundary - started
        if problem := _timing_problem(run.frames):
            return "verification_error", problem
        verify_frames = [f for f in run.frames if f.job < nverify]
        in_verify = len(verify_frames) < nverify
        # A frame that arrived in the same read as the one that stopped the run was not
        # watched: check it here.
        checked = [messages[f.job] if f.job in messages
                   else self._message(f, expected[f.job], tolerance) for f in verify_frames]
        failure = self._judge_verification(task, plan.verify, verify_frames, checked,
                                           run.status if in_verify else None, run.text, verdict)
        if failure:
            return failure
        if in_verify:
            # It ended at an extra size, which only decides `generalizes`: time it in a
            # process of its own, as if the verification had been separate.
            with self.exclusive_timing():
                started = time.monotonic()
                run = self._run(scratch, task, plan.timing, events)
            durations["time"] = time.monotonic() - started
            frames = run.frames
        else:
            durations["time"] = started + run.wall_s - boundary
            frames = [dataclasses.replace(f, job=f.job - nverify) for f in run.frames
                      if f.job >= nverify]
        return self._judge_timing(task, plan.timing, frames, expected[nverify:], run.status,
                                  run.text, verdict)

    @staticmethod
    def _judge_verification(task: TaskSpec, jobs: list[gemm.Job], frames: list[gemm.Frame],
                            messages: list[str], status: str | None, text: str,
                            verdict: Verdict) -> tuple[str, str] | None:
        if not frames:
            assert status is not None
            return status, text
        if messages[0]:
            return "verification_error", f"wrong result at {_sizes(jobs[0].sizes)}: {messages[0]}"
        problems = [f"{_sizes(jobs[f.job].sizes)}: {m}" for f, m in zip(frames, messages,
                                                                          strict=True) if m]
        if status is not None:
            problems.append(f"{status}: {text}")
        verdict.generalizes = not problems
        if problems:
            text = "does not generalise to other sizes: " + "; ".join(problems)
            if task.penalize_generalization:
                return "verification_error", text
            verdict.error = text
        return None

    def _judge_timing(self, task: TaskSpec, jobs: list[gemm.Job], frames: list[gemm.Frame],
                      expected: list[gemm.Expected], status: str | None, text: str,
                      verdict: Verdict) -> tuple[str, str] | None:
        if status is not None:
            return status, text
        for frame in frames:
            message = self._message(frame, expected[frame.job], task.verification.rel_tolerance)
            if message:
                phase = {"w": "warm-up", "t": "timed", "v": "final verification"}[
                    jobs[frame.job].kind]
                return "verification_error", f"wrong result in the {phase} run: {message}"
        if problem := _timing_problem(frames):
            return "verification_error", problem
        runs = [f.effective_seconds() for f in frames if jobs[f.job].kind == "t"]
        if not all(gemm.is_finite_positive(r) for r in runs):
            return "runtime_error", f"the harness's clock reported impossible times {runs}"
        timing = timing_stats(runs)
        size = task.sizes.reward
        gflops = task.flop_count(size) / timing.mean_s / 1e9
        peak = self.host.peak_gflops
        if gflops > peak:
            return "verification_error", (
                f"measured {gflops:.1f} GFLOPS, above this host's theoretical peak of "
                f"{peak:.1f} GFLOPS; such a measurement cannot be genuine")
        verdict.timing, verdict.gflops = timing, gflops
        return None

    @contextlib.contextmanager
    def exclusive_timing(self) -> Iterator[None]:
        """One timing at a time per node: an flock on a shared file (a fresh open file
        description each time, so threads of one process exclude each other too)."""
        self.settings.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.settings.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _scratch(self) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix="cand-", dir=self.settings.work_dir))
        path.chmod(0o777)  # the sandbox user (nobody) writes here while compiling
        try:
            yield path
        finally:
            if not self.settings.keep_scratch:
                shutil.rmtree(path, ignore_errors=True)


_DEFAULT: Benchmarker | None = None


def evaluate(completion: str, *, stage: int, opt_level: str, task: TaskSpec,
             benchmarker: Benchmarker | None = None) -> Verdict:
    """Judge one completion with a process-wide default Benchmarker."""
    global _DEFAULT
    if benchmarker is None:
        if _DEFAULT is None:
            _DEFAULT = Benchmarker()
        benchmarker = _DEFAULT
    return benchmarker.evaluate(completion, stage=stage, opt_level=opt_level, task=task)


@contextlib.contextmanager
def _cancelling(future: Future[object]) -> Iterator[None]:
    """Drop background work that an early verdict made useless."""
    try:
        yield
    finally:
        future.cancel()


def _timing_problem(frames: list[gemm.Frame]) -> str:
    for frame in frames:
        if problem := frame.timing_problem():
            return f"the timing was tampered with: {problem}"
    return ""


def _stage_message(stage: int, broken: list[str]) -> str:
    return f"stage {stage} forbids {', '.join(broken)}, which the code uses"


def _diagnostics(text: str) -> str:
    lines = [line.replace("/scratch/", "") for line in text.splitlines()]
    return "\n".join(lines[:DIAGNOSTIC_LINES])[:DIAGNOSTIC_CHARS] or "compilation failed"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _sizes(sizes: dict[str, int]) -> str:
    return "x".join(str(v) for v in sizes.values())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _shell_quote(text: str) -> str:
    import shlex
    return shlex.quote(text)


def _find_library(name: str) -> str | None:
    for directory in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                      "/usr/lib"):
        candidate = Path(directory) / name
        if candidate.exists():
            return str(candidate)
    return None
