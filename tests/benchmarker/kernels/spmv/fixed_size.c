/* Right at the reward size only: walks the entries as one flat loop over a constant count
 * (the reward size's 700001), advancing a row cursor; at another size it misses entries or
 * reads past col and val. */
#define ENTRIES 700001
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < M; i++) y[i] = 0.0;
    int row = 0;
    for (int k = 0; k < ENTRIES; k++) {
        while (row < M - 1 && rowptr[row + 1] <= k) row++;
        y[row] += val[k] * x[col[k]];
    }
}
