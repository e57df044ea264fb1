// Hostile (issue 27, class 2): a thread that outlives its call computes part of the next
// call's C before that call's clock starts. Stage 4-6 (threads are allowed there).
//
// Its first call finds the harness's line buffer on the caller's stack ("v 256 256 256
// <seed>"; or, where the harness reads the sizes, the seed and a go "g" as lines of their own,
// "g\0" and the rest of the seed) and leaves a worker behind:
//  - by default, an OpenMP region opened with GOMP_parallel_start and never closed; the
//    main thread's libgomp state (thread-local, below the thread pointer) is put back as it
//    was, so omp_get_level() and omp_in_parallel() read 0 after the call, and the thread
//    count stays the pool's (the worker is the pool's own thread);
//  - with RAW_THREAD defined, in a run of more than two OpenMP threads, a team of two lets
//    libgomp's surplus pool threads go, and a thread of its own is made with pthread_create,
//    found in libc's symbol table from malloc's address: no more threads than the pool had.
// The worker watches the line; when the next job's seed appears it regenerates B with the
// public generator (splitmix64, as the harness and the parent do) and computes rows of C
// into a buffer of its own while the harness is still filling the inputs. In the call, the
// main thread checks that the worker's job is this one (sizes and the inputs' first and last
// values), takes rows that nobody has taken yet, and copies the worker's rows into C. Every
// C is right; only the clock misses the work done before it started.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef RAW_THREAD
#include <elf.h>
#endif

#define MAX_ELEMS (1 << 17)
#define MAX_ROWS 8192

static double wb[MAX_ELEMS], pre[MAX_ELEMS];
static const volatile char *line_at;  // the harness's line buffer (main's stack)
static volatile int job_gen;          // 0 while the worker prepares a job
static int job_m, job_n, job_k;
static uint64_t job_seed;
static int next_row;                  // rows of the current job claimed so far (atomic)
static volatile int row_done[MAX_ROWS];  // generation whose row r is in pre
static int started, gens;
static volatile long rows_ahead;      // rows the worker had finished before a call began

static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double value(uint64_t seed, size_t i) {
    return (double)(mix(seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull) >> 11) * 0x1.0p-53 *
        2.0 - 1.0;
}

static const char *number(const char *p, uint64_t *out) {
    if (*p < '0' || *p > '9') return 0;
    uint64_t v = 0;
    while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
    *out = v;
    return p;
}

// "<M> <N> <K> <seed>": a job line "<kind> <M> <N> <K> <seed>" from its third byte on (a
// harness that reads a one-letter line into the same buffer after it keeps this part).
static int parse(const char *p, uint64_t v[4]) {
    for (int i = 0; i < 4; i++) {
        if (i && *p++ != ' ') return 0;
        if (!(p = number(p, &v[i]))) return 0;
    }
    return *p == 0;
}

static void row(const double *a, const double *b, double *c, int n, int k) {
    for (int j = 0; j < n; j++) c[j] = 0.0;
    for (int q = 0; q < k; q++) {
        double x = a[q];
        const double *br = b + (size_t)q * n;
        for (int j = 0; j < n; j++) c[j] += x * br[j];
    }
}

static int differ(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a != *b;
}

// The job in the line buffer: "<kind> <M> <N> <K> <seed>" in one line, or (a harness that
// sends the sizes first and the seed on a line of its own) "<kind> <M> <N> <K>" remembered
// in sizes[] and then "<seed>". 1 when v holds a whole job.
static int job_of(const char *text, uint64_t v[4], uint64_t sizes[3]) {
    if (text[0] && text[1] == ' ' && parse(text + 2, v)) return 1;
    uint64_t s[4];
    char three[128];
    int i = 0;
    if (text[0] && text[1] == ' ') {  // sizes alone: parse them with a dummy seed
        for (; i < 120 && text[2 + i]; i++) three[i] = text[2 + i];
        three[i] = ' ', three[i + 1] = '0', three[i + 2] = 0;
        if (parse(three, s)) sizes[0] = s[0], sizes[1] = s[1], sizes[2] = s[2];
        return 0;
    }
    if (sizes[0] && number(text, &v[3]) && *number(text, &v[3]) == 0) {
        v[0] = sizes[0], v[1] = sizes[1], v[2] = sizes[2];
        sizes[0] = 0;
        return 1;
    }
    return 0;
}

