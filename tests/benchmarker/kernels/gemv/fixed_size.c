/* Right at the reward size only: the sizes are constants, M and N are ignored. */
#define ROWS 1023
#define COLS 1021
void gemv_optimized(const double *A, const double *x, double *y, int M, int N) {
    (void)N;
    for (int i = 0; i < ROWS && i < M; i++) {
        double s = 0.0;
        for (int j = 0; j < COLS; j++) s += A[(long)i * COLS + j] * x[j];
        y[i] = s;
    }
}
