/* Tricky: a GNU nested function whose address is taken needs a trampoline on an executable
 * stack, and an executable stack would run any bytes the kernel writes there. */
static void each_row(void (*row)(int), int m) {
    for (int i = 0; i < m; i++) row(i);
}
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    void row(int i) {
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    }
    each_row(row, M);
}
