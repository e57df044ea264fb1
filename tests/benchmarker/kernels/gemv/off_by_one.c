/* Wrong: the last column is never summed. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N - 1; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
}
