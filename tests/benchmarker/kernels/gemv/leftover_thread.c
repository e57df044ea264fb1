/* Hostile: starts a team with the old GOMP entry point and returns without ending it, so a
 * thread keeps running kernel code after the call (here it only spins for a while). */
#include <omp.h>
extern void GOMP_parallel_start(void (*fn)(void *), void *data, unsigned threads);
static void linger(void *data) {
    (void)data;
    double start = omp_get_wtime();
    while (omp_get_wtime() - start < 0.001) {
    }
}
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
    GOMP_parallel_start(linger, 0, 2);
}
