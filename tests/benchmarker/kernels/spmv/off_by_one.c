/* Wrong: one entry too many per row (k <= rowptr[i + 1]): the next row's first entry, and past
 * the end of col and val in the last row (col's guard zone reads -1, so x[-1]: NaN). */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = rowptr[i]; k <= rowptr[i + 1]; k++) s += val[k] * x[col[k]];
        y[i] = s;
    }
}
