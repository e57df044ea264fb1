/* Wrong: ignores col, as if each row's entries were its first columns (a dense prefix). */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) s += val[k] * x[(k - rowptr[i]) % N];
        y[i] = s;
    }
    (void)col;
}
