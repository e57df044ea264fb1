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
import functools
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_SYSTEM_RO = (
    "/usr/bin",
    "/usr/lib",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/include",
    "/etc/ld.so.cache",
)
OUTPUT_LIMIT = 256 * 1024  # bytes of stdout/stderr kept; the rest is drained and dropped
# A timed-out command whose threads (summed) waited for a CPU through more than STARVED_WAIT
# of its wall limit and ran for less than STARVED_SHARE of it was starved (Schedule.starved).
# Beside vLLM on 2 cores, 4 correct runs of 100 timed out having run 0.03-0.11 s and waited
# 6.8-8.0 s of their 8 s.
STARVED_WAIT, STARVED_SHARE = 0.5, 0.25
PIPE_SIZE = 1024 * 1024  # the default /proc/sys/fs/pipe-max-size for unprivileged users


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: int
    address_space_mb: int = 4096
    file_size_mb: int = 64
    open_files: int = 64
    tmp_mb: int = 64


@dataclass(frozen=True)
class Spec:
    """Everything about one sandboxed run but its command: what it sees, what it may use,
    and the channels it reports on."""

    scratch: Path  # mounted at /scratch, the working directory
    limits: Limits
    writable: bool = False  # the scratch dir: writable while compiling, read-only while running
    ro_binds: tuple[tuple[Path, str], ...] = ()  # more read-only binds: (host path, target)
    env: Mapping[str, str] = field(default_factory=dict)  # on top of PATH, LC_ALL, TMPDIR
    cpus: tuple[int, ...] | None = None  # confine the whole sandbox to these CPUs
    # ``{fd}`` in argv becomes a descriptor whose output is collected apart (Outcome.extra;
    # a watcher is shown it instead).
    extra_pipe: bool = False
    # ``{marks}`` in argv becomes a message socket; the host's kernel stamps each message.
    marks: bool = False
    # As the watcher's Reply field, from the start.
    marks_after_data: bool = False
    # With it, the wall limit runs from the process's first mark or output, and until then
    # the sandbox may take this long to start (namespaces, mounts, exec: seconds on a node
    # whose cores are saturated, which is no fault of the command's). Needs ``marks`` or
    # output that the command sends before its own work begins.
    start_limit_s: float | None = None


@dataclass(frozen=True)
class Schedule:
    """What a sandbox's threads got of the CPUs, summed over every thread alive when read
    (the host kernel's /proc/<tid>/schedstat, read from outside the sandbox)."""

    cpu_s: float  # on a CPU
    # Runnable, but waiting for a CPU (run-queue delay), up to each thread's last time on a
    # CPU: the kernel adds a wait when it ends, so one still going on is not in it yet.
    waiting_s: float
    threads: int

    def text(self) -> str:
        return (
            f"its {self.threads} threads: {self.cpu_s:.2f} s on a CPU, "
            f"{self.waiting_s:.2f} s waiting for one"
        )

    def starved(self, limit_s: float) -> bool:
        """The threads waited for a CPU through most of the limit and ran for little of it:
        other work had the CPUs, so the time limit says nothing about the command. Its own
        threads cannot make this so: whatever they spin on is time on a CPU, and a sleeping
        or blocked thread does not wait for one."""
        return self.waiting_s > STARVED_WAIT * limit_s and self.cpu_s < STARVED_SHARE * limit_s


@dataclass
class Outcome:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    wall_s: float
    extra: bytes = b""  # what the process wrote on the extra pipe, if requested (no watcher)
    phase_started: float | None = None  # monotonic time the watcher restarted the wall clock
    stopped: bool = False  # the watcher ended the run (the process group was killed)
    start_s: float | None = None  # from the start to the first mark or output, if any came
    never_started: bool = False  # Spec.start_limit_s passed with no mark or output at all
    schedule: Schedule | None = None  # read as the wall limit passed (timed out runs only)

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


def run(
    argv: Sequence[str],
    spec: Spec,
    *,
    stdin: bytes = b"",
    watch: Watcher | None = None,
    started: Callable[[int], None] | None = None,
) -> Outcome:
    """Run ``argv`` in the sandbox that ``spec`` describes. ``watch`` is shown every chunk of
    the extra pipe and every mark as they arrive, and may send more input (stdin then stays
    open until the run ends), restart the wall clock once (a run of two phases, each with
    the full wall limit) or end the run. ``started`` gets the host pid of the sandbox's root
    process (bubblewrap; ``command_process`` finds the command under it) before any input."""
    return start(argv, spec).run(stdin=stdin, watch=watch, started=started)


