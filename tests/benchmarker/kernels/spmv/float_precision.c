/* Wrong for a double task: products and sums in single precision. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < M; i++) {
        float s = 0.0f;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) s += (float)val[k] * (float)x[col[k]];
        y[i] = s;
    }
}
