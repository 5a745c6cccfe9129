/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ res), fp32, AVX-512: the linear layers of a CPU
 * decode step, optionally with the RMSNorm before them and the rotary embedding, the residual
 * add or the gated MLP's SiLU(gate) * up after them; and the decode step's attention.
 *
 * At a decode step's few rows the product is bound by reading the weights. Each weight is read
 * from memory once per call: W comes repacked into strips of 16 output columns (strip s holds
 * W[16s : 16s + 16, :]^T as K rows of 16 floats, zero rows past N; small_gemm.py packs it). A
 * panel is two adjacent strips (32 columns, the last panel may be one strip); up to 12 rows of x
 * (copied first with their values interleaved, step k's side by side: fix 55) are multiplied
 * against a panel at once, one zmm accumulator per row and strip (24 of the 32 registers), and
 * further rows re-read the panel from cache: in groups of up to 48 rows whose
 * passes take turns over chunks of 64 k, so that the weights stream in while the passes compute
 * (one core has too few outstanding misses to fetch a panel at the pace of one 12-row pass, and
 * fetched nothing during the passes after it: fix 35). Panels are shared out among OpenMP
 * threads (PyTorch's own libgomp: small_gemm.py links it). Sums run over k in order, one fused
 * multiply-add per step: fp32 throughout, rounded differently from a blocked BLAS, and the same
 * bits with any thread count. Built by small_gemm.py with -O3 -mavx512f -mfma -fopenmp.
 *
 * The fused norm, rotary, residual and activation save the decode step some twenty eager
 * PyTorch ops per layer, each slowed by the weight stream that just went through the caches
 * (benchmarks/README.md, fix 26); rl2_decode_layers chains a step's calls in C (fixes 27, 36). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 12 /* rows per pass */
#define AHEAD 64 /* prefetch distance in k (4 KiB of a strip; 16 was 5-20% slower, fix 27) */
#define GROUP 48 /* rows whose passes take turns over a panel's chunks of k (fix 35) */
#define KC 64    /* k per chunk: 8 KiB of a panel, held in L1 through the group's passes */

/* The lanes of a 16-float chunk that hold data when `left` floats remain */
static inline __mmask16 tail16(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* e^x, 16 lanes: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, |r| <=
 * 0.35), e^r by its Taylor series to r^7 (truncation < 1e-8, under fp32's rounding): within a
 * few ulp of libm's expf. +inf past 88.7, 0 below -87.3, NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-88.0f), x)); /* NaN: kept */
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

/* SiLU(g) * u as PyTorch computes SiLU: g / (1 + e^-g) */
static inline __m512 silu_mul(__m512 g, __m512 u) {
  __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* What a panel does with its sums besides storing them; pointers are at the panel's first row
 * and first column, NULL where unused. */
typedef struct {
  const float* bias; /* the panel's two strips' biases, 16 each */
  const float* res;  /* added to the sums last, as `res + linear(x)` rounds (row stride ldy) */
  int glu;           /* the strips are a gate's and an up projection's: store SiLU(gate) * up */
  const float* cos;  /* rope: the strips are the two halves of a head's columns: rotate them */
  const float* sin;  /* (HF's x * cos + rotate_half(x) * sin; cos, sin row stride ldc) */
  int64_t ldc, half; /* rope: the second half's cos / sin at + half */
  int64_t off1;      /* the second strip's output column, from the first's */
  __mmask16 mask;    /* valid columns of the panel's last strip */
} epilogue;

/* R rows of x against strips w0 and w1 (w1 NULL: one strip) over k in [k0, k1): the sums start
 * from the bias at k0 = 0, else from acc (R x 32 floats, where the previous chunk left them),
 * and go back to acc unless k1 = K, then finished into y (row stride ldy). Every `every`-th
 * step prefetches the next line of p0 and of p1 (the weights to be read next, see below). */
#define PANEL_AT(NAME, R, XAT)                                                                   \
  static void NAME(const float* x, int64_t K, int64_t k0, int64_t k1, const float* w0,     \
                        const float* w1, float* acc, float* y, int64_t ldy, const epilogue* e,   \
                        const float* p0, const float* p1, int every) {                           \
    int cnt = every;                                                                             \
    __m512 a0[R], a1[R];                                                                         \
    __mmask16 mask = e->mask, m0 = w1 ? (__mmask16)0xFFFF : mask;                                \
    if (k0) {                                                                                    \
      for (int r = 0; r < R; r++) {                                                              \
        a0[r] = _mm512_loadu_ps(acc + 32 * r);                                                   \
        a1[r] = _mm512_loadu_ps(acc + 32 * r + 16);                                              \
      }                                                                                          \
    } else {                                                                                     \
      __m512 b0 = e->bias ? _mm512_maskz_loadu_ps(m0, e->bias) : _mm512_setzero_ps();            \
      __m512 b1 = e->bias && w1 ? _mm512_maskz_loadu_ps(mask, e->bias + 16) : _mm512_setzero_ps(); \
      for (int r = 0; r < R; r++) { a0[r] = b0; a1[r] = b1; }                                    \
    }                                                                                            \
    if (w1) {                                                                                    \
      for (int64_t k = k0; k < k1; k++) {                                                        \
        if (--cnt == 0) {                                                                        \
          cnt = every;                                                                           \
          _mm_prefetch((const char*)p0, _MM_HINT_T0);                                            \
          _mm_prefetch((const char*)p1, _MM_HINT_T0);                                            \
          p0 += 16;                                                                              \
          p1 += 16;                                                                              \
        }                                                                                        \
        __m512 u = _mm512_loadu_ps(w0 + k * 16), v = _mm512_loadu_ps(w1 + k * 16);               \
        for (int r = 0; r < R; r++) {                                                            \
          __m512 s = _mm512_set1_ps(x[XAT]);                                                     \
          a0[r] = _mm512_fmadd_ps(s, u, a0[r]);                                                  \
          a1[r] = _mm512_fmadd_ps(s, v, a1[r]);                                                  \
        }                                                                                        \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t k = k0; k < k1; k++) {                                                        \
        if (--cnt == 0) {                                                                        \
          cnt = every;                                                                           \
          _mm_prefetch((const char*)p0, _MM_HINT_T0);                                            \
          p0 += 16;                                                                              \
        }                                                                                        \
        __m512 u = _mm512_loadu_ps(w0 + k * 16);                                                 \
        for (int r = 0; r < R; r++) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[XAT]), u, a0[r]);       \
      }                                                                                          \
    }                                                                                            \
    if (k1 < K) {                                                                                \
      for (int r = 0; r < R; r++) {                                                              \
        _mm512_storeu_ps(acc + 32 * r, a0[r]);                                                   \
        _mm512_storeu_ps(acc + 32 * r + 16, a1[r]);                                              \
      }                                                                                          \
    } else if (w1) {                                                                             \
      for (int r = 0; r < R; r++) finish_two(a0[r], a1[r], y + r * ldy, r, ldy, e);              \
    } else {                                                                                     \
      for (int r = 0; r < R; r++) {                                                              \
        if (e->res) a0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, e->res + r * ldy), a0[r]); \
        _mm512_mask_storeu_ps(y + r * ldy, mask, a0[r]);                                         \
      }                                                                                          \
    }                                                                                            \
  }

/* HF's rotate_half arithmetic on 16 lanes of a head's two halves: x1 cos - x2 sin to y, x2 cos
 * + x1 sin to y + off1 (c, s: the first half's cos / sin lanes, the second half's at + half) */
