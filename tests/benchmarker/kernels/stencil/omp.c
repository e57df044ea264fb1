/* Honest, with OpenMP threads over the rows: allowed from stage 4. */
void stencil_optimized(const double *u, double *v, int N, int M) {
    #pragma omp parallel for
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < M; j++) {
            long p = (long)i * M + j;
            if (i == 0 || i == N - 1 || j == 0 || j == M - 1)
                v[p] = u[p];
            else
                v[p] = 0.25 * (u[p - M] + u[p + M] + u[p - 1] + u[p + 1]);
        }
    }
}
