/* hpcrl harness, the part every task shares: runs an untrusted kernel on jobs read one at a
 * time from stdin and reports every call to the trusted parent. It is trusted code linked with
 * the untrusted kernel object inside the sandbox; it does not judge correctness (the parent
 * computes the reference from the same seeds).
 *
 * A task's template (gemm.c, gemv.c, ...) defines HARNESS_DIMS (the sizes on a job's line) and
 * HARNESS_INPUTS, includes this file and then defines, static and free of calls through
 * memory the kernel can write (they run between the seed's line and the call):
 *   size_t input_bytes(int input, const int *dims)      bytes of input `input`
 *   size_t output_count(const int *dims)                doubles of the output
 *   void fill_inputs(void *const *in, const int *dims, uint64_t seed)
 *                                                       the inputs from the seed (the parent
 *                                                       makes the same ones)
 *   void call_kernel(void *const *in, double *out, const int *dims)
 *
 * The kernel runs in this process, so it can read and write all of its memory. Nothing the
 * parent relies on may therefore be in memory that the kernel can reach *before* it matters:
 *  - a job's seed arrives only when the parent sends that job (after the previous one was
 *    complete): future inputs are never in this process, so nothing can be precomputed;
 *  - with HPCRL_READY=1 (the pipeline's runs), the harness fills a call's inputs, sends READY
 *    and waits for the parent's go ("g") before it starts the clock: meanwhile the parent
 *    reads, from the host's /proc, that no thread but this one has run since it sent the
 *    job (a thread left behind by an earlier call cannot work on these inputs before the
 *    clock starts). Nor can the kernel make this thread work for it then: a job is two
 *    lines, sent together, its sizes and then its seed; the buffers are allocated between
 *    them (malloc may call through libc's GOT, which is writable: Debian's libc is not
 *    linked with -z now), and from the seed's line to the call this thread makes no call
 *    through memory the kernel can write (the lines are parsed here, not by sscanf; the
 *    fill is the template's code; memcpy is reached through this binary's read-only GOT);
 *  - the start time is sent out before the kernel is called, on a socket whose messages the
 *    host's kernel timestamps on arrival (SO_TIMESTAMPNS); the end time is sent right after
 *    the call returns. The parent checks both against those timestamps, so a kernel that
 *    rewrites the harness's times (stack walk), forges messages or has the parent read them
 *    late gains at most the parent's small slack;
 *  - descriptors are compile-time constants (immediates in the code, not data), the clock and
 *    the writes are raw system calls (no GOT entry to redirect), the binary is linked with
 *    full RELRO, and seccomp refuses mmap/mprotect/mremap in the executable's address window,
 *    so the harness's own code path after the call cannot be changed;
 *  - every input and the output lie between two guard zones (GUARD_BYTES each, all bits set:
 *    NaN as doubles, -1 as integers), so that reading just past an array gives NaN (a wrong
 *    result) and writing there is seen after the call (the OUTSIDE_WRITTEN flag). Not seen:
 *    a write of what the zone already holds (arithmetic on that NaN, y[-1] += 1, gives the
 *    same bits back: nothing is stored), and a write further away than the zone (it lands
 *    in another buffer or the heap's bookkeeping: an input and its copy differ, or a crash).
 *
 * argv:  <data fd> [<mark fd>] (without a mark fd, marks go to the data fd: bench floor only)
 * stdin: "<nonce>\n", then per job "<kind> <dim 1> ... <dim HARNESS_DIMS>\n<seed>\n" (kind
 *        v|w|t) and, with HPCRL_READY=1, "g\n" after its READY mark; then "e\n".
 * marks (32 bytes each, one per message): {u64 nonce, u32 job, u32 type, u64 value, u64 count}
 *   READY  value = 0: the job's inputs are ready; the harness waits for "g" (HPCRL_READY=1)
 *   BEGIN  value = CLOCK_MONOTONIC ns just before the call
 *   RESULT value = CLOCK_MONOTONIC ns just after the call; count doubles of the output follow
 *          on the data fd
 *   CHECK  value = flags (inputs modified, output changed after return, parallel region left
 *          open, memory outside the arrays written)
 *   END    job = number of jobs run
 */
#ifndef HPCRL_HARNESS_H
#define HPCRL_HARNESS_H
#define _GNU_SOURCE
#include <errno.h>
#include <fenv.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <math.h>
#include <omp.h>
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

#if !defined(HARNESS_DIMS) || !defined(HARNESS_INPUTS)
#error "a harness template defines HARNESS_DIMS and HARNESS_INPUTS before including harness.h"
#endif

