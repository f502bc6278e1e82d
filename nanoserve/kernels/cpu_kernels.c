/* CPU kernels for nanoserve, built on first use by nanoserve/kernels/cpu_kernels.py
 * (cc -O3 -march=native -fopenmp) and called through ctypes. Each has a PyTorch reference with
 * the same semantics; tests/test_cpu_kernels.py holds them to it.
 *
 * Paged attention (paged_attention_f32, paged_decode_f32) reads K/V straight from the
 * block-table-addressed cache. The PyTorch path (paged_attention.py) gathers every sequence's
 * blocks into a padded copy, converts it to float32 and runs SDPA on it: the KV bytes cross
 * memory about seven times per layer. Here a work item walks its sequence's blocks once, widens
 * one key/value row at a time to float32 and keeps scores in a small scratch buffer. Math is
 * float32 for every cache dtype.
 *
 * For varlen, a tile is up to TILE consecutive query tokens of one sequence; token i of a tile
 * sees nkeys0 + i keys (causal). GQA: query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * rms_norm_bf16 and qk_norm_rope_bf16 fuse the small per-token ops around attention (residual
 * add, RMSNorm, q/k norm, rotary embedding) for bf16 activations, rounding to bf16 exactly where
 * the PyTorch modules do, so only summation order differs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "cpu_simd.h"
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

/* ------------------------------------------------------------------------------------------ */
/* bf16 helpers: round-to-nearest-even like torch's float -> bfloat16 conversion.            */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t nan = (v.u >> 16) | 0x40u; /* quiet NaN, sign and payload top bits kept */
    return (uint16_t)(((v.u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static inline void widen_row(const void *base, int64_t index, int64_t n, int dtype, float *restrict dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)src[d] << 16;
            dst[d] = v.f;
        }
    } else if (dtype == DTYPE_F16) {
        const _Float16 *src = (const _Float16 *)base + index;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) dst[d] = (float)src[d];
    } else {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    }
}

/* s[j] = exp(s[j] - m) for j < n; returns their sum. Vectorised with AVX2: exp(x) = 2^k * e^r with
   x = k ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf coefficients, within 2
   ulp of expf). Scalar expf costs ~10 ns; a decode step calls it millions of times. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  /* below: exp underflows; scores are <= 0 here */
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact k*hi */
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

static inline float exp_shifted_sum(float *s, int64_t n, float m) {
    float sum = 0.0f;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    return sum;
}

#define KB 8 /* keys per QK^T chunk: one 8-float vector of scores per query row */
#define VB 4 /* value rows folded per pass over an output row */
#define RB 4 /* query rows per QK^T pass */

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int paged_attention_f32(
    const float *q,           /* [num_tokens, num_heads, head_dim] */
    float *out,               /* [num_tokens, num_heads, head_dim] */
    const void *k_cache,      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache,
    int cache_dtype,
    const int32_t *block_tables, /* [num_seqs, bt_stride]; entries past a sequence's blocks are never read */
    int64_t bt_stride,
    const int32_t *tile_seq,     /* [num_tiles] sequence of each tile */
    const int32_t *tile_start,   /* [num_tiles] first token (row of q / out) */
    const int32_t *tile_len,     /* [num_tiles] tokens in the tile, 1..max_tile_len */
    const int32_t *tile_nkeys0,  /* [num_tiles] keys seen by the tile's first token (>= 1) */
    int64_t num_tiles,
    int64_t max_tile_len,
    int64_t max_keys,            /* max over tiles of nkeys0 + len - 1 */
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t max_rows = max_tile_len * G;
    const int64_t stride_keys = (max_keys + KB - 1) / KB * KB; /* scores row length, whole chunks */
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_rows * stride_keys));
        float *acc = malloc(sizeof(float) * (size_t)(max_rows * head_dim));
        float *qs = calloc((size_t)((max_rows + RB - 1) / RB * RB * head_dim), sizeof(float));
        float *chunk = malloc(sizeof(float) * (size_t)(KB * head_dim));
        float *rows_buf = malloc(sizeof(float) * (size_t)(VB * head_dim));
        float *inv_sum = malloc(sizeof(float) * (size_t)max_rows);
        if (!scores || !acc || !qs || !chunk || !rows_buf || !inv_sum) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t tile = 0; tile < num_tiles; tile++) {
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                if (failed) continue;
                const int32_t *table = block_tables + (int64_t)tile_seq[tile] * bt_stride;
                const int64_t t0 = tile_start[tile], n = tile_len[tile], nk0 = tile_nkeys0[tile];
                const int64_t nkeys = nk0 + n - 1, rows = n * G;

                /* the tile's query rows r = (token i, head g), pre-scaled */
                for (int64_t r = 0; r < rows; r++) {
                    const float *src = q + ((t0 + r / G) * num_heads + kvh * G + r % G) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) qs[r * head_dim + d] = src[d] * scale;
                }

                /* scores = Q K^T. Few rows (decode: G rows): one dot product per key and row. */
                if (rows < RB) {
                    for (int64_t j = 0, b = 0, off = 0; j < nkeys; j++) {
                        const int64_t slot = (int64_t)table[b] * block_size + off;
                        if (++off == block_size) { off = 0; b++; }  /* no division per key */
                        widen_row(k_cache, (slot * num_kv_heads + kvh) * head_dim, head_dim, cache_dtype, rows_buf);
                        for (int64_t r = 0; r < rows; r++) {
                            const float *qr = qs + r * head_dim;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t d = 0; d < head_dim; d++) dot += qr[d] * rows_buf[d];
                            scores[r * stride_keys + j] = dot;
                        }
                    }
                }
                /* Many rows: KB keys at a time, the chunk stored transposed ([d][k]) so each query row
                   accumulates KB scores in one vector, without horizontal sums */
                for (int64_t j0 = 0, b = 0, off = 0; rows >= RB && j0 < nkeys; j0 += KB) {
                    const int64_t kb = nkeys - j0 < KB ? nkeys - j0 : KB;
                    for (int64_t k = 0; k < KB; k++) {
                        if (k < kb) {
                            const int64_t slot = (int64_t)table[b] * block_size + off;
                            if (++off == block_size) { off = 0; b++; }
                            widen_row(k_cache, (slot * num_kv_heads + kvh) * head_dim, head_dim, cache_dtype,
                                      rows_buf);
                            for (int64_t d = 0; d < head_dim; d++) chunk[d * KB + k] = rows_buf[d];
                        } else {
                            for (int64_t d = 0; d < head_dim; d++) chunk[d * KB + k] = 0.0f;
                        }
                    }
                    /* RB rows at a time: independent accumulators hide the FMA latency */
                    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                        const int64_t rb = rows - r0 < RB ? rows - r0 : RB;
                        float s[RB][KB] = {{0}};
                        const float *qr = qs + r0 * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) {
                            const float *c = chunk + d * KB;
                            for (int i = 0; i < RB; i++) {
                                const float qd = qr[i * head_dim + d];
#pragma omp simd
                                for (int k = 0; k < KB; k++) s[i][k] += qd * c[k];
                            }
                        }
                        for (int64_t i = 0; i < rb; i++) {
                            float *dst = scores + (r0 + i) * stride_keys + j0;
                            for (int k = 0; k < KB; k++) dst[k] = s[i][k];
                        }
                    }
                }

                /* causal mask, then softmax; every row sees at least key 0 */
                for (int64_t r = 0; r < rows; r++) {
                    float *s = scores + r * stride_keys;
                    const int64_t visible = nk0 + r / G;
                    float m = s[0];
                    for (int64_t j = 1; j < visible; j++) m = s[j] > m ? s[j] : m;
                    const float sum = exp_shifted_sum(s, visible, m);
                    for (int64_t j = visible; j < stride_keys; j++) s[j] = 0.0f;
                    inv_sum[r] = 1.0f / sum;
                }

                /* acc = P V, VB value rows per pass over each output row */
                memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
                for (int64_t j0 = 0, b = 0, off = 0; j0 < nkeys; j0 += VB) {
                    const int64_t vb = nkeys - j0 < VB ? nkeys - j0 : VB;
                    for (int64_t k = 0; k < VB; k++) {
                        float *dst = rows_buf + k * head_dim;
                        if (k < vb) {
                            const int64_t slot = (int64_t)table[b] * block_size + off;
                            if (++off == block_size) { off = 0; b++; }
                            widen_row(v_cache, (slot * num_kv_heads + kvh) * head_dim, head_dim, cache_dtype, dst);
                        } else {
                            memset(dst, 0, sizeof(float) * (size_t)head_dim);
                        }
                    }
                    const float *v0 = rows_buf, *v1 = v0 + head_dim, *v2 = v1 + head_dim, *v3 = v2 + head_dim;
                    for (int64_t r = 0; r < rows; r++) {
                        const float *p = scores + r * stride_keys + j0;
                        const float p0 = p[0], p1 = vb > 1 ? p[1] : 0.0f, p2 = vb > 2 ? p[2] : 0.0f,
                                    p3 = vb > 3 ? p[3] : 0.0f;
                        float *a = acc + r * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    float *o = out + ((t0 + r / G) * num_heads + kvh * G + r % G) * head_dim;
                    const float *a = acc + r * head_dim;
                    const float w = inv_sum[r];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] = a[d] * w;
                }
            }
        }
        free(scores);
        free(acc);
        free(qs);
        free(chunk);
        free(rows_buf);
        free(inv_sum);
    }
    return failed;
}

