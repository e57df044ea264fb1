/* Correct but slow: every row summed four times over, through a volatile accumulator (a
 * store and a load per term). */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        for (int r = 0; r < 4; r++) {
            volatile double s = 0.0;
            for (int j = 0; j < N; j++) s += A[(long)i * N + j] * x[j];
            y[i] = s;
        }
    }
}
