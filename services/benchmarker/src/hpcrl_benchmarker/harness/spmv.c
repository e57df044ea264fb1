/* hpcrl SpMV harness: y = A*x with A an M x N sparse matrix in CSR form: rowptr (M + 1 ints),
 * col and val (NNZ each: int column indices, double values), x (N doubles), y (M doubles).
 * The task's part only; the protocol, the sandbox's lock-down and every guarantee of a call
 * are harness.h's (guard zones around all four inputs and y: a read of col or rowptr past its
 * end gives -1, of val or x NaN; a write past y is seen). The parent
 * (hpcrl_benchmarker/spmv.py) makes the same matrix from the same seed with this file's
 * fill_inputs and computes the reference with its reference() (below).
 * Job line: "<kind> <M> <N> <NNZ>".
 *
 * The matrix, from the seed: each of the NNZ entries falls in a row drawn from a skewed law
 * (a product of three uniforms, the rows then scattered by a bijection), so row lengths range
 * from empty to ~60x the mean; a quarter of the columns lie near the row's diagonal position,
 * the rest anywhere, in no order within a row, and may repeat. Built with counts and a prefix
 * sum in rowptr itself: no memory beyond the inputs, no call through writable memory.
 *
 * The parent's reference is this file's own (HARNESS_REFERENCE, in the trusted library only):
 * numpy's gather, products and row sums took ~3 ms a reward-size job, this loop 0.4. */
#define HARNESS_DIMS 3
#define HARNESS_REFERENCE
#define HARNESS_INPUTS 4
#define MAX_DIM (1 << 24)
#include "harness.h"

#ifndef KERNEL_NAME
#define KERNEL_NAME spmv_optimized
#endif
void KERNEL_NAME(const int *rowptr, const int *col, const double *val, const double *x,
                 double *y, int M, int N);

/* Salts of the four streams (spmv.py has the same). */
#define ROW_SALT 0x243F6A8885A308D3ull
#define COL_SALT 0x13198A2E03707344ull
#define VAL_SALT 0xA4093822299F31D0ull
#define X_SALT 0x5DEECE66DA3B1F7Full
/* A prime above MAX_DIM: r -> (r * SCATTER + offset) mod M is a bijection of the rows. */
#define SCATTER 16777259ull

static size_t input_bytes(int input, const int *d) {
    switch (input) {
    case 0: return ((size_t)d[0] + 1) * sizeof(int); /* rowptr */
    case 1: return (size_t)d[2] * sizeof(int);       /* col */
    case 2: return (size_t)d[2] * sizeof(double);    /* val */
    default: return (size_t)d[1] * sizeof(double);   /* x */
    }
}

static size_t output_count(const int *d) {
    return (size_t)d[0];
}

static uint64_t draw(uint64_t seed, size_t k) {
    return mix(seed + (uint64_t)(k + 1) * 0x9E3779B97F4A7C15ull);
}

/* x % d for x < 2^50 and 0 < d <= MAX_DIM, exactly, without a division (tens of cycles; the
 * row loop needs one per entry): x / d from the reciprocal errs by less than 1/8, so the
 * truncated quotient is off by at most one, and one correction gives the remainder. */
static uint64_t mod_by(uint64_t x, uint64_t d, double reciprocal) {
    uint64_t q = (uint64_t)(int64_t)((double)(int64_t)x * reciprocal);
    int64_t r = (int64_t)(x - q * d);
    if (r < 0) r += (int64_t)d;
    else if (r >= (int64_t)d) r -= (int64_t)d;
    return (uint64_t)r;
}

/* Entry k's row: the skewed law's t, scattered by (r * SCATTER + offset) % m. */
static int entry_row(uint64_t row_seed, size_t k, uint64_t m, uint64_t offset, double per_m) {
    uint64_t h = draw(row_seed, k);
    uint64_t t = ((h >> 43) * ((h >> 22) & 0x1FFFFF) * ((h >> 1) & 0x1FFFFF)) >> 42;
    /* (r * SCATTER + offset) % m, r < m <= 2^24: below 2^49 */
    return (int)mod_by(((t * m) >> 21) * SCATTER + offset, m, per_m);
}