static inline void rotate16(__m512 x1, __m512 x2, const float* c, const float* s, int64_t half,
                            float* y, int64_t off1) {
  _mm512_storeu_ps(y, _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c)),
                                    _mm512_mul_ps(x2, _mm512_loadu_ps(s))));
  _mm512_storeu_ps(y + off1, _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half)),
                                           _mm512_mul_ps(x1, _mm512_loadu_ps(s + half))));
}

/* Row r's sums of a two-strip panel, a0 and a1, to its output row y */
static inline void finish_two(__m512 a0, __m512 a1, float* y, int r, int64_t ldy,
                              const epilogue* e) {
  if (e->glu) {
    _mm512_mask_storeu_ps(y, e->mask, silu_mul(a0, a1));
    return;
  }
  if (e->cos) { /* the two strips are the matching lanes of a head's halves (never a tail) */
    rotate16(a0, a1, e->cos + r * e->ldc, e->sin + r * e->ldc, e->half, y, e->off1);
    return;
  }
  if (e->res) {
    a0 = _mm512_add_ps(_mm512_loadu_ps(e->res + r * ldy), a0);
    a1 = _mm512_add_ps(_mm512_maskz_loadu_ps(e->mask, e->res + r * ldy + e->off1), a1);
  }
  _mm512_storeu_ps(y, a0);
  _mm512_mask_storeu_ps(y + e->off1, e->mask, a1);
}

/* x row-major (row r at x + r * K); and x interleaved, the R rows' values of step k side by
 * side at x + k * R: one pointer for all rows, where twelve row pointers took the loop more
 * registers than x86 has and the compiler moved them through vector registers on the
 * multiply-add ports each step (fix 55) */
#define PANEL(R) PANEL_AT(panel_##R, R, r * K + k)
#define PANELI(R) PANEL_AT(paneli_##R, R, k * R + r)
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)
PANEL(7) PANEL(8) PANEL(9) PANEL(10) PANEL(11) PANEL(12)
PANELI(1) PANELI(2) PANELI(3) PANELI(4) PANELI(5) PANELI(6)
PANELI(7) PANELI(8) PANELI(9) PANELI(10) PANELI(11) PANELI(12)

typedef void (*panel_fn)(const float*, int64_t, int64_t, int64_t, const float*, const float*,
                         float*, float*, int64_t, const epilogue*, const float*, const float*, int);
static const panel_fn PANELS[ROWS + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6,
                                          panel_7, panel_8, panel_9, panel_10, panel_11, panel_12};
static const panel_fn PANELS_I[ROWS + 1] = {0, paneli_1, paneli_2, paneli_3, paneli_4, paneli_5,
                                            paneli_6, paneli_7, paneli_8, paneli_9, paneli_10,
                                            paneli_11, paneli_12};

/* h = x / sqrt(mean(x^2) + eps) * norm_w, one row of K (HF's fp32 RMSNorm, summed in another order) */
static float rms_row(const float* x, int64_t K, const float* norm_w, float eps, float* h) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __mmask16 m = tail16(K - k);
    __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float r = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)K + eps);
  __m512 rv = _mm512_set1_ps(r);
  for (int64_t k = 0; k < K; k += 16) {
    __mmask16 m = tail16(K - k);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), rv);
    _mm512_mask_storeu_ps(h + k, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, norm_w + k), v));
  }
  return r;
}

static void interleave_rows(const float* src, int64_t lds, int R, int64_t K, float* dst);

/* x: M x K row-major; w: ceil(N / 16) strips; bias: N floats or NULL; res: M x N or NULL, added
 * last; norm_w: K floats or NULL, then x is RMS-normalised first (eps) into h (M x K scratch);
 * y: M x N row-major.
 * glu: w holds 2 * ceil(N / 16) strips, a gate's and an up projection's alternating (N columns
 * each), bias (or NULL) 32 floats per strip pair likewise, res NULL, and y = SiLU(gate) * up.
 * rope_heads > 0: the first rope_heads * D columns (D = head_dim, a multiple of 32) are heads
 * to rotate by cos / sin (M x D each): their strips come in pairs, strip c of a head's first
 * half then strip c of its second half, bias likewise; res NULL. */
void rl2_small_gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                    const float* bias, const float* res, const float* norm_w, float eps, float* h,
                    float* y, int glu, int64_t rope_heads, int64_t head_dim, const float* cos,
                    const float* sin, int threads) {
  int64_t strips = (N + 15) / 16, panels = glu ? strips : (strips + 1) / 2;
  int64_t per_head = head_dim / 32, rope_panels = rope_heads * per_head;
  /* each pass's rows interleaved (PANELI): pass b's rows 12b.. at xp + 12 b K. The calling
   * thread keeps the buffer (a decode step makes ~30 calls: no allocation each time), never
   * freed: at most MAX_ROWS x K floats per thread that calls (small_gemm.py's MAX_ROWS) */
  static __thread float* xp;
  static __thread int64_t xp_cap;
  if (M > 1 && M * K > xp_cap) {
    free(xp);
    xp = (float*)malloc(M * K * sizeof(float));
    xp_cap = xp ? M * K : 0;
  }
  float* xi = M > 1 ? xp : 0; /* the parallel region's threads read this thread's buffer */
  /* one row is its own interleaving; without the buffer (no memory) the row-major passes */
  const float* a = xi ? xi : norm_w ? h : x;
  const panel_fn* pass = xi ? PANELS_I : PANELS;
  int64_t blocks = (M + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(threads)
  {
    float acc[GROUP * 32]; /* a group's sums between chunks */
    if (norm_w || xi) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; b++) {
        int64_t m = b * ROWS, rows = M - m < ROWS ? M - m : ROWS;
        const float* src = x + m * K;
        if (norm_w) {
          for (int64_t r = m; r < m + rows; r++) rms_row(x + r * K, K, norm_w, eps, h + r * K);
          src = h + m * K;
        }
        if (xi) interleave_rows(src, K, (int)rows, K, xi + m * K);
      } /* the loop's barrier: every pass's rows are in place before any panel reads them */
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
      int64_t s = 2 * p; /* the panel's first strip in w */
      int two = glu || s + 1 < strips;
      int64_t n0 = 16 * s, last = N - 16 * (s + two); /* its first column; the last strip's */
      epilogue e = {bias ? bias + 16 * s : 0, 0, glu, 0, 0, head_dim, head_dim / 2, 16, 0};
      if (glu) {
        n0 = 16 * p;
        last = N - n0;
      } else if (p < rope_panels) {
        int64_t c = 16 * (p % per_head); /* the column within the head's first half */
        n0 = p / per_head * head_dim + c;
        last = 16;
        e.cos = cos + c;
        e.sin = sin + c;
        e.off1 = head_dim / 2;
      }
      e.mask = tail16(last);
      const float* w0 = w + s * 16 * K;
      const float* w1 = two ? w0 + 16 * K : 0;
      for (int64_t g = 0; g < M; g += GROUP) {
        int64_t gm = M - g < GROUP ? M - g : GROUP, passes = (gm + ROWS - 1) / ROWS;
        int64_t kc = passes > 1 ? KC : K;
        /* what follows the group's last chunk: the next group's start of this panel, else
         * the next panel, where this thread most likely goes on (static schedule) */
        const float* next0 = g + gm < M ? w0 : w0 + (two ? 32 : 16) * K;
        const float* next1 = g + gm < M ? (w1 ? w1 : w0) : next0 + 16 * K;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          int64_t k1 = K - k0 < kc ? K : k0 + kc;
          for (int64_t i = 0; i < passes; i++) {
            int64_t m = g + i * ROWS, rows = g + gm - m < ROWS ? g + gm - m : ROWS;
            epilogue em = e;
            em.res = res ? res + m * N + n0 : 0;
            if (e.cos) {
              em.cos = e.cos + m * head_dim;
              em.sin = e.sin + m * head_dim;
            }
            /* one pass: prefetch AHEAD steps ahead. Several: each pass prefetches its share
             * of the next chunk (or of the next panel's first), so that the weights stream
             * in all through the chunk's passes, not in one burst that the core's few
             * outstanding misses cannot take (fix 35) */
            const float *p0 = w0 + AHEAD * 16, *p1 = (w1 ? w1 : w0) + AHEAD * 16;
            int every = 1;
            if (passes > 1) {
              int64_t skip = (k1 - k0) * i / passes;
              p0 = k1 < K ? w0 + (k1 + skip) * 16 : next0 + skip * 16;
              p1 = k1 < K ? (w1 ? w1 : w0) + (k1 + skip) * 16 : next1 + skip * 16;
              every = (int)passes;
            }
            pass[rows](a + m * K, K, k0, k1, w0, w1, acc + 32 * (m - g), y + m * N + n0, N,
                         &em, p0, p1, every);
          }
        }
      }
    }
  }
}