/* q . k over n floats (n a multiple of 8 when AVX2 is on; any n otherwise). */
static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
        }
        __m256 s = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        return _mm_cvtss_f32(h);
    }
#endif
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < n; d++) dot += a[d] * b[d];
    return dot;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* q.k for two query heads (q1 may equal q0: s1 is then a copy) and four bf16 key rows of n values
   (n % 16 == 0), eight independent FMA chains ended by horizontal sums. q is in even/odd order
   (eo_index): each 16 values of a key row are one 32-byte load whose 32-bit lanes widen to the
   even elements with a shift and to the odd ones with a mask, one op per 8 values where
   vpmovzxwd + shift took two (the decode loop is bound by those ops and the FMAs on Zen 1). */
static inline void qk_bf16_4x2(const float *q0, const float *q1, const uint16_t *k0, const uint16_t *k1,
                               const uint16_t *k2, const uint16_t *k3, int64_t n, float s0[4], float s1[4]) {
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define QK_KEY(kp, a, b)                                                                          \
    do {                                                                                          \
        const __m256i v = _mm256_loadu_si256((const __m256i *)((kp) + d));                        \
        const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                          \
        const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(v, odd));                          \
        a = _mm256_fmadd_ps(xo, ko, _mm256_fmadd_ps(xe, ke, a));                                  \
        b = _mm256_fmadd_ps(yo, ko, _mm256_fmadd_ps(ye, ke, b));                                  \
    } while (0)
    for (int64_t d = 0; d < n; d += 16) {
        const __m256 xe = _mm256_loadu_ps(q0 + d), xo = _mm256_loadu_ps(q0 + d + 8);
        const __m256 ye = _mm256_loadu_ps(q1 + d), yo = _mm256_loadu_ps(q1 + d + 8);
        QK_KEY(k0, a0, b0);
        QK_KEY(k1, a1, b1);
        QK_KEY(k2, a2, b2);
        QK_KEY(k3, a3, b3);
    }
#undef QK_KEY
    s0[0] = hsum8(a0), s0[1] = hsum8(a1), s0[2] = hsum8(a2), s0[3] = hsum8(a3);
    s1[0] = hsum8(b0), s1[1] = hsum8(b1), s1[2] = hsum8(b2), s1[3] = hsum8(b3);
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DECODE_ZMM 1
/* qk_bf16_4x2 in zmm registers (n % 32 == 0, q in the 32-value even/odd order): half the loads,
   widening ops and FMAs of the ymm loop, for CPUs with AVX-512. */
