#include <immintrin.h>
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++) {
        int j = 0;
        for (; j + 4 <= N; j += 4) {
            __m256d acc = _mm256_setzero_pd();
            for (int k = 0; k < K; k++) {
                _mm_prefetch((const char *)&B[(k + 4 < K ? k + 4 : k) * N + j], _MM_HINT_T0);
                acc = _mm256_fmadd_pd(_mm256_set1_pd(A[i * K + k]),
                                      _mm256_loadu_pd(&B[k * N + j]), acc);
            }
            _mm256_storeu_pd(&C[i * N + j], acc);
        }
        for (; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    }
}
