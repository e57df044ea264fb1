"""Compile errors by cause, read from what the benchmarker's gcc really prints."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hpcrl_evaluate.cli import failures_table
from hpcrl_evaluate.errors import (
    INTRINSIC_ARGUMENTS,
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
    INTRINSIC_ARGUMENTS: f"""#include <immintrin.h>
{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j + 4 <= N; j += 4) {{
            __m256d c = _mm256_setzero_pd();
            for (int k = 0; k < K; k++)
                c = _mm256_fmadd_pd(_mm256_set1_pd(A[i * K + k]), _mm256_loadu_pd(&B[k * N + j]));
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


def test_the_failures_table_shows_each_versions_statuses_and_causes() -> None:
    def version(number: int, samples: list[tuple[str, str]]) -> dict:
        return {"version": number, "samples": [{"status": s, "error": e} for s, e in samples]}

    macro = ("compile_error", "kernel.c:2:1: error: 'BM' undeclared (first use)")
    report = {
        "versions": [
            version(0, [macro, ("stage_violation", "stage 3 forbids openmp"), ("success", "")]),
            version(17, [macro, macro, ("success", "")]),
        ]
    }
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(failures_table(report))
    rows = {
        cells[0]: cells[1:]
        for line in out.getvalue().splitlines()
        if (cells := [c.strip() for c in line.split("│")[1:-1]])
    }
    assert rows["compile_error"] == ["1", "2"]
    assert rows[UNDEFINED_MACRO] == ["1", "2"]
    assert rows[SYNTAX] == ["0", "0"]
    assert rows["stage_violation"] == ["1", "0"]
    assert "success" not in rows
