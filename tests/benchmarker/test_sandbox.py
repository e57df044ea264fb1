"""The sandbox and the harness's seccomp policy on their own, without the source checks."""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl_benchmarker import build, gemm, sandbox
from hpcrl_benchmarker.pipeline import Benchmarker, Events
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.task import TaskSpec

from .conftest import kernel

LIMITS = sandbox.Limits(wall_s=20, cpu_s=20)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    return path


def test_host_files_are_invisible_and_untouchable(scratch: Path, tmp_path: Path) -> None:
    marker = tmp_path / "outside" / "marker"
    marker.parent.mkdir()
    script = (
        f"echo pwned > {marker}; echo pwned > /usr/bin/pwned; cat /etc/passwd; "
        "ls /home /root /work /proc/1 2>&1; echo done > /scratch/inside"
    )
    outcome = sandbox.run(["/bin/sh", "-c", script], sandbox.Spec(scratch, LIMITS, writable=True))
    assert not marker.exists() and not Path("/usr/bin/pwned").exists()
    assert b"root:" not in outcome.stdout
    assert (scratch / "inside").read_text() == "done\n"  # the scratch dir is the way out


def test_scratch_is_read_only_when_running(scratch: Path) -> None:
    outcome = sandbox.run(
        ["/bin/sh", "-c", "echo x > /scratch/f; echo y > /tmp/f && cat /tmp/f"],
        sandbox.Spec(scratch, LIMITS),
    )
    assert not (scratch / "f").exists()
    assert outcome.stdout == b"y\n"


def test_no_network(scratch: Path) -> None:
    code = (
        "import socket\ntry:\n socket.create_connection(('127.0.0.1', 5672), timeout=2)\n"
        " print('connected')\nexcept OSError as e:\n print('refused', e)"
    )
    outcome = sandbox.run(["/usr/bin/python3", "-c", code], sandbox.Spec(scratch, LIMITS))
    assert b"refused" in outcome.stdout, outcome.stderr


def test_wall_limit_kills_the_whole_group(scratch: Path) -> None:
    started = time.monotonic()
    outcome = sandbox.run(
        ["/bin/sh", "-c", "sleep 100 & sleep 100 & wait"],
        sandbox.Spec(scratch, sandbox.Limits(wall_s=1, cpu_s=5)),
    )
    assert outcome.timed_out and time.monotonic() - started < 10


def test_a_timed_out_run_tells_its_cpu_time_from_its_wait_for_a_cpu(scratch: Path) -> None:
    """What the sandbox reads as the wall limit passes: its threads' time on a CPU and their
    run-queue wait, which only other load on the same CPUs makes (sleeping makes neither);
    a run that mostly waited is starved (the runner hands such a candidate back)."""
    cpu = min(os.sched_getaffinity(0))
    limits = sandbox.Limits(wall_s=1.5, cpu_s=10)
    spin = ["/bin/sh", "-c", "echo go; while :; do :; done"]
    # The wall limit runs from the first output, past the sandbox's start.
    spec = sandbox.Spec(scratch, limits, cpus=(cpu,), start_limit_s=30)

    alone = sandbox.run(spin, spec).schedule
    asleep = sandbox.run(["/bin/sh", "-c", "echo go; sleep 10"], spec).schedule
    # Each hog in a session of its own, as the sandbox is: where the kernel schedules by
    # session first (autogroup), three hogs in this one would together get only half.
    hogs = [
        subprocess.Popen(
            ["taskset", "-c", str(cpu), *spin], stdout=subprocess.DEVNULL, start_new_session=True
        )
        for _ in range(11)
    ]
    try:
        crowded = sandbox.run(spin, spec).schedule
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert alone and asleep and crowded
    # A spinner is always runnable: on a CPU or waiting for one. (A wait still going on is
    # not counted yet: the kernel adds it when the thread next gets a CPU.)
    assert alone.cpu_s + alone.waiting_s > 0.8 * limits.wall_s, alone
    assert asleep.cpu_s < 0.2 and asleep.waiting_s < 0.2, asleep
    # Twelve spinners share the CPU: the sandbox's gets about a twelfth of it. It was
    # starved; neither the spinner alone (it ran) nor the sleeper (it never waited) was.
    assert crowded.waiting_s > 2 * crowded.cpu_s, crowded
    assert alone.cpu_s > 2 * crowded.cpu_s, (alone, crowded)
    assert crowded.starved(limits.wall_s), crowded
    assert not alone.starved(limits.wall_s) and not asleep.starved(limits.wall_s)


def test_a_sandbox_set_up_ahead_runs_its_command_only_when_told(
    scratch: Path, tmp_path: Path
) -> None:
    """``start`` sets the sandbox up with its command held back: the command may appear in
    the scratch directory later (the harness, during the compile), and the wall limit runs
    from ``run``, not from the set-up. One cancelled never runs its command."""
    writable = sandbox.Spec(scratch, sandbox.Limits(wall_s=1, cpu_s=5), writable=True)
    with sandbox.start(["/bin/sh", "./later.sh"], writable) as pending:
        time.sleep(1.5)  # longer than the wall limit: the set-up is not charged
        (scratch / "later.sh").write_text("echo ran > /scratch/ran; echo done\n")
        outcome = pending.run()
        with pytest.raises(RuntimeError, match="already run"):
            pending.run()
    assert outcome.returncode == 0 and not outcome.timed_out, outcome
    assert outcome.stdout == b"done\n" and (scratch / "ran").read_text() == "ran\n"
    assert outcome.wall_s < 1

    (scratch / "ran").unlink()
    for wait_s in (0.0, 0.2):  # cancelled mid-set-up, and blocked
        with sandbox.start(["/bin/sh", "./later.sh"], writable) as pending:
            time.sleep(wait_s)
        # Cancelled unrun: its command never starts, now that the pipe it waited on is shut.
        time.sleep(0.3)
        assert not (scratch / "ran").exists()
        assert pending.proc.returncode is not None
        with pytest.raises(RuntimeError, match="cancelled"):
            pending.run()


