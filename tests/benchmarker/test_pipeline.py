"""Every reward row and the hostile kernels, with real gcc, bubblewrap and OpenBLAS."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcrl_benchmarker import checks
from hpcrl_benchmarker.host import HostProfile
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common.messages import STATUSES
from hpcrl_common.rewards import FAILURE_REWARDS as REWARDS
from hpcrl_common.task import TaskSpec

from .conftest import HAS_AVX512, HOST, KERNELS, kernel, needs_avx512

Judge = Callable[..., Verdict]


def assert_status(verdict: Verdict, status: str) -> None:
    assert verdict.status == status, f"{verdict.status}: {verdict.error}"
    assert verdict.status in STATUSES
    if status == "success":
        assert verdict.gflops is not None and verdict.reward == verdict.gflops > 0
    else:
        assert verdict.gflops is None and verdict.reward == REWARDS[status]


# --- one test per reward row ---------------------------------------------------------------


def test_success_reports_gflops_and_timing_stats(judge: Judge, task: TaskSpec) -> None:
    verdict = judge(f"Sure! Here it is:\n```c\n{kernel('naive.c')}```\nIt is simple.", stage=1)
    assert_status(verdict, "success")
    timing = verdict.timing
    assert timing is not None and len(timing.runs_s) == task.timing.timed_runs
    assert timing.min_s <= timing.median_s <= timing.max_s and timing.cv >= 0
    assert verdict.gflops == pytest.approx(2 * 256**3 / timing.mean_s / 1e9)
    assert verdict.generalizes is True and verdict.techniques == []
    assert verdict.host.host_class == HOST.host_class
    assert set(verdict.durations_s) >= {"compile", "verify", "time"}


def test_format_violation(judge: Judge) -> None:
    assert_status(judge("I cannot write this kernel."), "format_violation")
    wrong = kernel("naive.c").replace("double *C", "float *C")
    verdict = judge(wrong)
    assert_status(verdict, "format_violation")
    assert "float" in verdict.error


def test_library_violation_blas(judge: Judge) -> None:
    code = """#include <cblas.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0, A, K, B, N, 0.0, C, N);
}
"""
    verdict = judge(code)
    assert_status(verdict, "library_violation")
    assert "cblas" in verdict.error


def test_stage_violation_reports_techniques(judge: Judge) -> None:
    verdict = judge(kernel("ikj_omp.c"), stage=3)
    assert_status(verdict, "stage_violation")
    assert verdict.reward == -100 and "openmp" in verdict.techniques


def test_compile_error_shows_diagnostics(judge: Judge) -> None:
    verdict = judge(kernel("naive.c").replace("double s = 0.0;", "double s = 0.0"))
    assert_status(verdict, "compile_error")
    assert "error" in verdict.error and "kernel.c" in verdict.error


def test_timeout_kills_the_run(judge: Judge, task: TaskSpec) -> None:
    started = time.monotonic()
    verdict = judge(kernel("infinite.c"))
    assert_status(verdict, "timeout")
    assert time.monotonic() - started < task.timing.time_limit_s + 30
    # It spun: its time went on a CPU, not on waiting for one.
    on_cpu, waiting = map(
        float, re.search(r"([\d.]+) s on a CPU, ([\d.]+) s waiting", verdict.error).groups()
    )
    assert on_cpu > 0.5 * task.timing.time_limit_s > waiting, verdict.error


def test_runtime_error_on_crash(judge: Judge) -> None:
    verdict = judge(kernel("segfault.c"))
    assert_status(verdict, "runtime_error")
    assert "SIGSEGV" in verdict.error


def test_verification_error(judge: Judge) -> None:
    verdict = judge(kernel("wrong.c"))
    assert_status(verdict, "verification_error")
    assert "reference" in verdict.error


# --- hostile kernels -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "accumulate.c",
        "once.c",
        "cached.c",
        "modifies_inputs.c",
        "timed_only.c",
        "sparse_wrong.c",
        "float_precision.c",
    ],
)
def test_reward_hacks_fail_verification(judge: Judge, name: str) -> None:
    assert_status(judge(kernel(name)), "verification_error")


# Each of these busy-waits >= 30 ms in every call at the reward size (its own clock), so an
# honest measurement is >= 30 ms per timed run, and a success must not report less.
TIMING_FLOOR_S = 0.03


def assert_not_inflated(verdict: Verdict) -> None:
    if verdict.status == "success":
        assert verdict.timing is not None
        assert verdict.timing.min_s >= TIMING_FLOOR_S - 0.001, verdict.timing
        assert verdict.gflops is not None
        assert verdict.gflops <= 2 * 256**3 / (TIMING_FLOOR_S - 0.001) / 1e9


def test_rewriting_the_harness_s_start_time_on_the_stack_gains_nothing(judge: Judge) -> None:
    # The kernel finds values near "now" on its caller's stack (the saved start time, as
    # seconds or nanoseconds) and moves them to 0.3 ms before its return. The harness sent
    # its start time out before the call, so the rewrite changes nothing the parent uses.
    verdict = judge(kernel("stack_time.c"))
    assert verdict.status in ("success", "verification_error"), verdict.error
    assert_not_inflated(verdict)


def test_forged_result_messages_are_tampering(judge: Judge) -> None:
    # Forged RESULT marks (claiming 0.1 ms) written to every descriptor through stdout's
    # FILE, with every value on the caller's stack tried as the nonce.
    verdict = judge(kernel("forge_marks.c"))
    assert_status(verdict, "runtime_error")
    assert "tampered" in verdict.error


def test_threads_left_running_after_the_call_fail(judge: Judge) -> None:
    verdict = judge(kernel("leftover_thread.c"))
    assert_status(verdict, "verification_error")
    assert "parallel region still open" in verdict.error
    # A GOMP entry point called by hand is OpenMP, whatever the source looks like.
    hidden = (
        kernel("leftover_thread.c")
        .replace("#include <omp.h>\n", "")
        .replace(
            "double start = omp_get_wtime();\n    while (omp_get_wtime() - start < 0.001) {\n    }",
            "",
        )
    )
    verdict = judge(hidden, stage=1)
    assert_status(verdict, "stage_violation")
    assert "openmp" in verdict.techniques


def test_changing_the_fp_environment_is_allowed_and_does_not_leak(judge: Judge) -> None:
    # Round toward zero + FTZ/DAZ, left set: the results stay within tolerance and every call
    # starts from the default environment again (decided: allowed, it gains nothing here).
    verdict = judge(kernel("fp_modes.c"))
    assert_status(verdict, "success")
    assert verdict.generalizes is True


def test_an_input_transposed_in_place_and_restored_is_allowed(judge: Judge) -> None:
    # The inputs are checked after every call; one that is changed and put back bit for bit
    # (here B transposed in place and back, at every size, square or not) is honest.
    verdict = judge(kernel("transpose_in_place.c"))
    assert_status(verdict, "success")
    assert verdict.generalizes is True


def test_early_exit_is_a_runtime_error(judge: Judge) -> None:
    verdict = judge(kernel("early_exit.c"))
    assert_status(verdict, "runtime_error")
    assert "exit" in verdict.error


def test_memory_bomb_is_contained(bench: Benchmarker, task: TaskSpec) -> None:
    small = Benchmarker(bench.settings.model_copy(update={"address_space_mb": 1024}), bench.host)
    verdict = small.evaluate(kernel("memory_bomb.c"), stage=6, opt_level="O1", task=task)
    assert_status(verdict, "runtime_error")


HIDDEN = {
    "blas by token pasting": """#define CAT(a, b) a##b