static inline void qk_bf16_4x2_zmm(const float *q0, const float *q1, const uint16_t *k0, const uint16_t *k1,
                                   const uint16_t *k2, const uint16_t *k3, int64_t n, float s0[4], float s1[4]) {
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define QK_KEY(kp, a, b)                                                                          \
    do {                                                                                          \
        const __m512i v = _mm512_loadu_si512((kp) + d);                                           \
        const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                          \
        const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(v, odd));                          \
        a = _mm512_fmadd_ps(xo, ko, _mm512_fmadd_ps(xe, ke, a));                                  \
        b = _mm512_fmadd_ps(yo, ko, _mm512_fmadd_ps(ye, ke, b));                                  \
    } while (0)
    for (int64_t d = 0; d < n; d += 32) {
        const __m512 xe = _mm512_loadu_ps(q0 + d), xo = _mm512_loadu_ps(q0 + d + 16);
        const __m512 ye = _mm512_loadu_ps(q1 + d), yo = _mm512_loadu_ps(q1 + d + 16);
        QK_KEY(k0, a0, b0);
        QK_KEY(k1, a1, b1);
        QK_KEY(k2, a2, b2);
        QK_KEY(k3, a3, b3);
    }
#undef QK_KEY
    s0[0] = _mm512_reduce_add_ps(a0), s0[1] = _mm512_reduce_add_ps(a1), s0[2] = _mm512_reduce_add_ps(a2);
    s0[3] = _mm512_reduce_add_ps(a3);
    s1[0] = _mm512_reduce_add_ps(b0), s1[1] = _mm512_reduce_add_ps(b1), s1[2] = _mm512_reduce_add_ps(b2);
    s1[3] = _mm512_reduce_add_ps(b3);
}
#else
#define DECODE_ZMM 0
#endif

/* The cache rows (first KV head kv0) of keys j0 .. j0+3 of a sequence; past its last key, the last
   one again, so a block of four is always whole. */
static inline void four_rows(const uint16_t *cache, const int32_t *table, int64_t j0, int64_t nkeys,
                             int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t head_dim,
                             const uint16_t *rows[4]) {
    for (int64_t i = 0; i < 4; i++) {
        const int64_t j = j0 + i < nkeys ? j0 + i : nkeys - 1;
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        rows[i] = cache + (slot * num_kv_heads + kv0) * head_dim;
    }
}

#ifndef DECODE_PREFETCH_KEYS
#define DECODE_PREFETCH_KEYS 16
#endif
/* keys j0+DECODE_PREFETCH_KEYS .. +3's rows (first KV head kv0, `bytes` each) requested ahead: a
   work item's rows sit a row of every KV head apart (2 KiB for Qwen3-0.6B), two to a page, and its
   blocks anywhere, which the hardware prefetchers did not follow (decode attention streamed ~26 GB/s,
   ~30 with this, Zen 5; NTA: each row is read once a step) */
static inline void prefetch_keys(const uint16_t *cache, const int32_t *table, int64_t j0, int64_t nkeys,
                                 int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t head_dim,
                                 int64_t bytes) {
    for (int64_t j = j0 + DECODE_PREFETCH_KEYS; j < j0 + DECODE_PREFETCH_KEYS + 4 && j < nkeys; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        const char *row = (const char *)(cache + (slot * num_kv_heads + kv0) * head_dim);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 0);  /* any target (NTA on x86) */
    }
}

/* QK^T of one decode work item over a bf16 cache: scores[r * max_keys + j] for its rows query
   heads (qs, scaled) and keys 0..nkeys-1, four keys and two heads at a time. */
static void decode_scores_bf16(const float *qs, const uint16_t *k_cache, const int32_t *table, int64_t nkeys,
                               int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t kv_per_item,
                               int64_t G, int64_t head_dim, float *scores, int64_t max_keys, int zmm) {
    (void)zmm;  /* read only where the build has the zmm kernels (DECODE_ZMM) */
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t j0 = 0; j0 < nkeys; j0 += 4) {
        const uint16_t *rows[4];  /* scores of a short block's repeated last key are dropped */
        four_rows(k_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, rows);
        prefetch_keys(k_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, kv_per_item * head_dim * 2);
        const int64_t nk = nkeys - j0 < 4 ? nkeys - j0 : 4;
        for (int64_t h = 0; h < kv_per_item; h++) {
            const int64_t koff = h * head_dim;
            for (int64_t g = 0; g < G; g += 2) {
                const int64_t r0 = h * G + g, r1 = g + 1 < G ? r0 + 1 : r0;
                float s0[4], s1[4];
#if DECODE_ZMM
                if (zmm)
                    qk_bf16_4x2_zmm(qs + r0 * head_dim, qs + r1 * head_dim, rows[0] + koff, rows[1] + koff,
                                    rows[2] + koff, rows[3] + koff, head_dim, s0, s1);
                else
#endif
                qk_bf16_4x2(qs + r0 * head_dim, qs + r1 * head_dim, rows[0] + koff, rows[1] + koff,
                            rows[2] + koff, rows[3] + koff, head_dim, s0, s1);
                for (int64_t i = 0; i < nk; i++) {
                    scores[r0 * max_keys + j0 + i] = s0[i];
                    scores[r1 * max_keys + j0 + i] = s1[i];
                }
            }
        }
    }
#else
    (void)qs; (void)k_cache; (void)table; (void)nkeys; (void)block_size; (void)num_kv_heads; (void)kv0;
    (void)kv_per_item; (void)G; (void)head_dim; (void)scores; (void)max_keys; (void)zmm;
#endif
}

/* P.V of one decode work item over a bf16 cache: acc[r] += sum_j scores[r][j] * v_j for its rows
   query heads, four value rows at a time widened in registers once for the G heads that share them;
   acc in even/odd order (eo_index), as the shift and the mask widen a chunk of 16 (ymm) or 32 (zmm) values. */