#define FLAG_INPUTS_MODIFIED 1u
#define FLAG_CHANGED_AFTER_RETURN 2u
#define FLAG_PARALLEL_LEFT_OPEN 4u
#define FLAG_OUTSIDE_WRITTEN 8u
#define MARK_BEGIN 1u
#define MARK_RESULT 2u
#define MARK_CHECK 3u
#define MARK_READY 4u
#define MARK_END 0x80000000u
#ifndef MAX_DIM
#define MAX_DIM 8192
#endif
/* Before and after every input and the output; a multiple of 64 (the arrays stay aligned). */
#define GUARD_BYTES 4096
#define GUARD_BYTE 0xFF
/* Exit statuses: defined once, in hpcrl_benchmarker/exitcodes.py (HarnessExit), which the
 * benchmarker passes in as -D flags when it compiles this file. */
#if !defined(HARNESS_EXIT_WRITE_FAILED) || !defined(HARNESS_EXIT_SECCOMP_FAILED) || \
    !defined(HARNESS_EXIT_OUT_OF_MEMORY) || !defined(HARNESS_EXIT_BAD_INPUT)
#error "compile with hpcrl_benchmarker.exitcodes.harness_defines()"
#endif
/* Below the sandbox's open-files limit (64); constants, so the kernel cannot redirect them. */
#define DATA_FD 60
#define MARK_FD 61

/* The template's part (see the top of this file). */
static size_t input_bytes(int input, const int *dims);
static size_t output_count(const int *dims);
static void fill_inputs(void *const *in, const int *dims, uint64_t seed);
static void call_kernel(void *const *in, double *out, const int *dims);

typedef struct __attribute__((packed)) {
    uint64_t nonce;
    uint32_t job;
    uint32_t type;
    uint64_t value;
    uint64_t count;
} mark_t;

extern char __executable_start[], _end[];

