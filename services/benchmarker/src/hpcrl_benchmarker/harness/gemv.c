/* hpcrl GEMV harness: y = A*x, row-major, A is M x N, x has N elements, y has M. The task's
 * part only; the protocol, the sandbox's lock-down and every guarantee of a call are
 * harness.h's (the guard zones around A, x and y among them: an off-by-one read of x or A
 * gives NaN, an off-by-one write of y is seen). The parent (hpcrl_benchmarker/gemv.py) makes
 * the same inputs from the same seed and computes the reference with cblas_dgemv. Job line:
 * "<kind> <M> <N>". */
#define HARNESS_DIMS 2
#define HARNESS_INPUTS 2
#include "harness.h"

#ifndef KERNEL_NAME
#define KERNEL_NAME gemv_optimized
#endif
void KERNEL_NAME(const double *A, const double *x, double *y, int M, int N);

static size_t input_bytes(int input, const int *d) {
    /* A: M x N, x: N */
    return (input == 0 ? (size_t)d[0] * d[1] : (size_t)d[1]) * sizeof(double);
}

static size_t output_count(const int *d) {
    return (size_t)d[0];
}

static void fill_inputs(void *const *in, const int *d, uint64_t seed) {
    fill(in[0], (size_t)d[0] * d[1], seed);
    fill(in[1], (size_t)d[1], seed ^ 0x5DEECE66DA3B1F7Full);
}

static void call_kernel(void *const *in, double *out, const int *d) {
    KERNEL_NAME(in[0], in[1], out, d[0], d[1]);
}
