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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
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

/* in cpu_int8.c: 16 float32 lanes rounded to bf16 as cpu_kernels.c's f32_to_bf16 */
__m256i f32x16_to_bf16(__m512 v);

/* A full tile's float32 sums of all its rows against one panel, into acc[16]: vdpbf16ps with each
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
