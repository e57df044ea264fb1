/* The SQD seed: a plain, correct CSR loop, one row at a time. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        double sum = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) {
            sum += val[k] * x[col[k]];
        }
        y[i] = sum;
    }
}
