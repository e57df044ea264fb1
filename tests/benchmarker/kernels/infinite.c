void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    volatile int forever = 1;
    while (forever) C[0] = A[0] + B[0] + M + N + K;
}
