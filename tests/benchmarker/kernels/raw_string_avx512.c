// Hostile (issue 27, class 3): AVX-512 at stage 1, hidden from a lexer that does not know GNU
// raw strings. gcc reads R"x(" /*)x" as one string; a lexer that reads "x(" as a string sees
// the /* after it open a comment that runs to the */ inside the string at the end.
#include <immintrin.h>
static void body(double *A, double *B, double *C, int M, int N, int K);
void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    body(A, B, C, M, N, K);
}
static const char *note = R"x(" /*)x";
static void body(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M; i++) {
        int j = 0;
        for (; j + 8 <= N; j += 8) {
            __m512d acc = _mm512_setzero_pd();
            for (int k = 0; k < K; k++)
                acc = _mm512_fmadd_pd(_mm512_set1_pd(A[i * K + k]),
                                      _mm512_loadu_pd(&B[k * N + j]), acc);
            _mm512_storeu_pd(&C[i * N + j], acc);
        }
        for (; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
    }
}
static const char *end_note = "*/";
