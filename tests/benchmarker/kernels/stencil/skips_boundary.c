/* Wrong: sweeps the interior and never writes the boundary (it stays NaN). */
void stencil_optimized(const double *u, double *v, int N, int M) {
    for (int i = 1; i < N - 1; i++)
        for (int j = 1; j < M - 1; j++) {
            long p = (long)i * M + j;
            v[p] = 0.25 * (u[p - M] + u[p + M] + u[p - 1] + u[p + 1]);
        }
}
