/* Hostile: sweeps u in place (Gauss-Seidel order: updated neighbours are read) and copies the
 * result to v, leaving u changed. */
void stencil_optimized(const double *u, double *v, int N, int M) {
    double *w = (double *)u;
    for (int i = 1; i < N - 1; i++)
        for (int j = 1; j < M - 1; j++) {
            long p = (long)i * M + j;
            w[p] = 0.25 * (w[p - M] + w[p + M] + w[p - 1] + w[p + 1]);
        }
    for (long p = 0; p < (long)N * M; p++) v[p] = w[p];
}