/* One (row, KV head) pair of a decode step's attention: the scores of its G queries against each
 * key row (read once for all G: K's chunks in registers), the softmax, then each value row
 * times the G weights. CH: D / 16, a constant where the compiler can unroll it. */
#define ATTEND(NAME, CH)                                                                         \
  static void NAME(const float* qb, const float* kb, const float* vb, const float* mb,          \
                   int64_t G, int64_t W, int64_t chunks, float scale, float* s, float* og) {     \
    __m512 qv[8][16], o[8][16], kv[16];                                                          \
    float mx[8], inv[8];                                                                         \
    /* Skip the left padding (bias -inf: weight exactly 0) whole 16-column chunks at a time, so \
     * the softmax sums the same lanes in the same order: the same bits, less of the cache read */\
    int64_t w0 = 0;                                                                              \
    while (w0 < W && mb[w0] == -INFINITY) w0++;                                                  \
    w0 = w0 < W ? w0 / 16 * 16 : 0;                                                              \
    for (int64_t g = 0; g < G; g++) {                                                            \
      mx[g] = -INFINITY;                                                                         \
      for (int64_t c = 0; c < CH; c++) {                                                         \
        qv[g][c] = _mm512_loadu_ps(qb + g * CH * 16 + 16 * c);                                   \
        o[g][c] = _mm512_setzero_ps();                                                           \
      }                                                                                          \
    }                                                                                            \
    for (int64_t w = w0; w < W; w++) { /* the product, times scale, plus the bias */             \
      for (int64_t c = 0; c < CH; c++) kv[c] = _mm512_loadu_ps(kb + (w * CH + c) * 16);          \
      for (int64_t g = 0; g < G; g++) {                                                          \
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);                                             \
        for (int64_t c = 1; c < CH; c++) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);            \
        float x = _mm512_reduce_add_ps(acc) * scale;                                             \
        x = x + mb[w];                                                                           \
        s[g * W + w] = x;                                                                        \
        mx[g] = x > mx[g] ? x : mx[g];                                                           \
      }                                                                                          \
    }                                                                                            \
    for (int64_t g = 0; g < G; g++) { /* softmax: exp(x - max), then times 1 / sum */            \
      __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(mx[g]);                             \
      for (int64_t w = w0; w < W; w += 16) {                                                     \
        __mmask16 m = tail16(W - w);                                                             \
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + g * W + w), top));           \
        e = _mm512_maskz_mov_ps(m, e);                                                           \
        _mm512_mask_storeu_ps(s + g * W + w, m, e);                                              \
        sum = _mm512_add_ps(sum, e);                                                             \
      }                                                                                          \
      inv[g] = 1.0f / _mm512_reduce_add_ps(sum);                                                 \
    }                                                                                            \
    for (int64_t w = w0; w < W; w++) {                                                           \
      for (int64_t c = 0; c < CH; c++) kv[c] = _mm512_loadu_ps(vb + (w * CH + c) * 16);          \
      for (int64_t g = 0; g < G; g++) {                                                          \
        __m512 p = _mm512_set1_ps(s[g * W + w] * inv[g]);                                        \
        for (int64_t c = 0; c < CH; c++) o[g][c] = _mm512_fmadd_ps(p, kv[c], o[g][c]);           \
      }                                                                                          \
    }                                                                                            \
    for (int64_t g = 0; g < G; g++)                                                              \
      for (int64_t c = 0; c < CH; c++) _mm512_storeu_ps(og + g * CH * 16 + 16 * c, o[g][c]);    \
  }
ATTEND(attend_4, 4)     /* head_dim 64 */
ATTEND(attend_8, 8)     /* head_dim 128 */
ATTEND(attend_n, chunks) /* other multiples of 16, up to 256 */

/* A decode step's attention, HF's eager formulation: for each row b, KV head h and query g of
 * its group, softmax(q . K^T * scale + bias[b]) in fp32, then the weights times V.
 * q: element (b, h, g, d) at b * q_sb + h * q_sh + g * D + d; k, v: (b, h, w, d) at b * kv_sb +
 * h * kv_sh + w * D + d (a window of the cache); bias: B x W (0 or -inf); D a multiple of 16,
 * at most 256; G at most 8; scratch: threads x G x W floats; out: B x KH x G x D. (b, h) pairs
 * are shared out among threads. Two batched matmuls, which read each key and value row once
 * per query, took 1.15-1.6x as long (benchmarks/README.md, fix 26). */
void rl2_decode_attention(const float* q, int64_t B, int64_t KH, int64_t G, int64_t D,
                          int64_t q_sb, int64_t q_sh, const float* k, const float* v,
                          int64_t kv_sb, int64_t kv_sh, int64_t W, const float* bias, float scale,
                          float* scratch, float* out, int threads) {
  int64_t chunks = D / 16;
#pragma omp parallel num_threads(threads)
  {
    float* s = scratch + (int64_t)omp_get_thread_num() * G * W; /* scores, then weights */
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * KH; bh++) {
      int64_t b = bh / KH, h = bh % KH;
      const float *qb = q + b * q_sb + h * q_sh, *kb = k + b * kv_sb + h * kv_sh;
      const float *vb = v + b * kv_sb + h * kv_sh, *mb = bias + b * W;
      float* og = out + bh * G * D;
      if (chunks == 4)
        attend_4(qb, kb, vb, mb, G, W, chunks, scale, s, og);
      else if (chunks == 8)
        attend_8(qb, kb, vb, mb, G, W, chunks, scale, s, og);
      else
        attend_n(qb, kb, vb, mb, G, W, chunks, scale, s, og);
    }
  }
}

