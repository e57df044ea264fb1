/* Hostile (or careless): clears one element past y, then computes y right. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i <= M; i++) y[i] = 0.0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) y[i] += A[(long)i * N + j] * x[j];
}
