/* Wrong: sweeps every row but the first, the last one included: its southern neighbours lie
 * one row past the end of u (the guard zone, which reads as NaN). */
void stencil_optimized(const double *u, double *v, int N, int M) {
    for (int j = 0; j < M; j++) v[j] = u[j];
    for (int i = 1; i < N; i++)
        for (int j = 0; j < M; j++) {
            long p = (long)i * M + j;
            if (j == 0 || j == M - 1)
                v[p] = u[p];
            else
                v[p] = 0.25 * (u[p - M] + u[p + M] + u[p - 1] + u[p + 1]);
        }
}