extern void CAT(cblas_, dgemm)(int, int, int, int, int, int, double, const double *, int,
                               const double *, int, double, double *, int);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    CAT(cblas_, dgemm)(101, 111, 111, M, N, K, 1.0, A, K, B, N, 0.0, C, N);
}""",
    "fortran blas declared inline": """extern void dgemm_(const char *, const char *, const int *,
    const int *, const int *, const double *, const double *, const int *, const double *,
    const int *, const double *, double *, const int *);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    double one = 1, zero = 0;
    dgemm_("N", "N", &N, &M, &K, &one, B, &N, A, &K, &zero, C, &N);
}""",
    "dlsym": """#include <dlfcn.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    void (*f)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "cblas_dgemm"); f();
}""",
    "file write": """#include <stdio.h>
#define OPEN(x) fo##x
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    FILE *f = OPEN(pen)("/tmp/hpcrl-marker", "w"); fputs("x", f);
}""",
    "fork bomb": """#include <unistd.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (;;) fork();
}""",
    "socket": """#include <sys/socket.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int s = socket(2, 1, 0); (void)s;
}""",
    "inline asm syscall": """#define ASM __asm__
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    long r; ASM volatile("syscall" : "=a"(r) : "a"(57) : "rcx", "r11", "memory");
}""",
    "signal handler": """#include <signal.h>