static inline long raw3(long nr, long a, long b, long c) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c)
                     : "rcx", "r11", "memory");
    return ret;
}

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    raw3(__NR_clock_gettime, CLOCK_MONOTONIC, (long)&ts, 0);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int write_all(int fd, const void *data, size_t size) {
    const char *p = data;
    while (size > 0) {
        long n = raw3(__NR_write, fd, (long)p, (long)size);
        if (n == -EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        size -= (size_t)n;
    }
    return 0;
}

static int send_mark(int fd, uint64_t nonce, uint32_t job, uint32_t type, uint64_t value,
                     uint64_t count) {
    mark_t mark = {nonce, job, type, value, count};
    return write_all(fd, &mark, sizeof mark);
}

static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Values in [-1, 1); the parent regenerates exactly the same numbers with numpy
 * (harnesses.random_values). Exact in any rounding mode (53-bit integers scaled by powers of
 * two), never subnormal. */
static void fill(double *x, size_t n, uint64_t seed) {
    _Pragma("omp simd") /* vectorised where 64-bit multiplies are (AVX-512DQ) */
    for (size_t i = 0; i < n; i++) {
        uint64_t z = mix(seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull);
        x[i] = (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    }
}

static size_t rounded(size_t bytes) {
    return (bytes + 63) & ~(size_t)63;
}

static void *must_alloc(size_t bytes) {
    void *p = aligned_alloc(64, bytes ? rounded(bytes) : 64);
    if (!p) {
        fprintf(stderr, "harness: out of memory\n");
        _exit(HARNESS_EXIT_OUT_OF_MEMORY);
    }
    return p;
}

/* `bytes` between two guard zones: GUARD_BYTES before, and from the array's exact end to the
 * end of the block (at least GUARD_BYTES) after. */
static void *guarded_alloc(size_t bytes) {
    char *block = must_alloc(GUARD_BYTES + rounded(bytes) + GUARD_BYTES);
    memset(block, GUARD_BYTE, GUARD_BYTES);
    memset(block + GUARD_BYTES + bytes, GUARD_BYTE, rounded(bytes) - bytes + GUARD_BYTES);
    return block + GUARD_BYTES;
}

static int guards_intact(const void *array, size_t bytes) {
    const unsigned char *before = (const unsigned char *)array - GUARD_BYTES;
    const unsigned char *after = (const unsigned char *)array + bytes;
    size_t tail = rounded(bytes) - bytes + GUARD_BYTES;
    unsigned char seen = GUARD_BYTE;
    for (size_t i = 0; i < GUARD_BYTES; i++) seen &= before[i];
    for (size_t i = 0; i < tail; i++) seen &= after[i];
    return seen == GUARD_BYTE;
}

static void guarded_free(void *array) {
    free((char *)array - GUARD_BYTES);
}

/* One line from stdin with raw reads (no stdio buffer in reach of the kernel between jobs). */
static int read_line(char *buf, size_t size) {
    size_t n = 0;
    while (n + 1 < size) {
        char c;
        long r = raw3(__NR_read, 0, (long)&c, 1);
        if (r == -EINTR) continue;
        if (r <= 0) return -1;
        if (c == '\n') break;
        buf[n++] = c;
    }
    buf[n] = 0;
    return (int)n;
}

/* "<kind> <dim> ..." (kind v|w|t, HARNESS_DIMS sizes) and "<seed>", read without libc: NULL
 * if they are not. */
static const char *parse_number(const char *p, uint64_t *out) {
    if (*p < '0' || *p > '9') return NULL;
    uint64_t v = 0;
    for (int digits = 0; *p >= '0' && *p <= '9'; digits++) {
        if (digits == 19) return NULL;
        v = v * 10 + (uint64_t)(*p++ - '0');
    }
    *out = v;
    return p;
}

static const char *parse_sizes(const char *p, int *dims) {
    uint64_t v;
    if (*p != 'v' && *p != 'w' && *p != 't') return NULL;
    p++;
    for (int i = 0; i < HARNESS_DIMS; i++) {
        if (*p++ != ' ' || !(p = parse_number(p, &v)) || v < 1 || v > MAX_DIM) return NULL;
        dims[i] = (int)v;
    }
    return *p ? NULL : p;
}

static const char *parse_seed(const char *p, uint64_t *seed) {
    return (p = parse_number(p, seed)) != NULL && *p == 0 ? p : NULL;
}

#define ALLOW(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)
#define ARG_LO(i) (offsetof(struct seccomp_data, args) + 8 * (i))
#define ARG_HI(i) (ARG_LO(i) + 4)
#define DENY BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM)
#define PASS BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)
#define LOAD(off) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (off))
#define NR offsetof(struct seccomp_data, nr)

/* After set-up, the kernel may only compute, allocate memory, use threads and write to the
 * descriptors it already has: no files, processes, sockets, signal handlers, new code, nor
 * memory-map changes inside the executable's address window (its GOT stays read-only). */
static int lock_down(int no_threads) {
    uint32_t lo = (uint32_t)((uintptr_t)__executable_start >> 32);
    uint32_t hi = (uint32_t)((uintptr_t)_end >> 32);
    if (lo == 0) lo = hi = 0xFFFFFFFFu; /* not PIE: the window rule would catch NULL hints */
    struct sock_filter filter[] = {
        LOAD(offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        /* mmap/mprotect: never executable memory (W^X), never in the executable's window */
        LOAD(NR),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mprotect, 0, 7),
        LOAD(ARG_LO(2)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, PROT_EXEC, 3, 0),
        LOAD(ARG_HI(0)),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, lo, 0, 2),
        BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, hi, 1, 0),
        DENY,
        PASS,
        /* mremap: never to a fixed address, never in the executable's window */
        LOAD(NR),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mremap, 0, 7),
        LOAD(ARG_LO(3)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, 2 /* MREMAP_FIXED */, 3, 0),
        LOAD(ARG_HI(0)),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, lo, 0, 2),
        BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, hi, 1, 0),
        DENY,
        PASS,
        /* At a stage that forbids OpenMP (no_threads): no thread at all. clone and clone3
         * kill the process (SIGSYS, which nothing can catch or block: the parent reads it as
         * the stage violation it is), however the kernel reached them: a pragma, a libgomp
         * or libc entry point resolved by hand, a raw system call. */
        LOAD(NR),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 2),
        BPF_JUMP(BPF_JMP | BPF_JA, no_threads ? 0 : 1, 0, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        /* clone: threads only, never a new process */
        LOAD(NR),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 4),
        LOAD(ARG_LO(0)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, 0x00010000 /* CLONE_THREAD */, 0, 1),
        PASS,
        DENY,
        /* clone3 hides its flags in memory: make glibc fall back to clone */
        LOAD(NR),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        ALLOW(__NR_read), ALLOW(__NR_write), ALLOW(__NR_close), ALLOW(__NR_fstat),
        ALLOW(__NR_munmap), ALLOW(__NR_brk), ALLOW(__NR_madvise),
        ALLOW(__NR_rt_sigprocmask), ALLOW(__NR_rt_sigreturn), ALLOW(__NR_sched_yield),
        ALLOW(__NR_nanosleep), ALLOW(__NR_clock_nanosleep), ALLOW(__NR_clock_gettime),
        ALLOW(__NR_getpid), ALLOW(__NR_gettid), ALLOW(__NR_tgkill), ALLOW(__NR_futex),
        ALLOW(__NR_sched_getaffinity), ALLOW(__NR_sched_setaffinity),
        ALLOW(__NR_set_robust_list), ALLOW(__NR_rseq), ALLOW(__NR_exit),
        ALLOW(__NR_exit_group), ALLOW(__NR_getrandom), ALLOW(__NR_membarrier),
        DENY,
    };
    struct sock_fprog prog = {.len = sizeof(filter) / sizeof(filter[0]), .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return (int)syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog);
}

