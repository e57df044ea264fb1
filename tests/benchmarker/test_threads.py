"""Threads that outlive a call: before it sends the next job (or the end), the parent counts
the harness process's threads from the host's /proc, where nothing in the sandbox can change
the figure, and a thread beyond the main one and OpenMP's pool fails the candidate.

The hostile kernels start their threads with raw clone system calls (inline asm), which the
source checks refuse; ``skip_checks`` runs the whole pipeline with the checks skipped, as if a
kernel had fooled them, so that what is tested is the run-time defence alone."""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcrl_benchmarker import gemm, runner, sandbox, steps
from hpcrl_benchmarker.pipeline import READY_ENV, Benchmarker
from hpcrl_benchmarker.steps import StepFailure
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec

from .conftest import HOST, kernel

Judge = Callable[..., Verdict]
# Fenced: without fences the extractor takes the lines of asm strings for prose.
FENCE = "```c\n{}```\n"
x86_64 = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the raw clone kernels are x86-64 assembly"
)


def skip_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, the real pipeline (gcc, sandbox, harness, OpenBLAS) runs without the
    source and object checks; a compile error still ends the candidate."""

    def compiled(
        preprocessed: str, listing: object, error: str, *args: object, **kwargs: object
    ) -> None:
        if error:
            raise StepFailure("compile_error", error)

    monkeypatch.setattr(steps, "check_source", lambda *args, **kwargs: None)
    monkeypatch.setattr(steps, "check_compiled", compiled)


@x86_64
def test_a_raw_thread_left_running_after_the_call_fails(
    judge: Judge, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = FENCE.format(kernel("raw_clone_thread.c"))
    # The rules already refuse the way in...
    checked = judge(code)
    assert checked.status == "library_violation" and "assembly" in checked.error
    # ...and the run refuses the thread itself. Its C is right and never changes after the
    # call (the thread only spins), so only the thread count tells.
    skip_checks(monkeypatch)
    verdict = judge(code)
    assert verdict.status == "verification_error", verdict.error
    assert "still running after the call returned" in verdict.error
    assert "256x256x256" in verdict.error  # the first call, at the reward size
    assert "time" not in verdict.durations_s  # stopped before its next inputs existed


@x86_64
def test_a_raw_thread_joined_within_the_call_is_allowed(
    judge: Judge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decided: a thread that ends before the call returns is part of the call, like an
    # OpenMP team: its work was timed and it can touch nothing afterwards.
    skip_checks(monkeypatch)
    verdict = judge(FENCE.format(kernel("raw_clone_joined.c")))
    assert verdict.status == "success", verdict.error
    assert verdict.generalizes is True


def test_openmp_kernels_stay_within_the_limit(judge: Judge) -> None:
    verdict = judge(kernel("ikj_omp.c"))
    assert verdict.status == "success", verdict.error


# Teams of every size, every call: nested teams (started and ended within the region), a
# smaller team than the pool (libgomp lets the surplus threads go), then the full team (it
# starts new ones, and the call returns with the pool at the limit). None of it may leave
# more threads than OMP_THREAD_LIMIT allows.
VARIED_TEAMS = """#include <omp.h>
#include <string.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    omp_set_max_active_levels(2);
    #pragma omp parallel num_threads(2)
    {
        #pragma omp parallel num_threads(2)
        {
            volatile double spin = omp_get_thread_num();
            (void)spin;
        }
    }
    #pragma omp parallel for num_threads(2)
    for (int i = 0; i < M; i++) memset(&C[(size_t)i * N], 0, sizeof(double) * N);
    #pragma omp parallel for
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) {
            double a = A[i * K + k];
            for (int j = 0; j < N; j++) C[i * N + j] += a * B[k * N + j];
        }
}
"""


def test_openmp_teams_that_shrink_regrow_and_nest_succeed(
    bench: Benchmarker, task: TaskSpec
) -> None:
    # Four OpenMP threads (on however many CPUs there are): a pool of three workers that the
    # kernel shrinks and grows again in every call.
    four = Benchmarker(bench.settings.model_copy(update={"threads": 4}), HOST)
    assert four.harness_env()["OMP_THREAD_LIMIT"] == "4"
    verdict = four.evaluate(VARIED_TEAMS, stage=6, opt_level="O3", task=task)
    assert verdict.status == "success", verdict.error


def test_the_threads_of_the_sandboxed_command_are_counted(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    # Three threads besides the main one, then a line on the extra pipe: the watcher counts.
    code = (
        "import os, sys, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True)"
        ".start()\n"
        "os.write(int(sys.argv[1]), b'ready')\ntime.sleep(30)\n"
    )
    counter = runner.ThreadCount(limit=2, grace_s=0.05)
    seen: list[int] = []

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply:
        seen.append(counter.stray())
        return sandbox.Reply(stop=True)

    spec = sandbox.Spec(scratch, sandbox.Limits(wall_s=20, cpu_s=20), extra_pipe=True)
    sandbox.run(
        ["/usr/bin/python3", "-c", code, "{fd}"], spec, watch=watch, started=counter.started
    )
    assert seen == [2]  # four threads, two allowed
    # A process that has ended has no threads left.
    assert counter.stray() == 0


class Counts(runner.ThreadCount):
    """The process's thread counts in turn (the last one repeats), instead of /proc's."""

    def __init__(self, *counts: int) -> None:
        super().__init__(limit=2, grace_s=0.05)
        self.counts = list(counts)

    def _count(self) -> int:
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def test_threads_over_the_limit_get_a_grace_to_end() -> None:
    assert Counts(2).stray() == 0
    assert Counts(3, 3, 2).stray() == 0  # libgomp's surplus threads, ending
    assert Counts(5).stray() == 3  # still there when the grace is over
    assert Counts(0).stray() == 0  # the process has ended


JOBS = [gemm.Job("v", {"M": 2, "N": 3, "K": 2}, 1), gemm.Job("t", {"M": 2, "N": 3, "K": 2}, 2)]


def _complete(talk: runner.Conversation, job: int) -> sandbox.Reply | None:
    """One call as the harness reports it; the parent's reply to its last message."""
    nonce, now = talk.nonce, 1_000_000 * (job + 1)
    c = np.zeros(6, dtype="<f8").tobytes()
    talk.on_event(sandbox.MARK, gemm.MARK.pack(nonce, job, gemm.MARK_BEGIN, now, 0), now)
    talk.on_event(sandbox.MARK, gemm.MARK.pack(nonce, job, gemm.MARK_RESULT, now + 9, 6), now + 10)
    talk.on_event(sandbox.DATA, c, now + 20)
    return talk.on_event(sandbox.MARK, gemm.MARK.pack(nonce, job, gemm.MARK_CHECK, 0, 0), now + 30)


