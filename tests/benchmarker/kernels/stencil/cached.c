/* Hostile: computes the reward size's grid once and replays it on every later call. */
#include <string.h>
static double cache[1023 * 1021];
static int cached;
void stencil_optimized(const double *u, double *v, int N, int M) {
    if (N == 1023 && M == 1021 && cached) { memcpy(v, cache, sizeof cache); return; }
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            long p = (long)i * M + j;
            if (i == 0 || i == N - 1 || j == 0 || j == M - 1)
                v[p] = u[p];
            else
                v[p] = 0.25 * (u[p - M] + u[p + M] + u[p - 1] + u[p + 1]);
        }
    if (N == 1023 && M == 1021) { memcpy(cache, v, sizeof cache); cached = 1; }
}
