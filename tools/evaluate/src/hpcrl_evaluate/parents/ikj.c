// Fixed parent of the evaluation set (stage 1): the plain triple loop in i-k-j order, so the
// innermost loop walks B and C row-wise (unit stride). Correct for any M, N, K.
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            C[i * N + j] = 0.0;
        }
        for (int k = 0; k < K; k++) {
            double a = A[i * K + k];
            for (int j = 0; j < N; j++) {
                C[i * N + j] += a * B[k * N + j];
            }
        }
    }
}