static void decode_values_bf16(const float *scores, const uint16_t *v_cache, const int32_t *table, int64_t nkeys,
                               int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t kv_per_item,
                               int64_t G, int64_t head_dim, float *acc, int64_t max_keys, int zmm) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000);
    for (int64_t j0 = 0; j0 < nkeys; j0 += 4) {
        const uint16_t *rows[4];  /* a short block's repeated last row gets weight 0 */
        const int64_t nk = nkeys - j0 < 4 ? nkeys - j0 : 4;
        four_rows(v_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, rows);
        prefetch_keys(v_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, kv_per_item * head_dim * 2);
        for (int64_t h = 0; zmm && h < kv_per_item; h++) {
#if DECODE_ZMM  /* the same, 32 values of a row at a time (acc in the 32-value even/odd order) */
            const __m512i odd16 = _mm512_set1_epi32((int)0xffff0000);
            const int64_t voff = h * head_dim;
            for (int64_t d = 0; d < head_dim; d += 32) {
                /* the four rows widened once for the G heads: even values (shifted up), odd (masked) */
#define PV_WIDEN(i) const __m512i u##i = _mm512_loadu_si512(rows[i] + voff + d);                   \
    const __m512 ve##i = _mm512_castsi512_ps(_mm512_slli_epi32(u##i, 16)),                        \
                 vo##i = _mm512_castsi512_ps(_mm512_and_si512(u##i, odd16));
                PV_WIDEN(0) PV_WIDEN(1) PV_WIDEN(2) PV_WIDEN(3)
#undef PV_WIDEN
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = h * G + g;
                    const float *p = scores + r * max_keys + j0;
                    const __m512 p0 = _mm512_set1_ps(p[0]), p1 = _mm512_set1_ps(nk > 1 ? p[1] : 0.0f);
                    const __m512 p2 = _mm512_set1_ps(nk > 2 ? p[2] : 0.0f), p3 = _mm512_set1_ps(nk > 3 ? p[3] : 0.0f);
                    float *a = acc + r * head_dim + d;
                    __m512 e = _mm512_loadu_ps(a), o = _mm512_loadu_ps(a + 16);
#define PV_ROW(i, pk) e = _mm512_fmadd_ps(pk, ve##i, e), o = _mm512_fmadd_ps(pk, vo##i, o)
                    PV_ROW(0, p0);
                    PV_ROW(1, p1);
                    PV_ROW(2, p2);
                    PV_ROW(3, p3);
#undef PV_ROW
                    _mm512_storeu_ps(a, e), _mm512_storeu_ps(a + 16, o);
                }
            }
#endif
        }
        for (int64_t h = 0; !zmm && h < kv_per_item; h++) {
            const int64_t voff = h * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m256i u0 = _mm256_loadu_si256((const __m256i *)(rows[0] + voff + d));
                const __m256i u1 = _mm256_loadu_si256((const __m256i *)(rows[1] + voff + d));
                const __m256i u2 = _mm256_loadu_si256((const __m256i *)(rows[2] + voff + d));
                const __m256i u3 = _mm256_loadu_si256((const __m256i *)(rows[3] + voff + d));
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = h * G + g;
                    const float *p = scores + r * max_keys + j0;
                    const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(nk > 1 ? p[1] : 0.0f);
                    const __m256 p2 = _mm256_set1_ps(nk > 2 ? p[2] : 0.0f), p3 = _mm256_set1_ps(nk > 3 ? p[3] : 0.0f);
                    float *a = acc + r * head_dim + d;
                    __m256 e = _mm256_loadu_ps(a), o = _mm256_loadu_ps(a + 8);
#define PV_ROW(u, pk)                                                                             \
    e = _mm256_fmadd_ps(pk, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), e);                    \
    o = _mm256_fmadd_ps(pk, _mm256_castsi256_ps(_mm256_and_si256(u, odd)), o)
                    PV_ROW(u0, p0);
                    PV_ROW(u1, p1);
                    PV_ROW(u2, p2);
                    PV_ROW(u3, p3);
#undef PV_ROW
                    _mm256_storeu_ps(a, e), _mm256_storeu_ps(a + 8, o);
                }
            }
        }
    }
#else
    (void)scores; (void)v_cache; (void)table; (void)nkeys; (void)block_size; (void)num_kv_heads; (void)kv0;
    (void)kv_per_item; (void)G; (void)head_dim; (void)acc; (void)max_keys; (void)zmm;
#endif
}

#if DECODE_ZMM && defined(__AVX512BF16__)
#define DECODE_DPBF16 1
/* Sixteen float32 vectors' lane sums, as one vector (lane i: the sum of v[i]): pairs, quads, halves
   and wholes of 128-bit lanes folded together, 45 ops where sixteen reductions took ~130 */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 x[8], z[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: [a, b, c, d], each summed over the lane's 4 values */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* QK^T of one decode work item with vdpbf16ps (AVX512-BF16, bf16 q and cache, head_dim % 32 == 0):
   eight keys against two query heads (r0, r1) a pass, 32 values of d a step, q's pairs times each
   key's pairs into sixteen float32 sums (the products exact, as the widening loop's), folded by
   sum16 and scaled after. q: the item's bf16 query rows, natural order. */
static void decode_scores_dpbf16(const uint16_t *q, const uint16_t *k_cache, const int32_t *table, int64_t nkeys,
                                 int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t kv_per_item,
                                 int64_t G, int64_t head_dim, float scale, float *scores, int64_t max_keys) {
    const __m512 scalev = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < nkeys; j0 += 8) {
        const uint16_t *rows[8];
        const int64_t nk = nkeys - j0 < 8 ? nkeys - j0 : 8;
        four_rows(k_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, rows);
        four_rows(k_cache, table, j0 + 4, nkeys, block_size, num_kv_heads, kv0, head_dim, rows + 4);
        prefetch_keys(k_cache, table, j0, nkeys, block_size, num_kv_heads, kv0, head_dim, kv_per_item * head_dim * 2);
        prefetch_keys(k_cache, table, j0 + 4, nkeys, block_size, num_kv_heads, kv0, head_dim, kv_per_item * head_dim * 2);
        const __mmask16 keep = (__mmask16)((1u << nk) - 1);
        for (int64_t h = 0; h < kv_per_item; h++) {
            const int64_t koff = h * head_dim;
            for (int64_t g = 0; g < G; g += 2) {
                const int64_t r0 = h * G + g, r1 = g + 1 < G ? r0 + 1 : r0;
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 32) {
                    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q + r0 * head_dim + d);
                    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q + r1 * head_dim + d);
                    for (int i = 0; i < 8; i++) {
                        const __m512bh k = (__m512bh)_mm512_loadu_si512(rows[i] + koff + d);
                        acc[i] = _mm512_dpbf16_ps(acc[i], q0, k);
                        acc[8 + i] = _mm512_dpbf16_ps(acc[8 + i], q1, k);
                    }
                }
                const __m512 sums = _mm512_mul_ps(sum16(acc), scalev);  /* [r0's 8 keys, r1's 8 keys] */
                _mm512_mask_storeu_ps(scores + r0 * max_keys + j0, keep, sums);
                _mm512_mask_storeu_ps(scores + r1 * max_keys + j0, keep, _mm512_shuffle_f32x4(sums, sums, 0xEE));
            }
        }
    }
}