def test_a_thread_left_running_ends_the_run_before_the_next_job() -> None:
    talk = runner.Conversation(JOBS, 0, None, Counts(2))
    talk.opening()
    reply = _complete(talk, 0)
    assert reply is not None and reply.send == gemm.job_line(JOBS[1]) and not reply.stop
    assert talk.frames[0].stray_threads == 0

    talk = runner.Conversation(JOBS, 0, None, Counts(3))
    talk.opening()
    reply = _complete(talk, 0)
    assert reply is not None and reply.stop and reply.send == b""  # job 1 is never sent
    [frame] = talk.frames
    assert frame.stray_threads == 1
    expected = gemm.Expected(
        (np.zeros(1, np.intp), np.zeros(1, np.intp)), np.zeros(1), np.ones(1), gemm.NAMES
    )
    assert "still running after the call returned" in steps.frame_message(frame, expected, 1e-6)


# --- issue 27, class 1: at a stage that forbids OpenMP, no thread at all ---------------------


@pytest.mark.parametrize("name", ["hidden_pthread_create.c", "hidden_gomp_parallel.c"])
def test_threads_reached_without_a_symbol_are_a_stage_violation(judge: Judge, name: str) -> None:
    # Both were a success at stage 1 before: pthread_create and GOMP_parallel found from
    # malloc's address through libc's symbol table and dl_iterate_phdr, names built at run
    # time, so the source and object checks saw nothing but malloc.
    verdict = judge(kernel(name), stage=1)
    assert verdict.status == "stage_violation", verdict.error
    assert "tried to create a thread" in verdict.error
    assert "256x256x256" in verdict.error  # refused at its first call


