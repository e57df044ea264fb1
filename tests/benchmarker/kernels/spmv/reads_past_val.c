/* Wrong: an unrolled loop without a remainder: each row read four entries at a time, so up
 * to three entries past the row (past the end of col and val in the last one). */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k += 4)
            s += val[k] * x[col[k]] + val[k + 1] * x[col[k + 1]] + val[k + 2] * x[col[k + 2]] +
                 val[k + 3] * x[col[k + 3]];
        y[i] = s;
    }
}
