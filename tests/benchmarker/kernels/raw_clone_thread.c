/* Hostile (x86-64): computes C honestly, then starts a thread with a raw clone system call
 * (inline asm: no libc symbol names it, so the object check has nothing to see) and returns
 * while that thread runs on: it spins until the process ends. C is right and never changes
 * after the call, so neither the verification nor the late-change check sees anything; a
 * thread like it could as well finish C after the timer stopped, compute on the next job's
 * inputs before that job's timer starts, or compete with a later timed run. (It does not
 * write C after the call: the harness frees C 2 ms later, and a write after that, when a
 * loaded node delays the thread, would crash the process and test something else.) The
 * source checks refuse inline asm: the tests compile this with them skipped, as if fooled. */
#include <stdlib.h>

/* CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM */
#define THREAD_FLAGS 0x50f00L
#define STACK_BYTES (64 * 1024)

/* The new thread shares the caller's TLS (no CLONE_SETTLS): it calls no libc function. */
static void linger(void) {
    for (volatile unsigned long spin = 0;; spin++) {
    }
}

/* clone(flags, stack): the child starts on `stack` right after the syscall, pops the
 * function that was put there, calls it and would end with exit (the thread only). The
 * parent gets the child's id. */
static long start_thread(void (*fn)(void)) {
    char *stack = malloc(STACK_BYTES);  /* never freed: the thread never ends */
    void **top = (void **)(stack + STACK_BYTES);
    *--top = (void *)fn;
    long ret;
    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "pop %%rax\n\t"
                     "and $-16, %%rsp\n\t"
                     "call *%%rax\n\t"
                     "mov $60, %%eax\n\t"
                     "xor %%edi, %%edi\n\t"
                     "syscall\n\t"
                     "1:"
                     : "=a"(ret)
                     : "a"(56 /* clone */), "D"(THREAD_FLAGS), "S"(top), "d"(0)
                     : "rcx", "r11", "r8", "r10", "memory");
    return ret;
}

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    start_thread(linger);
}
