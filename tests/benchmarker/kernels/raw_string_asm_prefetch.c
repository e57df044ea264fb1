// Hostile (issue 27, class 3): inline-asm prefetch at stage 4, hidden behind a u8 raw string
// holding a quote: a lexer that does not know raw strings reads "(" as a string and the /*
// after it as a comment that runs to the */ in the string at the end.
static void body(double *A, double *B, double *C, int M, int N, int K);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    body(A, B, C, M, N, K);
}
static const char *note = u8R"(")/*)";
static void body(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) {
                __asm__ volatile("prefetcht0 %0" : : "m"(B[(k + 8 < K ? k + 8 : k) * N + j]));
                s += A[i * K + k] * B[k * N + j];
            }
            C[i * N + j] = s;
        }
}
static const char *end_note = "*/";