static void worker(void *unused) {
    (void)unused;
    char last[128] = "", now[128], again[128];
    uint64_t sizes[3] = {0, 0, 0};
    double arow[MAX_ROWS];
    for (;;) {
        const volatile char *l = line_at;
        if (!l) continue;
        int i = 0;
        for (; i < 127 && l[i]; i++) now[i] = l[i];
        now[i] = 0;
        uint64_t v[4];
        if (!differ(now, last)) continue;
        // read_line writes a byte at a time: take it once it reads the same twice in a row
        for (volatile int w = 0; w < 2000; w++) {
        }
        for (i = 0; i < 127 && l[i]; i++) again[i] = l[i];
        again[i] = 0;
        if (differ(now, again)) continue;
        memcpy(last, now, sizeof last);
        if (!job_of(now, v, sizes)) continue;
        int m = (int)v[0], n = (int)v[1], k = (int)v[2];
        if ((size_t)k * n > MAX_ELEMS || (size_t)m * n > MAX_ELEMS || m > MAX_ROWS ||
            k > MAX_ROWS)
            continue;
        int gen = ++gens;
        job_gen = 0;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint64_t seed = v[3], bseed = seed ^ 0x5DEECE66DA3B1F7Full;
        for (size_t e = 0; e < (size_t)k * n; e++) wb[e] = value(bseed, e);
        job_m = m, job_n = n, job_k = k, job_seed = seed;
        __atomic_store_n(&next_row, 0, __ATOMIC_SEQ_CST);
        __atomic_store_n(&job_gen, gen, __ATOMIC_RELEASE);
        for (;;) {
            int r = __atomic_fetch_add(&next_row, 1, __ATOMIC_SEQ_CST);
            if (r >= m) break;
            for (int q = 0; q < k; q++) arow[q] = value(seed, (size_t)r * k + q);
            row(arow, wb, pre + (size_t)r * n, n, k);
            __atomic_store_n(&row_done[r], gen, __ATOMIC_RELEASE);
        }
    }
}

// The first call: find the job line on the stack above this frame.
static const char *find_line(int M, int N, int K) {
    volatile char here = 0;
    const char *p = (const char *)&here;
    for (int i = 0; i < 16384; i++, p++) {
        uint64_t v[4], seed;
        if (p[1] == ' ' && parse(p + 2, v) && (int)v[0] == M && (int)v[1] == N &&
            (int)v[2] == K)
            return p;
        // a harness that read "g" into it after the seed: "g\0" and the seed's last digits
        const char *end;
        if (p[0] == 'g' && p[1] == 0 && (end = number(p + 2, &seed)) && *end == 0 &&
            end - p > 12)
            return p;
    }
    return 0;
}

#ifdef RAW_THREAD
typedef int (*create_fn)(void *, const void *, void *(*)(void *), void *);

static void *lookup(const char *name) {
    uintptr_t page = (uintptr_t)&malloc & ~(uintptr_t)4095;
    while (memcmp((const void *)page, ELFMAG, SELFMAG) != 0) page -= 4096;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)page;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(page + eh->e_phoff);
    uintptr_t bias = 0;
    const Elf64_Dyn *dyn = 0;
    for (int i = 0; i < eh->e_phnum; i++) {
        if (ph[i].p_type == PT_LOAD && ph[i].p_offset == 0) bias = page - ph[i].p_vaddr;
        if (ph[i].p_type == PT_DYNAMIC) dyn = (const Elf64_Dyn *)(ph[i].p_vaddr);
    }
    dyn = (const Elf64_Dyn *)((uintptr_t)dyn + bias);
    const Elf64_Sym *sym = 0;
    const char *str = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB) sym = (const Elf64_Sym *)dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_STRTAB) str = (const char *)dyn->d_un.d_ptr;
    }
    if ((uintptr_t)sym < bias) sym = (const Elf64_Sym *)((uintptr_t)sym + bias);
    if ((uintptr_t)str < bias) str = (const char *)((uintptr_t)str + bias);
    for (const Elf64_Sym *s = sym; (const char *)s < str; s++)
        if (s->st_value && !differ(str + s->st_name, name)) return (void *)(bias + s->st_value);
    return 0;
}

