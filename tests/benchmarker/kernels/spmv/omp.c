/* Honest, with OpenMP threads over the rows (dynamic: the row lengths vary): allowed from
 * stage 4. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    #pragma omp parallel for schedule(dynamic, 64)
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) s += val[k] * x[col[k]];
        y[i] = s;
    }
}
