// Fixed parent of the evaluation set (stage 5): the stage-4 parent with the next row of B
// prefetched while the current one is used. Correct for any M, N, K.
#include <immintrin.h>
#include <omp.h>

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int n4 = N - N % 4;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; i++) {
        double *crow = &C[(long)i * N];
        for (int j = 0; j < N; j++) {
            crow[j] = 0.0;
        }
        for (int k = 0; k < K; k++) {
            const double *brow = &B[(long)k * N];
            if (k + 1 < K) {
                _mm_prefetch((const char *)(brow + N), _MM_HINT_T0);
            }
            __m256d a = _mm256_set1_pd(A[(long)i * K + k]);
            int j = 0;
            for (; j < n4; j += 4) {
                __m256d c = _mm256_loadu_pd(crow + j);
                c = _mm256_fmadd_pd(a, _mm256_loadu_pd(brow + j), c);
                _mm256_storeu_pd(crow + j, c);
            }
            for (; j < N; j++) {
                crow[j] += A[(long)i * K + k] * brow[j];
            }
        }
    }
}
