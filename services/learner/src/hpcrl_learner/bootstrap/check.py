"""Compile a kernel with gcc and check it against a naive reference at several sizes.

A quick check for the corpus tests and for measuring what the bootstrapped model writes; the
benchmarker's sandboxed verification against OpenBLAS is the one that gives rewards. The
kernel runs in a child process, so one that crashes or hangs is a verdict, not a crash here.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpcrl_common.stages import OPENMP, PREFETCH, SIMD

DEFAULT_FLAGS = ("-O1", "-march=native", "-fopenmp")
# Square reward-like size first, then sizes that are not multiples of any block or vector.
DEFAULT_SIZES: tuple[tuple[int, int, int], ...] = ((64, 64, 64), (37, 45, 29), (5, 3, 7))

_DRIVER = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K);

static unsigned state = 12345u;
static double next_value(void) {
    state = state * 1103515245u + 12345u;
    return (double)((state >> 16) & 0x7fff) / 32768.0 - 0.5;
}

int main(int argc, char **argv) {
    for (int a = 1; a + 2 < argc; a += 3) {
        int M = atoi(argv[a]), N = atoi(argv[a + 1]), K = atoi(argv[a + 2]);
        double *A = malloc(sizeof(double) * M * K), *B = malloc(sizeof(double) * K * N);
        double *C = malloc(sizeof(double) * M * N), *R = malloc(sizeof(double) * M * N);
        for (int i = 0; i < M * K; i++) A[i] = next_value();
        for (int i = 0; i < K * N; i++) B[i] = next_value();
        /* Garbage in C: a kernel must overwrite it, not accumulate into it. */
        for (int i = 0; i < M * N; i++) C[i] = 7.0;
        matmul_optimized(A, B, C, M, N, K);
        double worst = 0.0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double sum = 0.0, scale = 0.0;
                for (int k = 0; k < K; k++) {
                    sum += A[i * K + k] * B[k * N + j];
                    scale += fabs(A[i * K + k] * B[k * N + j]);
                }
                double err = fabs(C[i * N + j] - sum) / (scale > 1e-300 ? scale : 1.0);
                if (!(err <= worst)) worst = err; /* NaN counts as the worst */
            }
        printf("%d %d %d %.3e\n", M, N, K, worst);
        if (!(worst <= 1e-12)) return 3;
        free(A); free(B); free(C); free(R);
    }
    return 0;
}
"""

_FENCE = re.compile(r"```(?:c|C|cpp|c\+\+)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"", re.DOTALL)
_DETECT = {
    SIMD: re.compile(r"\b(__m(128|256|512)[di]?|_mm(256|512)?_\w+|#\s*pragma\s+(omp\s+simd|GCC\s+"
                     r"ivdep|ivdep|vector))\b"),
    OPENMP: re.compile(r"#\s*pragma\s+omp\b|\bomp_\w+\s*\("),
    PREFETCH: re.compile(r"\b(_mm_prefetch|__builtin_prefetch)\b"),
}


@dataclass(frozen=True)
class Verdict:
    status: str  # correct, wrong, compile_error, runtime_error, timeout, format_error
    detail: str = ""

    @property
    def compiles(self) -> bool:
        return self.status in ("correct", "wrong", "runtime_error", "timeout")


def extract_code(completion: str) -> str | None:
    """The first fenced code block of a completion (an unclosed one counts), else None."""
    match = _FENCE.search(completion)
    return match.group(1) if match else None


def detect_techniques(source: str) -> set[str]:
    """Which policed techniques the code (not its comments or strings) uses."""
    code = _COMMENTS.sub(" ", source)
    found = {name for name, pattern in _DETECT.items() if pattern.search(code)}
    if PREFETCH in found and not _DETECT[SIMD].search(code.replace("_mm_prefetch", "")):
        found.discard(SIMD)  # _mm_prefetch is a prefetch, not a vector instruction
    return found


def host_has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def check_kernel(
    source: str,
    sizes: tuple[tuple[int, int, int], ...] = DEFAULT_SIZES,
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    compiler: str = "gcc",
    time_limit_s: float = 20.0,
    workdir: Path | None = None,
) -> Verdict:
    if "matmul_optimized" not in source:
        return Verdict("format_error", "no matmul_optimized")
    with tempfile.TemporaryDirectory(prefix="hpcrl-check-", dir=workdir) as tmp:
        root = Path(tmp)
        (root / "kernel.c").write_text(source)
        (root / "driver.c").write_text(_DRIVER)
        build = subprocess.run(
            [compiler, *flags, "-o", str(root / "prog"), str(root / "kernel.c"),
             str(root / "driver.c"), "-lm"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        if build.returncode != 0:
            return Verdict("compile_error", build.stderr[-2000:])
        args = [str(n) for size in sizes for n in size]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        try:
            run = subprocess.run([str(root / "prog"), *args], capture_output=True, text=True,
                                 timeout=time_limit_s, check=False, env=env)
        except subprocess.TimeoutExpired:
            return Verdict("timeout", f"no answer within {time_limit_s:g} s")
        if run.returncode == 0:
            return Verdict("correct", run.stdout)
        if run.returncode == 3:
            return Verdict("wrong", run.stdout)
        return Verdict("runtime_error", f"exit status {run.returncode}\n{run.stderr[-500:]}")