/* One decoder layer of a decode step (Llama / Qwen2 / Qwen3 / Mistral, fp32), as
 * llama_forward's fused ops do it, op for op and so bit for bit: the q/k/v product with the
 * input norm and the rotary embedding (qkv_w in rope order), this step's keys and values
 * written at `column` of the cache buffers, the attention over columns [start, column], the
 * output projection plus x, and the MLP (norm, SiLU(gate) * up, down projection plus the
 * residual). Saves the step the ~20 small PyTorch ops between those calls.
 * q_norm, k_norm (Qwen3's per-head RMSNorms, D floats each, or NULL): the heads are normalised
 * after the product and rotated then (its norm sums in another order than PyTorch's).
 * x, out: M x hidden; kbuf, vbuf: the layer's cache buffers ((b, h, w, d) at b * kv_sb + h *
 * kv_sh + w * D + d); bias: M x (column + 1 - start); scratch: threads x G x that many floats;
 * h: M x hidden; qkv: M x (heads + 2 kv_heads) D; att: M x heads D; x2: M x hidden; act: M x
 * inter (the layer's intermediates, the caller's buffers). */
static void decode_layer(const float* x, int64_t M, int64_t hidden, int64_t heads,
                         int64_t kv_heads, int64_t D, const float* norm1, float eps1,
                         const float* qkv_w, const float* qkv_b, const float* cos,
                         const float* sin, const float* q_norm, const float* k_norm, float eps_q,
                         float eps_k, float* kbuf, float* vbuf, int64_t kv_sb, int64_t kv_sh,
                         int64_t start, int64_t column, const float* bias, float scale,
                         float* scratch, const float* o_w, const float* o_b, const float* norm2,
                         float eps2, const float* gu_w, const float* gu_b, int64_t inter,
                         const float* down_w, const float* down_b, float* h, float* qkv,
                         float* att, float* x2, float* act, float* out, int threads) {
  int64_t nq = heads * D, nkv = kv_heads * D, n = nq + 2 * nkv;
  if (!q_norm) {
    rl2_small_gemm(x, M, hidden, qkv_w, n, qkv_b, 0, norm1, eps1, h, qkv, 0, heads + kv_heads, D,
                   cos, sin, threads);
  } else { /* Qwen3: each query and key head RMS-normalised before the rotation (qkv_w in its
            * natural order), then rotated with HF's arithmetic */
    rl2_small_gemm(x, M, hidden, qkv_w, n, qkv_b, 0, norm1, eps1, h, qkv, 0, 0, 0, 0, 0, threads);
    float t[256];
    for (int64_t b = 0; b < M; b++)
      for (int64_t j = 0; j < heads + kv_heads; j++) {
        float* hd = qkv + b * n + j * D;
        rms_row(hd, D, j < heads ? q_norm : k_norm, j < heads ? eps_q : eps_k, t);
        for (int64_t i = 0; i < D / 2; i += 16)
          rotate16(_mm512_loadu_ps(t + i), _mm512_loadu_ps(t + D / 2 + i), cos + b * D + i,
                   sin + b * D + i, D / 2, hd + i, D / 2);
      }
  }
  for (int64_t b = 0; b < M; b++)
    for (int64_t j = 0; j < kv_heads; j++) {
      float* kd = kbuf + b * kv_sb + j * kv_sh + column * D;
      float* vd = vbuf + b * kv_sb + j * kv_sh + column * D;
      const float* src = qkv + b * n + nq + j * D;
      for (int64_t d = 0; d < D; d++) {
        kd[d] = src[d];
        vd[d] = src[nkv + d];
      }
    }
  rl2_decode_attention(qkv, M, kv_heads, heads / kv_heads, D, n, heads / kv_heads * D,
                       kbuf + start * D, vbuf + start * D, kv_sb, kv_sh, column + 1 - start, bias,
                       scale, scratch, att, threads);
  rl2_small_gemm(att, M, nq, o_w, hidden, o_b, x, 0, 0.0f, 0, x2, 0, 0, 0, 0, 0, threads);
  rl2_small_gemm(x2, M, hidden, gu_w, inter, gu_b, 0, norm2, eps2, h, act, 1, 0, 0, 0, 0, threads);
  rl2_small_gemm(act, M, inter, down_w, hidden, down_b, x2, 0, 0.0f, 0, out, 0, 0, 0, 0, 0,
                 threads);
}

/* A layer's own arguments of decode_layer (small_gemm.py's _Layer mirrors it) */
typedef struct {
  const float *norm1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *o_b, *norm2, *gu_w, *gu_b, *down_w,
      *down_b;
  float *kbuf, *vbuf;
  float eps1, eps_q, eps_k, eps2;
} layer_args;

/* A decode step's decoder layers, n of them, in one call (fix 36): layer i's output is layer
 * i + 1's input (through y and `out`, the last layer's into `out`). One call from Python a step
 * instead of one a layer: each cost ~0.2 ms of argument checks and ctypes conversions. The
 * other arguments as decode_layer's, the same for every layer (one batch, one window). */
void rl2_decode_layers(const layer_args* layers, int64_t n, const float* x, int64_t M,
                       int64_t hidden, int64_t heads, int64_t kv_heads, int64_t D, int64_t inter,
                       const float* cos, const float* sin, int64_t kv_sb, int64_t kv_sh,
                       int64_t start, int64_t column, const float* bias, float scale,
                       float* scratch, float* h, float* qkv, float* att, float* x2, float* act,
                       float* y, float* out, int threads) {
  for (int64_t i = 0; i < n; i++) {
    const layer_args* l = layers + i;
    float* dst = (n - 1 - i) % 2 ? y : out; /* never the layer's own input */
    decode_layer(x, M, hidden, heads, kv_heads, D, l->norm1, l->eps1, l->qkv_w, l->qkv_b, cos,
                 sin, l->q_norm, l->k_norm, l->eps_q, l->eps_k, l->kbuf, l->vbuf, kv_sb, kv_sh,
                 start, column, bias, scale, scratch, l->o_w, l->o_b, l->norm2, l->eps2, l->gu_w,
                 l->gu_b, inter, l->down_w, l->down_b, h, qkv, att, x2, act, dst, threads);
    x = dst;
  }
}

/* The kernel's epilogues as passes of their own, for products with more rows than the kernel
 * takes (a prefill's, on oneDNN): one pass each where PyTorch makes several (RMSNorm: five;
 * the rotation: cat, neg, two muls and an add). Rows are shared out among threads. */

/* h = RMSNorm(x) (rms_row), M rows of K */
void rl2_rms_norm(const float* x, int64_t M, int64_t K, const float* norm_w, float eps, float* h,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t m = 0; m < M; m++) rms_row(x + m * K, K, norm_w, eps, h + m * K);
}

/* y = SiLU(gate) * up, gu: M rows of 2N (the gate's N columns, then the up projection's) */
void rl2_silu_mul(const float* gu, int64_t M, int64_t N, float* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n += 16) {
      __mmask16 k = tail16(N - n);
      const float* g = gu + m * 2 * N + n;
      _mm512_mask_storeu_ps(y + m * N + n, k,
                            silu_mul(_mm512_maskz_loadu_ps(k, g), _mm512_maskz_loadu_ps(k, g + N)));
    }
}

/* The rotary embedding as HF's apply_rotary_pos_emb rotates a head: M token rows of `heads`
 * heads, head j of row m at x + m * ldx + j * hs (D floats, D a multiple of 32), to y the same
 * way (ldy, D per head; y may be x: each lane pair is read before it is written); cos, sin:
 * M x D. The prefill rotates its projections in place; training (one pass instead of
 * PyTorch's five forward and five backward ops) writes a new tensor. Forward: y1 = x1 cos1 -
 * x2 sin1, y2 = x2 cos2 + x1 sin2 (halves 1 and 2 of a head). Backward (inverse), its
 * transpose: x1 = y1 cos1 + y2 sin2, x2 = y2 cos2 - y1 sin1. */
