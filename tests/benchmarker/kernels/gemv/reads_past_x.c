/* Wrong: sums one term too many, reading A one past its row and x one past its end. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j <= N; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
}
