/* bf16 GEMM on CPUs with AVX512-BF16 (vdpbf16ps), compiled into the same library as cpu_kernels.c
 * and called through ctypes (nanoserve/kernels/cpu_gemm.py's DotBF16Gemm; its reference is
 * F.linear, tests/test_dpbf16.py).
 *
 * vdpbf16ps multiplies 16 pairs of bf16 values by 16 pairs and adds both products to 16 float32
 * sums: twice the float32 FMA's multiply-adds per instruction, on the bf16 bits as stored (no
 * widening). oneDNN's bf16 GEMM runs on it too, near its peak for a prefill's hundreds of rows, but
 * at a decode step's 1-32 rows it reads the weights and multiplies in turn: 27 ms for Qwen3-0.6B's
 * 28 layers at 16 rows against 16 ms for their bytes alone (2 Zen 5 cores). Here one pass streams a
 * panel of 16 output columns while up to 16 rows multiply it, the weights prefetched far ahead.
 *
 * Weights: [ceil(N / 16)][Kp / 2][16][2] bf16 (Kp = K rounded up to even, zero-padded): per pair of
 * inputs, 16 columns of two weights, one 64-byte operand. Activations: bf16 rows, rearranged per
 * tile of 16 rows into [tiles][Kp / 2][16] pairs so a tile reads them through one pointer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "cpu_simd.h"
#define DPBF16 1
#else
#define DPBF16 0
#endif

#define DP_PANEL 16
#define DP_ROWS 16         /* rows per tile: 16 float32 accumulators, the weights, a scratch */
#define DP_ROW_BLOCK 256   /* rows per pass over the weights */
#define DP_PREFETCH 8192   /* bytes ahead: the first row tile of a panel streams it from DRAM */

int dpbf16_supported(void) { return DPBF16; }

/* w [N, K] bf16 -> panels [ceil(N / 16)][Kp / 2][16][2], zero past N and K. */
void pack_dpbf16_panels(const uint16_t *w, int64_t N, int64_t K, uint16_t *panels, int num_threads) {
    const int64_t Kp = K + K % 2, num_panels = (N + DP_PANEL - 1) / DP_PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        uint16_t *dst = panels + p * Kp * DP_PANEL;
        for (int64_t k2 = 0; k2 < Kp / 2; k2++)
            for (int64_t j = 0; j < DP_PANEL; j++)
                for (int64_t i = 0; i < 2; i++) {
                    const int64_t n = p * DP_PANEL + j, k = 2 * k2 + i;
                    dst[(k2 * DP_PANEL + j) * 2 + i] = n < N && k < K ? w[n * K + k] : 0;
                }
    }
}

#if DPBF16
/* x [M, K] bf16 -> xt [tiles][Kp / 2][DP_ROWS] pairs (uint32), rows past M and the odd K's pad zero. */
static void tile_rows(const uint16_t *x, int64_t M, int64_t K, int64_t Kp, uint32_t *xt, int num_threads) {
    const int64_t tiles = (M + DP_ROWS - 1) / DP_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 65536)
    for (int64_t t = 0; t < tiles; t++) {
        uint32_t *dst = xt + t * (Kp / 2) * DP_ROWS;
        for (int64_t r = 0; r < DP_ROWS; r++) {
            const int64_t m = t * DP_ROWS + r;
            for (int64_t k2 = 0; k2 < Kp / 2; k2++) {
                uint32_t pair = 0;
                if (m < M) {
                    const uint32_t lo = x[m * K + 2 * k2], hi = 2 * k2 + 1 < K ? x[m * K + 2 * k2 + 1] : 0;
                    pair = lo | hi << 16;
                }
                dst[k2 * DP_ROWS + r] = pair;
            }
        }
    }
}


/* A full tile's float32 sums of its rows against `pairs` input pairs of one panel, into acc[16]: vdpbf16ps with each
   row's input pair broadcast from memory ({1to16}), one instruction a row and pair, its accumulator
   tied to a register. Inlined into dp_tile, the intrinsic's destructive operand had GCC copy the
   sixteen accumulators around every step (85% of vdpbf16ps's peak at 256 rows). */
