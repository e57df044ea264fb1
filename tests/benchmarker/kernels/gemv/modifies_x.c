/* Hostile: uses x as scratch (scaled by 2, then y halved) and leaves it changed. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    double *w = (double *)x;
    for (int j = 0; j < N; j++) w[j] *= 2.0;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j] * w[j];
        y[i] = 0.5 * s;
    }
}
