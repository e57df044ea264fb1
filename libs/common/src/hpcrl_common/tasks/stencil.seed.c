/* The SQD seed: copy the grid, then one plain Jacobi sweep over the interior. */
void stencil_optimized(const double *u, double *v, int N, int M) {
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < M; j++) {
            v[i * M + j] = u[i * M + j];
        }
    }
    for (int i = 1; i < N - 1; i++) {
        for (int j = 1; j < M - 1; j++) {
            v[i * M + j] = 0.25 * (u[(i - 1) * M + j] + u[(i + 1) * M + j] +
                                   u[i * M + j - 1] + u[i * M + j + 1]);
        }
    }
}
