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
import socket
import struct
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


@dataclass(frozen=True)
class Reply:
    """What a watcher answers for each event it is shown."""

    stop: bool = False  # the outcome is known: kill the process group now
    new_phase: bool = False  # restart the wall clock: the next phase has the full limit again
    send: bytes = b""  # write this to the process's stdin (kept open while a watcher runs)
    # Read no marks until the process writes data (or ends): while a timed call runs, this
    # process must not wake up on a core the kernel's threads are using. The marks keep
    # their kernel timestamps and are read, in order, before that data.
    marks_after_data: bool = False


DATA, MARK = "data", "mark"
# (channel, payload, time in ns on CLOCK_MONOTONIC): for DATA, when this process read the
# chunk; for MARK, when the host's kernel queued the message (SO_TIMESTAMPNS), which no delay
# of this process can move.
Watcher = Callable[[str, bytes, int], "Reply | None"]
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_MARK_SIZE = 4096


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
    marks: bool = False,
    watch: Watcher | None = None,
    cpus: Sequence[int] | None = None,
    marks_after_data: bool = False,
) -> Outcome:
    """Run ``argv`` in the sandbox. With ``extra_pipe``, ``{fd}`` in argv becomes the number
    of a descriptor whose output is collected separately (Outcome.extra); with ``marks``,
    ``{marks}`` becomes a message socket whose messages are timestamped by the host's kernel.
    ``watch`` is shown every chunk of the extra pipe and every mark as they arrive, and may
    send more input (stdin then stays open until the run ends), restart the wall clock once
    (a run of two phases, each with the full wall limit) or end the run. ``cpus`` restricts
    the whole sandbox to those CPUs. ``marks_after_data``: as the watcher's Reply field, from the
    start."""
    pass_fds: list[int] = []
    read_end = write_end = -1
    if extra_pipe:
        read_end, write_end = os.pipe()
        # A result (a whole matrix) fits at once: the writer need not wait for this process
        # to be scheduled and drain the pipe 64 KiB at a time.
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        pass_fds.append(write_end)
        argv = [arg.replace("{fd}", str(write_end)) for arg in argv]
    mark_parent: socket.socket | None = None
    mark_child: socket.socket | None = None
    if marks:
        mark_parent, mark_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mark_parent.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        mark_parent.setblocking(False)
        pass_fds.append(mark_child.fileno())
        argv = [arg.replace("{marks}", str(mark_child.fileno())) for arg in argv]
    cmd = _prlimit(limits) + _command(argv, scratch, writable=writable, ro_binds=ro_binds,
                                      env=env or {}, tmp_mb=limits.tmp_mb)
    if cpus is not None:
        cmd = ["taskset", "--cpu-list", ",".join(str(c) for c in cpus), *cmd]

    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, pass_fds=tuple(pass_fds),
    )
    if extra_pipe:
        os.close(write_end)
    if mark_child is not None:
        mark_child.close()
    assert proc.stdin and proc.stdout and proc.stderr
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    stdin_open = _send(proc, stdin)
    if watch is None:
        _close_stdin(proc)
    buffers: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray()}
    extra = bytearray()
    extra_times: list[tuple[int, float]] = []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    if extra_pipe:
        selector.register(read_end, selectors.EVENT_READ)
    if mark_parent is not None:
        selector.register(mark_parent, selectors.EVENT_READ)
    deadline = started + limits.wall_s
    timed_out = stopped = False
    phase_started: float | None = None
    marks_open = mark_parent is not None
    marks_paused = False

    def pause_marks(pause: bool) -> None:
        nonlocal marks_paused
        if mark_parent is None or not marks_open or pause == marks_paused:
            return
        if pause:
            selector.unregister(mark_parent)
        else:
            selector.register(mark_parent, selectors.EVENT_READ)
        marks_paused = pause

    def read_marks() -> None:
        nonlocal marks_open
        if mark_parent is None or not marks_open:
            return
        messages = _receive_marks(mark_parent)
        if messages is None:
            pause_marks(False)
            selector.unregister(mark_parent)
            marks_open = False
        for payload, at_ns in messages or ():
            if watch is not None and not stopped:
                show(MARK, payload, at_ns)

    def react(reply: Reply | None) -> None:
        nonlocal stopped, phase_started, deadline, stdin_open
        if reply is None:
            return
        if reply.stop:
            stopped = True
            return
        if reply.new_phase and phase_started is None:
            phase_started = time.monotonic()
            deadline = phase_started + limits.wall_s
        if reply.send and stdin_open:
            stdin_open = _send(proc, reply.send)
            pause_marks(reply.marks_after_data)

    def show(channel: str, payload: bytes, at_ns: int) -> None:
        assert watch is not None
        try:
            reply = watch(channel, payload, at_ns)
        except BaseException:
            kill_group(proc)
            raise
        react(reply)

    pause_marks(marks_after_data and stdin_open)
    open_pipes = len(selector.get_map()) - (marks_open and not marks_paused)
    while (open_pipes or marks_open) and not stopped:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        if not open_pipes:
            pause_marks(False)  # the process has closed every pipe: only marks are left
        for key, _ in selector.select(timeout=min(remaining, 0.5)):
            if stopped:
                break
            if key.fileobj is mark_parent:
                read_marks()
                continue
            # Whatever the process writes, the marks it sent first are read first.
            pause_marks(False)
            read_marks()
            if stopped:
                break
            fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                selector.unregister(key.fileobj)
                open_pipes -= 1
                continue
            if fd == read_end:
                extra += chunk
                extra_times.append((len(extra), time.monotonic()))
                if watch is not None:
                    show(DATA, chunk, time.monotonic_ns())
            elif len(buffers[fd]) < OUTPUT_LIMIT:
                buffers[fd] += chunk[: OUTPUT_LIMIT - len(buffers[fd])]
    if timed_out or stopped:
        kill_group(proc)
    _close_stdin(proc)
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
    if mark_parent is not None:
        mark_parent.close()
    return Outcome(returncode, bytes(buffers[out_fd]), bytes(buffers[err_fd]), timed_out,
                   time.monotonic() - started, bytes(extra), extra_times, phase_started,
                   stopped)


def _send(proc: subprocess.Popen, data: bytes) -> bool:
    """Write to the process's stdin; False once it can take no more (it closed or died)."""
    assert proc.stdin
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
        return False
    return True


def _close_stdin(proc: subprocess.Popen) -> None:
    assert proc.stdin
    with contextlib.suppress(BrokenPipeError, OSError):
        proc.stdin.close()


def _receive_marks(sock: socket.socket) -> list[tuple[bytes, int]] | None:
    """Every queued message with its kernel timestamp converted to CLOCK_MONOTONIC ns; None
    when the other end is closed (and nothing is left)."""
    messages: list[tuple[bytes, int]] = []
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(_MARK_SIZE, socket.CMSG_SPACE(16))
        except (BlockingIOError, InterruptedError):
            return messages
        except OSError:
            return messages or None
        if not data and not ancillary:
            return messages or None
        # The stamp is CLOCK_REALTIME; the offset to CLOCK_MONOTONIC is read now, a moment
        # after it (both clocks are slewed alike; only a step would move the offset).
        offset = time.time_ns() - time.monotonic_ns()
        stamp = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(payload) >= 16:
                seconds, nanos = struct.unpack_from("qq", payload)
                stamp = seconds * 1_000_000_000 + nanos - offset
        # No stamp (cannot happen on Linux): the arrival is no earlier than now.
        messages.append((data, stamp if stamp is not None else time.monotonic_ns()))


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
