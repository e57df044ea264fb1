"""A task's performance reference on this node: its OpenBLAS routine timed as a kernel is.

``Benchmarker.reference(task)`` runs this module as a child process under the node's timing
lock, on the CPUs and with the threads a kernel gets: OpenBLAS picks its kernels once, when
it loads, from the CPU model, and on virtual machines that hide the model it falls back to
old generic ones; the child names the core type for the host's ISA (``OPENBLAS_CORETYPE``)
before it loads, and its worker threads end with it. Every call gets fresh inputs and a
fresh output, filled just before the call as the harness fills a kernel's (so a memory-bound
routine finds its inputs in the caches a kernel finds them in); three untimed calls, then
the median of ``runs`` timed ones, on one thread and on the kernel's threads, of which the
faster counts (OpenBLAS's threads wait for each other actively: on a node whose other work
takes a core, its team of all the cores was seen 5x slower than one thread). Between calls
OpenBLAS's workers sleep, as a kernel's OpenMP team must (the harness sees no thread run
between calls): by default they would spin on for 2**28 cycles, through the next call's
fill, and each timed call would start with a team already awake that no kernel can have
(``IDLE_WORKERS_SLEEP``). The CPU time the workers spend between calls is measured and
reported with the figure. For a
memory-bound task the bandwidth it reaches (the harness's bytes moved per call over the
time) comes beside its GFLOPS.

The memory-bound tasks (GEMV, the stencil, SpMV) are also measured against the node's memory
bandwidth, the roof a streaming kernel can reach: STREAM's triad, a[j] = b[j] + s c[j]
(``triad.c``, compiled here with the tasks' flags), three arrays of at least 4x the
last-level cache and 64 MiB each (STREAM's rule), one untimed pass and then ``runs`` timed
ones, on one thread and on the kernel's threads, on the kernel's CPUs and under the same lock.
Bytes per pass as STREAM counts them: 24 per element (b and c read, a written; the write-
allocate read of a is not counted, as the tasks' bytes-moved figures do not count it
either). The figure is STREAM's: the best pass of the faster thread count.

    python -m hpcrl_benchmarker.reference <harness> '<sizes as JSON>' <runs> <threads,...> <cpus>
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl_benchmarker import harnesses
from hpcrl_benchmarker.host import openblas_coretype
from hpcrl_common.task import Sizes, TaskSpec

WARMUP_CALLS = 3
TIMEOUT_S = 120.0
# 2**4 cycles, OpenBLAS's least busy-wait: its idle workers go to sleep at once and the next
# call wakes them, as every call of a kernel wakes its team (OMP_WAIT_POLICY=passive).
IDLE_WORKERS_SLEEP = {"OPENBLAS_THREAD_TIMEOUT": "4"}


@dataclass(frozen=True)
class Reference:
    routine: str  # cblas_dgemm, cblas_dgemv, ...
    sizes: Sizes
    gflops: float  # the task's FLOPs over the median call
    gbytes_per_s: float | None  # the harness's bytes moved over the median call
    median_s: float
    runs_s: list[float]
    core: str  # OpenBLAS's kernels (its core name)
    threads: int  # OpenBLAS threads of the faster measurement
    # CPU time its worker threads had between two timed calls, the most of any gap of either
    # thread count (about 0 when they slept through every fill, as a kernel's team must)
    workers_between_calls_ns: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        bandwidth = f", {self.gbytes_per_s:.1f} GB/s" if self.gbytes_per_s is not None else ""
        return (
            f"OpenBLAS {self.routine} {self.gflops:.2f} GFLOPS{bandwidth} ({self.core} "
            f"kernels, {self.threads} thread{'s' if self.threads != 1 else ''}, median "
            f"of {len(self.runs_s)} calls, this node, now)"
        )


@dataclass(frozen=True)
class Triad:
    """The node's memory bandwidth, measured now: STREAM's triad (module docstring)."""

    gbytes_per_s: float  # STREAM's figure: 24 n bytes over the fastest pass
    median_gbytes_per_s: float  # over the median pass
    elements: int  # per array
    runs_s: list[float]  # the timed passes of the faster thread count
    threads: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        mib = self.elements * 8 / 2**20
        return (
            f"STREAM triad {self.gbytes_per_s:.1f} GB/s (best of {len(self.runs_s)} passes, "
            f"median {self.median_gbytes_per_s:.1f}; 3 arrays of {mib:.0f} MiB, "
            f"{self.threads} thread{'s' if self.threads != 1 else ''}, this node, now)"
        )


@dataclass(frozen=True)
class References:
    """A task's performance references on this node, now: its OpenBLAS routine (matmul,
    gemv) and, for a memory-bound task (gemv, stencil, spmv), the memory bandwidth."""

    openblas: Reference | None
    triad: Triad | None

    def to_json(self) -> dict[str, Any]:
        return {
            "openblas": None if self.openblas is None else self.openblas.to_json(),
            "triad": None if self.triad is None else self.triad.to_json(),
        }


class ReferenceUnavailable(RuntimeError):
    pass


TRIAD_MIN_BYTES = 64 * 2**20  # per array
TRIAD_MAX_BYTES = 2**30


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), 0 where the kernel does not say."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        scale = units.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return largest


def triad_elements() -> int:
    """Elements per array: STREAM's rule (4x the last-level cache), at least 64 MiB and at
    most 1 GiB per array."""
    wanted = max(4 * last_level_cache_bytes(), TRIAD_MIN_BYTES)
    return min(wanted, TRIAD_MAX_BYTES) // 8


def time_triad(
    *,
    compiler: str,
    flags: list[str],
    env: dict[str, str],
    threads: int,
    cpus: list[int],
    runs: int = 10,
) -> Triad:
    """STREAM's triad on ``cpus`` with one thread and with ``threads`` (module docstring);
    the faster counts. ``env`` is the harness's (OpenMP waiting and binding). The caller
    holds the timing lock."""
    elements = triad_elements()
    counts = sorted({1, threads})
    with tempfile.TemporaryDirectory(prefix="hpcrl-triad-") as scratch:
        source = Path(scratch) / "triad.c"
        source.write_text((resources.files("hpcrl_benchmarker") / "triad.c").read_text())
        binary = Path(scratch) / "triad"
        try:
            subprocess.run(
                [compiler, *flags, str(source), "-o", str(binary)],
                check=True,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            argv = [str(binary), str(elements), str(runs), ",".join(map(str, counts))]
            if cpus and shutil.which("taskset"):
                argv = ["taskset", "--cpu-list", ",".join(map(str, cpus)), *argv]
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env={**os.environ, **env, "OMP_THREAD_LIMIT": str(max(counts))},
            )
        except subprocess.CalledProcessError as exc:
            raise ReferenceUnavailable(f"the triad did not compile: {exc.stderr[-500:]}") from None
        except subprocess.TimeoutExpired:
            raise ReferenceUnavailable(f"the triad did not finish within {TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        raise ReferenceUnavailable(
            f"the triad failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
        )
    measured = json.loads(done.stdout)["runs_s"]
    timed = {int(n): [float(r) for r in runs_s] for n, runs_s in measured.items()}
    best = min(timed, key=lambda n: min(timed[n]))
    moved = 24.0 * elements
    return Triad(
        gbytes_per_s=moved / min(timed[best]) / 1e9,
        median_gbytes_per_s=moved / statistics.median(timed[best]) / 1e9,
        elements=elements,
        runs_s=timed[best],
        threads=best,
    )


def time_reference(task: TaskSpec, *, threads: int, cpus: list[int], runs: int = 9) -> Reference:
    """The task's reference at its reward size, timed in a child process on ``cpus`` with
    one thread and with ``threads`` (module docstring); the faster counts. The caller holds
    the timing lock."""
    harness = harnesses.for_task(task)
    sizes = task.sizes.reward
    core = openblas_coretype()
    env = {
        **os.environ,
        "OPENBLAS_NUM_THREADS": str(threads),
        **({"OPENBLAS_CORETYPE": core} if core else {}),
        **IDLE_WORKERS_SLEEP,
    }
    counts = sorted({1, threads})
    argv = [
        sys.executable,
        "-m",
        "hpcrl_benchmarker.reference",
        harness.name,
        json.dumps(sizes),
        str(runs),
        ",".join(map(str, counts)),
        ",".join(map(str, cpus)),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise ReferenceUnavailable(
            f"{harness.routine} did not finish within {TIMEOUT_S:g} s"
        ) from None
    if done.returncode != 0:
        raise ReferenceUnavailable(
            f"{harness.routine} could not be timed: {done.stderr.strip()[-500:]}"
        )
    measured = json.loads(done.stdout)
    timed = {int(n): [float(r) for r in runs_s] for n, runs_s in measured["runs_s"].items()}
    best = min(timed, key=lambda n: statistics.median(timed[n]))
    median = statistics.median(timed[best])
    moved = harness.bytes_moved(sizes)
    return Reference(
        routine=harness.routine,
        sizes=dict(sizes),
        gflops=task.flop_count(sizes) / median / 1e9,
        gbytes_per_s=None if moved is None else moved / median / 1e9,
        median_s=median,
        runs_s=timed[best],
        core=measured["core"],
        threads=best,
        workers_between_calls_ns=max(
            gap for gaps in measured["workers_between_calls_ns"].values() for gap in gaps
        ),
    )


def _measure(name: str, sizes: Sizes, runs: int, counts: list[int]) -> dict[str, Any]:
    harness = harnesses.get(name)
    lib = harnesses.openblas()  # OPENBLAS_CORETYPE is in this process's environment
    lib.openblas_get_corename.restype = ctypes.c_char_p
    timed: dict[int, list[float]] = {}
    between: dict[int, list[int]] = {}
    for threads in counts:
        lib.openblas_set_num_threads(threads)
        runs_s = timed[threads] = []
        gaps = between[threads] = []
        for call in range(WARMUP_CALLS + runs):
            ended = workers_cpu_ns()
            # As the harness: fresh inputs (and their copies), a fresh NaN output, the call.
            inputs = harness.inputs(sizes, call + 1)
            copies = [np.copy(x) for x in inputs]
            out = np.full(harness.output_shape(sizes), np.nan)
            gap = max(workers_cpu_ns() - ended, 0)  # a worker that ended takes its time along
            started = time.perf_counter()
            harness.reference_into(inputs, out)
            seconds = time.perf_counter() - started
            del copies
            if call >= WARMUP_CALLS:
                runs_s.append(seconds)
                gaps.append(gap)
    return {
        "runs_s": timed,
        "workers_between_calls_ns": between,
        "core": lib.openblas_get_corename().decode(),
    }


def workers_cpu_ns() -> int:
    """CPU time every thread of this process but the calling one has had, in ns: a spinning
    worker's time counts, a sleeping one's does not. Each thread's own CPU-time clock, which
    the kernel brings up to date as it is read, even while the thread runs (its schedstat
    would lag by up to a tick, longer than a gap between calls)."""
    caller = threading.get_native_id()
    total = 0
    for entry in os.scandir("/proc/self/task"):
        tid = int(entry.name)
        if tid == caller:
            continue
        with contextlib.suppress(OSError):  # a thread that has just ended
            total += time.clock_gettime_ns(((~tid) << 3) | 6)  # CPUCLOCK_SCHED, per thread
    return total


def main(argv: list[str]) -> int:
    name, sizes, runs, counts, cpus = argv
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    print(
        json.dumps(
            _measure(name, json.loads(sizes), int(runs), [int(n) for n in counts.split(",")])
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