static void h(int s) { (void)s; }
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    signal(SIGSEGV, h);
}""",
    "longjmp": """#include <setjmp.h>
static jmp_buf env;
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    if (!setjmp(env)) longjmp(env, 1);
}""",
    "background thread": """#include <pthread.h>
static void *work(void *p) { return p; }
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    pthread_t t; pthread_create(&t, 0, work, C);
}""",
    "constructor": """static int ready;
__attribute__((constructor)) static void early(void) { ready = 1; }
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M * N; i++) C[i] = ready;
}""",
    "harness global": """extern double hpcrl_elapsed;
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    hpcrl_elapsed = 1e-9;
}""",
    "interposed malloc": """#include <stddef.h>
static char pool[1 << 20];
void *malloc(size_t n) { (void)n; return pool; }
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) { C[0] = 0; }""",
    "getenv": """#include <stdlib.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    C[0] = getenv("HOME") != 0;
}""",
    "optimize pragma": """#pragma GCC optimize("O3")
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) { C[0] = 0; }""",
}


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_ways_around_the_task_are_library_violations(judge: Judge, name: str) -> None:
    marker = Path("/tmp/hpcrl-marker")
    before = marker.exists()
    verdict = judge(HIDDEN[name], opt_level="O0")
    assert_status(verdict, "library_violation")
    assert marker.exists() == before


def test_symbol_check_catches_what_source_checks_cannot_see(judge: Judge) -> None:
    # No forbidden word appears in the code: only the object's undefined symbols tell.
    code = """#define J(a, b, c) a##b##c