def start(argv: Sequence[str], spec: Spec) -> Pending:
    """Set the sandbox up now and hold its command back until ``Pending.run``: bubblewrap
    builds the namespaces and mounts, then waits on a pipe (--block-fd) before it executes
    ``argv``, which need not exist yet. A run started ahead (the harness's, during the
    compile) costs its caller no set-up time when it is needed."""
    return Pending(argv, spec)


class Pending:
    """A sandbox set up (or being set up) whose command has not begun. ``run`` lets it
    begin; ``cancel`` (or leaving it as a context manager unrun) kills it unrun."""

    def __init__(self, argv: Sequence[str], spec: Spec) -> None:
        self.spec = spec
        self.channels = _Channels(spec)
        hold, self._go = os.pipe()
        try:
            self.proc = subprocess.Popen(
                command(self.channels.argv(argv), spec, block_fd=hold),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(*self.channels.pass_fds, hold),
            )
        except BaseException:
            os.close(self._go)
            self.channels.close_child_ends()
            self.channels.close()
            raise
        finally:
            os.close(hold)
        self.channels.close_child_ends()
        self._done = False

    def run(
        self,
        *,
        stdin: bytes = b"",
        watch: Watcher | None = None,
        started: Callable[[int], None] | None = None,
    ) -> Outcome:
        """``sandbox.run`` for this sandbox: the wall limit (or the start limit) runs from
        now, not from its set-up."""
        if self._done:
            raise RuntimeError("this sandbox has already run or was cancelled")
        self._done = True
        began = time.monotonic()
        with contextlib.suppress(OSError):  # bubblewrap ended in its set-up: the outcome says
            os.write(self._go, b"g")
        os.close(self._go)
        if started is not None:
            started(self.proc.pid)
        session = _Session(self.proc, self.channels, self.spec, watch, began)
        session.start(stdin)
        session.pump()
        return session.finish()

    def cancel(self) -> None:
        """Kill the sandbox unrun (a no-op once it has run). Killed before the pipe it waits
        on closes: an end of file would let it go on."""
        if self._done:
            return
        self._done = True
        kill_group(self.proc)
        self.proc.wait()
        os.close(self._go)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.channels.close()

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def command_process(root: int) -> tuple[int, int] | None:
    """The host pid of the command that a sandbox runs, and its parent's, seen from outside
    (where nothing in the sandbox can change what /proc says); None once it has ended.

    ``root`` is bubblewrap (taskset and prlimit exec it); with a PID namespace it forks the
    namespace's init, which forks the command: each has one child, and the command, which
    may not fork (the harness's seccomp), has none."""
    parent, pid = 0, root
    for _ in range(4):  # bubblewrap, its init, the command: one level to spare
        children = _children(pid)
        if not children:
            return None if pid == root else (pid, parent)
        if len(children) > 1:
            # Not the layout above: better no run than a count of the wrong process.
            raise RuntimeError(f"sandbox process {pid} has several children {children}")
        parent, pid = pid, children[0]
    raise RuntimeError(f"the sandbox's process tree under {root} is deeper than expected")


def thread_count(pid: int, parent: int) -> int:
    """The threads of process ``pid`` now (the kernel's own count, read at once); 0 when it
    has ended, or when ``pid`` is no longer a child of ``parent`` (its number was reused)."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return 0
    try:
        text = os.read(fd, 1 << 16)  # ~1.5 KB; one read renders it all
    except ProcessLookupError:
        return 0
    finally:
        os.close(fd)
    found = _STATUS.search(text)
    if found is None:
        raise RuntimeError(f"/proc/{pid}/status has no PPid or Threads line")
    return int(found["threads"]) if int(found["ppid"]) == parent else 0


# Called after every call of a run: one read and one search (~15 us) rather than a dict of
# every line (~50 us).
_STATUS = re.compile(rb"\nPPid:\s*(?P<ppid>\d+)\n.*?\nThreads:\s*(?P<threads>\d+)\n", re.S)


def process_cpu_ns(pid: int) -> int | None:
    """CPU time of every thread that process ``pid`` has had, those that ended included, in
    ns (its CPU-time clock, read from outside: nothing in the process can change it); None
    once it has ended. A thread on a CPU as this is read is counted up to its last tick or
    switch (up to a few ms behind); a sleeping or waiting one exactly."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the process
    except OSError:
        return None


