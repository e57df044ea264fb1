/* Hostile: computes y once at the reward size and replays it on every later call. */
#include <string.h>
static double cache[20011];
static int cached;
void spmv_optimized(const int *rowptr, const int *col, const double *val, const double *x,
                    double *y, int M, int N) {
    (void)N;
    if (M == 20011 && cached) { memcpy(y, cache, sizeof cache); return; }
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int k = rowptr[i]; k < rowptr[i + 1]; k++) s += val[k] * x[col[k]];
        y[i] = s;
    }
    if (M == 20011) { memcpy(cache, y, sizeof cache); cached = 1; }
}
