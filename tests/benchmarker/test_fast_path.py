"""The cheaper paths keep every check: one readelf instead of nm, references computed ahead,
one harness process for verification and timing (two phases, each with its own limits), the
streamed result reader, pinned OpenMP threads."""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcrl_benchmarker import checks, cscan, gemm, runner, sandbox
from hpcrl_benchmarker.pipeline import Benchmarker, Events
from hpcrl_benchmarker.steps import InternalError
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.task import TaskSpec

from .conftest import HOST, KERNELS, kernel

Judge = Callable[..., Verdict]

# Every kind of symbol the object check cares about, in one object.
SYMBOLS = """#include <math.h>
#include <stddef.h>
static int local_state;
int common_sym;
__attribute__((weak)) int weak_def = 3;
extern int weak_ref __attribute__((weak));
static void *resolver(void) { return 0; }
void indirect(void) __attribute__((ifunc("resolver")));
__attribute__((constructor)) static void early(void) { local_state = 1; }
__attribute__((visibility("hidden"))) int hidden_fn(void) { return local_state + weak_ref; }
__attribute__((symver("malloc@GLIBC_2.2.5"))) void *versioned(size_t n) { (void)n; return 0; }
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    #pragma omp parallel for
    for (int i = 0; i < M; i++) C[i] = sqrt(A[i]) + B[i] + N + K;
}
"""


def _object(tmp_path: Path, name: str, code: str) -> Path:
    source = tmp_path / f"{name}.c"
    source.write_text(code)
    obj = tmp_path / f"{name}.o"
    done = subprocess.run(
        ["gcc", "-O2", "-march=native", "-fopenmp", "-fcommon", "-c", str(source), "-o", str(obj)],
        capture_output=True,
    )
    if done.returncode:
        pytest.skip(f"{name} does not compile on this host")
    return obj