void rl2_rope(const float* x, int64_t ldx, int64_t hs, float* y, int64_t ldy, int64_t M,
              int64_t heads, int64_t D, const float* cos, const float* sin, int inverse,
              int threads) {
  int64_t half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < heads; j++)
      for (int64_t c = 0; c < half; c += 16) {
        const float* p = x + m * ldx + j * hs + c;
        float* q = y + m * ldy + j * D + c;
        const float *c1 = cos + m * D + c, *s1 = sin + m * D + c;
        __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + half);
        if (!inverse) {
          rotate16(a, b, c1, s1, half, q, half);
          continue;
        }
        _mm512_storeu_ps(q, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c1)),
                                          _mm512_mul_ps(b, _mm512_loadu_ps(s1 + half))));
        _mm512_storeu_ps(q + half, _mm512_sub_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c1 + half)),
                                                 _mm512_mul_ps(a, _mm512_loadu_ps(s1))));
      }
}

/* Training RMSNorm (fp32, rows of K): PyTorch runs HF's module as ~6 ops forward and ~12
 * backward, most of them passes over the rows (25.7M model, 1020 tokens: 0.45 ms forward, 4.5
 * ms backward per norm). Forward: y = w * (x * r) with r = 1 / sqrt(mean(x^2) + eps) kept per
 * row. Backward, with y_k = w_k x_k r and dr/dx_j = -r^3 x_j / K:
 * dx_j = r g_j w_j - x_j r^3 / K * sum_k g_k w_k x_k, and dw_k = sum over rows of g_k x_k r,
 * summed per thread over its rows (part: threads x K, zeroed by the caller) and then over the
 * threads in order (the same bits for the same thread count). */
void rl2_rms_norm_fwd(const float* x, int64_t M, int64_t K, const float* w, float eps, float* y,
                      float* rstd, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t m = 0; m < M; m++) rstd[m] = rms_row(x + m * K, K, w, eps, y + m * K);
}

void rl2_rms_norm_bwd(const float* x, const float* g, const float* w, const float* rstd, int64_t M,
                      int64_t K, float* dx, float* dw, float* part, int threads) {
#pragma omp parallel num_threads(threads)
  {
    float* acc = dw ? part + (int64_t)omp_get_thread_num() * K : 0;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      const float *xm = x + m * K, *gm = g + m * K;
      float r = rstd[m];
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        __mmask16 q = tail16(K - k);
        __m512 gw = _mm512_mul_ps(_mm512_maskz_loadu_ps(q, gm + k),
                                  _mm512_maskz_loadu_ps(q, w + k));
        s = _mm512_fmadd_ps(gw, _mm512_maskz_loadu_ps(q, xm + k), s);
      }
      __m512 rv = _mm512_set1_ps(r);
      __m512 c = _mm512_set1_ps(r * r * r * _mm512_reduce_add_ps(s) / (float)K);
      for (int64_t k = 0; k < K; k += 16) {
        __mmask16 q = tail16(K - k);
        __m512 xv = _mm512_maskz_loadu_ps(q, xm + k), gv = _mm512_maskz_loadu_ps(q, gm + k);
        __m512 gw = _mm512_mul_ps(gv, _mm512_maskz_loadu_ps(q, w + k));
        _mm512_mask_storeu_ps(dx + m * K + k, q,
                              _mm512_sub_ps(_mm512_mul_ps(rv, gw), _mm512_mul_ps(c, xv)));
        if (dw)
          _mm512_mask_storeu_ps(acc + k, q, _mm512_fmadd_ps(_mm512_mul_ps(gv, xv), rv,
                                                           _mm512_maskz_loadu_ps(q, acc + k)));
      }
    }
    if (dw) { /* the for loop's barrier: every thread's part is complete */
#pragma omp for schedule(static)
      for (int64_t k = 0; k < K; k++) {
        float t = 0.0f;
        for (int i = 0; i < threads; i++) t += part[(int64_t)i * K + k];
        dw[k] = t;
      }
    }
  }
}

/* Training SiLU(gate) * up over n elements (fp32; gate, up, h and the gradients of one shape):
 * forward h = SiLU(g) * u (silu_mul); backward, with s = sigmoid(g) (PyTorch's silu_backward
 * formula): du = dh SiLU(g), dg = dh u s (1 + g (1 - s)). */
void rl2_glu_fwd(const float* g, const float* u, int64_t n, float* h, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 k = tail16(n - i);
    _mm512_mask_storeu_ps(h + i, k,
                          silu_mul(_mm512_maskz_loadu_ps(k, g + i), _mm512_maskz_loadu_ps(k, u + i)));
  }
}

void rl2_glu_bwd(const float* g, const float* u, const float* dh, int64_t n, float* dg, float* du,
                 int threads) {
  const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 k = tail16(n - i);
    __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
    __m512 d = _mm512_maskz_loadu_ps(k, dh + i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(du + i, k, _mm512_mul_ps(d, _mm512_mul_ps(gv, s)));
    __m512 ds = _mm512_mul_ps(s, _mm512_add_ps(one, _mm512_mul_ps(gv, _mm512_sub_ps(one, s))));
    _mm512_mask_storeu_ps(dg + i, k, _mm512_mul_ps(_mm512_mul_ps(d, uv), ds));
  }
}

/* a[c] = column c of the 16 x 16 block whose rows were a[0..15] */
static inline void transpose_regs(__m512* a) {
  __m512 b[16];
  /* 32-bit, then 64-bit interleaves of row pairs, then two exchanges of 128-bit lanes */
  for (int r = 0; r < 16; r += 2) {
    b[r] = _mm512_unpacklo_ps(a[r], a[r + 1]);
    b[r + 1] = _mm512_unpackhi_ps(a[r], a[r + 1]);
  }
  for (int r = 0; r < 16; r += 4) {
    __m512d p0 = _mm512_castps_pd(b[r]), p1 = _mm512_castps_pd(b[r + 1]);
    __m512d p2 = _mm512_castps_pd(b[r + 2]), p3 = _mm512_castps_pd(b[r + 3]);
    a[r] = _mm512_castpd_ps(_mm512_unpacklo_pd(p0, p2));
    a[r + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p2));
    a[r + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(p1, p3));
    a[r + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(p1, p3));
  }
  /* now a[4q + j], 128-bit lane l: column 4l + j of rows 4q..4q+3; two lane exchanges remain */
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; j++) {
      b[h + j] = _mm512_shuffle_f32x4(a[h + j], a[h + 4 + j], 0x88);
      b[h + 4 + j] = _mm512_shuffle_f32x4(a[h + j], a[h + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; j++) {
    a[j] = _mm512_shuffle_f32x4(b[j], b[8 + j], 0x88);
    a[8 + j] = _mm512_shuffle_f32x4(b[j], b[8 + j], 0xdd);
  }
}

/* 16 x 16 block: dst[c * ldd + r] = src[r * lds + c] for r < R, c < C (R, C <= 16) */
static inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd, int R, int C) {
  if (R < 16 || C < 16) {
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) dst[c * ldd + r] = src[r * lds + c];
    return;
  }
  __m512 a[16];
  for (int r = 0; r < 16; r++) a[r] = _mm512_loadu_ps(src + r * lds);
  transpose_regs(a);
  for (int c = 0; c < 16; c++) _mm512_storeu_ps(dst + c * ldd, a[c]);
}

