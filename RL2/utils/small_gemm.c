/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ res), fp32, AVX-512: the linear layers of a CPU
 * decode step, optionally with the RMSNorm before them and the rotary embedding, the residual
 * add or the gated MLP's SiLU(gate) * up after them; and the decode step's attention.
 *
 * At a decode step's few rows the product is bound by reading the weights. Each weight is read
 * from memory once per call: W comes repacked into strips of 16 output columns (strip s holds
 * W[16s : 16s + 16, :]^T as K rows of 16 floats, zero rows past N; small_gemm.py packs it). A
 * panel is two adjacent strips (32 columns, the last panel may be one strip); up to 12 rows of x
 * are multiplied against a panel at once, one zmm accumulator per row and strip (24 of the 32
 * registers), and further rows re-read the panel from cache. Panels are shared out among OpenMP
 * threads (PyTorch's own libgomp: small_gemm.py links it). Sums run over k in order, one fused
 * multiply-add per step: fp32 throughout, rounded differently from a blocked BLAS, and the same
 * bits with any thread count. Built by small_gemm.py with -O3 -mavx512f -mfma -fopenmp.
 *
 * The fused norm, rotary, residual and activation save the decode step some twenty eager
 * PyTorch ops per layer, each slowed by the weight stream that just went through the caches
 * (benchmarks/README.md, fix 26); rl2_decode_layer chains a layer's calls in C (fix 27). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define ROWS 12 /* rows per pass */
#define AHEAD 64 /* prefetch distance in k (4 KiB of a strip; 16 was 5-20% slower, fix 27) */

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

/* R rows of x against strips w0 and w1 (w1 NULL: one strip) into y (row stride ldy) */
#define PANEL(R)                                                                                 \
  static void panel_##R(const float* x, int64_t K, const float* w0, const float* w1, float* y,  \
                        int64_t ldy, const epilogue* e) {                                        \
    __m512 a0[R], a1[R];                                                                         \
    __mmask16 mask = e->mask, m0 = w1 ? (__mmask16)0xFFFF : mask;                                \
    __m512 b0 = e->bias ? _mm512_maskz_loadu_ps(m0, e->bias) : _mm512_setzero_ps();              \
    __m512 b1 = e->bias && w1 ? _mm512_maskz_loadu_ps(mask, e->bias + 16) : _mm512_setzero_ps(); \
    for (int r = 0; r < R; r++) { a0[r] = b0; a1[r] = b1; }                                      \
    if (w1) {                                                                                    \
      for (int64_t k = 0; k < K; k++) {                                                          \
        _mm_prefetch((const char*)(w0 + (k + AHEAD) * 16), _MM_HINT_T0);                         \
        _mm_prefetch((const char*)(w1 + (k + AHEAD) * 16), _MM_HINT_T0);                         \
        __m512 u = _mm512_loadu_ps(w0 + k * 16), v = _mm512_loadu_ps(w1 + k * 16);               \
        for (int r = 0; r < R; r++) {                                                            \
          __m512 s = _mm512_set1_ps(x[r * K + k]);                                               \
          a0[r] = _mm512_fmadd_ps(s, u, a0[r]);                                                  \
          a1[r] = _mm512_fmadd_ps(s, v, a1[r]);                                                  \
        }                                                                                        \
      }                                                                                          \
      for (int r = 0; r < R; r++) finish_two(a0[r], a1[r], y + r * ldy, r, ldy, e);              \
    } else {                                                                                     \
      for (int64_t k = 0; k < K; k++) {                                                          \
        _mm_prefetch((const char*)(w0 + (k + AHEAD) * 16), _MM_HINT_T0);                         \
        __m512 u = _mm512_loadu_ps(w0 + k * 16);                                                 \
        for (int r = 0; r < R; r++) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), u, a0[r]); \
      }                                                                                          \
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

PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)
PANEL(7) PANEL(8) PANEL(9) PANEL(10) PANEL(11) PANEL(12)

typedef void (*panel_fn)(const float*, int64_t, const float*, const float*, float*, int64_t,
                         const epilogue*);
static const panel_fn PANELS[ROWS + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6,
                                          panel_7, panel_8, panel_9, panel_10, panel_11, panel_12};

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
  const float* a = norm_w ? h : x;
#pragma omp parallel num_threads(threads)
  {
    if (norm_w) {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; m++) rms_row(x + m * K, K, norm_w, eps, h + m * K);
    } /* the loop's barrier: every row is normalised before any panel reads it */
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
      for (int64_t m = 0; m < M; m += ROWS) {
        int64_t rows = M - m < ROWS ? M - m : ROWS;
        epilogue em = e;
        em.res = res ? res + m * N + n0 : 0;
        if (e.cos) {
          em.cos = e.cos + m * head_dim;
          em.sin = e.sin + m * head_dim;
        }
        PANELS[rows](a + m * K, K, w0, w1, y + m * N + n0, N, &em);
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

/* One decoder layer of a decode step (Llama / Qwen2 / Qwen3 / Mistral, fp32) in one call, as
 * llama_forward's fused ops do it, op for op and so bit for bit: the q/k/v product with the
 * input norm and the rotary embedding (qkv_w in rope order), this step's keys and values
 * written at `column` of the cache buffers, the attention over columns [start, column], the
 * output projection plus x, and the MLP (norm, SiLU(gate) * up, down projection plus the
 * residual). Saves the step the Python and the ~20 small PyTorch ops between those calls.
 * q_norm, k_norm (Qwen3's per-head RMSNorms, D floats each, or NULL): the heads are normalised
 * after the product and rotated then (its norm sums in another order than PyTorch's).
 * x, out: M x hidden; kbuf, vbuf: the layer's cache buffers ((b, h, w, d) at b * kv_sb + h *
 * kv_sh + w * D + d); bias: M x (column + 1 - start); scratch: threads x G x that many floats;
 * h: M x hidden; qkv: M x (heads + 2 kv_heads) D; att: M x heads D; x2: M x hidden; act: M x
 * inter (the layer's intermediates, the caller's buffers). */
void rl2_decode_layer(const float* x, int64_t M, int64_t hidden, int64_t heads, int64_t kv_heads,
                      int64_t D, const float* norm1, float eps1, const float* qkv_w,
                      const float* qkv_b, const float* cos, const float* sin,
                      const float* q_norm, const float* k_norm, float eps_q, float eps_k,
                      float* kbuf, float* vbuf, int64_t kv_sb, int64_t kv_sh, int64_t start,
                      int64_t column, const float* bias, float scale, float* scratch, const float* o_w,
                      const float* o_b, const float* norm2, float eps2, const float* gu_w,
                      const float* gu_b, int64_t inter, const float* down_w, const float* down_b,
                      float* h, float* qkv, float* att, float* x2, float* act, float* out,
                      int threads) {
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

/* The first `heads` heads (D columns each, D a multiple of 32) of M rows of y (row stride ld)
 * rotated in place as HF's apply_rotary_pos_emb rotates a head; cos, sin: M x D */
void rl2_rope(float* y, int64_t M, int64_t ld, int64_t heads, int64_t D, const float* cos,
              const float* sin, int threads) {
  int64_t half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < heads; j++)
      for (int64_t c = 0; c < half; c += 16) {
        float* p = y + m * ld + j * D + c;
        rotate16(_mm512_loadu_ps(p), _mm512_loadu_ps(p + half), cos + m * D + c, sin + m * D + c,
                 half, p, half);
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