static __attribute__((noinline)) void dp_full_tile(const uint16_t *panel, const uint32_t *xb, int64_t pairs,
                                                   __m512 *acc) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    for (int64_t k2 = 0; k2 < pairs; k2++, panel += 2 * DP_PANEL, xb += DP_ROWS) {
        _mm_prefetch((const char *)panel + DP_PREFETCH, _MM_HINT_T0);
        const __m512 wv = _mm512_castsi512_ps(_mm512_loadu_si512(panel));
#define DP_FMA(r) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(a##r) : "v"(wv), "m"(xb[r]));
        DP_FMA(0) DP_FMA(1) DP_FMA(2) DP_FMA(3) DP_FMA(4) DP_FMA(5) DP_FMA(6) DP_FMA(7)
        DP_FMA(8) DP_FMA(9) DP_FMA(10) DP_FMA(11) DP_FMA(12) DP_FMA(13) DP_FMA(14) DP_FMA(15)
#undef DP_FMA
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
    acc[8] = a8, acc[9] = a9, acc[10] = a10, acc[11] = a11, acc[12] = a12, acc[13] = a13, acc[14] = a14;
    acc[15] = a15;
}

/* Rows m0 .. m0+mb-1 (m0 a multiple of DP_ROWS) against one panel, one float32 chain a row: a
   decode step's 16 rows multiply each weight as it streams in, where two 8-row tiles would stream
   it from memory for the first and then multiply it again from cache for the second. */
static inline __attribute__((always_inline)) void dp_tile(const int mb, const uint32_t *xt, int64_t m0, int64_t Kp,
                                                           const uint16_t *panel, int64_t n0, int64_t nn, int64_t N,
                                                           const float *bias, void *y, const int y_bf16) {
    const uint32_t *xb = xt + (m0 / DP_ROWS) * (Kp / 2) * DP_ROWS;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
/* row r's input pair `at` broadcast to the 16 columns, into accumulator a<acc> */
#define DP_INTO(acc, r, wv, at) \
    if (mb > r) a##acc = _mm512_dpbf16_ps(a##acc, (__m512bh)_mm512_set1_epi32((int)xb[(at) * DP_ROWS + r]), wv);
#define DP_ROW(r, wv, at) DP_INTO(r, r, wv, at)
#define DP_STEP(wv, at) DP_ROW(0, wv, at) DP_ROW(1, wv, at) DP_ROW(2, wv, at) DP_ROW(3, wv, at) DP_ROW(4, wv, at) \
    DP_ROW(5, wv, at) DP_ROW(6, wv, at) DP_ROW(7, wv, at) DP_ROW(8, wv, at) DP_ROW(9, wv, at) DP_ROW(10, wv, at)   \
    DP_ROW(11, wv, at) DP_ROW(12, wv, at) DP_ROW(13, wv, at) DP_ROW(14, wv, at) DP_ROW(15, wv, at)
    const int64_t pairs = Kp / 2;
    if (mb <= 8) {  /* up to 8 rows: a8 .. a15 take the odd input pairs, so that two chains a row hide the latency */
        int64_t k2 = 0;
        for (; k2 + 2 <= pairs; k2 += 2) {
            const uint16_t *w = panel + k2 * DP_PANEL * 2;
            _mm_prefetch((const char *)w + DP_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)w + DP_PREFETCH + 64, _MM_HINT_T0);
            const __m512bh wa = (__m512bh)_mm512_loadu_si512(w), wb = (__m512bh)_mm512_loadu_si512(w + 32);
            DP_ROW(0, wa, k2) DP_ROW(1, wa, k2) DP_ROW(2, wa, k2) DP_ROW(3, wa, k2) DP_ROW(4, wa, k2)
            DP_ROW(5, wa, k2) DP_ROW(6, wa, k2) DP_ROW(7, wa, k2)
            DP_INTO(8, 0, wb, k2 + 1) DP_INTO(9, 1, wb, k2 + 1) DP_INTO(10, 2, wb, k2 + 1) DP_INTO(11, 3, wb, k2 + 1)
            DP_INTO(12, 4, wb, k2 + 1) DP_INTO(13, 5, wb, k2 + 1) DP_INTO(14, 6, wb, k2 + 1) DP_INTO(15, 7, wb, k2 + 1)
        }
        if (k2 < pairs) {
            const __m512bh wa = (__m512bh)_mm512_loadu_si512(panel + k2 * DP_PANEL * 2);
            DP_ROW(0, wa, k2) DP_ROW(1, wa, k2) DP_ROW(2, wa, k2) DP_ROW(3, wa, k2) DP_ROW(4, wa, k2)
            DP_ROW(5, wa, k2) DP_ROW(6, wa, k2) DP_ROW(7, wa, k2)
        }
        a0 = _mm512_add_ps(a0, a8), a1 = _mm512_add_ps(a1, a9), a2 = _mm512_add_ps(a2, a10);
        a3 = _mm512_add_ps(a3, a11), a4 = _mm512_add_ps(a4, a12), a5 = _mm512_add_ps(a5, a13);
        a6 = _mm512_add_ps(a6, a14), a7 = _mm512_add_ps(a7, a15);
    } else if (mb == DP_ROWS) {
        __m512 acc[DP_ROWS];
        dp_full_tile(panel, xb, pairs, acc);
        a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5], a6 = acc[6], a7 = acc[7];
        a8 = acc[8], a9 = acc[9], a10 = acc[10], a11 = acc[11], a12 = acc[12], a13 = acc[13], a14 = acc[14];
        a15 = acc[15];
    } else {
        for (int64_t k2 = 0; k2 < pairs; k2++) {
            const uint16_t *w = panel + k2 * DP_PANEL * 2;
            _mm_prefetch((const char *)w + DP_PREFETCH, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w);
            DP_STEP(wv, k2)
        }
    }
