// Fixed parent of the evaluation set (stage 2): cache blocking (loop tiling) of the i-k-j
// loop nest, rows of B and C reached through hoisted pointers. Edge tiles are clipped, so it
// is correct for any M, N, K.
#define TILE_I 32
#define TILE_K 128
#define TILE_J 256

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M * N; i++) {
        C[i] = 0.0;
    }
    for (int ii = 0; ii < M; ii += TILE_I) {
        int i_end = ii + TILE_I < M ? ii + TILE_I : M;
        for (int kk = 0; kk < K; kk += TILE_K) {
            int k_end = kk + TILE_K < K ? kk + TILE_K : K;
            for (int jj = 0; jj < N; jj += TILE_J) {
                int j_end = jj + TILE_J < N ? jj + TILE_J : N;
                for (int i = ii; i < i_end; i++) {
                    double *c = C + (long)i * N;
                    for (int k = kk; k < k_end; k++) {
                        double a = A[(long)i * K + k];
                        const double *b = B + (long)k * N;
                        for (int j = jj; j < j_end; j++) {
                            c[j] += a * b[j];
                        }
                    }
                }
            }
        }
    }
}