def thread_cpu_ns(pid: int, tid: int) -> int | None:
    """CPU time of thread ``tid`` of ``pid`` in ns (its schedstat; behind like
    ``process_cpu_ns`` while it is on a CPU); None once it has ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as stat:
            return int(stat.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def unsettled_threads(pid: int) -> list[int]:
    """The threads of ``pid`` whose CPU time, read from the host, may not be up to date: those
    running or waiting for a CPU (state R), and, where the kernel tells, those that have
    just begun to sleep but are still on their CPU. A thread's state reads S from the moment
    it decides to sleep, but the time it ran since its last tick is added only when it
    leaves the CPU; until then its wait channel reads "0" (the kernel gives one only for a
    task off its run queue)."""
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
    wchan = _wait_channels_shown()
    unsettled = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                text = stat.read()
            # "tid (comm) state ...": comm may hold anything but its last ')'
            running = text[text.rindex(b")") + 2 :][:1] == b"R"
            if not running and wchan:
                with open(f"/proc/{pid}/task/{tid}/wchan", "rb") as channel:
                    running = channel.read().strip() in (b"", b"0")
        except OSError:
            continue  # ended
        if running:
            unsettled.append(tid)
    return unsettled


@functools.cache
def _wait_channels_shown() -> bool:
    """Whether this kernel names a sleeping thread's wait channel to us (it may show "0" for
    every thread: no symbols, or no right to see them); if not, only the state is read."""
    asleep = threading.Event()
    waiter = threading.Thread(target=asleep.wait, args=(5.0,), daemon=True)
    waiter.start()
    try:
        for _ in range(200):
            path = f"/proc/self/task/{waiter.native_id}/wchan"
            try:
                with open(path, "rb") as channel:
                    if channel.read().strip() not in (b"", b"0"):
                        return True
            except OSError:
                return False
            time.sleep(0.001)
        return False
    finally:
        asleep.set()
        waiter.join()


def schedule(root: int) -> Schedule | None:
    """The CPU time and run-queue wait of every thread of ``root`` and its descendants;
    None when the tree could not be walked (a process ended meanwhile)."""
    cpu_ns = waiting_ns = threads = 0
    try:
        pids = _tree(root)
    except (OSError, ValueError):
        return None
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as stat:
                    on_cpu, waited, _slices = stat.read().split()
            except (OSError, ValueError):
                continue  # ended meanwhile (or unreadable: the figure is for information)
            cpu_ns, waiting_ns = cpu_ns + int(on_cpu), waiting_ns + int(waited)
            threads += 1
    return Schedule(cpu_ns / 1e9, waiting_ns / 1e9, threads)


def _tree(root: int) -> list[int]:
    pids, level = [], [root]
    while level:
        pids += level
        level = [child for pid in level for child in _children(pid)]
    return pids


def _children(pid: int) -> list[int]:
    try:
        # The children of its main thread: bubblewrap and its init have no other.
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        if Path(f"/proc/{pid}").exists():
            return _children_by_scan(pid)  # a kernel without CONFIG_PROC_CHILDREN
        return []


def _children_by_scan(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # "pid (comm) state ppid ...": comm may hold anything but its last ')'
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            children.append(int(entry.name))
    return sorted(children)


def command(argv: Sequence[str], spec: Spec, block_fd: int | None = None) -> list[str]:
    """The whole command line: CPU set, rlimits, then bubblewrap around ``argv`` (held back
    until ``block_fd`` has data, if given)."""
    cmd = prlimit_argv(spec.limits) + bwrap_argv(argv, spec, block_fd)
    if spec.cpus is not None:
        cmd = ["taskset", "--cpu-list", ",".join(str(c) for c in spec.cpus), *cmd]
    return cmd


def prlimit_argv(limits: Limits) -> list[str]:
    # util-linux prlimit rather than a preexec_fn: the service forks from several threads,
    # where preexec_fn is unsafe.
    mb = 1024 * 1024
    return [
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.address_space_mb * mb}",
        f"--fsize={limits.file_size_mb * mb}",
        f"--nofile={limits.open_files}",
        "--core=0",
        "--",
    ]


def bwrap_argv(argv: Sequence[str], spec: Spec, block_fd: int | None = None) -> list[str]:
    cmd = [
        "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    for path in _SYSTEM_RO:
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    cmd += [
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--symlink",
        "usr/bin",
        "/bin",
        "--dev",
        "/dev",
        "--size",
        str(spec.limits.tmp_mb * 1024 * 1024),
        "--tmpfs",
        "/tmp",
    ]
    for source, target in spec.ro_binds:
        cmd += ["--ro-bind", str(source), target]
    cmd += [
        "--bind" if spec.writable else "--ro-bind",
        str(spec.scratch),
        "/scratch",
        "--chdir",
        "/scratch",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin",
        "--setenv",
        "LC_ALL",
        "C",
        "--setenv",
        "TMPDIR",
        "/tmp",
    ]
    for key, value in spec.env.items():
        cmd += ["--setenv", key, value]
    if block_fd is not None:
        cmd += ["--block-fd", str(block_fd)]
    return [*cmd, "--", *argv]


class _Channels:
    """The extra pipe and the mark socket of a run, when its spec asks for them."""

    def __init__(self, spec: Spec) -> None:
        self.read_end = self.write_end = -1
        self.marks: socket.socket | None = None
        self._mark_child: socket.socket | None = None
        if spec.extra_pipe:
            self.read_end, self.write_end = os.pipe()
            # A result (a whole matrix) fits at once: the writer need not wait for this
            # process to be scheduled and drain the pipe 64 KiB at a time.
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        if spec.marks:
            self.marks, self._mark_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.marks.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            self.marks.setblocking(False)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        fds = [self.write_end] if self.write_end >= 0 else []
        return (*fds, *([self._mark_child.fileno()] if self._mark_child else []))

    def argv(self, argv: Sequence[str]) -> list[str]:
        argv = list(argv)
        if self.write_end >= 0:
            argv = [arg.replace("{fd}", str(self.write_end)) for arg in argv]
        if self._mark_child is not None:
            argv = [arg.replace("{marks}", str(self._mark_child.fileno())) for arg in argv]
        return argv

    def close_child_ends(self) -> None:
        """The child has its copies now; ours would keep the pipe from ever ending."""
        if self.write_end >= 0:
            os.close(self.write_end)
        if self._mark_child is not None:
            self._mark_child.close()

    def close(self) -> None:
        if self.read_end >= 0:
            os.close(self.read_end)
        if self.marks is not None:
            self.marks.close()


class _Session:
    """One running sandbox: reads its output within the wall limit, shows the watcher each
    event and does what it replies, and collects the outcome."""

    def __init__(
        self,
        proc: subprocess.Popen,
        channels: _Channels,
        spec: Spec,
        watch: Watcher | None,
        started: float,
    ) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc, self.channels, self.spec, self.watch = proc, channels, spec, watch
        self.started = started
        self.deadline = started + (
            spec.limits.wall_s if spec.start_limit_s is None else spec.start_limit_s
        )
        self.begun: float | None = None  # when the first mark or output came
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.buffers: dict[int, bytearray] = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.extra = bytearray()
        self.selector = selectors.DefaultSelector()
        self.timed_out = self.stopped = False
        self.schedule: Schedule | None = None
        self.phase_started: float | None = None
        self.stdin_open = False
        self.marks_open = channels.marks is not None
        self.marks_paused = False
        self.open_pipes = 0

    def start(self, stdin: bytes) -> None:
        self.stdin_open = _send(self.proc, stdin)
        if self.watch is None:
            _close_stdin(self.proc)
        assert self.proc.stdout and self.proc.stderr
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.selector.register(self.proc.stderr, selectors.EVENT_READ)
        if self.channels.read_end >= 0:
            self.selector.register(self.channels.read_end, selectors.EVENT_READ)
        if self.channels.marks is not None:
            self.selector.register(self.channels.marks, selectors.EVENT_READ)
        # Until the first mark, marks are read as they come: it starts the wall clock. (That
        # wakes this process once, as the first call begins: a verification or warm-up
        # call, unless a task has no warm-up runs and a re-timing run starts timed.)
        self.pause_marks(
            self.spec.marks_after_data and self.stdin_open and self.spec.start_limit_s is None
        )
        self.open_pipes = len(self.selector.get_map()) - (self.marks_open and not self.marks_paused)

    def pump(self) -> None:
        """Read until every channel is closed, the watcher stops the run or time is up."""
        while (self.open_pipes or self.marks_open) and not self.stopped:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                self.schedule = schedule(self.proc.pid)
                return
            if not self.open_pipes:
                self.pause_marks(False)  # the process has closed every pipe: only marks left
            for key, _ in self.selector.select(timeout=min(remaining, 0.5)):
                if self.stopped:
                    break
                if key.fileobj is self.channels.marks:
                    self.read_marks()
                    continue
                # Whatever the process writes, the marks it sent first are read first. It has
                # begun: a first mark read now must not pause the marks (the data is here).
                self.begin()
                self.pause_marks(False)
                self.read_marks()
                if self.stopped:
                    break
                self.read_pipe(key)

    def begin(self) -> None:
        """The process's first mark or output: the wall limit runs from now."""
        if self.begun is not None:
            return
        self.begun = time.monotonic()
        if self.spec.start_limit_s is not None:
            self.deadline = self.begun + self.spec.limits.wall_s

    def read_pipe(self, key: selectors.SelectorKey) -> None:
        fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
        chunk = os.read(fd, 1 << 20)
        self.begin()
        if not chunk:
            self.selector.unregister(key.fileobj)
            self.open_pipes -= 1
            return
        if fd == self.channels.read_end:
            if self.watch is None:
                self.extra += chunk
            else:  # it keeps what it needs: a second copy of every matrix would cost ~1 ms
                self.show(DATA, chunk, time.monotonic_ns())
        elif len(self.buffers[fd]) < OUTPUT_LIMIT:
            self.buffers[fd] += chunk[: OUTPUT_LIMIT - len(self.buffers[fd])]

    def pause_marks(self, pause: bool) -> None:
        marks = self.channels.marks
        if marks is None or not self.marks_open or pause == self.marks_paused:
            return
        if pause:
            self.selector.unregister(marks)
        else:
            self.selector.register(marks, selectors.EVENT_READ)
        self.marks_paused = pause

    def read_marks(self) -> None:
        marks = self.channels.marks
        if marks is None or not self.marks_open:
            return
        messages = _receive_marks(marks)
        if messages and self.begun is None:
            self.begin()
            if self.spec.start_limit_s is not None:
                # Read early only to see the start: from now on, as the spec asks. (Without
                # a start limit they were never read early, and this read follows data.)
                self.pause_marks(self.spec.marks_after_data and self.stdin_open)
        if messages is None:
            self.pause_marks(False)
            self.selector.unregister(marks)
            self.marks_open = False
        for payload, at_ns in messages or ():
            if self.watch is not None and not self.stopped:
                self.show(MARK, payload, at_ns)

    def show(self, channel: str, payload: bytes, at_ns: int) -> None:
        assert self.watch is not None
        try:
            reply = self.watch(channel, payload, at_ns)
        except BaseException:
            kill_group(self.proc)
            raise
        if reply is not None:
            self.react(reply)

    def react(self, reply: Reply) -> None:
        if reply.stop:
            self.stopped = True
            return
        if reply.new_phase and self.phase_started is None:
            self.phase_started = time.monotonic()
            self.deadline = self.phase_started + self.spec.limits.wall_s
        if reply.send and self.stdin_open:
            self.stdin_open = _send(self.proc, reply.send)
            self.pause_marks(reply.marks_after_data)

    def finish(self) -> Outcome:
        """Kill what must not go on, reap the process, close every channel."""
        proc = self.proc
        if self.timed_out or self.stopped:
            kill_group(proc)
        _close_stdin(proc)
        try:
            returncode = proc.wait(timeout=max(0.1, self.deadline - time.monotonic()) + 2)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            kill_group(proc)
            returncode = proc.wait()
        self.selector.close()
        assert proc.stdout and proc.stderr
        proc.stdout.close()
        proc.stderr.close()
        self.channels.close()
        return Outcome(
            returncode,
            bytes(self.buffers[self.out_fd]),
            bytes(self.buffers[self.err_fd]),
            self.timed_out,
            time.monotonic() - self.started,
            bytes(self.extra),
            self.phase_started,
            self.stopped,
            None if self.begun is None else self.begun - self.started,
            self.timed_out and self.begun is None and self.spec.start_limit_s is not None,
            self.schedule,
        )


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