#else
#define DECODE_DPBF16 0
#endif

/* Does decode attention with bf16 q and cache (head_dim % 32 == 0) take the vdpbf16ps loops? (Their
   float32 sums differ from the float32-q call's in the last bits: tests/test_cpu_kernels.py.) */
int decode_dpbf16_supported(void) { return DECODE_DPBF16; }

/* Where element d of a head sits in the even/odd order of the bf16 decode loops: in each chunk of
   16 (ymm) or 32 (zmm) values, the even elements first, then the odd ones. */
static inline int64_t eo_index(int64_t d, int64_t chunk) {
    return (d & ~(chunk - 1)) + (d & 1) * (chunk / 2) + ((d & (chunk - 1)) >> 1);
}

/* Decode: one query token per sequence. A work item is (sequence, group of kv_per_item KV heads):
   it reads each key's kv_per_item * head_dim values, contiguous in the cache, so memory is walked
   block by block. A bf16 cache (head_dim % 16 == 0) is widened in registers, four keys at a time
   for the GQA heads that share them (decode_scores_bf16, decode_values_bf16): 1.2-1.5x faster than
   widening each row into a scratch and ending every (key, head) dot product in a horizontal sum
   (Zen 1, Qwen3-0.6B heads, 128-2048 keys, 1-16 sequences). Returns 0 on success, 1 if scratch memory could not be allocated. */
int paged_decode_f32(
    const void *q,               /* [num_seqs, num_heads, head_dim] float32, or bf16 with io_bf16 */
    void *out,                   /* [num_seqs, num_heads, head_dim] as q */
    const void *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache,
    int cache_dtype,
    const int32_t *block_tables, /* [num_seqs, bt_stride] */
    int64_t bt_stride,
    const int32_t *context_lens, /* [num_seqs] keys per sequence (>= 1) */
    int64_t num_seqs,
    int64_t max_keys,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t kv_per_item,         /* divides num_kv_heads */
    float scale,
    int io_bf16,                 /* q and out are bf16 (the model's dtype), not float32: no conversions around the call */
    int num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t rows = kv_per_item * G;      /* query heads per work item */
    const int64_t width = kv_per_item * head_dim;
    const int64_t groups = num_kv_heads / kv_per_item;
#if defined(__AVX2__) && defined(__FMA__)
    const int bf16_in_registers = cache_dtype == DTYPE_BF16 && head_dim % 16 == 0;
#else
    const int bf16_in_registers = 0;
#endif
    /* AVX-512: the bf16 loops in zmm registers where a head is whole 32-value chunks */
    const int zmm = DECODE_ZMM && bf16_in_registers && head_dim % 32 == 0;
    /* AVX512-BF16 with bf16 q: the scores by vdpbf16ps (1.1-1.4x the decode attention, Zen 5; P.V with
       each head's sums in registers over all keys was slower: every head a pass over the rows) */
    const int dpbf16 = DECODE_DPBF16 && zmm && io_bf16;
    const int64_t chunk = zmm ? 32 : 16;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * max_keys));
        float *acc = malloc(sizeof(float) * (size_t)(rows * head_dim));
        float *qs = malloc(sizeof(float) * (size_t)(rows * head_dim));
        float *kv = malloc(sizeof(float) * (size_t)(VB * width));
        float *inv_sum = malloc(sizeof(float) * (size_t)rows);
        if (!scores || !acc || !qs || !kv || !inv_sum) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; seq++) {
            for (int64_t grp = 0; grp < groups; grp++) {
                if (failed) continue;
                const int32_t *table = block_tables + seq * bt_stride;
                const int64_t nkeys = context_lens[seq];
                const int64_t kv0 = grp * kv_per_item;  /* first KV head; query heads kv0*G .. */
                const int64_t q0 = (seq * num_heads + kv0 * G) * head_dim;
                for (int64_t r = 0, x = 0; !dpbf16 && r < rows; r++)  /* even/odd order for the bf16 loops */
                    for (int64_t d = 0; d < head_dim; d++, x++)
                        qs[r * head_dim + (bf16_in_registers ? eo_index(d, chunk) : d)] =
                            (io_bf16 ? bf16_to_f32(((const uint16_t *)q)[q0 + x]) : ((const float *)q)[q0 + x]) * scale;

                if (dpbf16) {
#if DECODE_DPBF16
                    decode_scores_dpbf16((const uint16_t *)q + q0, (const uint16_t *)k_cache, table, nkeys, block_size,
                                         num_kv_heads, kv0, kv_per_item, G, head_dim, scale, scores, max_keys);
#endif
                } else if (bf16_in_registers) {
                    decode_scores_bf16(qs, (const uint16_t *)k_cache, table, nkeys, block_size, num_kv_heads, kv0,
                                       kv_per_item, G, head_dim, scores, max_keys, zmm);
                } else {
                    for (int64_t j = 0, b = 0, off = 0; j < nkeys; j++) {
                        const int64_t slot = (int64_t)table[b] * block_size + off;
                        if (++off == block_size) { off = 0; b++; }
                        widen_row(k_cache, (slot * num_kv_heads + kv0) * head_dim, width, cache_dtype, kv);
                        for (int64_t r = 0; r < rows; r++)
                            scores[r * max_keys + j] = dot_f32(qs + r * head_dim, kv + (r / G) * head_dim, head_dim);
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    float *s = scores + r * max_keys;
                    float m = s[0];
                    for (int64_t j = 1; j < nkeys; j++) m = s[j] > m ? s[j] : m;
                    const float sum = exp_shifted_sum(s, nkeys, m);
                    inv_sum[r] = 1.0f / sum;
                }
                memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
                if (bf16_in_registers)
                    decode_values_bf16(scores, (const uint16_t *)v_cache, table, nkeys, block_size, num_kv_heads,
                                       kv0, kv_per_item, G, head_dim, acc, max_keys, zmm);
                for (int64_t j0 = 0, b = 0, off = 0; !bf16_in_registers && j0 < nkeys; j0 += VB) {
                    const int64_t vb = nkeys - j0 < VB ? nkeys - j0 : VB;
                    for (int64_t k = 0; k < VB; k++) {
                        float *dst = kv + k * width;
                        if (k < vb) {
                            const int64_t slot = (int64_t)table[b] * block_size + off;
                            if (++off == block_size) { off = 0; b++; }
                            widen_row(v_cache, (slot * num_kv_heads + kv0) * head_dim, width, cache_dtype, dst);
                        } else {
                            memset(dst, 0, sizeof(float) * (size_t)width);
                        }
                    }
                    for (int64_t r = 0; r < rows; r++) {
                        const float *p = scores + r * max_keys + j0;
                        const float p0 = p[0], p1 = vb > 1 ? p[1] : 0.0f, p2 = vb > 2 ? p[2] : 0.0f,
                                    p3 = vb > 3 ? p[3] : 0.0f;
                        const float *v0 = kv + (r / G) * head_dim, *v1 = v0 + width, *v2 = v1 + width,
                                    *v3 = v2 + width;
                        float *a = acc + r * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    const float *a = acc + r * head_dim;
                    if (io_bf16) {
                        uint16_t *o = (uint16_t *)out + q0 + r * head_dim;
                        for (int64_t d = 0; d < head_dim; d++)
                            o[d] = f32_to_bf16(a[bf16_in_registers ? eo_index(d, chunk) : d] * inv_sum[r]);
                    } else {
                        float *o = (float *)out + q0 + r * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) o[d] = a[bf16_in_registers ? eo_index(d, chunk) : d] * inv_sum[r];
                    }
                }
            }
        }
        free(scores);
        free(acc);
        free(qs);
        free(kv);
        free(inv_sum);
    }
    return failed;
}