/* dst[k * R + r] = src[r * lds + k] for r < R <= 16, k < K: a pass's rows side by side, as
 * the interleaved panel passes read them (PANELI) */
static void interleave_rows(const float* src, int64_t lds, int R, int64_t K, float* dst) {
  __mmask16 rows = tail16(R);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    int C = K - k0 < 16 ? (int)(K - k0) : 16;
    __mmask16 cols = tail16(C);
    __m512 a[16];
    for (int r = 0; r < 16; r++)
      a[r] = r < R ? _mm512_maskz_loadu_ps(cols, src + r * lds + k0) : _mm512_setzero_ps();
    transpose_regs(a);
    for (int c = 0; c < C; c++) _mm512_mask_storeu_ps(dst + (k0 + c) * R, rows, a[c]);
  }
}

/* Lane r of the result: OP over the 16 lanes of v[r], r < 16, by a transposing tree: 15 OPs and
 * 30 shuffles for 16 rows, where a horizontal reduction per row is ~8 dependent steps each */
#define HREDUCE16(NAME, OP)                                                                      \
  static inline __m512 NAME(const __m512* v) {                                                   \
    __m512 w[8], u[4], z[2];                                                                     \
    for (int i = 0; i < 8; i++) /* 256-bit halves: row 2i, row 2i + 1 */                         \
      w[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                              \
                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));                             \
    for (int j = 0; j < 4; j++) /* 128-bit lane t: row 4j + t */                                 \
      u[j] = OP(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),                              \
                _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));                             \
    for (int k = 0; k < 2; k++) { /* lane t: rows 8k + t (floats 0-1), 8k + 4 + t (2-3) */       \
      __m512d e = _mm512_castps_pd(u[2 * k]), f = _mm512_castps_pd(u[2 * k + 1]);                \
      z[k] = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(e, f)),                                      \
                _mm512_castpd_ps(_mm512_unpackhi_pd(e, f)));                                     \
    }                                                                                            \
    __m512 r = OP(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));     \
    /* float 4t + c of r holds row 4c + t */                                                     \
    return _mm512_permutexvar_ps(                                                                \
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);             \
  }
HREDUCE16(rows_max16, _mm512_max_ps)
HREDUCE16(rows_sum16, _mm512_add_ps)

/* Training attention: causal softmax attention inside each sequence of a packed row, forward
 * and backward, fp32, head_dim 64 or 128 (flash-attention's blocked formulation: no L x L score
 * matrix). Per sequence and query head, blocks of QB query rows meet panels of 32 keys: the
 * scores come from rl2_small_gemm's own 12-row panel pass (the keys repacked as its two
 * strips of 16), the softmax runs online over the panels, and panels past the
 * block's last row are skipped (ATen's CPU kernel splits keys in 512s, so a sequence under ~1000
 * tokens does the work of a full square; benchmarks/README.md, fix 31). Scores are taken as
 * (scale * q) . k. Layouts: q (h, t, d) at h * q_sh + t * q_st + d, k and v likewise with KH
 * heads (query head h reads KV head h / (H / KH)); out, dq: (t, h, d) contiguous; lse: (h, t);
 * dk, dv: (tk, kh, d) contiguous. Work items are (query head, sequence) pairs, handed out
 * dynamically in the caller's order (the most work first). scratch: per thread, the packed
 * keys (and, backward, values and the dK / dV sums) of one sequence, `cap` floats each (the
 * most keys of a sequence rounded up to 32, times D). kbounds: where each sequence's keys lie
 * in k and v (`bounds` itself, or gathered keys of a shared prompt, TK rows): a sequence of L
 * queries and M >= L keys aligns its causal mask to the bottom right, so query row i sees keys
 * 0..M-L+i (flash-attention's rule for fewer queries than keys). */
#define QB ROWS /* query rows per block: the panel pass's 12 */
#define KP 32   /* keys per panel: two strips */

/* S[r][0:32] = Qb[r] . the panel's 32 columns, r < 12 (Qi: the 12 x D block Qb, rows past the
 * block zeros, interleaved by interleave_rows): the products' own 12-row panel pass. A panel
 * with n <= 16 live keys (the causal diagonal's last) takes its first strip only and zeros the
 * rest of S: half the work. */
static void tile(const float* Qi, const float* Pn, int64_t D, int64_t n, float* S) {
  epilogue e = {0};
  e.off1 = 16;
  e.mask = (__mmask16)0xFFFF;
  if (n > 16) {
    paneli_12(Qi, D, 0, D, Pn, Pn + D * 16, 0, S, KP, &e, Pn + AHEAD * 16, Pn + (D + AHEAD) * 16, 1);
    return;
  }
  paneli_12(Qi, D, 0, D, Pn, NULL, 0, S, KP, &e, Pn + AHEAD * 16, NULL, 1);
  for (int r = 0; r < QB; r++) _mm512_storeu_ps(S + r * KP + 16, _mm512_setzero_ps());
}

/* The keys [j0, j0 + n) of one KV head as a panel: two strips of 16 (D x 16 each, the products'
 * layout), columns past n zero */
static void pack_panel(const float* k, int64_t st, int64_t j0, int64_t n, int64_t D, float* Pn) {
  for (int64_t c0 = 0; c0 < KP; c0 += 16) {
    float* strip = Pn + (c0 / 16) * D * 16;
    int64_t keys = n - c0 < 0 ? 0 : n - c0 < 16 ? n - c0 : 16;
    if (keys < 16) /* a tail's missing columns are zeros */
      for (int64_t x = 0; x < D * 16; x += 16) _mm512_storeu_ps(strip + x, _mm512_setzero_ps());
    /* 16 keys x 16 of d at a time, transposed in registers (the scalar loop's strided stores
     * were ~12% of the forward, 1 thread) */
    for (int64_t d0 = 0; d0 < D && keys; d0 += 16)
      transpose16(k + (j0 + c0) * st + d0, st, strip + d0 * 16, 16, (int)keys, 16);
  }
}

/* out[i] (rows of D, stride D) += sum over j < n_sum of W[i * wi + j * wj] * Y[j] (Y's rows at
 * stride ldy), for i < n_out rounded up to whole groups of 16 / CH rows, held in registers while
 * Y's rows stream past (the caller's W is zero past n_out and out has room). With W a block's
 * [12][32] weights: out = W Y (wi = 32, wj = 1: P V, dS K) or W^T Y (wi = 1, wj = 32: P^T dO,
 * dS^T Q). CH = D / 16, a constant. */
