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
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    GOMP_parallel_start(linger, 0, 2);
}