extern int J(po, pe, n)(const char *, const char *);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    C[0] = J(po, pe, n)("x", "r");
}"""
    verdict = judge(code)
    assert_status(verdict, "library_violation")
    assert "popen" in verdict.error


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("text_section_code.c", "section attribute"),
        ("nested_trampoline.c", "executable stack"),
    ],
)
def test_hand_placed_machine_code_is_a_library_violation(
    judge: Judge, name: str, reason: str
) -> None:
    verdict = judge(kernel(name), stage=6)
    assert_status(verdict, "library_violation")
    assert reason in verdict.error


def _object_layout(source: str, directory: Path) -> list[str]:
    (directory / "k.c").write_text(source)
    subprocess.run(
        ["gcc", "-O3", "-march=native", "-fopenmp", "-c", "k.c", "-o", "k.o"],
        cwd=directory,
        check=True,
        capture_output=True,
    )
    elf = subprocess.run(
        ["readelf", "-S", "-s", "-W", "k.o"],
        cwd=directory,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return checks.layout_violations(elf)


def test_object_layout_check_is_the_gate_behind_the_source_checks(tmp_path: Path) -> None:
    # Straight from gcc, as if the source checks had been fooled.
    assert "places the data code in an executable section" in " ".join(
        _object_layout(kernel("text_section_code.c"), tmp_path)
    )
    assert any(
        "executable stack" in r for r in _object_layout(kernel("nested_trampoline.c"), tmp_path)
    )
    hidden = '__attribute__((section(".hpcrl,\\"awx\\",@progbits#"))) char c[] = {1};\n'
    assert any(
        "both writable and executable" in r
        for r in _object_layout(hidden + kernel("naive.c"), tmp_path)
    )
    # Compiled C passes: every kernel of the suite that gcc takes here.
    for path in sorted(KERNELS.glob("*.c")):
        if path.name in ("text_section_code.c", "nested_trampoline.c"):
            continue
        try:
            assert _object_layout(path.read_text(), tmp_path) == [], path.name
        except subprocess.CalledProcessError:
            assert not HAS_AVX512, path.name  # AVX-512 intrinsics on an AVX2 host


def test_a_macro_bomb_cannot_buy_time_outside_the_sandbox(judge: Judge) -> None:
    # 65536 copies of a 40-character literal: 2.7 MB of the kernel's own preprocessed lines,
    # which the checks (outside the sandbox) would otherwise read at ~1 s per MB.
    bomb = "".join(f"#define X{2 * n}(x) X{n}(X{n}(x))\n" for n in (1, 2, 4, 8))
    code = (
        "#define X1(x) x x\n"
        + bomb
        + 'const char *text = X16("0123456789012345678901234567890123456789");\n'
        + kernel("naive.c")
    )
    verdict = judge(code)
    assert_status(verdict, "compile_error")
    assert "after preprocessing, above the 2 MiB limit" in verdict.error


def test_including_host_files_shows_nothing_of_them(judge: Judge) -> None:
    secret = Path("/etc/passwd").read_text().splitlines()[0]
    code = '#include "/etc/passwd"\n' + kernel("naive.c")
    verdict = judge(code)
    assert_status(verdict, "compile_error")
    assert secret not in verdict.error
    assert "No such file" in verdict.error


# --- stages and techniques -----------------------------------------------------------------


def test_techniques_in_comments_and_strings_do_not_count(judge: Judge) -> None:
    code = (
        "/* _mm512_fmadd_pd and #pragma omp parallel would help here */\n"
        'static const char *note = "#pragma omp parallel for _mm_prefetch";\n' + kernel("naive.c")
    )
    verdict = judge(code, stage=1)
    assert_status(verdict, "success")
    assert verdict.techniques == []


def test_simd_and_prefetch_stage_rules(judge: Judge) -> None:
    code = kernel("avx2_prefetch.c")
    assert_status(judge(code, stage=2), "stage_violation")
    at_four = judge(code, stage=4)
    assert_status(at_four, "stage_violation")
    assert at_four.error.endswith("prefetch, which the code uses")
    verdict = judge(code, stage=5)
    assert_status(verdict, "success")
    assert {"simd", "prefetch"} <= set(verdict.techniques)


def test_macro_hidden_simd_is_seen_after_preprocessing(judge: Judge) -> None:
    code = kernel("avx2_prefetch.c").replace("_mm_prefetch(", "PF(")
    code = "#define PF(a, b) ((void)0)\n#define V(x) _mm256##x\n" + code.replace("_mm256", "V()")
    code = code.replace("V()_", "V(_)")
    verdict = judge(code, stage=2)
    assert_status(verdict, "stage_violation")
    assert "simd" in verdict.techniques


@needs_avx512
def test_avx512_openmp_kernel_succeeds_at_stage_4(judge: Judge) -> None:
    verdict = judge(kernel("avx512_omp.c"), stage=4)
    assert_status(verdict, "success")
    assert {"simd", "openmp"} <= set(verdict.techniques)


# --- generalisation, peak --------------------------------------------------------------------


def test_generalisation_is_reported_not_penalised_by_default(judge: Judge, task: TaskSpec) -> None:
    verdict = judge(kernel("only_multiples_of_8.c"), stage=1)
    assert_status(verdict, "success")
    assert verdict.generalizes is False and "255x257x129" in verdict.error
    strict = task.model_copy(update={"penalize_generalization": True})
    assert_status(
        judge(kernel("only_multiples_of_8.c"), stage=1, task=strict), "verification_error"
    )


def test_measurement_above_peak_is_never_success(bench: Benchmarker, task: TaskSpec) -> None:
    slow_host = HostProfile(
        hostname=HOST.hostname,
        cpu_model=HOST.cpu_model,
        flags=HOST.flags,
        cores=1,
        max_mhz=1e-6,
        compiler=HOST.compiler,
    )
    tiny = Benchmarker(bench.settings, slow_host)
    verdict = tiny.evaluate(kernel("naive.c"), stage=1, opt_level="O3", task=task)
    assert_status(verdict, "verification_error")
    assert "theoretical peak" in verdict.error


# --- issue 27, class 3: the checks read the tokens gcc reads --------------------------------


@pytest.mark.parametrize(
    ("name", "stage", "opt_level", "also"),
    [
        ("raw_string_avx512.c", 1, "O3", None),
        ("raw_string_asm_prefetch.c", 4, "O3", "inline assembly"),
        ("raw_string_optimize.c", 6, "O0", "optimisation level"),
    ],
)
def test_code_hidden_behind_a_raw_string_is_seen(
    judge: Judge, name: str, stage: int, opt_level: str, also: str | None
) -> None:
    # Each was a success before: a lexer without raw strings read their code as a comment.
    verdict = judge(kernel(name), stage=stage, opt_level=opt_level)
    assert_status(verdict, "library_violation")
    assert "raw string" in (verdict.error or "")
    if also:
        assert also in (verdict.error or "")
