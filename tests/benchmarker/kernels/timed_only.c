/* Hostile: counts calls to tell the timed runs (after 4 verification sizes and a warm-up)
 * from the checked ones, and skips two rows there (left as 0, finite; no corner, no centre),
 * which the paper's 105 sampled points miss about 45 % of the time per run. */
#include <string.h>
static int calls;
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int call = ++calls, timed = M == 256 && call >= 6 && call <= 8;
    memset(C, 0, sizeof(double) * M * N);
    for (int i = 0; i < M; i++) {
        if (timed && (i == 1 || i == 2)) continue;
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    }
}