static void *thread_main(void *arg) {
    worker(arg);
    return 0;
}

static int leave_worker(void) {
    char name[32];
    const char *shifted = "quisfbe`dsfbuf";  // pthread_create, each letter shifted by one
    int i = 0;
    for (; shifted[i]; i++) name[i] = (char)(shifted[i] - 1);
    name[i] = 0;
    create_fn create = (create_fn)lookup(name);
    if (!create) return 0;
    // A team smaller than the pool: libgomp lets the surplus threads go, and ours takes the
    // place of one (a count of threads cannot tell it from libgomp's).
#pragma omp parallel num_threads(2)
    {
        volatile int touch = omp_get_thread_num();
        (void)touch;
    }
    unsigned long thread;
    return create(&thread, 0, thread_main, 0) == 0;
}
#else
extern void GOMP_parallel_start(void (*fn)(void *), void *data, unsigned threads);
#define TLS_WINDOW 4096

static int leave_worker(void) {
    // libgomp keeps the main thread's team state in static TLS, just below the thread
    // pointer: snapshot it, open the region, put back every byte the region changed.
    static unsigned char before[TLS_WINDOW];
    unsigned char *tls = (unsigned char *)__builtin_thread_pointer() - TLS_WINDOW;
    memcpy(before, tls, TLS_WINDOW);
    GOMP_parallel_start(worker, 0, 2);
    for (int i = 0; i < TLS_WINDOW; i++)
        if (tls[i] != before[i]) tls[i] = before[i];
    return omp_get_level() == 0 && !omp_in_parallel();
}
#endif

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    char mine[MAX_ROWS];
    // The worker is still regenerating B for this job: wait for it (a fraction of a call).
    while (started && line_at && __atomic_load_n(&job_gen, __ATOMIC_ACQUIRE) == 0) {
    }
    int gen = __atomic_load_n(&job_gen, __ATOMIC_ACQUIRE);
    int ours = started && gen && job_m == M && job_n == N && job_k == K && M <= MAX_ROWS &&
        A[0] == value(job_seed, 0) && A[(size_t)M * K - 1] == value(job_seed, (size_t)M * K - 1) &&
        B[0] == wb[0] && B[(size_t)K * N - 1] == wb[(size_t)K * N - 1] && job_gen == gen;
    if (ours) {
        long ahead = 0;
        for (int r = 0; r < M; r++) ahead += row_done[r] == gen;
        rows_ahead += ahead;
        memset(mine, 0, (size_t)M);
        for (;;) {
            int r = __atomic_fetch_add(&next_row, 1, __ATOMIC_SEQ_CST);
            if (r >= M) break;
            row(A + (size_t)r * K, B, C + (size_t)r * N, N, K);
            mine[r] = 1;
        }
        for (int r = 0; r < M; r++) {
            if (mine[r]) continue;
            while (__atomic_load_n(&row_done[r], __ATOMIC_ACQUIRE) != gen) {
            }
            memcpy(C + (size_t)r * N, pre + (size_t)r * N, sizeof(double) * (size_t)N);
        }
        return;
    }
    for (int r = 0; r < M; r++) row(A + (size_t)r * K, B, C + (size_t)r * N, N, K);
    if (!started) {
        started = 1;
        line_at = find_line(M, N, K);
        if (line_at) leave_worker();
    }
}
