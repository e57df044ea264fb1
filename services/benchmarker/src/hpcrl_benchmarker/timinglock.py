"""The timing locks: who may run a harness on which CPUs of the node at a time.

A replica with no CPU set (the default) times alone on the node: it holds the node's lock
file (``lock_path``) exclusively, as every replica did before CPU sets existed. A replica
with a CPU set holds the node's lock *shared* (so a whole-node replica still excludes it,
and it excludes a whole-node replica) and then one exclusive lock file per CPU of its set,
``<lock_path>.cpu<N>``, taken in ascending order. Two replicas whose sets share a CPU meet
on that CPU's file and take turns; replicas on disjoint sets time at once. One global order
(the node file, then the CPUs ascending) means no two replicas can each hold what the other
waits for, and every wait is bounded anyway (``timing_lock_timeout_s``, for the whole set).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hpcrl_benchmarker.steps import InternalError


def cpu_lock_path(lock_path: Path, cpu: int) -> Path:
    return lock_path.with_name(f"{lock_path.name}.cpu{cpu}")


def lock_files(lock_path: Path, cpus: Sequence[int]) -> list[tuple[Path, int]]:
    """(file, flock operation) in the order they are taken."""
    if not cpus:
        return [(lock_path, fcntl.LOCK_EX)]
    return [
        (lock_path, fcntl.LOCK_SH),
        *((cpu_lock_path(lock_path, cpu), fcntl.LOCK_EX) for cpu in sorted(set(cpus))),
    ]


class LockTimeout(Exception):
    """A lock stayed held past the timeout."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__(f"timing lock {path} still held after {timeout_s:g} s")
        self.path = path


@contextlib.contextmanager
def timing_locks(
    lock_path: Path,
    cpus: Sequence[int],
    timeout_s: float,
    *,
    waiting: Callable[[float], None] | None = None,
) -> Iterator[float]:
    """Hold the timing locks of ``cpus`` (none: the whole node); yields the seconds waited.

    Each lock is a fresh open file description, so threads of one process exclude each
    other too. ``waiting(started)`` is called (with the monotonic start of the wait) once the
    first lock turns out to be held by someone else. Raises LockTimeout when the whole set is
    not held within ``timeout_s``; InternalError for a lock file that is not ours.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    fds: list[int] = []
    try:
        for path, operation in lock_files(lock_path, cpus):
            fd = open_lock_file(path)
            fds.append(fd)
            while True:
                try:
                    fcntl.flock(fd, operation | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if waiting is not None:
                        waiting(started)
                    if time.monotonic() >= deadline:
                        raise LockTimeout(path, timeout_s) from None
                    time.sleep(0.05)
        yield time.monotonic() - started
    finally:
        for fd in reversed(fds):
            os.close(fd)


def open_lock_file(path: Path) -> int:
    """A timing lock's descriptor; the file is ours, mode 0600, never through a symlink."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise InternalError(
            f"timing lock {path} belongs to uid {info.st_uid}, not to this "
            f"service: anyone who owns it can stall every timing"
        )
    return fd
