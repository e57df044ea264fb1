"""Run one untrusted step (compile, link, harness) inside bubblewrap with hard limits.

The sandbox sees only what gcc and the harness need, read-only: /usr/{bin,lib,lib64,libexec,
include}, the dynamic loader's cache, a minimal /dev, the harness directory, plus a scratch
directory (writable while compiling, read-only while running) and a small private /tmp. It
has its own user (nobody), PID, network, IPC, UTS and cgroup namespaces, no capabilities, a
new session, dies with its parent, and runs under rlimits (address space, CPU time, file size,
open files, core dumps off). On the wall-clock limit the whole process group is killed, and
the PID namespace takes every descendant with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_SYSTEM_RO = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/libexec", "/usr/include",
              "/etc/ld.so.cache")
OUTPUT_LIMIT = 256 * 1024  # bytes of stdout/stderr kept; the rest is drained and dropped
PIPE_SIZE = 1024 * 1024  # the default /proc/sys/fs/pipe-max-size for unprivileged users


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: int
    address_space_mb: int = 4096
    file_size_mb: int = 64
    open_files: int = 64
    tmp_mb: int = 64


@dataclass
class Outcome:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    wall_s: float
    extra: bytes = b""  # what the process wrote on the extra pipe (fd 3), if requested
    extra_times: list[tuple[int, float]] = field(default_factory=list)
    phase_started: float | None = None  # monotonic time the watcher restarted the wall clock
    stopped: bool = False  # the watcher ended the run (the process group was killed)

    @property
    def signal(self) -> int | None:
        # bwrap, as the namespace's init, reports a signalled child as 128 + signal.
        if self.returncode < 0:
            return -self.returncode
        if self.returncode > 128:
            return self.returncode - 128
        return None


def available() -> bool:
    return all(shutil.which(tool) for tool in ("bwrap", "prlimit", "taskset"))


def _command(argv: Sequence[str], scratch: Path, *, writable: bool,
             ro_binds: Sequence[tuple[Path, str]], env: dict[str, str], tmp_mb: int) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
           "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for path in _SYSTEM_RO:
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    cmd += ["--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--dev", "/dev",
            "--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    for source, target in ro_binds:
        cmd += ["--ro-bind", str(source), target]
    cmd += ["--bind" if writable else "--ro-bind", str(scratch), "/scratch", "--chdir", "/scratch",
            "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "LC_ALL", "C",
            "--setenv", "TMPDIR", "/tmp"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    return [*cmd, "--", *argv]


# What a watcher of the extra pipe may answer for each chunk it is shown.
NEW_PHASE = "phase"  # restart the wall clock: the next phase has the full limit again
STOP = "stop"  # the outcome is known: kill the process group now
Watcher = Callable[[bytes], str | None]


def _prlimit(limits: Limits) -> list[str]:
    # util-linux prlimit rather than a preexec_fn: the service forks from several threads,
    # where preexec_fn is unsafe.
    mb = 1024 * 1024
    return ["prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--as={limits.address_space_mb * mb}", f"--fsize={limits.file_size_mb * mb}",
            f"--nofile={limits.open_files}", "--core=0", "--"]


def run(
    argv: Sequence[str],
    scratch: Path,
    limits: Limits,
    *,
    writable: bool = False,
    ro_binds: Sequence[tuple[Path, str]] = (),
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
    extra_pipe: bool = False,
    watch: Watcher | None = None,
    cpus: Sequence[int] | None = None,
) -> Outcome:
    """Run ``argv`` in the sandbox. With ``extra_pipe``, ``{fd}`` in argv becomes the number
    of a descriptor whose output is collected separately (Outcome.extra); ``watch`` is shown
    each chunk of it as it arrives and may restart the wall clock once (``NEW_PHASE``: a run
    of two phases, each with the full wall limit) or end the run (``STOP``). ``cpus``
    restricts the whole sandbox to those CPUs."""
    pass_fds: tuple[int, ...] = ()
    read_end = write_end = -1
    if extra_pipe:
        read_end, write_end = os.pipe()
        # A result frame (a whole matrix) fits at once: the writer need not wait for this
        # process to be scheduled and drain the pipe 64 KiB at a time.
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        pass_fds = (write_end,)
        argv = [arg.replace("{fd}", str(write_end)) for arg in argv]
    cmd = _prlimit(limits) + _command(argv, scratch, writable=writable, ro_binds=ro_binds,
                                      env=env or {}, tmp_mb=limits.tmp_mb)
    if cpus is not None:
        cmd = ["taskset", "--cpu-list", ",".join(str(c) for c in cpus), *cmd]

    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, pass_fds=pass_fds,
    )
    if extra_pipe:
        os.close(write_end)
    assert proc.stdin and proc.stdout and proc.stderr
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(stdin)
    proc.stdin.close()
    buffers: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray()}
    extra = bytearray()
    extra_times: list[tuple[int, float]] = []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    if extra_pipe:
        selector.register(read_end, selectors.EVENT_READ)
    deadline = started + limits.wall_s
    timed_out = stopped = False
    phase_started: float | None = None
    open_streams = len(selector.get_map())
    while open_streams and not stopped:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in selector.select(timeout=min(remaining, 0.5)):
            fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            if fd == read_end:
                extra += chunk
                extra_times.append((len(extra), time.monotonic()))
                if watch is not None:
                    try:
                        action = watch(chunk)
                    except BaseException:
                        kill_group(proc)
                        raise
                    if action == STOP:
                        stopped = True
                        break
                    if action == NEW_PHASE and phase_started is None:
                        phase_started = time.monotonic()
                        deadline = phase_started + limits.wall_s
            elif len(buffers[fd]) < OUTPUT_LIMIT:
                buffers[fd] += chunk[: OUTPUT_LIMIT - len(buffers[fd])]
    if timed_out or stopped:
        kill_group(proc)
    try:
        returncode = proc.wait(timeout=max(0.1, deadline - time.monotonic()) + 2)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        returncode = proc.wait()
    selector.close()
    proc.stdout.close()
    proc.stderr.close()
    if extra_pipe:
        os.close(read_end)
    return Outcome(returncode, bytes(buffers[out_fd]), bytes(buffers[err_fd]), timed_out,
                   time.monotonic() - started, bytes(extra), extra_times, phase_started,
                   stopped)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
