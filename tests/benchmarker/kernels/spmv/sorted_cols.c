/* Wrong: assumes each row's columns are sorted and distinct, and stops at the first one that
 * is not above the one before (as a merge-based kernel would). */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        int last = -1;
        for (int k = rowptr[i]; k < rowptr[i + 1] && col[k] > last; k++) {
            s += val[k] * x[col[k]];
            last = col[k];
        }
        y[i] = s;
    }
}
