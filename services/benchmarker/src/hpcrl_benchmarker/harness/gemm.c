/* hpcrl GEMM harness: C = A*B, row-major, A is M x K, B is K x N, C is M x N. The task's part
 * only; the protocol, the sandbox's lock-down and every guarantee of a call are harness.h's.
 * The parent (hpcrl_benchmarker/gemm.py) makes the same inputs from the same seed and
 * computes the reference with cblas_dgemm. Job line: "<kind> <M> <N> <K>". */
#define HARNESS_DIMS 3
#define HARNESS_INPUTS 2
#include "harness.h"

#ifndef KERNEL_NAME
#define KERNEL_NAME matmul_optimized
#endif
void KERNEL_NAME(double *A, double *B, double *C, int M, int N, int K);

static size_t input_bytes(int input, const int *d) {
    /* A: M x K, B: K x N */
    return (input == 0 ? (size_t)d[0] * d[2] : (size_t)d[2] * d[1]) * sizeof(double);
}

static size_t output_count(const int *d) {
    return (size_t)d[0] * d[1];
}

static void fill_inputs(void *const *in, const int *d, uint64_t seed) {
    fill(in[0], (size_t)d[0] * d[2], seed);
    fill(in[1], (size_t)d[2] * d[1], seed ^ 0x5DEECE66DA3B1F7Full);
}

static void call_kernel(void *const *in, double *out, const int *d) {
    KERNEL_NAME(in[0], in[1], out, d[0], d[1], d[2]);
}
