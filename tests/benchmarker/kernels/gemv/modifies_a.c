/* Hostile: marks A (const cast away) to recognise inputs seen before. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
    ((double *)A)[0] = 12345.0;
}