#if defined(__AVX2__) && defined(__FMA__)
/* f32_to_bf16 on 8 lanes: the bf16 bits in the low half of each 32-bit lane */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
#endif

/* out[i, d] = bf16(bf16(silu(gate)) * up) with x[i] = [gate | up] (dim 2n), for bf16: what
   F.silu(gate) * up does in bf16, as one call (at one decode row the two torch ops cost ~10x the
   math). silu(g) = g / (1 + e^-g) in float32; exp256_ps is within 2 ulp of expf, so a result can
   differ from torch's by one bf16 step where it lies on a rounding boundary. */
void silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *gate = x + i * 2 * n, *up = gate + n;
        uint16_t *o = out + i * n;
        int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
        for (; d + 16 <= n; d += 16) {  /* the loop below in zmm registers: half the divisions, a third of the time */
            const __m512 g = bf16x16_to_f32(gate + d);
            const __m512 e = exp512_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(89.0f)));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm256_storeu_si256((__m256i *)(o + d), f32x16_to_bf16(_mm512_mul_ps(round_bf16_ps(silu), bf16x16_to_f32(up + d))));
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        for (; d + 8 <= n; d += 8) {
            const __m256 g = widen_bf16x8(gate + d);
            /* e^-g; where it overflows float32 it is +inf as in torch (g / inf = 0; exp256_ps gets there
               from -g ~ 88.4, expf from 88.7: a silu of ~-3e-37 becomes -0), the clamp keeps it there */
            const __m256 e = exp256_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(89.0f)));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            const __m256 rounded = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(silu), 16));
            const __m256i bits = bf16_bits8(_mm256_mul_ps(rounded, widen_bf16x8(up + d)));
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
            _mm_storeu_si128((__m128i *)(o + d), _mm256_castsi256_si128(packed));
        }
#endif
        for (; d < n; d++) {
            const float g = bf16_to_f32(gate[d]);
            o[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g)))) * bf16_to_f32(up[d]));
        }
    }
}

/* out = bf16(weight * bf16(r * rsqrt(mean(r^2) + eps))), r = x, or with residual:
   r = bf16(x + residual) is also written to residual_out (may alias residual). Rows of `dim`. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *residual_out, const uint16_t *weight,
                   uint16_t *out, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * dim;
        uint16_t *oi = out + i * dim;
        float buf[dim];
        if (residual) {
            const uint16_t *ri = residual + i * dim;
            uint16_t *ro = residual_out + i * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) {
                const uint16_t r = f32_to_bf16(bf16_to_f32(xi[d]) + bf16_to_f32(ri[d]));
                ro[d] = r;
                buf[d] = bf16_to_f32(r);
            }
        } else {
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) buf[d] = bf16_to_f32(xi[d]);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += buf[d] * buf[d];
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            oi[d] = f32_to_bf16(bf16_to_f32(weight[d]) * bf16_to_f32(f32_to_bf16(buf[d] * scale)));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
/* qk_norm_rope_bf16's head in zmm registers, for head_dim % 32 == 0 (halves of whole vectors): the
   same float32 operations and roundings, no FMA contraction, ~3x the auto-vectorized loops (whose
   per-head bf16 roundings went through scalar-sized conversions) */
__attribute__((optimize("fp-contract=off"))) static void norm_rope_head_zmm(const uint16_t *src, uint16_t *dst, const uint16_t *w, const float *cs, int64_t head_dim,
                               float eps) {
    float v[head_dim];
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 x = bf16x16_to_f32(src + d);
        _mm512_storeu_ps(v + d, x);
        ss = _mm512_add_ps(ss, _mm512_mul_ps(x, x));
    }
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)head_dim + eps));
    for (int64_t d = 0; d < head_dim; d += 16)  /* the norm's output, rounded as the module does */
        _mm512_storeu_ps(v + d, round_bf16_ps(_mm512_mul_ps(bf16x16_to_f32(w + d),
                                                            round_bf16_ps(_mm512_mul_ps(_mm512_loadu_ps(v + d), scale)))));
    const int64_t half = head_dim / 2;
    for (int64_t d = 0; d < half; d += 16) {
        const __m512 c = _mm512_loadu_ps(cs + d), s = _mm512_loadu_ps(cs + half + d);
        const __m512 x1 = _mm512_loadu_ps(v + d), x2 = _mm512_loadu_ps(v + half + d);
        _mm256_storeu_si256((__m256i *)(dst + d), f32x16_to_bf16(_mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s))));
        _mm256_storeu_si256((__m256i *)(dst + half + d),
                            f32x16_to_bf16(_mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s))));
    }
}
#define NORM_ROPE_ZMM 1
#else
#define NORM_ROPE_ZMM 0
#endif

