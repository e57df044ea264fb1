/* hpcrl's memory-bandwidth reference: STREAM's triad, a[j] = b[j] + s * c[j], timed as STREAM
 * times it (one pass per sample, the first pass untimed, the arrays far larger than the
 * last-level cache), on each OpenMP thread count asked for. Trusted code of the benchmarker
 * (reference.py compiles and runs it; no kernel is linked with it).
 *
 *   triad <elements per array> <timed passes> <thread counts, comma-separated>
 *
 * Prints {"runs_s": {"<threads>": [seconds per pass, ...], ...}} on stdout; exits 1 if a
 * result is wrong (the compiler must not have skipped the work) or memory is short. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    long n = atol(argv[1]);
    int runs = atoi(argv[2]);
    if (n < 1 || runs < 1) return 2;
    double *a = aligned_alloc(64, (size_t)n * sizeof(double));
    double *b = aligned_alloc(64, (size_t)n * sizeof(double));
    double *c = aligned_alloc(64, (size_t)n * sizeof(double));
    if (!a || !b || !c) return 1;
    const double s = 3.0;
    /* First touch with the passes' schedule: each thread's pages where it will use them. */
#pragma omp parallel for schedule(static)
    for (long j = 0; j < n; j++) a[j] = 0.0, b[j] = 1.0, c[j] = 2.0;
    printf("{\"runs_s\": {");
    char *counts = strdup(argv[3]);
    int first = 1;
    for (char *item = strtok(counts, ","); item; item = strtok(NULL, ",")) {
        int threads = atoi(item);
        if (threads < 1) return 2;
        omp_set_num_threads(threads);
        printf("%s\"%d\": [", first ? "" : ", ", threads);
        first = 0;
        for (int r = 0; r <= runs; r++) {
            double t0 = now();
#pragma omp parallel for schedule(static)
            for (long j = 0; j < n; j++) a[j] = b[j] + s * c[j];
            double t1 = now();
            if (r > 0) printf("%s%.9f", r > 1 ? ", " : "", t1 - t0);
        }
        printf("]");
        for (long j = 0; j < n; j += n / 7 + 1)
            if (a[j] != 7.0) return 1;
        if (a[n - 1] != 7.0) return 1;
    }
    printf("}}\n");
    free(counts);
    return 0;
}
