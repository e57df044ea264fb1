/* Wrong: row sums of A, x never read. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    (void)x;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j];
        y[i] = s;
    }
}
