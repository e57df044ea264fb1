/* Wrong: assumes a band: keeps only the entries within 16 columns of the row's diagonal
 * position (as a DIA/banded kernel would store them), dropping the rest. */
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    for (int i = 0; i < M; i++) {
        long diagonal = (long)i * N / M;
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) {
            long d = col[k] - diagonal;
            if (d >= -16 && d <= 16) s += val[k] * x[col[k]];
        }
        y[i] = s;
    }
}