#ifdef HARNESS_INPUTS_ONLY
/* The trusted parent's copy of the inputs (harnesses.NativeInputs): this file and a template
 * compiled as a shared library with -DHARNESS_INPUTS_ONLY, without the kernel (call_kernel,
 * the only use of it, is static and unused, so never emitted), main or the lock-down. The
 * parent then makes every job's inputs with the template's own fill_inputs, bit for bit
 * what the harness makes from the same seed, in a few ms where numpy needs tens. */
#define HPCRL_EXPORT __attribute__((visibility("default")))
HPCRL_EXPORT int hpcrl_inputs(void) {
    return HARNESS_INPUTS;
}
HPCRL_EXPORT int hpcrl_dims(void) {
    return HARNESS_DIMS;
}
HPCRL_EXPORT long hpcrl_max_dim(void) {
    return MAX_DIM;
}
HPCRL_EXPORT size_t hpcrl_input_bytes(int input, const int *dims) {
    return input_bytes(input, dims);
}
HPCRL_EXPORT size_t hpcrl_output_count(const int *dims) {
    return output_count(dims);
}
HPCRL_EXPORT void hpcrl_fill_inputs(void *const *in, const int *dims, uint64_t seed) {
    fill_inputs(in, dims, seed);
}
#ifdef HARNESS_REFERENCE
/* A template that defines HARNESS_REFERENCE before including this file gives the parent its
 * reference in C too (harnesses.native_reference): reference(in, out, dims) writes the whole
 * correct output for inputs made by fill_inputs. Trusted code only, as above: it is built
 * into this library alone, never into the harness that runs a kernel. */
static void reference(void *const *in, double *out, const int *dims);
HPCRL_EXPORT void hpcrl_reference(void *const *in, const int *dims, double *out) {
    reference(in, out, dims);
}
#endif
#else
int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) return HARNESS_EXIT_BAD_INPUT;
    int data = atoi(argv[1]), marks = argc == 3 ? atoi(argv[2]) : data;
    if (data < 3 || marks < 3 || dup2(data, DATA_FD) != DATA_FD ||
        dup2(marks, MARK_FD) != MARK_FD)
        return HARNESS_EXIT_BAD_INPUT;
    if (data != DATA_FD && data != MARK_FD) close(data);
    if (marks != DATA_FD && marks != MARK_FD && marks != data) close(marks);
    char line[160];
    uint64_t nonce;
    if (read_line(line, sizeof line) < 0 || sscanf(line, "%lu", &nonce) != 1)
        return HARNESS_EXIT_BAD_INPUT;
    /* HPCRL_NO_THREADS=1: a stage that forbids OpenMP (the parent sets it, and nothing of
     * the kernel has run yet). Its OMP_NUM_THREADS is 1, so the warm-up below starts no
     * thread; after the lock-down none can be started. */
    const char *no_threads_env = getenv("HPCRL_NO_THREADS");
    int no_threads = no_threads_env != NULL && no_threads_env[0] == '1';
    /* HPCRL_READY=1: READY and the parent's go before every call. The kernel could clear
     * this flag; the parent, which expects READY before every BEGIN and a start after its
     * go, then ends the run as tampered with. */
    const char *ready_env = getenv("HPCRL_READY");
    int handshake = ready_env != NULL && ready_env[0] == '1';
    /* Start the OpenMP thread pool before the lock-down so that TSYNC covers its threads. */
    volatile int warm = 0;
