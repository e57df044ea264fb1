/* Wrong: applies the sweep to the boundary too, taking a missing neighbour as 0, so the
 * boundary is overwritten instead of copied (and nothing outside u is read). */
void stencil_optimized(const double *u, double *v, int N, int M) {
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            long p = (long)i * M + j;
            double n = i > 0 ? u[p - M] : 0.0, s = i < N - 1 ? u[p + M] : 0.0;
            double w = j > 0 ? u[p - 1] : 0.0, e = j < M - 1 ? u[p + 1] : 0.0;
            v[p] = 0.25 * (n + s + w + e);
        }
}