#undef DP_STEP
#undef DP_ROW
#undef DP_INTO
    const __mmask16 mask = (__mmask16)((1u << nn) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
#define DP_STORE(r)                                                                               \
    if (mb > r) {                                                                                 \
        const __m512 out = _mm512_add_ps(a##r, bv);                                               \
        if (y_bf16)                                                                               \
            _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + r) * N + n0, mask, f32x16_to_bf16(out));   \
        else                                                                                      \
            _mm512_mask_storeu_ps((float *)y + (m0 + r) * N + n0, mask, out);                    \
    }
    DP_STORE(0) DP_STORE(1) DP_STORE(2) DP_STORE(3) DP_STORE(4) DP_STORE(5) DP_STORE(6) DP_STORE(7)
    DP_STORE(8) DP_STORE(9) DP_STORE(10) DP_STORE(11) DP_STORE(12) DP_STORE(13) DP_STORE(14) DP_STORE(15)
#undef DP_STORE
}
#endif

/* y[M, N] = x[M, K] . w^T (+ bias float32), x bf16, w packed by pack_dpbf16_panels, y bf16 (y_bf16)
   or float32; float32 sums. Returns 1 without AVX512-BF16, 2 without memory. */
int dpbf16_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                void *y, int y_bf16, int num_threads) {
#if DPBF16
    const int64_t Kp = K + K % 2, num_panels = (N + DP_PANEL - 1) / DP_PANEL;
    const int64_t Mt = (M + DP_ROWS - 1) / DP_ROWS * DP_ROWS;
    uint32_t *xt = malloc((size_t)(Mt * (Kp / 2)) * sizeof(uint32_t));
    if (xt == NULL) return 2;
    tile_rows(x, M, K, Kp, xt, num_threads);
    for (int64_t r0 = 0; r0 < M; r0 += DP_ROW_BLOCK) {
        const int64_t r1 = M - r0 < DP_ROW_BLOCK ? M : r0 + DP_ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < num_panels; p++) {
            const uint16_t *panel = panels + p * Kp * DP_PANEL;
            const int64_t n0 = p * DP_PANEL, nn = N - n0 < DP_PANEL ? N - n0 : DP_PANEL;
            int64_t m0 = r0;
            for (; m0 + DP_ROWS <= r1; m0 += DP_ROWS) dp_tile(DP_ROWS, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16);
            switch (r1 - m0) {
                case 15: dp_tile(15, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 14: dp_tile(14, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 13: dp_tile(13, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 12: dp_tile(12, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 11: dp_tile(11, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 10: dp_tile(10, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 9: dp_tile(9, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 8: dp_tile(8, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 7: dp_tile(7, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 6: dp_tile(6, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 5: dp_tile(5, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 4: dp_tile(4, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 3: dp_tile(3, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 2: dp_tile(2, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                case 1: dp_tile(1, xt, m0, Kp, panel, n0, nn, N, bias, y, y_bf16); break;
                default: break;
            }
        }
    }
    free(xt);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)panels; (void)N; (void)bias; (void)y; (void)y_bf16; (void)num_threads;
    return 1;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Prefill attention over a bf16 paged cache with vdpbf16ps (CPUs with AVX512-BF16): long query    */
/* runs (a prompt's prefill, a pooling model's documents), where the float32 SDPA per sequence     */
/* widened every key and value row and ran the FMA units at a tenth of this. Its reference is      */
/* paged_attention_varlen_torch (nanoserve/kernels/paged_attention.py), tests/test_cpu_kernels.py. */
/*                                                                                                 */
/* A work item is 16 query tokens of one sequence and the query heads of one KV head: the tokens   */
/* are the 16 lanes of every score vector. Keys come 32 at a time, copied out of the cache into a   */
/* contiguous chunk once for those heads: S^T[j] (a                                                  */
/* vector over the 16 queries) = sum over input pairs of the queries' pair times key j's pair,     */
/* broadcast; the online softmax is then lane-wise (each query its own max and sum), with no       */
/* horizontal reduction; O[r] (16 values of d a vector) += P[r][j] broadcast . V[j] (float32 FMAs  */
/* over the widened value rows, P not rounded; or, for pooling engines, P rounded to bf16 and two   */
/* keys a vdpbf16ps: chunk_pairs).                                                                  */
#if DPBF16
#define PA_ROWS 16 /* query tokens per work item */
#define PA_KEYS 32 /* keys per chunk: the output rows are loaded and stored once per chunk */
#define PA_SCORE_KEYS 16 /* keys per pass of chunk_scores: its sixteen accumulators */
/* Row stride of the chunk's key and value copies, the largest head_dim this kernel takes: a constant,
   so that each of the 16 keys' broadcasts is one fixed offset from one pointer. */
#define PA_MAX_D 512

typedef struct {    /* per thread; G query heads share a KV head */
    uint32_t *qp;  /* [G][D / 2][PA_ROWS] the queries' input pairs */
    uint16_t *kc;  /* [PA_KEYS][PA_MAX_D] the chunk's key rows */
    float *vf;     /* [PA_KEYS][PA_MAX_D] the chunk's value rows, float32 (p_bf16: key pairs, copy_values) */
    float *ot;     /* [G][PA_ROWS][D] the output rows */
    float *m, *l;  /* [G][PA_ROWS] each query's running max and sum */
} PrefillScratch;

/* S^T for one chunk: s[j] = the 16 queries' scores against key j, unscaled */
static __attribute__((noinline)) void chunk_scores(const uint32_t *qp, const uint16_t *kc, int64_t D, __m512 s[PA_SCORE_KEYS]) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    __m512 s8 = s0, s9 = s0, s10 = s0, s11 = s0, s12 = s0, s13 = s0, s14 = s0, s15 = s0;
    const uint32_t *k = (const uint32_t *)kc;  /* key j's pair p at k[j * PA_MAX_D / 2 + p] */
    for (int64_t p = 0; p < D / 2; p++, qp += PA_ROWS, k++) {
        const __m512 qv = _mm512_castsi512_ps(_mm512_loadu_si512(qp));
#define PA_DOT(j) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(s##j) : "v"(qv), "m"(k[(j) * (PA_MAX_D / 2)]));
        PA_DOT(0) PA_DOT(1) PA_DOT(2) PA_DOT(3) PA_DOT(4) PA_DOT(5) PA_DOT(6) PA_DOT(7)
        PA_DOT(8) PA_DOT(9) PA_DOT(10) PA_DOT(11) PA_DOT(12) PA_DOT(13) PA_DOT(14) PA_DOT(15)
#undef PA_DOT
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3, s[4] = s4, s[5] = s5, s[6] = s6, s[7] = s7;
    s[8] = s8, s[9] = s9, s[10] = s10, s[11] = s11, s[12] = s12, s[13] = s13, s[14] = s14, s[15] = s15;
}

/* An 8-row x 32-value block's output sums into registers o<r>a, o<r>b, rescaled by the rows' alpha
   (the online softmax's correction), and back: shared by the float32 and the bf16-P loops */
#define PA_LOAD(r) __m512 o##r##a = _mm512_mul_ps(_mm512_loadu_ps(o + (r) * D), _mm512_set1_ps(alpha[r0 + (r)])), \
                          o##r##b = _mm512_mul_ps(_mm512_loadu_ps(o + (r) * D + 16), _mm512_set1_ps(alpha[r0 + (r)]));
#define PA_ROWS8_LOAD PA_LOAD(0) PA_LOAD(1) PA_LOAD(2) PA_LOAD(3) PA_LOAD(4) PA_LOAD(5) PA_LOAD(6) PA_LOAD(7)
#define PA_STORE(r) _mm512_storeu_ps(o + (r) * D, o##r##a), _mm512_storeu_ps(o + (r) * D + 16, o##r##b);
#define PA_ROWS8_STORE PA_STORE(0) PA_STORE(1) PA_STORE(2) PA_STORE(3) PA_STORE(4) PA_STORE(5) PA_STORE(6) PA_STORE(7)

/* O[r] = O[r] * alpha[r] + sum over the chunk's keys j of P[r][j] . V[j], 16 values of d at a time:
   the 16 rows' sums in registers, each key's (widened) V vector loaded once for all of them, each
   row's P broadcast from memory (p[j][r]). Here P stays float32, as the reference's softmax leaves it:
   rounded to bf16 for vdpbf16ps it moved greedy tokens off HF's bf16 model where the top two
   logits were 0.03 apart. */
/* Rows r0 .. r0+7, values d .. d+31: 8 rows x 2 vectors of sums in registers, so each key's two V
   vectors and 8 P broadcasts (10 loads) feed 16 FMAs, where 16 rows x 1 vector took 17 loads */
static inline void chunk_values_8x32(float *ot, const float *vf, const float *p, const float *alpha, int64_t D,
                                     int nkeys, int r0, int64_t d) {
    float *o = ot + r0 * D + d;
    PA_ROWS8_LOAD
    for (int j = 0; j < nkeys; j++) {
        const __m512 va = _mm512_loadu_ps(vf + j * PA_MAX_D + d), vb = _mm512_loadu_ps(vf + j * PA_MAX_D + d + 16);
        const float *pj = p + j * PA_ROWS + r0;
#define PA_PV(r) { const __m512 pr = _mm512_set1_ps(pj[r]); \
                   o##r##a = _mm512_fmadd_ps(pr, va, o##r##a), o##r##b = _mm512_fmadd_ps(pr, vb, o##r##b); }
        PA_PV(0) PA_PV(1) PA_PV(2) PA_PV(3) PA_PV(4) PA_PV(5) PA_PV(6) PA_PV(7)
#undef PA_PV
    }
    PA_ROWS8_STORE
}

static __attribute__((noinline)) void chunk_values(float *ot, const float *vf, const float *p, const float *alpha,
                                                   int64_t D, int nkeys) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32)
        chunk_values_8x32(ot, vf, p, alpha, D, nkeys, 0, d), chunk_values_8x32(ot, vf, p, alpha, D, nkeys, 8, d);
    for (; d < D; d += 16) {  /* a last 16 values (D % 32 == 16): all 16 rows at once */
        float *o = ot + d;
#define PA_LOAD1(r) __m512 o##r = _mm512_mul_ps(_mm512_loadu_ps(o + (r) * D), _mm512_set1_ps(alpha[r]));
        PA_LOAD1(0) PA_LOAD1(1) PA_LOAD1(2) PA_LOAD1(3) PA_LOAD1(4) PA_LOAD1(5) PA_LOAD1(6) PA_LOAD1(7)
        PA_LOAD1(8) PA_LOAD1(9) PA_LOAD1(10) PA_LOAD1(11) PA_LOAD1(12) PA_LOAD1(13) PA_LOAD1(14) PA_LOAD1(15)
#undef PA_LOAD1
        for (int j = 0; j < nkeys; j++) {
            const __m512 v = _mm512_loadu_ps(vf + j * PA_MAX_D + d);
            const float *pj = p + j * PA_ROWS;
#define PA_PV(r) __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(o##r) : "v"(v), "m"(pj[r]));
            PA_PV(0) PA_PV(1) PA_PV(2) PA_PV(3) PA_PV(4) PA_PV(5) PA_PV(6) PA_PV(7)
            PA_PV(8) PA_PV(9) PA_PV(10) PA_PV(11) PA_PV(12) PA_PV(13) PA_PV(14) PA_PV(15)
#undef PA_PV
        }
#define PA_STORE1(r) _mm512_storeu_ps(o + (r) * D, o##r);
        PA_STORE1(0) PA_STORE1(1) PA_STORE1(2) PA_STORE1(3) PA_STORE1(4) PA_STORE1(5) PA_STORE1(6) PA_STORE1(7)
        PA_STORE1(8) PA_STORE1(9) PA_STORE1(10) PA_STORE1(11) PA_STORE1(12) PA_STORE1(13) PA_STORE1(14) PA_STORE1(15)
#undef PA_STORE1
    }
}

/* P . V with P rounded to bf16 (p_bf16): vdpbf16ps takes two keys a step, P[r][j], P[r][j+1] as one
   broadcast pair against the two keys' values interleaved (vp[j/2][d] = V[j][d], V[j+1][d]), half the
   instructions of the float32 FMAs. The sums stay float32 and the softmax's sum l is unrounded, as
   flash-attn's GPU kernels cast P for their second GEMM. */
#define PA_PAIR_DOT(acc, pr, v) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(pr), "v"(v))
static inline void chunk_pairs_8x32(float *ot, const uint32_t *vp, const uint32_t *p2, const float *alpha, int64_t D,
                                    int npairs, int r0, int64_t d) {
    float *o = ot + r0 * D + d;
    PA_ROWS8_LOAD
    for (int jp = 0; jp < npairs; jp++) {
        const __m512i va = _mm512_loadu_si512(vp + jp * PA_MAX_D + d), vb = _mm512_loadu_si512(vp + jp * PA_MAX_D + d + 16);
        const uint32_t *pj = p2 + jp * PA_ROWS + r0;
#define PA_PV(r) { const __m512i pr = _mm512_set1_epi32((int)pj[r]); PA_PAIR_DOT(o##r##a, pr, va); PA_PAIR_DOT(o##r##b, pr, vb); }
        PA_PV(0) PA_PV(1) PA_PV(2) PA_PV(3) PA_PV(4) PA_PV(5) PA_PV(6) PA_PV(7)
#undef PA_PV
    }
    PA_ROWS8_STORE
}

#undef PA_ROWS8_STORE
#undef PA_STORE
#undef PA_ROWS8_LOAD
#undef PA_LOAD

static __attribute__((noinline)) void chunk_pairs(float *ot, const uint32_t *vp, const uint32_t *p2, const float *alpha,
                                                  int64_t D, int npairs) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32)
        chunk_pairs_8x32(ot, vp, p2, alpha, D, npairs, 0, d), chunk_pairs_8x32(ot, vp, p2, alpha, D, npairs, 8, d);
    for (; d < D; d += 16) {  /* a last 16 values (D % 32 == 16) */
        for (int r = 0; r < PA_ROWS; r++) {
            float *o = ot + r * D + d;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[r]));
            for (int jp = 0; jp < npairs; jp++)
                PA_PAIR_DOT(acc, _mm512_set1_epi32((int)p2[jp * PA_ROWS + r]), _mm512_loadu_si512(vp + jp * PA_MAX_D + d));
            _mm512_storeu_ps(o, acc);
        }
    }
}
#undef PA_PAIR_DOT

/* The chunk's value rows for P . V: widened to float32 (vf[j][d]), or for p_bf16 key pairs interleaved
   (vp[j/2][d]); rows past nk are zeros. */
static void copy_values(const uint16_t *const vrows[PA_KEYS], int64_t D, int nkeys, int p_bf16, float *vf) {
    if (p_bf16) {
        uint32_t *vp = (uint32_t *)vf;
        for (int64_t jp = 0; jp < nkeys / 2; jp++) {
            const uint16_t *a = vrows[2 * jp], *b = vrows[2 * jp + 1];
            for (int64_t d = 0; d < D; d += 16) {
                const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d))) : _mm512_setzero_si512();
                const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d))) : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + jp * PA_MAX_D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
        return;
    }
    for (int64_t j = 0; j < nkeys; j++) {  /* a bf16 value is a float32's high half */
        const uint16_t *vr = vrows[j];
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i v = vr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + d))) : _mm512_setzero_si512();
            _mm512_storeu_ps(vf + j * PA_MAX_D + d, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
    }
}

/* Query tokens t0 .. t0+nq-1 (positions pos0 ..; nq <= PA_ROWS) of one sequence and the G query
   heads of KV head kvh, against its keys 0 .. pos0+nq-1 through `table`: each chunk's keys and value
   pairs copied out once for the G heads (each head its own queries, sums, max and output rows). */
static void prefill_tile(const uint16_t *q, void *out, int out_bf16, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *table, int64_t block_size, int64_t H, int64_t Hkv, int64_t D, int64_t t0,
                         int64_t nq, int64_t pos0, int64_t kvh, float scale, int p_bf16, PrefillScratch *sc) {
    const int64_t G = H / Hkv;
    /* the tile's query rows requested all at once: the transposition below reads them row by row,
       a few cache misses in flight at a time */
    for (int64_t r = 0; r < nq; r++) {
        const char *row = (const char *)(q + ((t0 + r) * H + kvh * G) * D);
        for (int64_t b = 0; b < G * D * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = kvh * G + g;
        uint32_t *qp = sc->qp + g * (D / 2) * PA_ROWS;
        for (int64_t r = 0; r < PA_ROWS; r++) {
            const uint32_t *row = (const uint32_t *)(q + ((t0 + r) * H + h) * D);
            for (int64_t p = 0; p < D / 2; p++) qp[p * PA_ROWS + r] = r < nq ? row[p] : 0;
        }
    }
    memset(sc->ot, 0, sizeof(float) * (size_t)(G * PA_ROWS * D));
    /* each lane's position; lanes past nq repeat the last query (finite, never written out) */
    int32_t pos[PA_ROWS];
    for (int64_t r = 0; r < PA_ROWS; r++) pos[r] = (int32_t)(pos0 + (r < nq ? r : nq - 1));
    const __m512i posv = _mm512_loadu_si512(pos);
    const __m512 scalev = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    /* word 2r <- word r (the first key's row r), word 2r + 1 <- word 16 + r (the second's) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t g = 0; g < G; g++) {
        _mm512_storeu_ps(sc->m + g * PA_ROWS, neg_inf);
        _mm512_storeu_ps(sc->l + g * PA_ROWS, _mm512_setzero_ps());
    }
    const int64_t nkeys = pos0 + nq;
    for (int64_t j0 = 0; j0 < nkeys; j0 += PA_KEYS) {
        const int64_t nk = nkeys - j0 < PA_KEYS ? nkeys - j0 : PA_KEYS;
        /* the keys this chunk computes: a last chunk of at most 16 keys (on the diagonal, half the
           time) skips the second half's scores, exponentials and P . V */
        const int nu = nk <= PA_SCORE_KEYS ? PA_SCORE_KEYS : PA_KEYS;
        const uint16_t *vrows[PA_KEYS];
        for (int64_t j = 0; j < nu; j++) {
            uint16_t *kd = sc->kc + j * PA_MAX_D;
            vrows[j] = NULL;
            if (j < nk) {
                const int64_t key = j0 + j, slot = (int64_t)table[key / block_size] * block_size + key % block_size;
                memcpy(kd, k_cache + (slot * Hkv + kvh) * D, sizeof(uint16_t) * (size_t)D);
                vrows[j] = v_cache + (slot * Hkv + kvh) * D;
            } else {
                memset(kd, 0, sizeof(uint16_t) * (size_t)D);
            }
        }
        copy_values(vrows, D, nu, p_bf16, sc->vf);
        for (int64_t key = j0 + PA_KEYS; key < j0 + 2 * PA_KEYS && key < nkeys; key++) {  /* the next chunk's rows */
            const int64_t slot = (int64_t)table[key / block_size] * block_size + key % block_size;
            const char *kr = (const char *)(k_cache + (slot * Hkv + kvh) * D), *vr = (const char *)(v_cache + (slot * Hkv + kvh) * D);
            for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(kr + b, _MM_HINT_T0), _mm_prefetch(vr + b, _MM_HINT_T0);
        }
        __mmask16 visible[PA_KEYS];
        for (int64_t j = 0; j < nu; j++)
            visible[j] = j < nk ? _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32((int)(j0 + j))) : 0;
        for (int64_t g = 0; g < G; g++) {
            __m512 s[PA_KEYS];
            for (int64_t j = 0; j < nu; j += PA_SCORE_KEYS)
                chunk_scores(sc->qp + g * (D / 2) * PA_ROWS, sc->kc + j * PA_MAX_D, D, s + j);
            const __m512 m = _mm512_loadu_ps(sc->m + g * PA_ROWS);
            __m512 mnew = m;
            for (int64_t j = 0; j < nu; j++) {
                s[j] = _mm512_mask_mul_ps(neg_inf, visible[j], s[j], scalev);
                mnew = _mm512_max_ps(mnew, s[j]);
            }
            const __m512 alpha = exp512_ps(_mm512_sub_ps(m, mnew));  /* m = -inf at first: ~0, times zeros */
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nu; j++) {
                s[j] = _mm512_maskz_mov_ps(visible[j], exp512_ps(_mm512_sub_ps(s[j], mnew)));
                sum = _mm512_add_ps(sum, s[j]);
            }
            _mm512_storeu_ps(sc->l + g * PA_ROWS, _mm512_fmadd_ps(_mm512_loadu_ps(sc->l + g * PA_ROWS), alpha, sum));
            _mm512_storeu_ps(sc->m + g * PA_ROWS, mnew);
            float alphas[PA_ROWS];
            _mm512_storeu_ps(alphas, alpha);
            if (p_bf16) {
                uint32_t p2[PA_KEYS / 2][PA_ROWS];  /* p2[j/2][r] = P[r][j], P[r][j+1] as a bf16 pair */
                for (int64_t jp = 0; jp < nu / 2; jp++)  /* both keys' 16 rows rounded (RNE), then interleaved */
                    _mm512_storeu_si512(p2[jp], _mm512_permutexvar_epi16(interleave,
                                        (__m512i)_mm512_cvtne2ps_pbh(s[2 * jp + 1], s[2 * jp])));
                chunk_pairs(sc->ot + g * PA_ROWS * D, (const uint32_t *)sc->vf, &p2[0][0], alphas, D, nu / 2);
            } else {
                float p[PA_KEYS][PA_ROWS];  /* p[j][r] = P[r][j] */
                for (int64_t j = 0; j < nu; j++) _mm512_storeu_ps(p[j], s[j]);
                chunk_values(sc->ot + g * PA_ROWS * D, sc->vf, &p[0][0], alphas, D, nu);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = kvh * G + g;
        float inv[PA_ROWS];
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(sc->l + g * PA_ROWS)));
        for (int64_t r = 0; r < nq; r++) {
            const int64_t at = ((t0 + r) * H + h) * D;
            const float *o = sc->ot + (g * PA_ROWS + r) * D;
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv[r]));
                if (out_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + d), f32x16_to_bf16(v));
                else _mm512_storeu_ps((float *)out + at + d, v);
            }
        }
    }
}
#endif

