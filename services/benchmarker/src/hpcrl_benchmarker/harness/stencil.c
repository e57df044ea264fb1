/* hpcrl stencil harness: one Jacobi sweep of the 5-point Laplacian over an N x M grid of
 * doubles, row-major (point (i, j) is u[i*M + j]): v = 0.25 (north + south + west + east) at
 * every interior point, v = u on the boundary. The task's part only; the protocol, the
 * sandbox's lock-down and every guarantee of a call are harness.h's (the guard zones around
 * u and v among them: a read one row past u gives NaN, a write past v is seen). The parent
 * (hpcrl_benchmarker/stencil.py) makes the same u from the same seed and computes the
 * reference with numpy. Job line: "<kind> <N> <M>". */
#define HARNESS_DIMS 2
#define HARNESS_INPUTS 1
#include "harness.h"

#ifndef KERNEL_NAME
#define KERNEL_NAME stencil_optimized
#endif
void KERNEL_NAME(const double *u, double *v, int N, int M);

static size_t input_bytes(int input, const int *d) {
    (void)input; /* u: N x M */
    return (size_t)d[0] * d[1] * sizeof(double);
}

static size_t output_count(const int *d) {
    return (size_t)d[0] * d[1];
}

static void fill_inputs(void *const *in, const int *d, uint64_t seed) {
    fill(in[0], (size_t)d[0] * d[1], seed);
}

static void call_kernel(void *const *in, double *out, const int *d) {
    KERNEL_NAME(in[0], out, d[0], d[1]);
}
