/* Honest, with OpenMP threads: allowed from stage 4. */
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    #pragma omp parallel for
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++) s += A[(long)i * N + j] * x[j];
        y[i] = s;
    }
}
