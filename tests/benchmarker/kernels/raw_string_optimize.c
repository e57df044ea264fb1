// Hostile (issue 27, class 3): #pragma GCC optimize at -O0, hidden behind an L raw string
// whose delimiter is a quote: another lexer reads "'(" as a string and the /* after it
// as a comment that swallows the pragma.
static void body(double *A, double *B, double *C, int M, int N, int K);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    body(A, B, C, M, N, K);
}
static const int *note = (const int *)LR"'(")/*)'";
#pragma GCC optimize("O3", "unroll-loops")
static void body(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
}
static const char *end_note = "*/";