/* Per-head RMSNorm then neox-style RoPE (rotate halves), for q and k of a fused qkv row.
   q_in/k_in: rows of a [tokens, in_stride] bf16 tensor, heads of head_dim values each;
   q_out [tokens, num_q_heads, head_dim], k_out [tokens, num_k_heads, head_dim] bf16;
   cos_sin [max_pos, head_dim] float32: cos of the head_dim/2 frequencies, then their sin. */
/* No FMA contraction: x1 * c - x2 * s rounds each product like the PyTorch module does. */
__attribute__((optimize("fp-contract=off"))) void qk_norm_rope_bf16(const uint16_t *q_in, const uint16_t *k_in, int64_t in_stride, uint16_t *q_out,
                       uint16_t *k_out, const uint16_t *q_weight, const uint16_t *k_weight, const int64_t *positions,
                       const float *cos_sin, int64_t tokens, int64_t num_q_heads, int64_t num_k_heads,
                       int64_t head_dim, float eps, int num_threads) {
    const int64_t half = head_dim / 2, heads = num_q_heads + num_k_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * head_dim > 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const int is_q = h < num_q_heads;
            const int64_t hh = is_q ? h : h - num_q_heads;
            const uint16_t *src = (is_q ? q_in : k_in) + t * in_stride + hh * head_dim;
            uint16_t *dst = (is_q ? q_out + t * num_q_heads * head_dim : k_out + t * num_k_heads * head_dim)
                            + hh * head_dim;
            const uint16_t *w = is_q ? q_weight : k_weight;
#if NORM_ROPE_ZMM
            if (head_dim % 32 == 0) {
                norm_rope_head_zmm(src, dst, w, cs, head_dim, eps);
                continue;
            }
#endif
            float v[head_dim];
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < head_dim; d++) {
                v[d] = bf16_to_f32(src[d]);
                ss += v[d] * v[d];
            }
            const float scale = 1.0f / sqrtf(ss / (float)head_dim + eps);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)  /* the norm's output, rounded as the module does */
                v[d] = bf16_to_f32(f32_to_bf16(bf16_to_f32(w[d]) * bf16_to_f32(f32_to_bf16(v[d] * scale))));
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float c = cs[d], s = cs[half + d], x1 = v[d], x2 = v[half + d];
                dst[d] = f32_to_bf16(x1 * c - x2 * s);
                dst[half + d] = f32_to_bf16(x2 * c + x1 * s);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* This step's K/V rows into the paged cache at their slots (slot < 0: skip). A row is           */
