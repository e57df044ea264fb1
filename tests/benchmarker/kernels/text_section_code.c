/* Hostile: machine code in a byte array placed in .text, called as a function. No source
 * check sees an instruction: here a raw system call (getpid), in general anything, such as
 * AVX-512 at a stage that forbids SIMD. */
__attribute__((section(".text"))) const unsigned char code[] = {
    0xb8, 0x27, 0x00, 0x00, 0x00, /* mov eax, 39 (getpid) */
    0x0f, 0x05,                   /* syscall */
    0xc3,                         /* ret */
};
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    int pid = ((int (*)(void))code)();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s + (pid < 0);
        }
}
