"""Canned completions of the scripted generator (the only stand-in these tests use).

Each request gets, by index: a correct kernel for its target stage, a compile error, a stage
violation (OpenMP before stage 4), a wrong result and a second, much slower correct kernel
(the plain triple loop, repeated), so that group-normalised rewards have two successes to
compare.
Completions are wrapped in a markdown block as a model would answer.
"""

from __future__ import annotations

SUCCESS_STAGE1 = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) C[i * N + j] = 0.0;
        for (int k = 0; k < K; k++) {
            double a = A[i * K + k];
            for (int j = 0; j < N; j++) C[i * N + j] += a * B[k * N + j];
        }
    }
}"""

SUCCESS_BLOCKED = """#define BS 64
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M * N; i++) C[i] = 0.0;
    for (int kk = 0; kk < K; kk += BS)
        for (int i = 0; i < M; i++)
            for (int k = kk; k < K && k < kk + BS; k++) {
                double a = A[i * K + k];
                for (int j = 0; j < N; j++) C[i * N + j] += a * B[k * N + j];
            }
}"""

COMPILE_ERROR = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M * N; i++) C[i] = 0.0
}"""

STAGE_VIOLATION = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    #pragma omp parallel for
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
}"""

WRONG_RESULT = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 1; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
}"""

# The plain triple loop, done 8 times over (the count is volatile, so the compiler cannot drop
# the repeats): about 80x slower than SUCCESS_STAGE1, so that no disturbance of a busy 2-core
# test machine (a timed run 10-60x slower than its neighbours has been seen) can swap their
# ranks, and still well inside the wall limit.
SLOW_SUCCESS = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    volatile int repeats = 8;
    for (int r = 0; r < repeats; r++)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double s = 0.0;
                for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
                C[i * N + j] = s;
            }
}"""

EXPECTED = ("success", "compile_error", "stage_violation", "verification_error", "success")


def completion(target_stage: int, index: int) -> str:
    success = SUCCESS_STAGE1 if target_stage == 1 else SUCCESS_BLOCKED
    code = (success, COMPILE_ERROR, STAGE_VIOLATION, WRONG_RESULT, SLOW_SUCCESS)[index % 5]
    return f"Here is the kernel.\n```c\n{code}\n```\n"