@pytest.mark.parametrize("name", ["symbols", *sorted(p.stem for p in KERNELS.glob("*.c"))])
def test_readelf_reads_the_same_symbols_as_nm(tmp_path: Path, name: str) -> None:
    code = SYMBOLS if name == "symbols" else kernel(f"{name}.c")
    obj = _object(tmp_path, name, code)
    nm = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    elf = subprocess.run(
        ["readelf", "-S", "-s", "-W", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    nm_undefined, nm_defined = checks.parse_nm(nm)
    undefined, defined, unreadable = checks.parse_readelf_symbols(elf)
    assert unreadable == []
    assert sorted(undefined) == sorted(nm_undefined)

    def classes(pairs: list[tuple[str, str]]) -> dict[str, set[str]]:
        return {
            "ifunc": {n for k, n in pairs if k in "iI"},
            "global": {n for k, n in pairs if k.isupper() and k not in "iI"},
        }

    assert classes(defined) == classes(nm_defined)
    # And the same verdict on both inputs.
    sections = checks.parse_sections(elf)
    runtime = frozenset({"malloc", "free"})
    assert checks.object_violations(
        undefined, defined, sections, function="matmul_optimized", runtime_symbols=runtime
    ) == checks.object_violations(
        nm_undefined, nm_defined, sections, function="matmul_optimized", runtime_symbols=runtime
    )
    if name == "symbols":
        text = " | ".join(
            checks.object_violations(
                undefined, defined, sections, function="matmul_optimized", runtime_symbols=runtime
            )
        )
        assert "indirect" in text and ".init_array" in text and "malloc@GLIBC_2.2.5" in text


def test_unreadable_symbol_rows_fail_closed() -> None:
    text = (
        "Symbol table '.symtab' contains 2 entries:\n"
        "   Num:    Value          Size Type    Bind   Vis      Ndx Name\n"
        "     0: 0000000000000000     0 NOTYPE  LOCAL  DEFAULT  UND \n"
        "     1: garbled row\n"
    )
    undefined, defined, unreadable = checks.parse_readelf_symbols(text)
    assert unreadable == ["1: garbled row"] and undefined == [] and defined == []


@pytest.mark.parametrize(
    "directive",
    ['#line 1 "/usr/include/stdlib.h"', '# 7 "/usr/include/x.h" 1 3', '%: 3 "x.h"', "  #  line 9"],
)
def test_line_directives_are_refused(directive: str) -> None:
    code = (
        f"{directive}\nvoid matmul_optimized(double *A, double *B, double *C, int M, int N, "
        "int K) { C[0] = 0; }\n"
    )
    assert any("#line" in r for r in checks.source_violations(code))


def test_line_directive_cannot_hide_macro_made_simd(judge: Judge) -> None:
    # Without the refusal, the lines after the directive would look like a header's in the
    # preprocessor output and escape the stage check that reads it.
    code = '#define V(x) _mm256##x\n#line 1 "/usr/include/immintrin-extra.h"\n' + kernel(
        "naive.c"
    ).replace("double s = 0.0;", "double s = 0.0; V(_zeroall)();")
    verdict = judge(code, stage=2)
    assert verdict.status == "library_violation" and "#line" in verdict.error


def test_main_file_lines_ignores_fake_markers_inside_a_line() -> None:
    text = (
        '# 1 "kernel.c"\nint a;\fint b;\n# 1 "/usr/include/x.h" 1 3\nint hidden;\n'
        '# 4 "kernel.c" 2\nint c;\x1c# 1 "/usr/include/y.h"\nint d;'
    )
    kept = cscan.main_file_lines(text, "kernel.c")
    assert "hidden" not in kept
    assert all(name in kept for name in ("int a;", "int b;", "int c;", "int d;"))


def test_expected_points_match_the_full_check() -> None:
    job = gemm.Job("v", {"M": 37, "N": 29, "K": 41}, 12345)
    a, b = gemm.inputs(job.sizes, job.seed)
    ref = gemm.reference(a, b)
    expected = gemm.expect(job, 100, True, np.random.default_rng(3))
    assert len(expected.points[0]) == 105
    assert np.array_equal(expected.values, ref[expected.points[0], expected.points[1]])
    assert gemm.check_expected(ref.copy(), expected, 1e-6) == ""
    bad = ref.copy()
    i, j = int(expected.points[0][7]), int(expected.points[1][7])
    bad[i, j] += 1.0
    assert f"C[{i}][{j}]" in gemm.check_expected(bad, expected, 1e-6)
    bad = ref.copy()
    bad[0, 0] = np.nan
    assert "C[0][0] = nan" in gemm.check_expected(bad, expected, 1e-6)


def test_the_full_matrix_check_catches_what_the_sampled_points_miss() -> None:
    job = gemm.Job("v", {"M": 64, "N": 48, "K": 40}, 777)
    expected = gemm.expect(job, 100, True, np.random.default_rng(5))
    assert expected.full is not None
    sampled = set(zip(expected.points[0].tolist(), expected.points[1].tolist(), strict=True))
    wrong = [(i, j) for i in range(64) for j in range(48) if (i, j) not in sampled][:40]
    c = expected.full.copy()
    for i, j in wrong:
        c[i, j] = 0.0  # finite garbage where no point looks
    message = gemm.check_expected(c, expected, 1e-6)
    assert "40 of 3072 elements are wrong (full-matrix check" in message
    assert "105 check points passed" in message
    assert gemm.check_expected(expected.full.copy(), expected, 1e-6) == ""
    # A last-bit difference everywhere (another summation order) is fine.
    assert gemm.check_expected(expected.full * (1 + 1e-12), expected, 1e-6) == ""


def _mark(nonce: int, job: int, kind: int, value: int = 0, count: int = 0) -> bytes:
    return gemm.MARK.pack(nonce, job, kind, value, count)


def _feed_job(
    reader: gemm.RunReader, nonce: int, index: int, job: gemm.Job, start_ns: int
) -> list[gemm.Frame]:
    """One job as the harness sends it: sent, BEGIN, RESULT, C (in two chunks), CHECK."""
    count = job.sizes["M"] * job.sizes["N"]
    reader.sent(index, start_ns)
    c = np.arange(count, dtype="<f8").tobytes()
    done = reader.mark(_mark(nonce, index, gemm.MARK_BEGIN, start_ns + 10), start_ns + 20)
    done += reader.data(c[:8])  # C may be read before its RESULT mark
    done += reader.mark(
        _mark(nonce, index, gemm.MARK_RESULT, start_ns + 5000, count), start_ns + 5030
    )
    done += reader.data(c[8:])
    done += reader.mark(_mark(nonce, index, gemm.MARK_CHECK, 0), start_ns + 9000)
    return done


JOBS = [gemm.Job("v", {"M": 3, "N": 5, "K": 2}, 1), gemm.Job("t", {"M": 2, "N": 2, "K": 2}, 2)]


def test_run_reader_follows_the_protocol_and_keeps_the_clocks() -> None:
    reader = gemm.RunReader(99, JOBS)
    [first] = _feed_job(reader, 99, 0, JOBS[0], 1_000_000)
    assert first.output.shape == (3, 5) and first.output[2, 4] == 14.0
    assert (first.sent_ns, first.t0_ns, first.begin_ns) == (1_000_000, 1_000_010, 1_000_020)
    assert first.seconds == pytest.approx(4990e-9) and first.timing_problem() == ""
    [second] = _feed_job(reader, 99, 1, JOBS[1], 2_000_000)
    assert second.job == 1 and not reader.finished
    assert reader.mark(_mark(99, 2, gemm.MARK_END), 3_000_000) == [] and reader.finished
    with pytest.raises(gemm.ProtocolError, match="after the end"):
        reader.mark(_mark(99, 2, gemm.MARK_END), 3_000_001)


@pytest.mark.parametrize(
    "tamper, match",
    [
        (lambda r: r.mark(_mark(98, 0, gemm.MARK_BEGIN, 5), 6), "nonce"),
        (lambda r: r.mark(_mark(99, 0, gemm.MARK_BEGIN, 5)[:-1], 6), "size"),
        # a forged RESULT before the harness's own BEGIN, or a second BEGIN
        (lambda r: r.mark(_mark(99, 0, gemm.MARK_RESULT, 5, 15), 6), "order"),
        (
            lambda r: [
                r.mark(_mark(99, 0, gemm.MARK_BEGIN, 5), 6),
                r.mark(_mark(99, 0, gemm.MARK_BEGIN, 5), 6),
            ],
            "order",
        ),
        # a job the parent has not sent yet: its inputs cannot exist
        (lambda r: r.mark(_mark(99, 1, gemm.MARK_BEGIN, 5), 6), "order"),
        (lambda r: r.data(b"x" * (8 * 15 + 1)), "unexpected data"),
        (lambda r: r.mark(_mark(99, 0, gemm.MARK_END), 6), "end marker"),
    ],
)
def test_run_reader_rejects_forged_or_misordered_output(
    tamper: Callable[[gemm.RunReader], object], match: str
) -> None:
    reader = gemm.RunReader(99, JOBS)
    reader.sent(0, 1)
    with pytest.raises(gemm.ProtocolError, match=match):
        tamper(reader)


def test_a_forged_result_mark_cannot_replace_the_harness_s_own() -> None:
    reader = gemm.RunReader(99, JOBS)
    reader.sent(0, 0)
    reader.mark(_mark(99, 0, gemm.MARK_BEGIN, 10), 20)
    reader.mark(_mark(99, 0, gemm.MARK_RESULT, 30, 15), 40)  # forged early by the kernel
    with pytest.raises(gemm.ProtocolError, match="order"):
        reader.mark(_mark(99, 0, gemm.MARK_RESULT, 9_000_000, 15), 9_000_020)  # the real one


def _frame(**clocks: int) -> gemm.Frame:
    base = {
        "t0_ns": 1_000_000,
        "t1_ns": 31_000_000,
        "sent_ns": 0,
        "begin_ns": 1_000_010,
        "result_ns": 31_000_020,
    }
    return gemm.Frame(0, 0, np.zeros((1, 1)), **{**base, **clocks})


def test_reported_clocks_must_fit_the_stamps() -> None:
    honest = _frame()
    assert honest.timing_problem() == ""
    assert honest.effective_seconds() == pytest.approx(0.030)
    # start moved later than its own message was sent, or earlier than the job existed
    assert "start" in _frame(t0_ns=2_000_000).timing_problem()
    assert "start" in _frame(sent_ns=1_500_000).timing_problem()
    # end reported after its message, or before the start
    assert "end" in _frame(t1_ns=32_000_000).timing_problem()
    assert "end" in _frame(t1_ns=500_000).timing_problem()


def test_a_forged_early_end_counts_no_earlier_than_the_stamp_allows() -> None:
    # The call really returned at 31 ms (the RESULT stamp), a rewritten t1 claims 2 ms.
    forged = _frame(t1_ns=2_000_000)
    assert forged.timing_problem() == ""  # possible on its face...
    slack = gemm.END_SLACK_NS
    assert forged.effective_seconds() == pytest.approx((31_000_020 - slack - 1_000_000) / 1e9)
    assert forged.effective_seconds() >= 0.030 - slack / 1e9  # ...but gains at most the slack


def test_a_wrong_kernel_is_stopped_before_it_is_timed(judge: Judge) -> None:
    verdict = judge(kernel("wrong.c"))
    assert verdict.status == "verification_error"
    assert "verify" in verdict.durations_s and "time" not in verdict.durations_s


def test_a_crash_at_an_extra_size_still_gets_timed(judge: Judge) -> None:
    # Extra sizes decide `generalizes` only: the kernel is timed in a process of its own.
    code = kernel("naive.c").replace(
        "for (int i = 0; i < M; i++)",
        "if (N % 8) *(volatile int *)0 = 1;\n    for (int i = 0; i < M; i++)",
        1,
    )
    verdict = judge(code, stage=1)
    assert verdict.status == "success", verdict.error
    assert verdict.generalizes is False and "SIGSEGV" in verdict.error
    assert verdict.timing is not None and len(verdict.timing.runs_s) == 3


# Compiled straight into the harness (no checks): sleeps in every call of size 64.
SLEEPER = """#include <time.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    if (M == 64) { struct timespec t = {0, 500000000}; nanosleep(&t, 0); }
    for (int i = 0; i < M * N; i++) C[i] = 0;
}
"""


def test_each_phase_has_its_own_wall_limit(
    bench: Benchmarker, task: TaskSpec, scratch: Path
) -> None:
    assert bench.compile(scratch, SLEEPER, task, task.compile_flags("O1"), Events()).error == ""
    short = task.model_copy(update={"timing": task.timing.model_copy(update={"time_limit_s": 1.6})})
    slow, quick = {"M": 64, "N": 8, "K": 4}, {"M": 2, "N": 3, "K": 4}
    seen: list[int] = []

    def watch(frame: gemm.Frame) -> bool:
        seen.append(frame.job)
        return False

    # 1 s of sleep per phase: each fits 1.6 s, both together do not.
    jobs = [
        gemm.Job("v", slow, 1),
        gemm.Job("v", quick, 2),
        gemm.Job("v", slow, 3),
        gemm.Job("t", slow, 4),
        gemm.Job("t", slow, 5),
    ]
    run = bench.run(scratch, short, jobs, Events(), verify_runs=3, watch=watch)
    assert run.failure is None, run.failure
    assert len(run.frames) == 5 and seen == [0, 1, 2] and run.phase_started is not None
    assert run.wall_s > 1.6
    # A second phase over its own limit is a timeout, reported within that phase.
    jobs = jobs[:3] + [gemm.Job("t", slow, 6 + i) for i in range(4)]
    run = bench.run(scratch, short, jobs, Events(), verify_runs=3)
    assert run.failure is not None and run.failure.status == "timeout"
    assert "of 4 (64x8x4)" in run.failure.error


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    path.chmod(0o777)
    return path


def test_threads_pinned_and_restricted_to_their_cpus(
    bench: Benchmarker, task: TaskSpec, tmp_path: Path, scratch: Path
) -> None:
    def make(**kwargs: object) -> Benchmarker:
        return Benchmarker(bench.settings.model_copy(update=kwargs), HOST)

    env = make(threads=1).harness_env()
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_PROC_BIND"] == "close"
    assert env["OMP_PLACES"].count("{") == 1
    assert make().harness_env()["OMP_PLACES"].count("{") == HOST.cores
    assert "OMP_PROC_BIND" not in make(pin_threads=False).harness_env()
    # Unpinned, the kernel's thread sees the sandbox's CPU set: `threads` CPUs of them.
    one = make(threads=1, pin_threads=False)
    flags = task.compile_flags("O1")
    assert one.compile(scratch, AFFINITY, task, flags, Events()).error == ""
    jobs = [gemm.Job("v", {"M": 1, "N": 2, "K": 1}, secrets.randbits(63))]
    run = one.run(scratch, task, jobs, Events())
    assert run.failure is None, run.failure
    assert run.frames[0].output[0, 0] == 1
    run = make(pin_threads=False).run(scratch, task, jobs, Events())
    assert run.failure is None and run.frames[0].output[0, 0] == HOST.cores
    # However many threads a team asks for, it gets at most `threads`.
    assert make(threads=1).harness_env()["OMP_THREAD_LIMIT"] == "1"
    assert one.compile(scratch, GREEDY_TEAM, task, flags, Events()).error == ""
    run = one.run(scratch, task, jobs, Events())
    assert run.failure is None, run.failure
    assert run.frames[0].output[0, 0] == 1


# Compiled straight into the harness (no checks): counts the CPUs of its affinity mask.
AFFINITY = """#define _GNU_SOURCE
#include <sched.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    for (int i = 0; i < M * N; i++) C[i] = CPU_COUNT(&set);
}
"""


# Asks for 64 threads and reports how many it got.
GREEDY_TEAM = """#include <omp.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int got = 0;
#pragma omp parallel num_threads(64)
#pragma omp single
    got = omp_get_num_threads();
    for (int i = 0; i < M * N; i++) C[i] = got;
}
"""


def test_a_watcher_can_stop_a_run_start_a_second_phase_and_feed_input(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    # Writes a byte to the data pipe and a message to the mark socket, then echoes each line
    # it is sent to the data pipe.
    script = (
        "import os, socket, sys, time\nfd, mk = int(sys.argv[1]), int(sys.argv[2])\n"
        "s = socket.socket(fileno=mk)\nos.write(fd, b'a')\ns.send(b'm')\n"
        "for line in sys.stdin:\n    time.sleep(1.5)\n    os.write(fd, line[0].encode())\n"
        "time.sleep(60)"
    )
    seen: list[tuple[str, bytes]] = []
    stamps: list[int] = []

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        seen.append((channel, payload))
        stamps.append(at_ns)
        return {
            b"a": None,
            b"m": sandbox.Reply(send=b"b\n"),
            b"b": sandbox.Reply(new_phase=True, send=b"c\n"),
            b"c": sandbox.Reply(stop=True),
        }[payload]

    started_ns = time.monotonic_ns()
    spec = sandbox.Spec(tmp_path, sandbox.Limits(wall_s=2.5, cpu_s=5), extra_pipe=True, marks=True)
    outcome = sandbox.run(["/usr/bin/python3", "-c", script, "{fd}", "{marks}"], spec, watch=watch)
    # 3 s in all: past one wall limit of 2.5 s, but within the second phase's.
    assert sorted(seen) == sorted([("data", b"a"), ("mark", b"m"), ("data", b"b"), ("data", b"c")])
    assert outcome.stopped and not outcome.timed_out and outcome.phase_started is not None
    # Every stamp is on this process's monotonic clock, after the start.
    assert all(started_ns < at < time.monotonic_ns() for at in stamps)


def test_marks_after_data_keeps_this_process_asleep_until_the_data(tmp_path: Path) -> None:
    """While a timed call runs, the parent must not wake on the kernel's cores: with
    marks_after_data, a mark is read only once data follows it, with its early stamp kept,
    and still before that data."""
    tmp_path.chmod(0o777)
    script = (
        "import os, socket, sys, time\nfd, mk = int(sys.argv[1]), int(sys.argv[2])\n"
        "s = socket.socket(fileno=mk)\ns.send(b'begin')\ntime.sleep(0.8)\n"
        "s.send(b'result')\nos.write(fd, b'C')\ntime.sleep(0.3)\ns.send(b'check')\n"
    )
    seen: list[tuple[str, bytes, int, int]] = []

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        seen.append((channel, payload, at_ns, time.monotonic_ns()))
        return None

    started = time.monotonic_ns()
    spec = sandbox.Spec(
        tmp_path,
        sandbox.Limits(wall_s=5, cpu_s=5),
        extra_pipe=True,
        marks=True,
        marks_after_data=True,
    )
    outcome = sandbox.run(["/usr/bin/python3", "-c", script, "{fd}", "{marks}"], spec, watch=watch)
    assert outcome.returncode == 0 and not outcome.timed_out
    assert [(c, p) for c, p, _, _ in seen] == [
        ("mark", b"begin"),
        ("mark", b"result"),
        ("data", b"C"),
        ("mark", b"check"),
    ]
    begin_stamp, begin_seen = seen[0][2], seen[0][3]
    result_stamp = seen[1][2]
    assert result_stamp - begin_stamp > 0.7e9  # the stamps keep the real times
    assert begin_seen >= result_stamp  # but "begin" was read only when the data came
    assert begin_stamp - started < 0.7e9


# The whole script of a sandboxed command that starts slowly (as a sandbox does on a node
# whose cores are saturated), marks its first call, reports a result and ends.
SLOW_START = (
    "import os, socket, sys, time\nfd, mk = int(sys.argv[1]), int(sys.argv[2])\n"
    "s = socket.socket(fileno=mk)\ntime.sleep(1.5)\ns.send(b'begin')\n"
    "time.sleep(0.5)\ns.send(b'result')\ntime.sleep(0.5)\nos.write(fd, b'C')\n"
)


def test_the_wall_limit_runs_from_the_first_mark_when_the_start_is_slow(tmp_path: Path) -> None:
    """A start of 1.5 s and 1 s of work against a wall limit of 2 s: charged to the command,
    the start made it a timeout; with ``start_limit_s`` the limit runs from its first mark.
    That first mark is read as it comes (it starts the clock); later ones, as the spec asks,
    only with the data after them."""
    tmp_path.chmod(0o777)
    seen: list[tuple[bytes, int, int]] = []

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        seen.append((payload, at_ns, time.monotonic_ns()))
        return None

    argv = ["/usr/bin/python3", "-c", SLOW_START, "{fd}", "{marks}"]
    limits = sandbox.Limits(wall_s=2.0, cpu_s=5)
    charged = sandbox.run(
        argv,
        sandbox.Spec(tmp_path, limits, extra_pipe=True, marks=True, marks_after_data=True),
        watch=watch,
    )
    assert charged.timed_out and not charged.never_started
    seen.clear()
    spec = sandbox.Spec(
        tmp_path, limits, extra_pipe=True, marks=True, marks_after_data=True, start_limit_s=10.0
    )
    outcome = sandbox.run(argv, spec, watch=watch)
    assert outcome.returncode == 0 and not outcome.timed_out, outcome.stderr
    assert outcome.start_s is not None and 1.4 < outcome.start_s < 1.9 < outcome.wall_s
    assert [payload for payload, _, _ in seen] == [b"begin", b"result", b"C"]
    (_, begin_stamp, begin_seen), (_, result_stamp, result_seen) = seen[:2]
    assert begin_seen - begin_stamp < 0.4e9 < result_seen - result_stamp


MARK_AFTER_DATA = (
    "import os, socket, sys, time\nfd, mk = int(sys.argv[1]), int(sys.argv[2])\n"
    "s = socket.socket(fileno=mk)\ns.send(b'a')\nos.write(fd, b'C')\n"
    "time.sleep(0.3)\ns.send(b'b')\nsys.stdin.readline()\nos.write(fd, b'D')\n"
)


@pytest.mark.parametrize(
    ("start_limit_s", "late"),
    [(None, False), (10.0, False), (10.0, True)],
    ids=["start charged", "start limit", "start limit, parent late"],
)
def test_a_mark_after_data_is_read_with_or_without_a_start_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_limit_s: float | None, late: bool
) -> None:
    """The process marks, writes data, marks again and waits for the reply to that mark. The
    first mark read without a start limit (after the data) used to pause the marks again, so
    the second was never read and a correct run was a timeout (as every harness run was).
    So did a first mark read with the data when the parent came late to watch: set up
    ahead, the harness marked and wrote its first C before the parent had registered its
    channels (1 run in ~300 was a timeout)."""
    tmp_path.chmod(0o777)
    seen: list[tuple[str, bytes]] = []
    if late:
        send = sandbox._send

        def late_send(proc: subprocess.Popen, data: bytes) -> bool:
            sent = send(proc, data)
            time.sleep(0.2)  # descheduled: the process marks and writes meanwhile
            return sent

        monkeypatch.setattr(sandbox, "_send", late_send)

    def watch(channel: str, payload: bytes, at_ns: int) -> sandbox.Reply | None:
        seen.append((channel, payload))
        return sandbox.Reply(send=b"go\n", marks_after_data=True) if payload == b"b" else None

    spec = sandbox.Spec(
        tmp_path,
        sandbox.Limits(wall_s=5.0, cpu_s=5),
        extra_pipe=True,
        marks=True,
        marks_after_data=True,
        start_limit_s=start_limit_s,
    )
    outcome = sandbox.run(
        ["/usr/bin/python3", "-c", MARK_AFTER_DATA, "{fd}", "{marks}"], spec, watch=watch
    )
    assert outcome.returncode == 0 and not outcome.timed_out, (seen, outcome.stderr)
    assert [p for channel, p in seen if channel == sandbox.MARK] == [b"a", b"b"]
    assert b"".join(p for channel, p in seen if channel == sandbox.DATA) == b"CD"


def test_a_sandbox_that_never_starts_is_no_timeout_of_the_command(tmp_path: Path) -> None:
    """No mark within ``start_limit_s``: the run is stopped and reported as never started,
    which the runner turns into the benchmarker's own failure (the candidate goes back to
    the queue), never into the kernel's timeout."""
    tmp_path.chmod(0o777)
    script = "import time\ntime.sleep(60)\n"
    spec = sandbox.Spec(
        tmp_path,
        sandbox.Limits(wall_s=30, cpu_s=5),
        extra_pipe=True,
        marks=True,
        marks_after_data=True,
        start_limit_s=1.0,
    )
    started = time.monotonic()
    outcome = sandbox.run(["/usr/bin/python3", "-c", script, "{fd}", "{marks}"], spec)
    assert outcome.timed_out and outcome.never_started and outcome.start_s is None
    assert time.monotonic() - started < 10
    talk = runner.Conversation([gemm.Job("v", {"M": 4, "N": 4, "K": 4}, 1)], 0, None)
    with pytest.raises(InternalError, match="did not start the harness"):
        runner.run_failure(outcome, talk, 8.0)
