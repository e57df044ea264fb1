/* Hostile: stashes a value in the word just before y (state a later call could find), then
 * computes y right. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    y[-1] = (double)M;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
}
