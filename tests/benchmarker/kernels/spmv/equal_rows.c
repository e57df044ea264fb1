/* Wrong: assumes every row holds the same number of entries (rowptr[M] / M) and ignores the
 * rest of rowptr. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    int per_row = rowptr[M] / M;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = i * per_row; k < (i + 1) * per_row; k++) s += val[k] * x[col[k]];
        y[i] = s;
    }
}
