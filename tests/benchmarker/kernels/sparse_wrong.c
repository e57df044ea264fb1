/* Hostile: leaves one column of every other row as finite garbage (no corner, no centre):
 * 128 wrong elements of 65536, which 105 sampled points miss about 80 % of the time. */
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            if (N > 4 && j == N - 3 && i % 2) { C[i * N + j] = 0.0; continue; }
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
}