def test_file_size_limit(scratch: Path) -> None:
    limits = sandbox.Limits(wall_s=20, cpu_s=20, file_size_mb=1)
    sandbox.run(
        ["/bin/sh", "-c", "head -c 5000000 /dev/zero > /scratch/big"],
        sandbox.Spec(scratch, limits, writable=True),
    )
    assert (scratch / "big").stat().st_size <= 1024 * 1024


ESCAPES = """#define _GNU_SOURCE
#include <stdio.h>
#include <unistd.h>
#include <sys/mman.h>
/* Compiled straight into the harness (no source or symbol checks) to test the seccomp
 * policy: each attempt that succeeds spoils the result. */
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int escaped = 0;
    pid_t child = fork();
    if (child == 0) _exit(0);
    escaped += child > 0;
    escaped += fopen("/tmp/x", "w") != NULL;
    escaped += mmap(0, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS,
                    -1, 0) != MAP_FAILED;
    /* The executable's own pages (its read-only GOT among them) stay as they are: no
     * mprotect, no mapping placed over or next to them, no mremap to a fixed address. */
    extern char __executable_start[];
    char *page = (char *)((unsigned long)&matmul_optimized & ~4095ul);
    escaped += mprotect(page, 4096, PROT_READ | PROT_WRITE) == 0;
    escaped += mprotect(__executable_start, 4096, PROT_READ | PROT_WRITE) == 0;
    escaped += mmap(__executable_start - 4096, 4096, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED;
    void *heap = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    escaped += heap == MAP_FAILED;  /* ordinary anonymous memory still works */
    escaped += mremap(heap, 8192, 4096, MREMAP_MAYMOVE | MREMAP_FIXED, page) != MAP_FAILED;
    escaped += mprotect(heap, 4096, PROT_READ) != 0;  /* and so does mprotect outside */
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s + escaped;
        }
}
"""


def test_harness_seccomp_blocks_processes_files_and_executable_memory(
    bench: Benchmarker, task: TaskSpec, scratch: Path
) -> None:
    compiled = bench.compile(scratch, ESCAPES, task, task.compile_flags("O1"), Events())
    assert compiled.error == ""
    jobs = [gemm.Job("v", {"M": 16, "N": 8, "K": 4}, secrets.randbits(63))]
    run = bench.run(scratch, task, jobs, Events())
    assert run.failure is None, run.failure
    a, b = gemm.inputs(jobs[0].sizes, jobs[0].seed)
    c = run.frames[0].output
    assert gemm.check(c, gemm.reference(a, b), a, b, [(0, 0), (15, 7)], 1e-9) == ""


def test_a_kernel_cannot_name_the_files_its_compile_writes(
    tmp_path: Path, bench: Benchmarker, task: TaskSpec
) -> None:
    """gcc -E (whose output the checks read) and gcc -c run side by side on the kernel. Had
    it named a file one of them writes (``__has_include``), a kernel could preprocess one
    way for the checks and another for the compiler. Every name seen in one compile's
    directory, and the fixed names once used, are unknown to the next compile's gcc."""
    first = tmp_path / "first"
    first.mkdir()
    assert (
        bench.compile(first, kernel("naive.c"), task, task.compile_flags("O3"), Events()).error
        == ""
    )
    names = {p.name for p in first.iterdir()} - {build.KERNEL_FILE}
    names |= {"kernel.i", "kernel.o", "cc.txt", "cpp.txt"}
    probes = "".join(
        f'#if __has_include("{where}{name}")\n#error "sees {name}"\n#endif\n'
        for name in sorted(names)
        for where in ("", "/scratch/")
    )
    # The probe works: the kernel's own file is there.
    probes += '#if !__has_include("kernel.c")\n#error "__has_include sees nothing"\n#endif\n'
    second = tmp_path / "second"
    second.mkdir()
    compiled = bench.compile(
        second, probes + kernel("naive.c"), task, task.compile_flags("O3"), Events()
    )
    assert compiled.error == "", compiled.error


def test_the_compile_clock_starts_once_its_sandbox_has(
    scratch: Path, bench: Benchmarker, task: TaskSpec
) -> None:
    """The compile script's first output starts its time limit, so a sandbox slow to start
    (a saturated node) is not a compile_error; one that never starts is the benchmarker's
    failure, handed back."""
    (scratch / build.KERNEL_FILE).write_text(kernel("naive.c"))
    harness = bench.harness_object(task)
    spec = build.spec(scratch, task, harness, 4096)
    assert spec.start_limit_s == build.START_LIMIT_S
    outcome = sandbox.run(
        [
            "/bin/sh",
            "-c",
            build.script(
                task.compile.compiler, task.compile_flags("O3"), harness, build.Outputs.of(scratch)
            ),
        ],
        spec,
    )
    assert outcome.returncode == 0, outcome.stderr
    assert outcome.start_s is not None and outcome.start_s < outcome.wall_s
    assert outcome.stdout.decode().split() == [build.STARTED]
    stalled = dataclasses.replace(
        outcome, returncode=-9, timed_out=True, never_started=True, start_s=None
    )
    with pytest.raises(InternalError, match="did not start"):
        build.result(stalled, scratch, task)