def test_the_same_thread_is_allowed_where_openmp_is(judge: Judge) -> None:
    # Joined within its call, as an OpenMP team is: at stage 4 it is a kernel like another.
    verdict = judge(kernel("hidden_pthread_create.c"), stage=4)
    assert verdict.status == "success", verdict.error


@x86_64
def test_a_raw_clone_is_refused_where_openmp_is_forbidden(
    judge: Judge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The seccomp filter is the boundary, not the checks: with them skipped, a raw clone
    # system call at stage 3 kills the process, and the verdict says why.
    skip_checks(monkeypatch)
    verdict = judge(FENCE.format(kernel("raw_clone_joined.c")), stage=3)
    assert verdict.status == "stage_violation", verdict.error
    assert "tried to create a thread" in verdict.error


def test_the_harness_environment_at_a_stage_without_threads(bench: Benchmarker) -> None:
    env = bench.harness_env(threads=False)
    assert env["OMP_NUM_THREADS"] == "1" and env["HPCRL_NO_THREADS"] == "1"
    assert "HPCRL_NO_THREADS" not in bench.harness_env()


# --- issue 27, class 2: no thread works outside its call ------------------------------------


@pytest.mark.parametrize("stage", [4, 6])
def test_a_worker_left_in_an_open_openmp_region_is_refused(judge: Judge, stage: int) -> None:
    # Its first call opens a region with GOMP_parallel_start, never closes it and puts back
    # the main thread's libgomp state: omp_in_parallel() reads false and the thread count is
    # the pool's. The worker waits for the next job's seed and computes C before the clock
    # starts: every C right, a success before (3-64 GFLOPS against 4-7 for ikj_omp.c here).
    verdict = judge(kernel("precompute_next_call.c"), stage=stage)
    assert verdict.status == "stage_violation", verdict.error
    assert "worked outside its calls" in verdict.error
    assert "before run 2 of 4 (255x257x129)" in verdict.error  # its first chance
    assert "time" not in verdict.durations_s  # never timed


def test_a_raw_thread_in_the_place_of_a_pool_thread_is_refused(
    bench: Benchmarker, task: TaskSpec
) -> None:
    # Four OpenMP threads: a team of two lets libgomp's surplus pool threads go, and a thread
    # made with pthread_create (found from malloc's address) takes the place of one, so the
    # count stays within OMP_THREAD_LIMIT. It works ahead of each call like the one above.
    four = Benchmarker(bench.settings.model_copy(update={"threads": 4}), HOST)
    code = "#define RAW_THREAD 1\n" + kernel("precompute_next_call.c")
    verdict = four.evaluate(code, stage=4, opt_level="O3", task=task)
    assert verdict.status == "stage_violation", verdict.error
    assert "worked outside its calls" in verdict.error


# Honest: a buffer kept from call to call (packing B transposed), with and without OpenMP.
PACKED = """#include <stdlib.h>
static double *packed;
static size_t room;
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    size_t need = (size_t)K * N;
    if (need > room) {
        free(packed);
        packed = malloc(need * sizeof(double));
        room = need;
    }
    for (int k = 0; k < K; k++)
        for (int j = 0; j < N; j++) packed[(size_t)j * K + k] = B[(size_t)k * N + j];
    PRAGMA
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[(size_t)i * K + k] * packed[(size_t)j * K + k];
            C[(size_t)i * N + j] = s;
        }
}
"""


@pytest.mark.parametrize(
    ("pragma", "stage"),
    [("", 1), ('_Pragma("omp parallel for")', 4), ('_Pragma("omp parallel for")', 6)],
)
def test_honest_kernels_with_threads_or_a_kept_buffer_succeed(
    judge: Judge, pragma: str, stage: int
) -> None:
    verdict = judge(PACKED.replace("PRAGMA", pragma), stage=stage)
    assert verdict.status == "success", verdict.error
    assert verdict.generalizes is True


def test_ikj_omp_succeeds_at_stage_4(judge: Judge) -> None:
    verdict = judge(kernel("ikj_omp.c"), stage=4)
    assert verdict.status == "success", verdict.error


def test_a_thread_rule_broken_at_an_extra_size_is_final(judge: Judge) -> None:
    # Threads only at the sizes that decide `generalizes`: a stage violation there is the
    # verdict, not a note (the timing runs, at the reward size alone, would make none).
    code = kernel("hidden_pthread_create.c").replace(
        "    char name[32];\n",
        "    char name[32];\n    if (M == 256) {\n"
        "        struct part all = {A, B, C, M, N, K, 0, M};\n"
        "        rows(&all);\n        return;\n    }\n",
        1,
    )
    assert code != kernel("hidden_pthread_create.c")
    verdict = judge(code, stage=1)
    assert verdict.status == "stage_violation", verdict.error
    assert "255x257x129" in verdict.error


def test_harness_runs_hand_shake_and_idle_threads_sleep(
    bench: Benchmarker, task: TaskSpec, tmp_path: Path
) -> None:
    env = bench.harness_env()
    assert env["OMP_WAIT_POLICY"] == "passive" and env["GOMP_SPINCOUNT"] == "0"
    assert READY_ENV not in env  # the bench's bare floor answers no READY
    spec = bench.start_run(tmp_path, task, two_phases=True)
    spec.cancel()
    assert spec.spec.env[READY_ENV] == "1"


def test_the_other_threads_cpu_time_is_read_from_outside(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    # A thread that sleeps, then works 40 ms and ends; the main thread reports before and
    # after. A thread that has ended still counts (the process's CPU clock keeps its time).
    code = (
        "import os, sys, threading, time\n"
        "def work():\n"
        "    time.sleep(0.2)\n"
        "    end = time.thread_time() + 0.04\n"
        "    while time.thread_time() < end: pass\n"
        "t = threading.Thread(target=work)\n"
        "t.start()\n"
        "os.write(int(sys.argv[1]), b'a')\n"
        "t.join()\n"
        "time.sleep(0.1)\n"
        "os.write(int(sys.argv[1]), b'b')\n"
        "time.sleep(30)\n"
    )
    counter = runner.ThreadCount(limit=2)
    idle = runner.IdleThreads(counter)
    used: list[int | None] = []

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        if payload == b"a":
            idle.baseline()
            used.append(idle.used())  # nothing yet: the thread sleeps
            return None
        used.append(idle.used())
        return sandbox.Reply(stop=True)

    spec = sandbox.Spec(scratch, sandbox.Limits(wall_s=20, cpu_s=20), extra_pipe=True)
    sandbox.run(
        ["/usr/bin/python3", "-c", code, "{fd}"], spec, watch=watch, started=counter.started
    )
    assert used[0] is not None and used[0] <= runner.IDLE_LIMIT_NS
    assert used[1] is not None and used[1] >= 30_000_000, used


def test_a_busy_main_thread_is_not_counted_as_another_threads_work() -> None:
    # The main thread runs throughout (it fills inputs between calls); the other thread
    # sleeps. Read one clock after the other, a tick of the main thread landing between the
    # two reads used to put up to 4 ms on the sleeping thread's account.
    code = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "while True: pass\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)
        moves = []
        for _ in range(1000):
            first = runner._others_cpu_ns(process.pid)
            second = runner._others_cpu_ns(process.pid)
            assert first is not None and second is not None
            moves.append(abs(second - first))
        assert max(moves) <= runner.IDLE_LIMIT_NS, max(moves)
    finally:
        process.kill()
        process.wait()


class Used(runner.IdleThreads):
    """The other threads' CPU time, as given, instead of /proc's."""

    def __init__(self, used: int) -> None:
        super().__init__(runner.ThreadCount(limit=2))
        self.value = used

    def baseline(self) -> None:
        pass

    def used(self) -> int | None:
        return self.value


def _mark(
    talk: runner.Conversation, job: int, kind: int, value: int = 0, count: int = 0, at: int = 0
) -> sandbox.Reply | None:
    return talk.on_event(sandbox.MARK, gemm.MARK.pack(talk.nonce, job, kind, value, count), at)


def test_a_call_begins_only_after_the_go() -> None:
    talk = runner.Conversation(JOBS, 0, None, Counts(2), idle=Used(0))
    talk.opening()
    reply = _mark(talk, 0, gemm.MARK_READY, at=100)
    assert reply is not None and reply.send == gemm.GO_LINE and reply.marks_after_data
    _mark(talk, 0, gemm.MARK_BEGIN, 200, at=210)
    _mark(talk, 0, gemm.MARK_RESULT, 300, 6, at=310)
    talk.on_event(sandbox.DATA, np.zeros(6, dtype="<f8").tobytes(), 320)
    reply = _mark(talk, 0, gemm.MARK_CHECK, at=330)
    # The next job's line; its READY must be read as it comes.
    assert reply is not None and reply.send == gemm.job_line(JOBS[1])
    assert not reply.marks_after_data
    assert talk.frames[0].go_ns > 0
    # A BEGIN before its READY, or before the go, is tampering.
    assert _mark(talk, 1, gemm.MARK_BEGIN, 400, at=410) == sandbox.Reply(stop=True)
    assert "out of order" in talk.tampered
    talk = runner.Conversation(JOBS, 0, None, Counts(2), idle=Used(0))
    talk.opening()
    talk.reader.mark(gemm.MARK.pack(talk.nonce, 0, gemm.MARK_READY, 0, 0), 100)
    with pytest.raises(gemm.ProtocolError, match="before its go"):
        talk.reader.mark(gemm.MARK.pack(talk.nonce, 0, gemm.MARK_BEGIN, 200, 0), 210)


def test_a_start_before_the_go_is_a_tampered_timing() -> None:
    frame = gemm.Frame(
        0,
        0,
        np.zeros((1, 1)),
        t0_ns=1_000_000,
        t1_ns=2_000_000,
        sent_ns=500_000,
        go_ns=900_000,
        begin_ns=1_000_100,
        result_ns=2_000_100,
    )
    assert frame.timing_problem() == ""
    early = dataclasses.replace(frame, go_ns=1_200_000)
    assert "not between the job's dispatch" in early.timing_problem()


def test_work_between_calls_stops_the_run_before_the_call() -> None:
    talk = runner.Conversation(JOBS, 0, None, Counts(2), idle=Used(runner.IDLE_LIMIT_NS + 1))
    talk.opening()
    # The first call: no kernel code has run before it, nothing to read.
    reply = _mark(talk, 0, gemm.MARK_READY, at=100)
    assert reply is not None and reply.send == gemm.GO_LINE
    _mark(talk, 0, gemm.MARK_BEGIN, 200, at=210)
    _mark(talk, 0, gemm.MARK_RESULT, 300, 6, at=310)
    talk.on_event(sandbox.DATA, np.zeros(6, dtype="<f8").tobytes(), 320)
    _mark(talk, 0, gemm.MARK_CHECK, at=330)
    reply = _mark(talk, 1, gemm.MARK_READY, at=400)
    assert reply == sandbox.Reply(stop=True)  # no go: the call never begins
    assert "worked outside its calls" in talk.worked_outside
    failure = runner.run_failure(sandbox.Outcome(-9, b"", b"", False, 0.1, stopped=True), talk, 8.0)
    assert failure is not None and failure.status == "stage_violation"