#define RANK_UPDATE(NAME, CH)                                                                    \
  static void NAME(const float* W, int64_t wi, int64_t wj, const float* Y, int64_t ldy,          \
                   int64_t n_out, int64_t n_sum, float* out) {                                   \
    enum { G = 16 / CH, D = 16 * CH };                                                           \
    for (int64_t i0 = 0; i0 < n_out; i0 += G) {                                                  \
      __m512 a[G][CH];                                                                           \
      for (int i = 0; i < G; i++)                                                                \
        for (int x = 0; x < CH; x++) a[i][x] = _mm512_loadu_ps(out + (i0 + i) * D + 16 * x);     \
      for (int64_t j = 0; j < n_sum; j++) {                                                      \
        __m512 y[CH];                                                                            \
        for (int x = 0; x < CH; x++) y[x] = _mm512_loadu_ps(Y + j * ldy + 16 * x);               \
        for (int i = 0; i < G; i++) {                                                            \
          __m512 w = _mm512_set1_ps(W[(i0 + i) * wi + j * wj]);                                  \
          for (int x = 0; x < CH; x++) a[i][x] = _mm512_fmadd_ps(w, y[x], a[i][x]);              \
        }                                                                                        \
      }                                                                                          \
      for (int i = 0; i < G; i++)                                                                \
        for (int x = 0; x < CH; x++) _mm512_storeu_ps(out + (i0 + i) * D + 16 * x, a[i][x]);     \
    }                                                                                            \
  }
RANK_UPDATE(rank_update_64, 4)
RANK_UPDATE(rank_update_128, 8)

/* Query rows [i0, i0 + R) of one head into Qb (12 x D, zero rows after R), times `mul` */
static void load_rows(const float* q, int64_t st, int64_t i0, int64_t R, int64_t D, float mul,
                      float* Qb) {
  for (int64_t r = 0; r < QB; r++)
    for (int64_t d = 0; d < D; d++) Qb[r * D + d] = r < R ? q[(i0 + r) * st + d] * mul : 0.0f;
}

typedef void (*update_fn)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                          float*);

void rl2_attn_fwd(const float* q, int64_t q_sh, int64_t q_st, const float* k, const float* v,
                  int64_t kv_sh, int64_t kv_st, int64_t H, int64_t KH, int64_t D, int64_t T,
                  const int64_t* bounds, const int64_t* kbounds, const int64_t* items,
                  int64_t n_items, float scale, float* scratch, int64_t cap, float* out, float* lse,
                  int threads) {
  update_fn update = D == 64 ? rank_update_64 : rank_update_128;
  int64_t n_seq = n_items / H, G = H / KH;
#pragma omp parallel num_threads(threads)
  {
    float Qb[QB * 128], Qi[QB * 128], Ob[QB * 128], S[QB * KP];
    float* panels = scratch + (int64_t)omp_get_thread_num() * cap;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; it++) {
      int64_t h = items[it] / n_seq, sq = items[it] % n_seq, kh = h / G;
      int64_t s = bounds[sq], L = bounds[sq + 1] - s, ks = kbounds[sq], M = kbounds[sq + 1] - ks;
      int64_t off = M - L, np = (M + KP - 1) / KP; /* row i sees keys up to off + i */
      if (L <= 0) continue;
      const float *kb = k + kh * kv_sh + ks * kv_st, *vb = v + kh * kv_sh + ks * kv_st;
      for (int64_t p = 0; p < np; p++)
        pack_panel(kb, kv_st, p * KP, M - p * KP < KP ? M - p * KP : KP, D, panels + p * KP * D);
      for (int64_t i0 = 0; i0 < L; i0 += QB) {
        int64_t R = L - i0 < QB ? L - i0 : QB;
        load_rows(q + h * q_sh + s * q_st, q_st, i0, R, D, scale, Qb);
        interleave_rows(Qb, D, QB, D, Qi);
        /* lane r: row r's running max and sum of exponentials (rows past R: padding) */
        __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps();
        __mmask16 live = tail16(R);
        for (int64_t x = 0; x < QB * D; x++) Ob[x] = 0.0f;
        int64_t last = off + i0 + R - 1; /* the block's last row: keys up to it */
        for (int64_t p = 0; p * KP <= last; p++) {
          int64_t j0 = p * KP, n = last + 1 - j0 < KP ? last + 1 - j0 : KP;
          tile(Qi, panels + p * KP * D, D, n, S);
          __m512 part[16];
          for (int64_t r = 0; r < 16; r++) {
            if (r >= R) { part[r] = _mm512_set1_ps(-INFINITY); continue; }
            float* sr = S + r * KP;
            int64_t lim = off + i0 + r - j0 + 1; /* keys of this row in the panel: c < lim */
            lim = lim < n ? lim : n;
            __mmask16 k0 = lim <= 0 ? 0 : tail16(lim), k1 = lim <= 16 ? 0 : tail16(lim - 16);
            __m512 s0 = _mm512_mask_blend_ps(k0, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sr));
            __m512 s1 = _mm512_mask_blend_ps(k1, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sr + 16));
            _mm512_storeu_ps(sr, s0);
            _mm512_storeu_ps(sr + 16, s1);
            part[r] = _mm512_max_ps(s0, s1);
          }
          /* a real row sees key 0 in the first panel, so its max is finite from there on; e^(-inf)
           * = 0 drops the empty start. Padding rows get 0, not -inf - -inf. */
          __m512 mn = _mm512_maskz_mov_ps(live, _mm512_max_ps(mv, rows_max16(part)));
          __m512 alpha = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(mv, mn)));
          float top[16], al[16];
          _mm512_storeu_ps(top, mn);
          _mm512_storeu_ps(al, alpha);
          for (int64_t r = 0; r < 16; r++) {
            if (r >= R) { part[r] = _mm512_setzero_ps(); continue; }
            float* sr = S + r * KP;
            __m512 t = _mm512_set1_ps(top[r]);
            __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr), t)); /* masked keys: 0 */
            __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16), t));
            _mm512_storeu_ps(sr, e0);
            _mm512_storeu_ps(sr + 16, e1);
            part[r] = _mm512_add_ps(e0, e1);
            if (al[r] != 1.0f) {
              __m512 a = _mm512_set1_ps(al[r]);
              for (int64_t x = 0; x < D; x += 16)
                _mm512_storeu_ps(Ob + r * D + x, _mm512_mul_ps(a, _mm512_loadu_ps(Ob + r * D + x)));
            }
          }
          lv = _mm512_add_ps(_mm512_mul_ps(lv, alpha), rows_sum16(part));
          mv = mn;
          /* Ob[r] += sum_c P[r][c] V[j0 + c] */
          update(S, KP, 1, vb + j0 * kv_st, kv_st, R, n, Ob);
        }
        float m[16], l[16];
        _mm512_storeu_ps(m, mv);
        _mm512_storeu_ps(l, lv);
        for (int64_t r = 0; r < R; r++) {
          float inv = 1.0f / l[r];
          float* o = out + ((s + i0 + r) * H + h) * D;
          for (int64_t x = 0; x < D; x++) o[x] = Ob[r * D + x] * inv;
          lse[h * T + s + i0 + r] = m[r] + logf(l[r]);
        }
      }
    }
  }
}

/* Backward, given the forward's out and lse (flash-attention 2's recomputation): per block of
 * query rows and panel of keys, P = exp(S - lse), dP = dO V^T, dS = P (dP - delta) with delta =
 * rowsum(dO * O); then dV += P^T dO, dK += dS^T (scale q), dQ += dS K * scale. dk_part, dv_part:
 * G x TK x KH x D each: query head h's share of its KV head's gradients in slot h % G (no two
 * work items write the same rows), summed over the slots in order by rl2_attn_sum. */
