/* The SQD seed: a plain, correct double loop (row-major y = A * x). */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double sum = 0.0;
        for (int j = 0; j < N; j++) {
            sum += A[i * N + j] * x[j];
        }
        y[i] = sum;
    }
}
