/* Test support (not hostile): always right, but erratic in the harness process that also ran
 * the verification sizes (its second timed call does the work thirty times over: the first
 * timing attempt's runs disagree, cv above 1 even when another of its runs is slowed 3x), steady in a process that runs only the reward size (a
 * re-timing attempt). A test may define RETIMED_CALL to make the kernel do something else
 * from the second call of such a process on. */
static int process_calls, saw_other_size, reward_calls;

static void multiply(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) C[i * N + j] = 0.0;
        for (int k = 0; k < K; k++) {
            double a = A[i * K + k];
            for (int j = 0; j < N; j++) C[i * N + j] += a * B[k * N + j];
        }
    }
}

#ifndef RETIMED_CALL
#define RETIMED_CALL multiply
#endif

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    process_calls++;
    if (M != 256) saw_other_size = 1;
    if (!saw_other_size && process_calls >= 2) {
        RETIMED_CALL(A, B, C, M, N, K);
        return;
    }
    volatile int repeats = (saw_other_size && M == 256 && ++reward_calls == 3) ? 30 : 1;
    for (int r = 0; r < repeats; r++) multiply(A, B, C, M, N, K);
}