/* row_bytes of heads x head_dim, contiguous in the source (rows strided, e.g. a slice of qkv)  */
/* and in the cache, whose flat view [slots][row] a slot indexes directly. One call for both     */
/* caches: the torch version's boolean mask, gather and two index_copy_ cost ~0.1 ms a layer.  */
void store_kv_rows(const uint8_t *key, int64_t key_stride, const uint8_t *value, int64_t value_stride,
                   uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Small-M GEMM with bf16 weights: y[M,N] = x[M,K] . w[N,K]^T (+ bias), x and y float32.       */
/* The weight is packed once into panels of 16 output columns, [N/16][K][16] bf16 (zero-padded */
/* past N), so at every k one panel row is one 32-byte load, widened to two float32 vectors in */
/* registers with one op each (panel_slot says how). Tiles of up to 6 rows x 16 columns keep   */
/* 12 accumulators and compute outer products: each x value is broadcast once and meets both   */
/* weight vectors (no horizontal sums). 12 FMAs per 2 widened weight vectors and 6 broadcasts  */
/* keeps the FMA units busy. On Zen 1 (a 256-bit op is two 128-bit halves) the widening is the */
/* margin: zero-extend + shift per 8 weights held the tile at ~70% of the FMA peak, one shift  */
/* or one and per 8 weights at ~85% (single core, CPU time, 16-256 rows).                      */

int panel_gemm_supported(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* bf16 activations around the float32 GEMMs: flags & IO_X_BF16, x [M, K] is bf16 (widened here
   into a float32 copy, exact); flags & IO_Y_BF16, y [M, N] is bf16 (the kernel writes a float32
   copy, rounded into y as torch's .to() rounds). At a few rows the two torch conversions around a
   call cost more than the GEMM's own overhead; here they are one pass each. Returns 1 without memory. */
enum { IO_X_BF16 = 1, IO_Y_BF16 = 2 };

int bf16_io_begin(const void *x, void *y, int64_t M, int64_t K, int64_t N, int flags, const float **xf, float **yf,
                  int num_threads) {
    *xf = (const float *)x, *yf = (float *)y;
    float *xw = NULL, *yw = NULL;
    const int copy_x = (flags & IO_X_BF16) && M * K > 0, copy_y = (flags & IO_Y_BF16) && M * N > 0;
    if (copy_x) xw = malloc(sizeof(float) * (size_t)(M * K));
    if (copy_y) yw = malloc(sizeof(float) * (size_t)(M * N));
    if ((copy_x && xw == NULL) || (copy_y && yw == NULL)) {
        free(xw), free(yw);
        return 1;
    }
    if (xw != NULL) {
        const uint16_t *xb = (const uint16_t *)x;
#pragma omp parallel for simd schedule(static) num_threads(num_threads) if (M * K > (1 << 18))
        for (int64_t i = 0; i < M * K; i++) xw[i] = bf16_to_f32(xb[i]);
        *xf = xw;
    }
    if (yw != NULL) *yf = yw;
    return 0;
}

void bf16_io_end(const void *x, void *y, int64_t M, int64_t N, int flags, const float *xf, float *yf,
                 int num_threads) {
    if ((flags & IO_Y_BF16) && yf != y) {
        uint16_t *yb = (uint16_t *)y;
#pragma omp parallel for simd schedule(static) num_threads(num_threads) if (M * N > (1 << 18))
        for (int64_t i = 0; i < M * N; i++) yb[i] = f32_to_bf16(yf[i]);
        free(yf);
    }
    if ((flags & IO_X_BF16) && xf != x) free((void *)xf);
}

#define PANEL 16
/* Bytes ahead that the panel tile prefetches, a cache line every other k (the rate it reads them).
   At 1-3 rows the hardware prefetcher left the weights' stream at ~23 of ~30 GB/s on Zen 1: the
   prefetch makes those GEMMs 1.2x faster (4 rows 1.1x, 6 rows and up unchanged). */
#define PANEL_PREFETCH 1024
#ifndef ROW_BLOCK
#define ROW_BLOCK 256 /* rows of x per pass over the weights (measured best of 48-512 on 2 Zen 3 cores) */
#endif

/* Where column j of a panel sits in its 16-weight row: columns 0-7 in the even slots, 8-15 in the
   odd ones. Read as 8 32-bit lanes, a row then widens to float32 in two cheap ops: lane << 16 is
   column j (even slot), lane & 0xffff0000 is column 8 + j (odd slot). */
static inline int64_t panel_slot(int64_t j) { return j < PANEL / 2 ? 2 * j : 2 * (j - PANEL / 2) + 1; }

/* w [N, K] bf16 -> panels [ceil(N / 16), K, 16] bf16, padded with zeros. */
void pack_bf16_panels(const uint16_t *w, int64_t N, int64_t K, uint16_t *panels, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        uint16_t *dst = panels + p * K * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t n = p * PANEL + j;
            const int64_t slot = panel_slot(j);
            if (n < N) {
                const uint16_t *src = w + n * K;
                for (int64_t k = 0; k < K; k++) dst[k * PANEL + slot] = src[k];
            } else {
                for (int64_t k = 0; k < K; k++) dst[k * PANEL + slot] = 0;
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline void store_tile_row(float *yr, __m256 lo, __m256 hi, int64_t n0, int64_t nn, const float *bias) {
    float out[PANEL];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    for (int64_t j = 0; j < nn; j++) yr[j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
}

/* Rows m0 .. m0+mb-1 (mb <= 6, a compile-time constant at every call) of x against one panel
   (output columns n0 .. n0+nn-1). The accumulators are named variables, not an array: GCC keeps
   an array in memory and stores all of it every iteration, which made the loop store-bound. */
static inline __attribute__((always_inline)) void panel_tile(const int mb, const float *x, int64_t m0, int64_t K,
                                                              const uint16_t *panel, int64_t n0, int64_t nn, int64_t N,
                                                              const float *bias, float *y) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *x0 = x + m0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K, *x4 = x3 + K, *x5 = x4 + K;
    const __m256i hi_half = _mm256_set1_epi32((int)0xffff0000);
    for (int64_t k = 0; k < K; k++) {
        if ((k & 1) == 0) _mm_prefetch((const char *)(panel + k * PANEL) + PANEL_PREFETCH, _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(panel + k * PANEL));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));       /* columns 0-7 */
        const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi_half));   /* columns 8-15 */
        __m256 b = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01);
        if (mb > 1) b = _mm256_broadcast_ss(x1 + k), c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11);
        if (mb > 2) b = _mm256_broadcast_ss(x2 + k), c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21);
        if (mb > 3) b = _mm256_broadcast_ss(x3 + k), c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31);
        if (mb > 4) b = _mm256_broadcast_ss(x4 + k), c40 = _mm256_fmadd_ps(b, w0, c40), c41 = _mm256_fmadd_ps(b, w1, c41);
        if (mb > 5) b = _mm256_broadcast_ss(x5 + k), c50 = _mm256_fmadd_ps(b, w0, c50), c51 = _mm256_fmadd_ps(b, w1, c51);
    }
    float *yr = y + m0 * N + n0;
    store_tile_row(yr, c00, c01, n0, nn, bias);
    if (mb > 1) store_tile_row(yr + N, c10, c11, n0, nn, bias);
    if (mb > 2) store_tile_row(yr + 2 * N, c20, c21, n0, nn, bias);
    if (mb > 3) store_tile_row(yr + 3 * N, c30, c31, n0, nn, bias);
    if (mb > 4) store_tile_row(yr + 4 * N, c40, c41, n0, nn, bias);
    if (mb > 5) store_tile_row(yr + 5 * N, c50, c51, n0, nn, bias);
}
#endif

static int panel_gemm_f32(const float *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                          float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    /* Blocks of ROW_BLOCK rows of x (they stay in L2) outermost, then panels: one panel (K * 32
       bytes) stays in L1/L2 while every row tile of the block reads it. */
    for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
        const int64_t r1 = M - r0 < ROW_BLOCK ? M : r0 + ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const uint16_t *panel = panels + p * K * PANEL;
        const int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
        int64_t m0 = r0;
        for (; m0 + 6 <= r1; m0 += 6) panel_tile(6, x, m0, K, panel, n0, nn, N, bias, y);
        switch (r1 - m0) {
            case 5: panel_tile(5, x, m0, K, panel, n0, nn, N, bias, y); break;
            case 4: panel_tile(4, x, m0, K, panel, n0, nn, N, bias, y); break;
            case 3: panel_tile(3, x, m0, K, panel, n0, nn, N, bias, y); break;
            case 2: panel_tile(2, x, m0, K, panel, n0, nn, N, bias, y); break;
            case 1: panel_tile(1, x, m0, K, panel, n0, nn, N, bias, y); break;
            default: break;
        }
    }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)panels; (void)N; (void)bias; (void)y; (void)num_threads;
    return 1;
#endif
}

/* y [M, N] = x [M, K] . W^T (+ bias), W packed bf16 panels; x and y float32 or bf16 (io: IO_* flags).
   Returns 0 on success, 1 if this build has no AVX2/FMA, 2 without memory for bf16 io. */
int panel_gemm_bf16(const void *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                    void *y, int io, int num_threads) {
    const float *xf;
    float *yf;
    if (bf16_io_begin(x, y, M, K, N, io, &xf, &yf, num_threads)) return 2;
    const int rc = panel_gemm_f32(xf, M, K, panels, N, bias, yf, num_threads);
    bf16_io_end(x, y, M, N, io, xf, yf, num_threads);
    return rc;
}