#pragma omp parallel
    {
#pragma omp atomic
        warm++;
    }
    if (lock_down(no_threads) != 0) {
        fprintf(stderr, "harness: seccomp failed\n");
        return HARNESS_EXIT_SECCOMP_FAILED;
    }
    uint32_t j = 0;
    for (;; j++) {
        int dims[HARNESS_DIMS];
        uint64_t seed;
        if (read_line(line, sizeof line) < 0) return HARNESS_EXIT_BAD_INPUT;
        if (line[0] == 'e' && line[1] == 0) break;
        if (!parse_sizes(line, dims)) return HARNESS_EXIT_BAD_INPUT;
        /* Fresh buffers and fresh inputs for every call: nothing can be reused by pointer,
         * content or position, and the output starts as NaN so nothing can be accumulated
         * into it. */
        void *in[HARNESS_INPUTS], *in0[HARNESS_INPUTS];
        size_t bytes[HARNESS_INPUTS];
        for (int i = 0; i < HARNESS_INPUTS; i++) {
            bytes[i] = input_bytes(i, dims);
            in[i] = guarded_alloc(bytes[i]);
            in0[i] = must_alloc(bytes[i]);
        }
        size_t nout = output_count(dims);
        double *output = guarded_alloc(nout * sizeof(double));
        double *copy = must_alloc(nout * sizeof(double));
        /* The seed only now: whatever the kernel made malloc call cannot have read it. */
        if (read_line(line, sizeof line) < 0 || !parse_seed(line, &seed))
            return HARNESS_EXIT_BAD_INPUT;
        fill_inputs(in, dims, seed);
        for (int i = 0; i < HARNESS_INPUTS; i++) memcpy(in0[i], in[i], bytes[i]);
        for (size_t i = 0; i < nout; i++) output[i] = NAN;
        /* Every call starts in the default FP environment (round to nearest, no FTZ/DAZ),
         * whatever an earlier call left behind. */
        fesetenv(FE_DFL_ENV);
        if (handshake) {
            /* The parent checks, from outside, that no other thread ran while these inputs
             * existed, then lets the call begin. */
            if (send_mark(MARK_FD, nonce, j, MARK_READY, 0, 0)) return HARNESS_EXIT_WRITE_FAILED;
            if (read_line(line, sizeof line) < 0 || line[0] != 'g' || line[1] != 0)
                return HARNESS_EXIT_BAD_INPUT;
        }
        uint64_t t0 = mono_ns();
        if (send_mark(MARK_FD, nonce, j, MARK_BEGIN, t0, 0))
            return HARNESS_EXIT_WRITE_FAILED;
        call_kernel(in, output, dims);
        uint64_t t1 = mono_ns();
        uint32_t flags = 0;
        /* GOMP_parallel_start without its end leaves threads running kernel code. */
        if (omp_get_level() != 0 || omp_in_parallel()) flags |= FLAG_PARALLEL_LEFT_OPEN;
        /* The mark first (its stamp bounds t1 tightly); the output is copied after it, and
         * one that still changes after the copy is caught below. */
        if (send_mark(MARK_FD, nonce, j, MARK_RESULT, t1, nout))
            return HARNESS_EXIT_WRITE_FAILED;
        memcpy(copy, output, nout * sizeof(double));
        if (write_all(DATA_FD, copy, nout * sizeof(double)))
            return HARNESS_EXIT_WRITE_FAILED;
        for (int i = 0; i < HARNESS_INPUTS; i++) {
            if (memcmp(in[i], in0[i], bytes[i])) flags |= FLAG_INPUTS_MODIFIED;
            if (!guards_intact(in[i], bytes[i])) flags |= FLAG_OUTSIDE_WRITTEN;
        }
        if (!guards_intact(output, nout * sizeof(double))) flags |= FLAG_OUTSIDE_WRITTEN;
        /* Work still running after return (a detached thread) shows up as a late change;
         * the thread itself, however it was started, in the parent's count of this
         * process's threads (from the host's /proc, before it sends the next job). */
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
        if (memcmp(copy, output, nout * sizeof(double))) flags |= FLAG_CHANGED_AFTER_RETURN;
        if (send_mark(MARK_FD, nonce, j, MARK_CHECK, flags, 0))
            return HARNESS_EXIT_WRITE_FAILED;
        for (int i = 0; i < HARNESS_INPUTS; i++) guarded_free(in[i]), free(in0[i]);
        guarded_free(output), free(copy);
    }
    if (send_mark(MARK_FD, nonce, j, MARK_END, 0, 0)) return HARNESS_EXIT_WRITE_FAILED;
    return 0;
}
#endif /* HARNESS_INPUTS_ONLY */
#endif
