/* Wrong: reads A as if it were stored by columns (A^T x for a column-major A). */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)j * M + i] * x[j];
        y[i] = s;
    }
}
