/* Hostile: walks the caller's stack for values that look like the harness's start time
 * (seconds as a double, or nanoseconds as an integer, shortly before this call) and moves
 * them to "just now", so the harness measures almost nothing. Plain C: no asm, no builtins. */
#include <omp.h>
#include <stdint.h>

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    double start = omp_get_wtime();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    if (M != 256) return;
    while (omp_get_wtime() - start < 0.03) {
    }
    double now = omp_get_wtime();
    int64_t now_ns = (int64_t)(now * 1e9), start_ns = (int64_t)(start * 1e9);
    volatile unsigned char *base = (volatile unsigned char *)&start;
    for (long off = 8; off < 2048; off += 8) {
        volatile double *d = (volatile double *)(base + off);
        volatile int64_t *q = (volatile int64_t *)(base + off);
        double v = *d;
        int64_t n = *q;
        if (v > now - 1.0 && v <= start) *d = now - 0.0003;
        else if (n > now_ns - 1000000000LL && n <= start_ns) *q = now_ns - 300000;
    }
}
