"""The compile step's pieces: the script run in the sandbox, what it left behind, and the
trusted objects it links against (the harness, compiled once; the runtime's symbol names).

One sandbox runs the whole step. The preprocessor's output, which the checks read, comes
from ``gcc -E`` with the same flags on the same file, run alongside the compilation on
another core (-save-temps gave the same file but serialised it, ~70 ms more). Preprocessing
is deterministic, so it is what cc1 compiled, as long as neither can see what the other
writes: a kernel could otherwise ask (``__has_include``, ``#include``) for the other's
output file and preprocess differently in the two. So every file written while gcc reads
the kernel has a name it cannot know (``Outputs``). Then sections and symbols from one
readelf (nm costs ~10x more: it loads the LTO plugin) alongside the link with the harness.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from hpcrl_benchmarker import checks, cscan, harnesses, sandbox
from hpcrl_benchmarker.exitcodes import CompileExit, harness_defines
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.task import TaskSpec

log = structlog.get_logger("hpcrl.benchmarker")

KERNEL_FILE = "kernel.c"
DIAGNOSTIC_LINES = 40
DIAGNOSTIC_CHARS = 4000
# gcc opens many headers and needs more memory than a kernel run may have.
OPEN_FILES = 256
MIN_ADDRESS_SPACE_MB = 2048
STARTED = "started"  # what the compile script writes first
# How long the compile's sandbox may take to start before the compile's own time limit
# runs: seconds on a node whose cores are saturated, which must not become a compile_error.
START_LIMIT_S = 60.0


@dataclass(frozen=True)
class Compiled:
    """What the compile step left behind. The checks read it before its error counts."""

    error: str  # '' when the kernel compiled and linked
    preprocessed: str  # the kernel's own lines of gcc -E's output ('' if there is none)
    listing: checks.ObjectListing | None  # None when there is no object to list


# Drawn once per process; with the scratch directory's path (which the sandbox does not
# show either) it names a compile's files.
_NAMES_KEY = secrets.token_bytes(32)


@dataclass(frozen=True)
class Outputs:
    """The files a compile writes while gcc reads the kernel, under names the kernel cannot
    know. Written after both gcc runs ended: elf.txt, ld.txt and the executable ``run``."""

    preprocessed: str
    object: str
    cpp_log: str
    cc_log: str

    @classmethod
    def of(cls, scratch: Path) -> Outputs:
        tag = hmac.new(_NAMES_KEY, str(scratch).encode(), hashlib.sha256).hexdigest()[:32]
        return cls(f"{tag}.i", f"{tag}.o", f"{tag}.cpp.txt", f"{tag}.cc.txt")


def script(compiler: str, flags: list[str], harness: Path, outputs: Outputs) -> str:
    quoted = " ".join(shlex.quote(f) for f in flags)
    gcc = f"{compiler} {quoted} -fdiagnostics-color=never"
    i, o, cpp, cc = outputs.preprocessed, outputs.object, outputs.cpp_log, outputs.cc_log
    return (
        # The first output starts the compile's wall clock (sandbox.Spec.start_limit_s).
        f"echo {STARTED}\n"
        f"{gcc} -E {KERNEL_FILE} -o {i} 2> {cpp} & cpp=$!\n"
        f"{gcc} -c {KERNEL_FILE} -o {o} 2> {cc} "
        f"|| {{ wait $cpp; exit {CompileExit.COMPILE_FAILED:d}; }}\n"
        f"wait $cpp || {{ cat {cpp} >> {cc}; exit {CompileExit.COMPILE_FAILED:d}; }}\n"
        # The listing and the link read the object at once, on two cores.
        f"readelf -S -s -W {o} > elf.txt & elf=$!\n"
        # Full RELRO: the harness's GOT is read-only before the kernel first runs (and the
        # harness's seccomp filter refuses to remap it). The stack is never executable,
        # whatever the object asks for (the checks refuse such objects).
        f"{compiler} {quoted} {o} /harness/{harness.name} -Wl,-z,relro,-z,now "
        "-Wl,-z,noexecstack -o run -lm 2> ld.txt; linked=$?\n"
        f"wait $elf || exit {CompileExit.OBJECT_UNREADABLE:d}\n"
        f"[ $linked -eq 0 ] || exit {CompileExit.LINK_FAILED:d}\n"
    )


def spec(
    scratch: Path,
    task: TaskSpec,
    harness: Path,
    address_space_mb: int,
    cpus: tuple[int, ...] | None = None,
) -> sandbox.Spec:
    """The compile step's sandbox; ``cpus``: the replica's CPU set, if it has one."""
    limits = sandbox.Limits(
        wall_s=task.compile.time_limit_s,
        cpu_s=int(task.compile.time_limit_s) + 5,
        address_space_mb=max(address_space_mb, MIN_ADDRESS_SPACE_MB),
        open_files=OPEN_FILES,
    )
    # The scratch dir is writable only here: the objects are written into it.
    return sandbox.Spec(
        scratch,
        limits,
        writable=True,
        ro_binds=((harness.parent, "/harness"),),
        cpus=cpus,
        start_limit_s=START_LIMIT_S,
    )


def result(outcome: sandbox.Outcome, scratch: Path, task: TaskSpec) -> Compiled:
    """The step's outcome read from the script's exit status and the files it wrote."""
    outputs = Outputs.of(scratch)
    error, has_object = _verdict(outcome, scratch, task, outputs)
    preprocessed = ""
    if (scratch / outputs.preprocessed).is_file():
        preprocessed = cscan.main_file_lines(
            (scratch / outputs.preprocessed).read_text(errors="replace"), KERNEL_FILE
        )
    listing = checks.ObjectListing.parse(_read(scratch / "elf.txt")) if has_object else None
    return Compiled(error, preprocessed, listing)


def _verdict(
    outcome: sandbox.Outcome, scratch: Path, task: TaskSpec, outputs: Outputs
) -> tuple[str, bool]:
    """(the compile error, '' if none; whether there is an object to check)."""
    if outcome.never_started:
        raise InternalError(
            f"the compile sandbox did not start within {START_LIMIT_S:g} s "
            "(the node's cores are saturated?)"
        )
    if outcome.timed_out:
        if outcome.schedule is not None and outcome.schedule.starved(task.compile.time_limit_s):
            raise InternalError(
                f"the compile was starved of CPU within {task.compile.time_limit_s:g} s "
                f"({outcome.schedule.text()}): the node's cores are saturated"
            )
        return f"compilation did not finish within {task.compile.time_limit_s:g} s", False
    if outcome.returncode == 0:
        return "", True
    if outcome.returncode == CompileExit.COMPILE_FAILED:
        return _diagnostics(_read(scratch / outputs.cc_log)), False
    if outcome.returncode == CompileExit.LINK_FAILED:
        link_log = _read(scratch / "ld.txt").replace(outputs.object, "kernel.o")
        return "link failed:\n" + _diagnostics(link_log), True
    if outcome.returncode == CompileExit.OBJECT_UNREADABLE:
        return "the object file could not be read", False
    raise InternalError(
        f"compile sandbox failed (rc {outcome.returncode}): "
        f"{outcome.stderr[-2000:].decode(errors='replace')}"
    )


# sha256 of each harness object this process compiled: a cached object is used only while
# its bytes are still the ones compiled here (one from an earlier run, or changed on disk, is
# compiled again), so nothing written into the work directory can stand in for the harness.
_COMPILED: dict[Path, str] = {}


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def harness_object(
    task: TaskSpec, work_dir: Path, compiler_version: str, lock: threading.Lock
) -> Path:
    """The harness template (with the ``harness.h`` it includes) compiled once per
    (template, task function, compiler) and process, and checked against what was compiled
    before every use."""
    try:
        template = harnesses.Template.of(task.harness)
    except harnesses.HarnessError as exc:
        raise InternalError(f"task {task.name!r}: {exc}") from None
    # The part every template includes (harness.h: the protocol, the lock-down).
    text, headers, stem = template.text, template.headers, template.stem
    flags = [
        "-O2",
        "-march=native",
        "-fopenmp",
        f"-DKERNEL_NAME={task.function}",
        *harness_defines(),
    ]
    sources = text + b"".join(name.encode() + body for name, body in sorted(headers.items()))
    key = hashlib.sha256(sources + repr((flags, compiler_version)).encode()).hexdigest()[:16]
    directory = work_dir / f"harness-{key}"
    obj = directory / f"{stem}.o"
    with lock:
        compiled = _COMPILED.get(obj)
        if compiled is not None and _digest(obj) == compiled:
            return obj
        if compiled is not None:
            log.warning("the cached harness changed on disk; compiling it again", path=str(obj))
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        source = template.write(directory)
        partial = directory / f".{stem}.o.{os.getpid()}"
        subprocess.run(
            [task.compile.compiler, *flags, "-c", str(source), "-o", str(partial)],
            check=True,
            capture_output=True,
        )
        partial.replace(obj)
        _COMPILED[obj] = _digest(obj) or ""
    return obj


@functools.cache
def runtime_symbols() -> frozenset[str]:
    """Names exported by libc, libm and libgomp: a kernel may not define (interpose) them."""
    names: set[str] = set()
    for lib in ("libc.so.6", "libm.so.6", "libgomp.so.1"):
        path = _find_library(lib)
        if path is None:
            continue
        out = subprocess.run(
            ["nm", "-D", "--defined-only", path], capture_output=True, text=True
        ).stdout
        names |= {
            line.split()[-1].split("@")[0] for line in out.splitlines() if len(line.split()) == 3
        }
    return frozenset(names)


def _find_library(name: str) -> str | None:
    for directory in (
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ):
        candidate = Path(directory) / name
        if candidate.exists():
            return str(candidate)
    return None


def _diagnostics(text: str) -> str:
    lines = [line.replace("/scratch/", "") for line in text.splitlines()]
    return "\n".join(lines[:DIAGNOSTIC_LINES])[:DIAGNOSTIC_CHARS] or "compilation failed"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