void rl2_attn_bwd(const float* q, int64_t q_sh, int64_t q_st, const float* k, const float* v,
                  int64_t kv_sh, int64_t kv_st, const float* out, const float* dout,
                  const float* lse, int64_t H, int64_t KH, int64_t D, int64_t T, int64_t TK,
                  const int64_t* bounds, const int64_t* kbounds, const int64_t* items,
                  int64_t n_items, float scale, float* scratch, int64_t cap, float* dq,
                  float* dk_part, float* dv_part,
                  int threads) {
  update_fn update = D == 64 ? rank_update_64 : rank_update_128;
  int64_t n_seq = n_items / H, G = H / KH;
#pragma omp parallel num_threads(threads)
  {
    float Qb[QB * 128], dOb[QB * 128], dQb[QB * 128], S[QB * KP], dP[QB * KP], delta[QB], ls[QB];
    float Qi[QB * 128], dOi[QB * 128]; /* Qb and dOb interleaved, as tile reads them */
    float* kpan = scratch + (int64_t)omp_get_thread_num() * 4 * cap;
    float *vpan = kpan + cap, *dK = kpan + 2 * cap, *dV = kpan + 3 * cap;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; it++) {
      int64_t h = items[it] / n_seq, sq = items[it] % n_seq, kh = h / G;
      int64_t s = bounds[sq], L = bounds[sq + 1] - s, ks = kbounds[sq], M = kbounds[sq + 1] - ks;
      int64_t off = M - L, np = (M + KP - 1) / KP;
      if (L <= 0) continue;
      const float *kb = k + kh * kv_sh + ks * kv_st, *vb = v + kh * kv_sh + ks * kv_st;
      for (int64_t p = 0; p < np; p++) {
        int64_t n = M - p * KP < KP ? M - p * KP : KP;
        pack_panel(kb, kv_st, p * KP, n, D, kpan + p * KP * D);
        pack_panel(vb, kv_st, p * KP, n, D, vpan + p * KP * D);
      }
      for (int64_t x = 0; x < M * D; x++) dK[x] = dV[x] = 0.0f;
      for (int64_t i0 = 0; i0 < L; i0 += QB) {
        int64_t R = L - i0 < QB ? L - i0 : QB;
        load_rows(q + h * q_sh + s * q_st, q_st, i0, R, D, scale, Qb);
        for (int64_t r = 0; r < QB; r++)
          for (int64_t x = 0; x < D; x++) {
            dOb[r * D + x] = r < R ? dout[((s + i0 + r) * H + h) * D + x] : 0.0f;
            dQb[r * D + x] = 0.0f;
          }
        interleave_rows(Qb, D, QB, D, Qi);
        interleave_rows(dOb, D, QB, D, dOi);
        for (int64_t r = 0; r < R; r++) {
          const float* o = out + ((s + i0 + r) * H + h) * D;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t x = 0; x < D; x += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(dOb + r * D + x), _mm512_loadu_ps(o + x), acc);
          delta[r] = _mm512_reduce_add_ps(acc);
          ls[r] = lse[h * T + s + i0 + r];
        }
        int64_t last = off + i0 + R - 1;
        for (int64_t p = 0; p * KP <= last; p++) {
          int64_t j0 = p * KP, n = last + 1 - j0 < KP ? last + 1 - j0 : KP;
          tile(Qi, kpan + p * KP * D, D, n, S);
          tile(dOi, vpan + p * KP * D, D, n, dP);
          for (int64_t r = 0; r < QB; r++) {
            float *sr = S + r * KP, *dr = dP + r * KP;
            int64_t lim = r < R ? off + i0 + r - j0 + 1 : 0;
            lim = lim < n ? lim : n;
            __mmask16 k0 = lim <= 0 ? 0 : tail16(lim), k1 = lim <= 16 ? 0 : tail16(lim - 16);
            __m512 top = _mm512_set1_ps(r < R ? ls[r] : 0.0f), dl = _mm512_set1_ps(r < R ? delta[r] : 0.0f);
            __m512 p0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(_mm512_loadu_ps(sr), top)));
            __m512 p1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16), top)));
            _mm512_storeu_ps(sr, p0);
            _mm512_storeu_ps(sr + 16, p1);
            _mm512_storeu_ps(dr, _mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(dr), dl)));
            _mm512_storeu_ps(dr + 16, _mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(dr + 16), dl)));
          }
          update(S, 1, KP, dOb, D, n, R, dV + j0 * D);           /* dV += P^T dO */
          update(dP, 1, KP, Qb, D, n, R, dK + j0 * D);           /* dK += dS^T (scale q) */
          update(dP, KP, 1, kb + j0 * kv_st, kv_st, R, n, dQb);  /* dQ += dS K (scale after) */
        }
        for (int64_t r = 0; r < R; r++) {
          float* o = dq + ((s + i0 + r) * H + h) * D;
          for (int64_t x = 0; x < D; x++) o[x] = dQb[r * D + x] * scale;
        }
      }
      float *pk = dk_part + ((h % G) * TK + ks) * KH * D + kh * D;
      float *pv = dv_part + ((h % G) * TK + ks) * KH * D + kh * D;
      for (int64_t t = 0; t < M; t++)
        for (int64_t x = 0; x < D; x++) {
          pk[t * KH * D + x] = dK[t * D + x];
          pv[t * KH * D + x] = dV[t * D + x];
        }
    }
  }
}

/* dst[i] = sum over g < G of part[g * n + i], in order */
void rl2_attn_sum(const float* part, int64_t G, int64_t n, float* dst, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail16(n - i);
    __m512 a = _mm512_maskz_loadu_ps(m, part + i);
    for (int64_t g = 1; g < G; g++) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(m, part + g * n + i));
    _mm512_mask_storeu_ps(dst + i, m, a);
  }
}

/* dst[C, R] = src[R, C]^T (row strides lds, ldd): a training linear's weight gradient and
 * input gradient want their operands with the token dimension last (onednn.py); PyTorch's
 * strided copy moved them at a quarter of this pace. */
void rl2_transpose(const float* src, int64_t R, int64_t C, int64_t lds, float* dst, int64_t ldd,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t c = 0; c < C; c += 16)
    for (int64_t r = 0; r < R; r += 64)
      for (int64_t rr = r; rr < r + 64 && rr < R; rr += 16)
        transpose16(src + rr * lds + c, lds, dst + c * ldd + rr, ldd,
                    R - rr < 16 ? (int)(R - rr) : 16, C - c < 16 ? (int)(C - c) : 16);
}

/* The kernel's weight layout in one pass: strip s (K rows of 16 floats at out + s * K * 16) is
 * the nrows[s] <= 16 weight rows from address src[s] (row stride lds floats) transposed, zeros
 * in its lanes past nrows[s]. Python describes the strips (small_gemm.strip_sources), so one
 * weight, stacked ones (q / k / v), the rotary order and a gate's and up's alternating strips
 * are all this copy; torch's reshape-transpose-contiguous plus the cat / stack / row gather
 * for those made 2-4 passes over ~100 MB after every weight sync (benchmarks/README.md, fix 53). */
void rl2_pack_strips(const int64_t* src, const int32_t* nrows, int64_t S, int64_t K, int64_t lds,
                     float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < S; s++) {
    const float* w = (const float*)(intptr_t)src[s];
    float* dst = out + s * K * 16;
    int r = nrows[s];
    if (r < 16)
      for (int64_t i = 0; i < K * 16; i++) dst[i] = 0.0f;
    if (r > 0)
      for (int64_t k0 = 0; k0 < K; k0 += 16)
        transpose16(w + k0, lds, dst + k0 * 16, 16, r, K - k0 < 16 ? (int)(K - k0) : 16);
  }
}
