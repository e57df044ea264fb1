"""The verdict pipeline: extract, check, compile, verify, time, reward.

``evaluate(completion, stage=..., opt_level=..., task=...)`` is the whole thing for one
candidate; the CLI's ``check`` and the service's handler both call it. Every step that
touches the untrusted code runs in the sandbox (``sandbox.run``); the checks and the
reference are computed here, in the trusted process.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
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


@dataclass
class Events:
    """Hooks for metrics; the service fills them, the CLI leaves them empty."""

    sandbox_kills: list[str] = field(default_factory=list)


class Benchmarker:
    def __init__(self, settings: Settings | None = None, host: HostProfile | None = None) -> None:
        self.settings = settings or Settings()
        self.host = host or detect()
        self.settings.work_dir.mkdir(parents=True, exist_ok=True)
        self._harness_lock = threading.Lock()
        self._runtime_symbols: frozenset[str] | None = None

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

        with self._scratch() as scratch:
            (scratch / _KERNEL_FILE).write_text(code)
            started = time.monotonic()
            compiled = self._compile(scratch, task, flags, events)
            durations["compile"] = time.monotonic() - started
            preprocessed = ""
            if (scratch / "kernel.i").is_file():
                preprocessed = cscan.main_file_lines(
                    (scratch / "kernel.i").read_text(errors="replace"), _KERNEL_FILE)
            techniques |= checks.detect_techniques("", preprocessed)
            verdict.techniques = sorted(techniques)
            reasons = checks.source_violations("", preprocessed)
            if compiled.object_ok:
                undefined, defined = checks.parse_nm(_read(scratch / "nm.txt"))
                sections = checks.parse_sections(_read(scratch / "sections.txt"))
                reasons += checks.object_violations(
                    undefined, defined, sections, function=task.function,
                    runtime_symbols=self.runtime_symbols())
            if reasons:
                return self._fail(verdict, "library_violation", "; ".join(reasons))
            if broken := policy.violations(techniques):
                return self._fail(verdict, "stage_violation", _stage_message(stage, broken))
            if compiled.error:
                return self._fail(verdict, "compile_error", compiled.error)

            started = time.monotonic()
            failure = self._verify(scratch, task, verdict, events)
            durations["verify"] = time.monotonic() - started
            if failure:
                return self._fail(verdict, *failure)

            started = time.monotonic()
            failure = self._time(scratch, task, verdict, events)
            durations["time"] = time.monotonic() - started
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
        # One sandbox for the whole step: compile (keeping the preprocessor output for the
        # checks), list symbols and sections, then link with the harness.
        script = (
            f"{cc} {quoted} -fdiagnostics-color=never -save-temps=obj -c {_KERNEL_FILE} "
            "-o kernel.o 2> cc.txt || exit 10\n"
            "nm kernel.o > nm.txt && readelf -S -W kernel.o > sections.txt || exit 11\n"
            f"{cc} {quoted} kernel.o /harness/{harness.name} -o run -lm 2> ld.txt || exit 12\n"
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

    def _run_jobs(self, scratch: Path, task: TaskSpec, jobs: list[gemm.Job],
                  events: Events) -> tuple[list[gemm.Frame], str | None, str]:
        """Run the harness; (frames completed, failure status or None, failure text)."""
        nonce = secrets.randbits(64)
        threads = self.settings.threads or self.host.cores
        limits = sandbox.Limits(
            wall_s=task.timing.time_limit_s,
            cpu_s=int(task.timing.time_limit_s * threads) + 2,
            address_space_mb=self.settings.address_space_mb,
            file_size_mb=self.settings.file_size_mb, open_files=self.settings.open_files,
        )
        outcome = sandbox.run(["./run", "{fd}"], scratch, limits, stdin=gemm.request(nonce, jobs),
                              env={"OMP_NUM_THREADS": str(threads)}, extra_pipe=True)
        try:
            frames, finished = gemm.parse_frames(outcome.extra, nonce, jobs)
        except gemm.ProtocolError as exc:
            return [], "runtime_error", f"the harness's output was tampered with: {exc}"
        if finished and outcome.returncode == 0 and not outcome.timed_out:
            return frames, None, ""
        failed_job = jobs[min(len(frames), len(jobs) - 1)]
        where = f"during run {len(frames) + 1} of {len(jobs)} ({_sizes(failed_job.sizes)})"
        if outcome.timed_out:
            events.sandbox_kills.append("timeout")
            return frames, "timeout", (f"did not finish within {task.timing.time_limit_s:g} s "
                                       f"{where}; the process group was killed")
        sig = outcome.signal
        if sig is not None:
            name = _signal_name(sig)
            hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
            return frames, "runtime_error", f"killed by {name}{hint} {where}"
        if outcome.returncode == 97:
            return frames, "runtime_error", f"out of memory {where}"
        if outcome.returncode in (96, 98):
            raise InternalError(f"harness refused to start (rc {outcome.returncode}): "
                                f"{outcome.stderr[-1000:].decode(errors='replace')}")
        return frames, "runtime_error", (f"the process exited early with status "
                                         f"{outcome.returncode} {where} (exit() in the kernel?)")

    def _check_frames(self, task: TaskSpec, jobs: list[gemm.Job],
                      frames: list[gemm.Frame]) -> list[str]:
        """One message per frame ('' when right)."""
        rng = np.random.default_rng(secrets.randbits(64))
        results = []
        for frame in frames:
            job = jobs[frame.job]
            if frame.flags & gemm.FLAG_INPUTS_MODIFIED:
                results.append("the kernel modified its inputs A or B")
                continue
            if frame.flags & gemm.FLAG_CHANGED_AFTER_RETURN:
                results.append("C was still being written after the kernel returned")
                continue
            a, b = gemm.inputs(job.sizes, job.seed)
            ref = gemm.reference(a, b)
            points = gemm.sample_points(job.sizes["M"], job.sizes["N"],
                                        task.verification.random_points,
                                        task.verification.corners_and_centre, rng)
            results.append(gemm.check(frame.c, ref, a, b, points,
                                      task.verification.rel_tolerance))
        return results

    def _verify(self, scratch: Path, task: TaskSpec, verdict: Verdict,
                events: Events) -> tuple[str, str] | None:
        sizes = [task.sizes.reward, *task.sizes.verify]
        jobs = [gemm.Job("v", s, secrets.randbits(63)) for s in sizes]
        frames, status, text = self._run_jobs(scratch, task, jobs, events)
        messages = self._check_frames(task, jobs, frames)
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

    def _time(self, scratch: Path, task: TaskSpec, verdict: Verdict,
              events: Events) -> tuple[str, str] | None:
        size = task.sizes.reward
        jobs = [gemm.Job("w", size, secrets.randbits(63)) for _ in range(task.timing.warmup_runs)]
        jobs += [gemm.Job("t", size, secrets.randbits(63)) for _ in range(task.timing.timed_runs)]
        jobs.append(gemm.Job("v", size, secrets.randbits(63)))
        with self.exclusive_timing():
            frames, status, text = self._run_jobs(scratch, task, jobs, events)
        if status is not None:
            return status, text
        for frame, message in zip(frames, self._check_frames(task, jobs, frames), strict=True):
            if message:
                phase = {"w": "warm-up", "t": "timed", "v": "final verification"}[
                    jobs[frame.job].kind]
                return "verification_error", f"wrong result in the {phase} run: {message}"
        runs = [f.seconds for f in frames if jobs[f.job].kind == "t"]
        if not all(gemm.is_finite_positive(r) for r in runs):
            return "runtime_error", f"the harness's clock reported impossible times {runs}"
        timing = timing_stats(runs)
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
