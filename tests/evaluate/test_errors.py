"""Compile errors by cause, read from what the benchmarker's gcc really prints."""

from __future__ import annotations

import pytest

from hpcrl_evaluate.errors import (
    NO_INTRINSICS_HEADER,
    OTHER,
    SYNTAX,
    UNDECLARED_VARIABLE,
    UNDEFINED_MACRO,
    compile_error_cause,
    compile_error_causes,
)
from hpcrl_evaluate.run import make_judge

SIGNATURE = "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K)"
LOOP = "for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];"
KERNELS = {
    # A tile size a hand-written parent named otherwise, used and never defined.
    UNDEFINED_MACRO: f"""{SIGNATURE} {{
    for (int ii = 0; ii < M; ii += BM)
        for (int i = ii; i < M && i < ii + BM; i++)
            for (int j = 0; j < N; j++) {{ double s = 0; {LOOP} C[i * N + j] = s; }}
}}""",
    UNDECLARED_VARIABLE: f"""{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (j = 0; j < N; j++) {{ double s = 0; {LOOP} C[i * N + j] = s; }}
}}""",
    NO_INTRINSICS_HEADER: f"""{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j + 4 <= N; j += 4) {{
            __m256d c = _mm256_setzero_pd();
            for (int k = 0; k < K; k++)
                c = _mm256_add_pd(c, _mm256_mul_pd(_mm256_set1_pd(A[i * K + k]),
                                                   _mm256_loadu_pd(&B[k * N + j])));
            _mm256_storeu_pd(&C[i * N + j], c);
        }}
}}""",
    SYNTAX: f"""{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {{ double s = 0; {LOOP} C[i * N + j] = s }}
}}""",
}


@pytest.mark.parametrize("cause", list(KERNELS))
def test_each_cause_is_read_from_the_benchmarkers_own_error(cause: str) -> None:
    verdict = make_judge("matmul", "O3")(f"```c\n{KERNELS[cause]}\n```", 6)  # all allowed
    assert verdict.status == "compile_error", verdict.error
    assert compile_error_cause(verdict.error) == cause


def test_only_compile_errors_are_counted() -> None:
    counts = compile_error_causes(
        [
            ("compile_error", "kernel.c:2:36: error: 'TILE_I' undeclared (first use)"),
            ("compile_error", "kernel.c:3:14: error: 'kk' undeclared (first use)"),
            ("compile_error", "kernel.c:3:1: error: implicit declaration of function '_mm_add'"),
            ("compile_error", "kernel.c:1:1: error: conflicting types for 'matmul_optimized'"),
            ("compile_error", "collect2: ld returned 1 exit status"),
            ("verification_error", "kernel.c:2:36: error: 'BM' undeclared"),
            ("success", ""),
        ]
    )
    assert counts == {
        UNDEFINED_MACRO: 1,
        UNDECLARED_VARIABLE: 1,
        NO_INTRINSICS_HEADER: 1,
        OTHER: 2,
    }
