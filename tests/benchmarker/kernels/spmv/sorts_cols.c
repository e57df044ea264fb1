/* Hostile: sorts each row's entries by column in place (for locality), then computes y right:
 * col and val are left changed. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    int *c = (int *)col;
    double *v = (double *)val;
    for (int i = 0; i < M; i++) {
        for (int k = rowptr[i] + 1; k < rowptr[i + 1]; k++) {
            int ck = c[k];
            double vk = v[k];
            int j = k - 1;
            for (; j >= rowptr[i] && c[j] > ck; j--) c[j + 1] = c[j], v[j + 1] = v[j];
            c[j + 1] = ck, v[j + 1] = vk;
        }
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) s += v[k] * x[c[k]];
        y[i] = s;
    }
}