/* A column anywhere in the row (three entries in four, by h's low bits). */
static int far_column(uint64_t h, uint64_t n) {
    return (int)(((h >> 32) * n) >> 32);
}

/* A column within 16 of the row's diagonal position: (diagonal + (h >> 8) % 33 + 16 n - 16) %
 * n, the sum below 17 n + 33. */
static int near_column(uint64_t h, uint64_t diagonal, uint64_t n, double per_n) {
    return (int)mod_by(diagonal + (h >> 8) % 33 + 16 * n - 16, n, per_n);
}

static void prefix_sum(int *rowptr, uint64_t m) {
    for (uint64_t i = 0; i < m; i++) rowptr[i + 1] += rowptr[i];
}

static void fill_inputs(void *const *in, const int *d, uint64_t seed) {
    int *rowptr = in[0], *col = in[1];
    uint64_t m = (uint64_t)d[0], n = (uint64_t)d[1];
    size_t nnz = (size_t)d[2];
    double per_m = 1.0 / (double)m, per_n = 1.0 / (double)n;
    uint64_t row_seed = seed ^ ROW_SALT, col_seed = seed ^ COL_SALT;
    uint64_t offset = mix(row_seed) % m;
    for (uint64_t i = 0; i <= m; i++) rowptr[i] = 0;
#ifdef __AVX512DQ__
    /* Where vectors multiply and convert 64-bit integers, the hashing vectorises once it is
     * apart from the stores through computed addresses: each entry's row parked in col
     * (overwritten below) and then counted; each column drawn, those near the diagonal marked
     * -1 and drawn again once their row is known. Reward size: 5.5 -> 3.4 ms a call (AVX-512,
     * gcc 12 -O2); with AVX2 alone the extra passes cost more than the vectors save. */
    _Pragma("omp simd")
    for (size_t k = 0; k < nnz; k++) col[k] = entry_row(row_seed, k, m, offset, per_m);
    for (size_t k = 0; k < nnz; k++) rowptr[col[k] + 1]++;
    prefix_sum(rowptr, m);
    _Pragma("omp simd")
    for (size_t k = 0; k < nnz; k++) {
        uint64_t h = draw(col_seed, k);
        col[k] = (h & 3) == 0 ? -1 : far_column(h, n);
    }
    for (uint64_t i = 0; i < m; i++)
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++)
            if (col[k] < 0) col[k] = near_column(draw(col_seed, (size_t)k), i * n / m, n, per_n);
#else
    for (size_t k = 0; k < nnz; k++) rowptr[entry_row(row_seed, k, m, offset, per_m) + 1]++;
    prefix_sum(rowptr, m);
    for (uint64_t i = 0; i < m; i++)
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) {
            uint64_t h = draw(col_seed, (size_t)k);
            col[k] = (h & 3) == 0 ? near_column(h, i * n / m, n, per_n) : far_column(h, n);
        }
#endif
    fill(in[2], nnz, seed ^ VAL_SALT);
    fill(in[3], (size_t)n, seed ^ X_SALT);
}

static void call_kernel(void *const *in, double *out, const int *d) {
    KERNEL_NAME(in[0], in[1], in[2], in[3], out, d[0], d[1]);
}

#ifdef HARNESS_INPUTS_ONLY
/* y_i = the sum of row i's products in storage order (0 for an empty row). Any order errs by
 * at most L_i u of the row's sum |val x| (spmv.py has the arithmetic), far below the task's
 * tolerance; which order is the kernel's to choose, not the reference's. */
static void reference(void *const *in, double *out, const int *d) {
    const int *rowptr = in[0], *col = in[1];
    const double *val = in[2], *x = in[3];
    for (int i = 0; i < d[0]; i++) {
        double sum = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) sum += val[k] * x[col[k]];
        out[i] = sum;
    }
}
#endif
