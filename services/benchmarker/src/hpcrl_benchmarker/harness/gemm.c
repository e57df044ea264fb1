/* hpcrl GEMM harness: runs an untrusted kernel C = A*B on jobs read from stdin and streams
 * every output matrix to a pipe. It is trusted code linked with the untrusted kernel object
 * inside the sandbox; it does not judge correctness (the parent computes the reference with
 * cblas_dgemm from the same seeds), so corrupting this process can only make a run fail.
 *
 * stdin:  "<nonce> <njobs>\n" then per job "<kind> <M> <N> <K> <seed>\n" (kind v|w|t)
 * argv[1]: the descriptor to write results to.
 * out fd: per job a frame {u64 nonce, u32 job, u32 flags, f64 seconds, u64 count} + count
 *         doubles of C; finally {nonce, njobs, FLAG_END, 0, 0}.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef KERNEL_NAME
#define KERNEL_NAME matmul_optimized
#endif
void KERNEL_NAME(double *A, double *B, double *C, int M, int N, int K);

#define FLAG_INPUTS_MODIFIED 1u
#define FLAG_CHANGED_AFTER_RETURN 2u
#define FLAG_END 0x80000000u
#define MAX_JOBS 64
#define MAX_DIM 8192

typedef struct {
    char kind;
    int m, n, k;
    uint64_t seed;
} job_t;

typedef struct __attribute__((packed)) {
    uint64_t nonce;
    uint32_t job;
    uint32_t flags;
    double seconds;
    uint64_t count;
} frame_t;

static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Values in [-1, 1); the parent regenerates exactly the same numbers with numpy. */
static void fill(double *x, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        uint64_t z = mix(seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull);
        x[i] = (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    }
}

static int OUT_FD = -1;

static int write_all(const void *data, size_t size) {
    const char *p = data;
    while (size > 0) {
        ssize_t n = write(OUT_FD, p, size);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        size -= (size_t)n;
    }
    return 0;
}

static void *must_alloc(size_t count) {
    size_t bytes = (count * sizeof(double) + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, bytes ? bytes : 64);
    if (!p) {
        fprintf(stderr, "harness: out of memory\n");
        _exit(97);
    }
    return p;
}

#define ALLOW(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)
#define ARG_LO(i) (offsetof(struct seccomp_data, args) + 8 * (i))

/* After set-up, the kernel may only compute, allocate memory, use threads and write to the
 * descriptors it already has: no files, processes, sockets, signals handlers or new code. */
static int lock_down(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        /* mmap/mprotect: never executable memory (W^X: no code written at run time) */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mprotect, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(2)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, PROT_EXEC, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* clone: threads only, never a new process */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(0)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, 0x00010000 /* CLONE_THREAD */, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        /* clone3 hides its flags in memory: make glibc fall back to clone */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        ALLOW(__NR_read), ALLOW(__NR_write), ALLOW(__NR_close), ALLOW(__NR_fstat),
        ALLOW(__NR_munmap), ALLOW(__NR_brk), ALLOW(__NR_madvise), ALLOW(__NR_mremap),
        ALLOW(__NR_rt_sigprocmask), ALLOW(__NR_rt_sigreturn), ALLOW(__NR_sched_yield),
        ALLOW(__NR_nanosleep), ALLOW(__NR_clock_nanosleep), ALLOW(__NR_clock_gettime),
        ALLOW(__NR_getpid), ALLOW(__NR_gettid), ALLOW(__NR_tgkill), ALLOW(__NR_futex),
        ALLOW(__NR_sched_getaffinity), ALLOW(__NR_sched_setaffinity),
        ALLOW(__NR_set_robust_list), ALLOW(__NR_rseq), ALLOW(__NR_exit),
        ALLOW(__NR_exit_group), ALLOW(__NR_getrandom), ALLOW(__NR_membarrier),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
    };
    struct sock_fprog prog = {.len = sizeof(filter) / sizeof(filter[0]), .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return (int)syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 2 || (OUT_FD = atoi(argv[1])) < 3) return 98;
    uint64_t nonce;
    int njobs;
    job_t jobs[MAX_JOBS];
    if (scanf("%lu %d", &nonce, &njobs) != 2 || njobs < 1 || njobs > MAX_JOBS) return 98;
    for (int j = 0; j < njobs; j++) {
        job_t *job = &jobs[j];
        if (scanf(" %c %d %d %d %lu", &job->kind, &job->m, &job->n, &job->k, &job->seed) != 5)
            return 98;
        if (job->m < 1 || job->n < 1 || job->k < 1 || job->m > MAX_DIM || job->n > MAX_DIM ||
            job->k > MAX_DIM)
            return 98;
    }
    /* Start the OpenMP thread pool before the lock-down so that TSYNC covers its threads. */
    volatile int warm = 0;
#pragma omp parallel
    {
#pragma omp atomic
        warm++;
    }
    if (lock_down() != 0) {
        fprintf(stderr, "harness: seccomp failed\n");
        return 96;
    }
    for (int j = 0; j < njobs; j++) {
        job_t *job = &jobs[j];
        size_t na = (size_t)job->m * job->k, nb = (size_t)job->k * job->n;
        size_t nc = (size_t)job->m * job->n;
        /* Fresh buffers and fresh inputs for every call: nothing can be reused by pointer,
         * content or position, and C starts as NaN so nothing can be accumulated into it. */
        double *A = must_alloc(na), *B = must_alloc(nb), *C = must_alloc(nc);
        double *A0 = must_alloc(na), *B0 = must_alloc(nb), *out = must_alloc(nc);
        fill(A, na, job->seed);
        fill(B, nb, job->seed ^ 0x5DEECE66DA3B1F7Full);
        memcpy(A0, A, na * sizeof(double));
        memcpy(B0, B, nb * sizeof(double));
        for (size_t i = 0; i < nc; i++) C[i] = NAN;
        double t0 = now();
        KERNEL_NAME(A, B, C, job->m, job->n, job->k);
        double t1 = now();
        memcpy(out, C, nc * sizeof(double));
        uint32_t flags = 0;
        if (memcmp(A, A0, na * sizeof(double)) || memcmp(B, B0, nb * sizeof(double)))
            flags |= FLAG_INPUTS_MODIFIED;
        /* Work still running after return (a detached thread) shows up as a late change. */
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
        if (memcmp(out, C, nc * sizeof(double))) flags |= FLAG_CHANGED_AFTER_RETURN;
        frame_t frame = {nonce, (uint32_t)j, flags, t1 - t0, nc};
        if (write_all(&frame, sizeof frame) || write_all(out, nc * sizeof(double))) return 95;
        free(A), free(B), free(C), free(A0), free(B0), free(out);
    }
    frame_t end = {nonce, (uint32_t)njobs, FLAG_END, 0.0, 0};
    if (write_all(&end, sizeof end)) return 95;
    return 0;
}