int prefill_attention_dpbf16_supported(void) { return DPBF16; }

/* Causal attention of every prefill query token against its sequence's cached keys (its own among
   them, already stored): q [T, H, D] bf16, out [T, H, D] bf16 (out_bf16) or float32, k/v cache
   [blocks, block_size, Hkv, D] bf16; sequence s's query tokens cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1
   are its last ones (context_lens[s] keys in all). D a multiple of 16, at most PA_MAX_D. Returns 1
   without AVX512-BF16 (or for another D), 2 without memory. */
int prefill_attention_dpbf16(const uint16_t *q, void *out, int out_bf16, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
                             const int32_t *cu_seqlens_q, const int32_t *context_lens, int64_t num_seqs, int64_t H,
                             int64_t Hkv, int64_t D, int64_t block_size, float scale, int p_bf16, int num_threads) {
#if DPBF16
    if (D % 16 || D > PA_MAX_D) return 1;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) tiles += (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + PA_ROWS - 1) / PA_ROWS;
    int64_t *tile_seq = malloc(sizeof(int64_t) * (size_t)(tiles > 0 ? tiles : 1));
    if (tile_seq == NULL) return 2;
    /* tiles in sequence order; handed out last first, so each sequence's later tiles (more keys) start
       before its earlier ones and the dynamic schedule ends more evenly */
    int64_t *tile_t0 = malloc(sizeof(int64_t) * (size_t)(tiles > 0 ? tiles : 1));
    if (tile_t0 == NULL) { free(tile_seq); return 2; }
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = cu_seqlens_q[s]; t < cu_seqlens_q[s + 1]; t += PA_ROWS) tile_seq[n] = s, tile_t0[n] = t, n++;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t G = H / Hkv;
        PrefillScratch sc = {
            malloc(sizeof(uint32_t) * (size_t)(G * D / 2 * PA_ROWS)), malloc(sizeof(uint16_t) * (size_t)(PA_KEYS * PA_MAX_D)),
            malloc(sizeof(float) * (size_t)(PA_KEYS * PA_MAX_D)), malloc(sizeof(float) * (size_t)(G * D * PA_ROWS)),
            malloc(sizeof(float) * (size_t)(G * PA_ROWS)), malloc(sizeof(float) * (size_t)(G * PA_ROWS)),
        };
        if (!sc.qp || !sc.kc || !sc.vf || !sc.ot || !sc.m || !sc.l) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = 0; i < tiles; i++) {
            for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                int stop;
#pragma omp atomic read
                stop = failed;
                if (stop) continue;
                const int64_t it = tiles - 1 - i;
                const int64_t s = tile_seq[it], t0 = tile_t0[it], end = cu_seqlens_q[s + 1];
                const int64_t nq = end - t0 < PA_ROWS ? end - t0 : PA_ROWS;
                const int64_t pos0 = context_lens[s] - (end - cu_seqlens_q[s]) + (t0 - cu_seqlens_q[s]);
                prefill_tile(q, out, out_bf16, k_cache, v_cache, block_tables + s * bt_stride, block_size, H, Hkv, D,
                             t0, nq, pos0, kvh, scale, p_bf16, &sc);
            }
        }
        free(sc.qp), free(sc.kc), free(sc.vf), free(sc.ot), free(sc.m), free(sc.l);
    }
    free(tile_seq), free(tile_t0);
    return failed ? 2 : 0;
#else
    (void)q; (void)out; (void)out_bf16; (void)k_cache; (void)v_cache; (void)block_tables; (void)bt_stride;
    (void)cu_seqlens_q; (void)context_lens; (void)num_seqs; (void)H; (void)Hkv; (void)D; (void)block_size;
    (void)scale; (void)p_bf16; (void)num_threads;
    return 1;
#endif
}
