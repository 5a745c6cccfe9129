/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32, AVX-512: the linear layers of a CPU decode step.
 *
 * At a decode step's few rows the product is bound by reading the weights. Each weight is read
 * from memory once per call: W comes repacked into strips of 16 output columns (strip s holds
 * W[16s : 16s + 16, :]^T as K rows of 16 floats, zero rows past N; small_gemm.py packs it), and
 * up to 16 rows of x are multiplied against a strip at once, one zmm accumulator per row.
 * Strips are shared out among OpenMP threads (PyTorch's own libgomp: small_gemm.py links it).
 * Sums run over k in order, one fused multiply-add per step: fp32 throughout, rounded differently
 * from a blocked BLAS. Built by small_gemm.py with -O3 -mavx512f -mfma -fopenmp. */
#include <immintrin.h>
#include <stdint.h>

#define STRIP(R)                                                                                 \
  static void strip_##R(const float* x, int64_t K, const float* w, float* y, int64_t ldy,       \
                        const float* bias, __mmask16 mask) {                                     \
    __m512 acc[R];                                                                               \
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();                   \
    for (int r = 0; r < R; r++) acc[r] = b;                                                      \
    for (int64_t k = 0; k < K; k++) {                                                            \
      _mm_prefetch((const char*)(w + (k + 16) * 16), _MM_HINT_T0); /* 1 KiB ahead */             \
      __m512 wk = _mm512_loadu_ps(w + k * 16);                                                   \
      for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wk, acc[r]); \
    }                                                                                            \
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);                \
  }
STRIP(1) STRIP(2) STRIP(3) STRIP(4) STRIP(5) STRIP(6) STRIP(7) STRIP(8)
STRIP(9) STRIP(10) STRIP(11) STRIP(12) STRIP(13) STRIP(14) STRIP(15) STRIP(16)

typedef void (*strip_fn)(const float*, int64_t, const float*, float*, int64_t, const float*, __mmask16);
static const strip_fn STRIPS[17] = {0, strip_1, strip_2, strip_3, strip_4, strip_5, strip_6,
                                    strip_7, strip_8, strip_9, strip_10, strip_11, strip_12,
                                    strip_13, strip_14, strip_15, strip_16};

/* x: M x K row-major; w: ceil(N / 16) strips; bias: N floats or NULL; y: M x N row-major. */
void rl2_small_gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                    const float* bias, float* y, int threads) {
  int64_t strips = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < strips; s++) {
    int64_t n0 = s * 16, width = N - n0 < 16 ? N - n0 : 16;
    __mmask16 mask = (__mmask16)((1u << width) - 1u);
    for (int64_t m = 0; m < M; m += 16) {  /* more than 16 rows: the strip is re-read from cache */
      int64_t rows = M - m < 16 ? M - m : 16;
      STRIPS[rows](x + m * K, K, w + n0 * K, y + m * N + n0, N, bias ? bias + n0 : 0, mask);
    }
  }
}
