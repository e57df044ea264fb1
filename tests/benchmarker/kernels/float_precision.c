/* Hostile: single precision (twice the SIMD throughput) passes most relative-error checks
 * where |C| is large, and fails where cancellation makes it small. */
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += (float)A[i * K + k] * (float)B[k * N + j];
            C[i * N + j] = s;
        }
}
