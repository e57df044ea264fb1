/* Wrong for a double task: products and sums in single precision. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        float s = 0.0f;
        for (int j = 0; j < N; j++) s += (float)A[(long)i * N + j] * (float)x[j];
        y[i] = s;
    }
}
