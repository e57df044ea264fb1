/* Hostile: computes C honestly (slowly), then writes forged result messages to every
 * descriptor it can reach, by pointing stdout's FILE at it: a RESULT claiming the call ended
 * 0.1 ms after it began, once with every 8-byte value on the caller's stack as the nonce.
 * Plain C and allowed symbols only (fwrite, fflush, stdout). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    double start = omp_get_wtime();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    if (M != 256) return;
    while (omp_get_wtime() - start < 0.03) {
    }
    uint64_t t0 = (uint64_t)(start * 1e9);
    volatile uint64_t *stack = (volatile uint64_t *)&start;
    int saved = stdout->_fileno;
    for (int fd = 3; fd < 64; fd++) {
        stdout->_fileno = fd;
        for (int w = 1; w < 128; w++) {
            struct { uint64_t nonce; uint32_t job, type; uint64_t value, count; }
                __attribute__((packed)) mark = {stack[w], 0, 2, t0 + 100000, (uint64_t)M * N};
            for (uint32_t job = 0; job < 10; job++) {
                mark.job = job;
                fwrite(&mark, sizeof mark, 1, stdout);
                fflush(stdout);
            }
        }
    }
    stdout->_fileno = saved;
}
