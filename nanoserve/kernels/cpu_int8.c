/* int8-weight GEMMs for nanoserve's CPU backend, compiled into the same library as cpu_kernels.c
 * and called through ctypes (nanoserve/kernels/cpu_int8.py holds the bindings and the PyTorch
 * reference of every function here; tests/test_int8.py holds them to it).
 *
 * Weights: int8, symmetric, one float32 scale per output channel and group of `group_size`
 * input channels (group_size = K: per channel, what `quantization="int8"` uses; smaller groups are
 * what int4 checkpoints need, and they run through the same loops: each group's partial sums are
 * scaled into the tile once per group). Packed like the bf16 panels of cpu_kernels.c, in panels
 * of 16 output columns, [ceil(N / 16)][Kp][16] int8 with Kp = K rounded up to even, zero-padded;
 * scales [groups][ceil(N / 16) * 16] float32, so one panel's scales for a group are one vector.
 *
 * Two kernels read that one layout:
 *   W8A16  x float32; 16 weights of a panel row widened in registers (vpmovsxbd + vcvtdq2ps),
 *          then the 6x16 outer-product tile of the bf16 panel GEMM. Float32 math, no activation
 *          rounding beyond the weights'.
 *   W8A8   x quantized per token (row) to int8 values held as int16 (symmetric, scale amax/127);
 *          two panel rows (k, k+1) are interleaved and sign-extended to int16 pairs, and vpmaddwd
 *          against a broadcast (x[k], x[k+1]) pair does 16 multiply-adds into int32 per
 *          instruction. vpmaddubsw (u8 x s8) would do 32 per instruction but needs a second
 *          vpmaddwd to widen its int16 sums, so both reach the same rate on one multiply port,
 *          and its int16 pair sums saturate for u8 activations (255 * 127 * 2 > 32767) unless
 *          activations or weights lose a bit. The int16 form has neither problem.
 * Exact int32 sums: |x|, |w| <= 127 and K < 2^31 / 127^2 / 2 per group.
 *
 * On CPUs with AVX512-VNNI a third int8 kernel (VNNI, below W4A8) takes its own layout, the
 * weights as q + 128 in vpdpbusd's operand order, and runs W4A8's panels as well.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "cpu_simd.h"
#endif

/* in cpu_kernels.c: bf16 activations in and out around the float32 kernels (IO_* flags) */
int bf16_io_begin(const void *x, void *y, int64_t M, int64_t K, int64_t N, int flags, const float **xf, float **yf,
                  int num_threads);
void bf16_io_end(const void *x, void *y, int64_t M, int64_t N, int flags, const float *xf, float *yf,
                 int num_threads);

/* The body of an exported GEMM entry: KERNEL (float32 x and y) on the entry's x and y, float32 or
   bf16 (io: IO_* flags). Returns KERNEL's code, 2 without memory for the float32 copies. */
#define BF16_IO_ENTRY(KERNEL, ...)                                                                \
    do {                                                                                          \
        const float *xf;                                                                          \
        float *yf;                                                                                \
        if (bf16_io_begin(x, y, M, K, N, io, &xf, &yf, num_threads)) return 2;                    \
        const int rc = KERNEL(xf, __VA_ARGS__, yf, num_threads);                                  \
        bf16_io_end(x, y, M, N, io, xf, yf, num_threads);                                         \
        return rc;                                                                                \
    } while (0)

#define I8_PANEL 16
#ifndef I8_ROW_BLOCK
#define I8_ROW_BLOCK 256 /* rows of x per pass over the weights, as in the bf16 panel GEMM */
_Static_assert(I8_ROW_BLOCK % 16 == 0, "the VNNI tiles of 16 rows must not straddle two row blocks");
#endif

int int8_gemm_supported(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* q [N, K] int8 -> panels [ceil(N / 16), Kp, 16] int8, zero-padded past N and K. */
void pack_int8_panels(const int8_t *q, int64_t N, int64_t K, int64_t Kp, int8_t *panels, int num_threads) {
    const int64_t num_panels = (N + I8_PANEL - 1) / I8_PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        int8_t *dst = panels + p * Kp * I8_PANEL;
        memset(dst, 0, (size_t)(Kp * I8_PANEL));
        for (int64_t j = 0; j < I8_PANEL && p * I8_PANEL + j < N; j++) {
            const int8_t *src = q + (p * I8_PANEL + j) * K;
            for (int64_t k = 0; k < K; k++) dst[k * I8_PANEL + j] = src[k];
        }
    }
}

/* Per-row symmetric quantization: scale = amax / 127, q = round-half-even(x * (127 / amax)),
   written as int16 into rows of Kp (zeros past K). A zero row gets scale 0 and q 0. Rounding is
   the conversion instructions' (MXCSR's default, round half to even, like torch.round);
   nearbyintf would be a libm call per element, slower than the GEMM it feeds at small N. */
void quantize_rows_int8(const float *x, int64_t M, int64_t K, int64_t Kp, int16_t *q, float *scales,
                        int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int16_t *qr = q + m * Kp;
        float amax = 0.0f;
        int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vmax = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xr + k), abs_mask));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
#endif
        for (; k < K; k++) amax = fmaxf(amax, fabsf(xr[k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scales[m] = amax / 127.0f;
        k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; k + 16 <= K; k += 16) {
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), vinv));
            /* packs works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder the 64-bit quarters */
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i *)(qr + k), packed);
        }
        for (; k < K; k++) qr[k] = (int16_t)_mm_cvtss_si32(_mm_set_ss(xr[k] * inv));
#else
        for (; k < K; k++) qr[k] = (int16_t)nearbyintf(xr[k] * inv);
#endif
        for (k = K; k < Kp; k++) qr[k] = 0;
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* tile[r][0..15] += lo/hi * scale vector (one group's partial sums of row r) */
static inline void flush_row(float *t, __m256 lo, __m256 hi, __m256 s0, __m256 s1) {
    _mm256_storeu_ps(t, _mm256_fmadd_ps(lo, s0, _mm256_loadu_ps(t)));
    _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(hi, s1, _mm256_loadu_ps(t + 8)));
}

static inline void store_rows(int mb, const float tile[6][I8_PANEL], float *y, int64_t m0, int64_t N, int64_t n0,
                              int64_t nn, const float *row_scale, const float *bias) {
    for (int r = 0; r < mb; r++) {
        float *yr = y + (m0 + r) * N + n0;
        const float rs = row_scale ? row_scale[m0 + r] : 1.0f;
        for (int64_t j = 0; j < nn; j++) yr[j] = tile[r][j] * rs + (bias ? bias[n0 + j] : 0.0f);
    }
}

static inline __m256 widen_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The mb rows of float accumulators c00 .. c51 into the tile, scaled by (s0, s1) */
#define W8A16_FLUSH(s0, s1)                                                                      \
    do {                                                                                         \
        flush_row(tile[0], c00, c01, s0, s1);                                                    \
        if (mb > 1) flush_row(tile[1], c10, c11, s0, s1);                                        \
        if (mb > 2) flush_row(tile[2], c20, c21, s0, s1);                                        \
        if (mb > 3) flush_row(tile[3], c30, c31, s0, s1);                                        \
        if (mb > 4) flush_row(tile[4], c40, c41, s0, s1);                                        \
        if (mb > 5) flush_row(tile[5], c50, c51, s0, s1);                                        \
    } while (0)

/* W8A16: rows m0 .. m0+mb-1 of x (float32, row stride K) against one panel. Named accumulators,
   as in the bf16 panel tile: an array would be kept in memory. */
static inline __attribute__((always_inline)) void w8a16_tile(const int mb, const float *x, int64_t m0, int64_t K,
                                                              int64_t Kp, const int8_t *panel, const float *scales,
                                                              int64_t Np, int64_t group, int64_t n0, int64_t nn,
                                                              int64_t N, const float *bias, float *y,
                                                              const float *wf) {
    float tile[6][I8_PANEL] = {{0}};
    const float *x0 = x + m0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K, *x4 = x3 + K, *x5 = x4 + K;
    if (wf != NULL) {  /* the panel already dequantized (scales applied): [K][16] float32 */
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int64_t k = 0; k < K; k++) {
            const __m256 w0 = _mm256_loadu_ps(wf + k * I8_PANEL), w1 = _mm256_loadu_ps(wf + k * I8_PANEL + 8);
            __m256 b = _mm256_broadcast_ss(x0 + k);
            c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01);
            if (mb > 1) b = _mm256_broadcast_ss(x1 + k), c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11);
            if (mb > 2) b = _mm256_broadcast_ss(x2 + k), c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21);
            if (mb > 3) b = _mm256_broadcast_ss(x3 + k), c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31);
            if (mb > 4) b = _mm256_broadcast_ss(x4 + k), c40 = _mm256_fmadd_ps(b, w0, c40), c41 = _mm256_fmadd_ps(b, w1, c41);
            if (mb > 5) b = _mm256_broadcast_ss(x5 + k), c50 = _mm256_fmadd_ps(b, w0, c50), c51 = _mm256_fmadd_ps(b, w1, c51);
        }
        /* per channel, the scratch holds the integers and the scales apply here, once */
        const __m256 one = _mm256_set1_ps(1.0f);
        const __m256 s0 = group >= K ? _mm256_loadu_ps(scales + n0) : one;
        const __m256 s1 = group >= K ? _mm256_loadu_ps(scales + n0 + 8) : one;
        W8A16_FLUSH(s0, s1);
        store_rows(mb, tile, y, m0, N, n0, nn, NULL, bias);
        return;
    }
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, gi++) {
        const int64_t g1 = g0 + group < K ? g0 + group : K;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int64_t k = g0; k < g1; k++) {
            const __m256 w0 = widen_i8x8(panel + k * I8_PANEL);
            const __m256 w1 = widen_i8x8(panel + k * I8_PANEL + 8);
            __m256 b = _mm256_broadcast_ss(x0 + k);
            c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01);
            if (mb > 1) b = _mm256_broadcast_ss(x1 + k), c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11);
            if (mb > 2) b = _mm256_broadcast_ss(x2 + k), c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21);
            if (mb > 3) b = _mm256_broadcast_ss(x3 + k), c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31);
            if (mb > 4) b = _mm256_broadcast_ss(x4 + k), c40 = _mm256_fmadd_ps(b, w0, c40), c41 = _mm256_fmadd_ps(b, w1, c41);
            if (mb > 5) b = _mm256_broadcast_ss(x5 + k), c50 = _mm256_fmadd_ps(b, w0, c50), c51 = _mm256_fmadd_ps(b, w1, c51);
        }
        const __m256 s0 = _mm256_loadu_ps(scales + gi * Np + n0), s1 = _mm256_loadu_ps(scales + gi * Np + n0 + 8);
        W8A16_FLUSH(s0, s1);
    }
    (void)Kp;
    store_rows(mb, tile, y, m0, N, n0, nn, NULL, bias);
}

/* (x[k], x[k+1]) of an int16 row, broadcast to every 32-bit lane */
static inline __m256i pair_i16(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* acc += b . w in int16 pairs. The add in asm, accumulating in place: as an intrinsic, GCC (with
   AVX-512's 32 registers to spare) gave each sum a new register and copied all twelve back every
   step, one more instruction per multiply-add (Zen 5, the W8A8 GEMMs at the Qwen3-0.6B shapes:
   63 / 67% -> 74 / 82% of the vpmaddwd + vpaddd peak at 64 / 256 rows) */
#define MADD(acc, b, w)                                                                          \
    ({                                                                                           \
        const __m256i madd_ = _mm256_madd_epi16(b, w);                                           \
        __asm__("vpaddd %1, %0, %0" : "+v"(acc) : "v"(madd_));                                   \
    })

/* W8A8: rows m0 .. m0+mb-1 of the quantized x (int16, row stride Kp) against one panel. */
static inline __attribute__((always_inline)) void w8a8_tile(const int mb, const int16_t *xq, const float *xs,
                                                             int64_t m0, int64_t K, int64_t Kp, const int8_t *panel,
                                                             const float *scales, int64_t Np, int64_t group,
                                                             int64_t n0, int64_t nn, int64_t N, const float *bias,
                                                             float *y, const int16_t *ws) {
    float tile[6][I8_PANEL] = {{0}};
    const int16_t *x0 = xq + m0 * Kp, *x1 = x0 + Kp, *x2 = x1 + Kp, *x3 = x2 + Kp, *x4 = x3 + Kp, *x5 = x4 + Kp;
    for (int64_t g0 = 0, gi = 0; g0 < Kp; g0 += group, gi++) {
        const int64_t g1 = g0 + group < Kp ? g0 + group : Kp;
        __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define W8A8_STEP(w0, w1)                                                                        \
    do {                                                                                         \
        __m256i b = pair_i16(x0 + k);                                                            \
        MADD(c00, b, w0), MADD(c01, b, w1);                                                      \
        if (mb > 1) b = pair_i16(x1 + k), MADD(c10, b, w0), MADD(c11, b, w1);                    \
        if (mb > 2) b = pair_i16(x2 + k), MADD(c20, b, w0), MADD(c21, b, w1);                    \
        if (mb > 3) b = pair_i16(x3 + k), MADD(c30, b, w0), MADD(c31, b, w1);                    \
        if (mb > 4) b = pair_i16(x4 + k), MADD(c40, b, w0), MADD(c41, b, w1);                    \
        if (mb > 5) b = pair_i16(x5 + k), MADD(c50, b, w0), MADD(c51, b, w1);                    \
    } while (0)
        if (ws != NULL) {  /* the panel already widened: per pair of k, 16 (w[k][j], w[k+1][j]) int16 pairs */
            for (int64_t k = g0; k < g1; k += 2) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(ws + k * I8_PANEL));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(ws + k * I8_PANEL + 16));
                W8A8_STEP(w0, w1);
            }
        } else {
            for (int64_t k = g0; k < g1; k += 2) {
                /* rows k and k+1 of the panel, interleaved: (w[k][j], w[k+1][j]) pairs, j = 0..15 */
                const __m128i r0 = _mm_loadu_si128((const __m128i *)(panel + k * I8_PANEL));
                const __m128i r1 = _mm_loadu_si128((const __m128i *)(panel + (k + 1) * I8_PANEL));
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));  /* columns 0-7 */
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));  /* columns 8-15 */
                W8A8_STEP(w0, w1);
            }
        }
#undef W8A8_STEP
        const __m256 s0 = _mm256_loadu_ps(scales + gi * Np + n0), s1 = _mm256_loadu_ps(scales + gi * Np + n0 + 8);
        flush_row(tile[0], _mm256_cvtepi32_ps(c00), _mm256_cvtepi32_ps(c01), s0, s1);
        if (mb > 1) flush_row(tile[1], _mm256_cvtepi32_ps(c10), _mm256_cvtepi32_ps(c11), s0, s1);
        if (mb > 2) flush_row(tile[2], _mm256_cvtepi32_ps(c20), _mm256_cvtepi32_ps(c21), s0, s1);
        if (mb > 3) flush_row(tile[3], _mm256_cvtepi32_ps(c30), _mm256_cvtepi32_ps(c31), s0, s1);
        if (mb > 4) flush_row(tile[4], _mm256_cvtepi32_ps(c40), _mm256_cvtepi32_ps(c41), s0, s1);
        if (mb > 5) flush_row(tile[5], _mm256_cvtepi32_ps(c50), _mm256_cvtepi32_ps(c51), s0, s1);
    }
    (void)K;
    store_rows(mb, tile, y, m0, N, n0, nn, xs, bias);
}

/* Rows r0..r1 of one panel as 6-row tiles, then the remainder (TILE's first argument: its rows; it
   reads m0, the tile's first row). */
#define I8_ROW_TILES(TILE, ...)                                                                  \
    do {                                                                                         \
        int64_t m0 = r0;                                                                         \
        for (; m0 + 6 <= r1; m0 += 6) TILE(6, __VA_ARGS__);                                      \
        switch (r1 - m0) {                                                                       \
            case 5: TILE(5, __VA_ARGS__); break;                                                 \
            case 4: TILE(4, __VA_ARGS__); break;                                                 \
            case 3: TILE(3, __VA_ARGS__); break;                                                 \
            case 2: TILE(2, __VA_ARGS__); break;                                                 \
            case 1: TILE(1, __VA_ARGS__); break;                                                 \
            default: break;                                                                      \
        }                                                                                        \
    } while (0)

/* Row blocks outermost, then panels over the threads, each panel against every row tile of the
   block (ROW_TILES: I8_ROW_TILES, or W4_ROW_TILES for W4A8's 4-row tiles). */
#define I8_DRIVE_TILES(ROW_TILES, TILE, ...)                                                     \
    do {                                                                                         \
        const int64_t num_panels = (N + I8_PANEL - 1) / I8_PANEL;                                \
        for (int64_t r0 = 0; r0 < M; r0 += I8_ROW_BLOCK) {                                       \
            const int64_t r1 = M - r0 < I8_ROW_BLOCK ? M : r0 + I8_ROW_BLOCK;                    \
            _Pragma("omp parallel for schedule(static) num_threads(num_threads)")               \
            for (int64_t p = 0; p < num_panels; p++) {                                           \
                const int8_t *panel = panels + p * panel_bytes;                                  \
                const int64_t n0 = p * I8_PANEL, nn = N - n0 < I8_PANEL ? N - n0 : I8_PANEL;      \
                ROW_TILES(TILE, __VA_ARGS__);                                                    \
            }                                                                                    \
        }                                                                                        \
    } while (0)
#define I8_DRIVE(TILE, ...) I8_DRIVE_TILES(I8_ROW_TILES, TILE, __VA_ARGS__)
#endif

/* y[M, N] = x[M, K] . dequant(w)^T (+ bias), x and y float32. Returns 1 without AVX2/FMA. */
static int int8_gemm_w8a16_f32(const float *x, int64_t M, int64_t K, const int8_t *panels, int64_t Kp, const float *scales,
                    int64_t group, int64_t N, const float *bias, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t Np = (N + I8_PANEL - 1) / I8_PANEL * I8_PANEL, panel_bytes = Kp * I8_PANEL;
    if (M <= 6) {  /* one tile: widen the weights in its loop */
        const float *wf = NULL;
        I8_DRIVE(w8a16_tile, x, m0, K, Kp, panel, scales, Np, group, n0, nn, N, bias, y, wf);
        return 0;
    }
    /* More rows: widen each panel once into a float32 scratch ([K][16], in L2) and run every row
       tile against it. Widening int8 takes two 256-bit ops per 8 weights (vpmovsxbd, vcvtdq2ps);
       done in every tile it held the tile at ~67% of the FMA peak on Zen 1, where a 256-bit op is
       two halves. Per channel the scratch keeps the integers and the tiles scale their sums: no
       multiply per weight in the FMA pipes (7-16 rows 4-6% faster on Zen 1). */
    const int64_t num_panels = (N + I8_PANEL - 1) / I8_PANEL;
    for (int64_t r0 = 0; r0 < M; r0 += I8_ROW_BLOCK) {  /* row blocks outermost, as I8_DRIVE */
        const int64_t r1 = M - r0 < I8_ROW_BLOCK ? M : r0 + I8_ROW_BLOCK;
#pragma omp parallel num_threads(num_threads)
        {
            /* NULL if out of memory: the tiles then widen the weights themselves */
            float *wf = aligned_alloc(32, (size_t)((K * I8_PANEL * 4 + 31) / 32 * 32));
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int8_t *panel = panels + p * Kp * I8_PANEL;
                const int64_t n0 = p * I8_PANEL, nn = N - n0 < I8_PANEL ? N - n0 : I8_PANEL;
                if (wf != NULL && group >= K) {  /* per channel: integers only, scaled in the tile's flush */
                    for (int64_t k = 0; k < K; k++) {
                        _mm256_storeu_ps(wf + k * I8_PANEL, widen_i8x8(panel + k * I8_PANEL));
                        _mm256_storeu_ps(wf + k * I8_PANEL + 8, widen_i8x8(panel + k * I8_PANEL + 8));
                    }
                }
                for (int64_t g0 = 0, gi = 0; wf != NULL && group < K && g0 < K; g0 += group, gi++) {
                    const int64_t g1 = g0 + group < K ? g0 + group : K;
                    const __m256 s0 = _mm256_loadu_ps(scales + gi * Np + n0);
                    const __m256 s1 = _mm256_loadu_ps(scales + gi * Np + n0 + 8);
                    for (int64_t k = g0; k < g1; k++) {
                        _mm256_storeu_ps(wf + k * I8_PANEL, _mm256_mul_ps(widen_i8x8(panel + k * I8_PANEL), s0));
                        _mm256_storeu_ps(wf + k * I8_PANEL + 8,
                                         _mm256_mul_ps(widen_i8x8(panel + k * I8_PANEL + 8), s1));
                    }
                }
                I8_ROW_TILES(w8a16_tile, x, m0, K, Kp, panel, scales, Np, group, n0, nn, N, bias, y, wf);
            }
            free(wf);
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)panels; (void)Kp; (void)scales; (void)group; (void)N; (void)bias; (void)y;
    (void)num_threads;
    return 1;
#endif
}

/* int8_gemm_w8a16 on float32 or bf16 x and y (io: IO_* flags); 2 without memory for bf16 io. */
int int8_gemm_w8a16(const void *x, int64_t M, int64_t K, const int8_t *panels, int64_t Kp, const float *scales,
                    int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads) {
    BF16_IO_ENTRY(int8_gemm_w8a16_f32, M, K, panels, Kp, scales, group, N, bias);
}

/* y[M, N] = xs[m] * (xq[M, Kp] . w^T, scaled per group) (+ bias). xq from quantize_rows_int8.
   group must be even (pairs of k never straddle a group). Returns 1 without AVX2/FMA. */
int int8_gemm_w8a8(const int16_t *xq, const float *xs, int64_t M, int64_t K, const int8_t *panels, int64_t Kp,
                   const float *scales, int64_t group, int64_t N, const float *bias, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t Np = (N + I8_PANEL - 1) / I8_PANEL * I8_PANEL, panel_bytes = Kp * I8_PANEL;
    if (M < 32) {  /* a few tiles: widen the weights in their loop (widening first gained nothing at 16 rows) */
        const int16_t *ws = NULL;
        I8_DRIVE(w8a8_tile, xq, xs, m0, K, Kp, panel, scales, Np, group, n0, nn, N, bias, y, ws);
        return 0;
    }
    /* More rows: widen each panel once per row block into int16 pairs (scratch [Kp][16] int16, in
       L2), as the W8A16 kernel dequantizes its panels, and run every row tile against it (on a
       Zen 1 core, 73% -> 76-80% of the vpmaddwd peak at 64-256 rows). */
    const int64_t num_panels = (N + I8_PANEL - 1) / I8_PANEL;
    for (int64_t r0 = 0; r0 < M; r0 += I8_ROW_BLOCK) {
        const int64_t r1 = M - r0 < I8_ROW_BLOCK ? M : r0 + I8_ROW_BLOCK;
#pragma omp parallel num_threads(num_threads)
        {
            /* NULL if out of memory: the tiles then widen the weights themselves */
            int16_t *ws = aligned_alloc(32, (size_t)((Kp * I8_PANEL * 2 + 31) / 32 * 32));
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int8_t *panel = panels + p * Kp * I8_PANEL;
                const int64_t n0 = p * I8_PANEL, nn = N - n0 < I8_PANEL ? N - n0 : I8_PANEL;
                for (int64_t k = 0; ws != NULL && k < Kp; k += 2) {
                    const __m128i a = _mm_loadu_si128((const __m128i *)(panel + k * I8_PANEL));
                    const __m128i b = _mm_loadu_si128((const __m128i *)(panel + (k + 1) * I8_PANEL));
                    _mm256_storeu_si256((__m256i *)(ws + k * I8_PANEL), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)));
                    _mm256_storeu_si256((__m256i *)(ws + k * I8_PANEL + 16),
                                        _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)));
                }
                I8_ROW_TILES(w8a8_tile, xq, xs, m0, K, Kp, panel, scales, Np, group, n0, nn, N, bias, y, ws);
            }
            free(ws);
        }
    }
    return 0;
#else
    (void)xq; (void)xs; (void)M; (void)K; (void)panels; (void)Kp; (void)scales; (void)group; (void)N; (void)bias;
    (void)y; (void)num_threads;
    return 1;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* W4A16: 4-bit weights with a zero point and a scale per group (GPTQ / AWQ / compressed-tensors   */
/* int4), half the int8 bytes. Panels of 16 columns, [ceil(N / 16)][K][8] bytes: byte j of row k   */
/* holds column j in its low nibble and column j + 8 in its high one, q unsigned in [0, 15].       */
/* w[n, k] = (q - z) * s per group, so y = sum_g s * (x . q)_g - z * s * (sum of x over g): the    */
/* group's sums of x times q, then once per group + xsum[m, g] * offsets (offsets = -z * s).       */
/* Nibbles are widened to float32 in registers (vpmovzxbd, vpand / vpsrld, vcvtdq2ps) and run the  */
/* W8A16 tile's FMAs: at 1-4 rows the GEMM streams weights, and their bytes are what it saves.    */

#if defined(__AVX2__) && defined(__FMA__)
/* tile[r] += lo/hi * scale + xsum * offset (one group's partial sums of row r) */
static inline void flush_row_zp(float *t, __m256 lo, __m256 hi, __m256 s0, __m256 s1, __m256 o0, __m256 o1,
                                float xsum) {
    const __m256 b = _mm256_set1_ps(xsum);
    _mm256_storeu_ps(t, _mm256_fmadd_ps(lo, s0, _mm256_fmadd_ps(b, o0, _mm256_loadu_ps(t))));
    _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(hi, s1, _mm256_fmadd_ps(b, o1, _mm256_loadu_ps(t + 8))));
}

static inline __attribute__((always_inline)) void w4a16_tile(const int mb, const float *x, int64_t m0, int64_t K,
                                                              const int8_t *panel_bytes_, const float *scales,
                                                              const float *offsets, const float *xg, int64_t G,
                                                              int64_t Np, int64_t group, int64_t n0, int64_t nn,
                                                              int64_t N, const float *bias, float *y) {
    const uint8_t *panel = (const uint8_t *)panel_bytes_;
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    float tile[6][I8_PANEL] = {{0}};
    const float *x0 = x + m0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K, *x4 = x3 + K, *x5 = x4 + K;
    const float *g0r = xg + m0 * G;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, gi++) {
        const int64_t g1 = g0 + group < K ? g0 + group : K;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int64_t k = g0; k < g1; k++) {
            /* bytes to int32 lanes first: then one AND and one shift split all 16 nibbles */
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(panel + k * 8)));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)); /* columns 0-7 */
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));      /* columns 8-15 */
            __m256 b = _mm256_broadcast_ss(x0 + k);
            c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01);
            if (mb > 1) b = _mm256_broadcast_ss(x1 + k), c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11);
            if (mb > 2) b = _mm256_broadcast_ss(x2 + k), c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21);
            if (mb > 3) b = _mm256_broadcast_ss(x3 + k), c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31);
            if (mb > 4) b = _mm256_broadcast_ss(x4 + k), c40 = _mm256_fmadd_ps(b, w0, c40), c41 = _mm256_fmadd_ps(b, w1, c41);
            if (mb > 5) b = _mm256_broadcast_ss(x5 + k), c50 = _mm256_fmadd_ps(b, w0, c50), c51 = _mm256_fmadd_ps(b, w1, c51);
        }
        const float *sg = scales + gi * Np + n0, *og = offsets + gi * Np + n0;
        const __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
        const __m256 o0 = _mm256_loadu_ps(og), o1 = _mm256_loadu_ps(og + 8);
        flush_row_zp(tile[0], c00, c01, s0, s1, o0, o1, g0r[gi]);
        if (mb > 1) flush_row_zp(tile[1], c10, c11, s0, s1, o0, o1, g0r[G + gi]);
        if (mb > 2) flush_row_zp(tile[2], c20, c21, s0, s1, o0, o1, g0r[2 * G + gi]);
        if (mb > 3) flush_row_zp(tile[3], c30, c31, s0, s1, o0, o1, g0r[3 * G + gi]);
        if (mb > 4) flush_row_zp(tile[4], c40, c41, s0, s1, o0, o1, g0r[4 * G + gi]);
        if (mb > 5) flush_row_zp(tile[5], c50, c51, s0, s1, o0, o1, g0r[5 * G + gi]);
    }
    store_rows(mb, tile, y, m0, N, n0, nn, NULL, bias);
}
#endif

/* y[M, N] = x[M, K] . ((q - z) * s)^T (+ bias), x and y float32; panels as above, scales and
   offsets (-z * s) [ceil(K / group)][ceil(N / 16) * 16] float32. Returns 1 without AVX2/FMA, 2 if
   the per-group sums of x cannot be allocated. */
static int int4_gemm_w4a16_f32(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                    const float *offsets, int64_t group, int64_t N, const float *bias, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t G = (K + group - 1) / group;
    const int64_t Np = (N + I8_PANEL - 1) / I8_PANEL * I8_PANEL, panel_bytes = K * (I8_PANEL / 2);
    float *xg = (float *)malloc((size_t)(M * G) * sizeof(float));
    if (xg == NULL) return 2;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t k1 = (g + 1) * group < K ? (g + 1) * group : K;
            float sum = 0.0f;
            for (int64_t k = g * group; k < k1; k++) sum += x[m * K + k];
            xg[m * G + g] = sum;
        }
    }
    I8_DRIVE(w4a16_tile, x, m0, K, panel, scales, offsets, xg, G, Np, group, n0, nn, N, bias, y);
    free(xg);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)panels; (void)scales; (void)offsets; (void)group; (void)N; (void)bias; (void)y;
    (void)num_threads;
    return 1;
#endif
}

/* int4_gemm_w4a16 on float32 or bf16 x and y (io: IO_* flags). */
int int4_gemm_w4a16(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                    const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads) {
    BF16_IO_ENTRY(int4_gemm_w4a16_f32, M, K, panels, scales, offsets, group, N, bias);
}

/* ------------------------------------------------------------------------------------------ */
/* W4A8: the same 4-bit weights against activations quantized to int8 (outliers found per block  */
/* of 32 inputs, one scale per run of activation_run_blocks blocks), multiplied with              */
/* vpmaddubsw (u8 nibble x s8 activation, two products summed into int16). |q * x| <= 15 * 127,   */
/* so eight such instructions add up in int16 before one vpmaddwd widens them (8 * 2 * 15 * 127   */
/* < 32767): about 1.8 int8 multiply-adds per multiply-port slot for every float32 FMA, and no    */
/* nibble is ever converted to float. Weights packed for it: panels of 16 columns, [ceil(N/16)]    */
/* [Kp/8][2][32] bytes (Kp = K rounded up to 32): in half h of step s, byte b holds column         */
/* 8h + b/4 at input 8s + b%4 (low nibble) and 8s + 4 + b%4 (high), so one AND (and one shift)    */
/* gives 8 columns x 4 consecutive inputs, the operand layout vpmaddubsw sums along K.            */
/* y[m, n] = sum_b xs[m, b] * s[n, g(b)] * (xq_b . q_b) + sum_g xg[m, g] * offsets[n, g],         */
/* xg[m, g] = sum over the group's blocks of xs * (sum of xq): the zero points' term, per group.  */
/* (pack_int4 in cpu_int8.py writes this layout.)                                                  */

#define W4_BLOCK 32 /* inputs per quantization block (outliers are found per block; a run of them shares an
                       activation scale: activation_run_blocks); groups are whole blocks (or one group spans K) */
/* Bytes ahead of the panel read that each step prefetches, one cache line a step (the rate it
   reads them). At one row Zen 1's hardware prefetcher left the kernel at ~12 of 26 GB/s: ~8% faster. */
#define W4_PREFETCH 1024
#define W4_ROWS 4   /* rows per tile: 8 int16 accumulators + the weights fit the 16 ymm registers */
/* x is an outlier above 8x its block's mean |x| (~6.4 sigma for Gaussian values). After SiLU-and-mul
   ~6% of a down projection's inputs pass 4x (the threshold until this was measured), and their exact
   float32 sums took twice its multiply-adds; ~1% pass 8x, for the same teacher-forced accuracy. */
#define W4_OUTLIER 8.0
#define W4_MAX_OUTLIERS 8 /* per block: k outliers hold > k * 8 / 32 of the block's sum of |x|, so k < 4 (room to spare) */
/* Activations take one scale per run of ACTIVATION_RUN_BLOCKS blocks (both W4A8 tiles and the VNNI
   kernel for int8 weights): the tiles sum a run in int32 before one float32 rescale, a conversion and
   an FMA per accumulator, on the pipes the integer multiply-adds need. For int8 weights on the VNNI
   tile a run of 2 blocks held it ~10% below one scale per row, 4 blocks ~5% (64 / 256-row GEMMs
   1.03-1.05x faster than 2 blocks, Zen 5); int4 weights had rescaled every block: runs of 4 made
   their GEMMs 1.16-1.18x faster at 16-256 rows on the VNNI tile, 1.11-1.14x at 4-64 on the AVX2 one
   (its rescale took a vpmaddwd, a conversion and an FMA an accumulator; now a vpmaddwd and an add
   into the run's int32 sums in memory). Accuracy
   against bf16, teacher-forced (48 x 32 positions), int8 runs of 1 / 2 / 4 blocks: trained
   checkpoint 95.51 / 95.44 / 95.57% top-1, mean |logprob diff| 0.0485 / 0.0512 / 0.0535 (W8A16
   96.22%, 0.0404); the outlier copy of tiny-qwen3 95.12 / 95.31 / 95.44%, 0.0586 / 0.0627 / 0.0623;
   of the random Qwen3-0.6B (24 x 32) 73.96 / 73.05 / 72.53%, 1.23 / 1.31 / 1.27. (With an earlier 4x
   outlier threshold, 4-block runs had cost more.) */
#define ACTIVATION_RUN_BLOCKS 4

/* Blocks per activation scale for weights in groups of `group` inputs: ACTIVATION_RUN_BLOCKS, halved
   until a run never spans two groups (cpu_int8.py's activation_run_blocks mirrors it; a test compares). */
int activation_run_blocks(int64_t group, int64_t K) {
    const int64_t per_group = group >= K ? 0 : group / W4_BLOCK;  /* 0: one group spans K */
    int64_t run = ACTIVATION_RUN_BLOCKS;
    while (per_group && per_group % run) run /= 2;
    return (int)run;
}

#define W4_ROW_TILES(TILE, ...)                                                                  \
    do {                                                                                         \
        int64_t m0 = r0;                                                                         \
        for (; m0 + W4_ROWS <= r1; m0 += W4_ROWS) TILE(W4_ROWS, __VA_ARGS__);                    \
        switch (r1 - m0) {                                                                       \
            case 3: TILE(3, __VA_ARGS__); break;                                                 \
            case 2: TILE(2, __VA_ARGS__); break;                                                 \
            case 1: TILE(1, __VA_ARGS__); break;                                                 \
            default: break;                                                                      \
        }                                                                                        \
    } while (0)

/* |x| > limit (in double) <=> |x| > the largest float <= limit, for float |x|: the float threshold
   a block's outliers are found by, in both passes of quantize_blocks_int8. */
static inline float float_below(double limit) {
    float below = (float)limit;
    if ((double)below > limit && below > 0.0f) {  /* nextafterf(below, 0), without a libm call a block */
        uint32_t bits;
        memcpy(&bits, &below, 4), bits--, memcpy(&below, &bits, 4);
    }
    return below;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define QUANTIZE_ZMM 1
/* block_outliers and quantize_block on sixteen whole blocks at a time (a row's last few run the AVX2
   versions): their sums, thresholds, maxima and quantized sums reduced together,
   lane j of one vector per block j (a transposing tree of shuffles), where a horizontal reduction
   per block and figure (a chain of ~8 dependent operations each) made most of the quantizer's time
   (only a block holding an outlier still takes one, for its amax). */
/* 16 vectors v[j] -> one vector whose lane j is OP over v[j]'s 16 lanes (OP a float32 or int32 op) */
#define TRANSPOSE_REDUCE16(OP, v, out)                                                                      \
    do {                                                                                                    \
        __m512 t[8], u[4], w[2];                                                                            \
        for (int i = 0; i < 8; i++)  /* each 128-bit chunk: [a0 a1 a2 a3], [b0 ..] -> [a02 b02 a13 b13] */ \
            t[i] = OP(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));  \
        for (int i = 0; i < 4; i++) {  /* -> [a b c d] per chunk, each over its chunk's 4 lanes */         \
            const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);            \
            u[i] = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y))); \
        }                                                                                                   \
        for (int i = 0; i < 2; i++)  /* chunks (0, 1) and (2, 3) of two such vectors */                    \
            w[i] = OP(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD)); \
        out = OP(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));          \
    } while (0)
#define MAX_PS(a, b) _mm512_max_ps(a, b)
#define ADD_EPI32(a, b) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))

/* block_outliers for the 16 whole blocks at x (inputs k0 ..): below[j] and amax[j] of each. A block
   whose largest |x| is not above its threshold (most blocks: an outlier channel sits in a few) has no
   outliers, and that largest |x| is its amax; only the others are searched value by value. */
static inline void blocks16_outliers_zmm(const float *x, int64_t k0, double outlier, int32_t *ok, float *ov,
                                         int *n_out, float *below, float *amax) {
    __m512 m[16];
    for (int h = 0; h < 2; h++) {  /* blocks 8h .. 8h+7: their double sums, lane j the block's */
        __m512d d[8], t[4], u[2];
        for (int j = 0; j < 8; j++) {
            const float *xb = x + 32 * (8 * h + j);
            const __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), v1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
            m[8 * h + j] = _mm512_max_ps(v0, v1);
            d[j] = _mm512_add_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v0)),
                                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(v0, 1))),
                                 _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v1)),
                                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(v1, 1))));
        }
        for (int i = 0; i < 4; i++)
            t[i] = _mm512_add_pd(_mm512_unpacklo_pd(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_pd(d[2 * i], d[2 * i + 1]));
        for (int i = 0; i < 2; i++)
            u[i] = _mm512_add_pd(_mm512_shuffle_f64x2(t[2 * i], t[2 * i + 1], 0x88),
                                 _mm512_shuffle_f64x2(t[2 * i], t[2 * i + 1], 0xDD));
        const __m512d sum = _mm512_add_pd(_mm512_shuffle_f64x2(u[0], u[1], 0x88), _mm512_shuffle_f64x2(u[0], u[1], 0xDD));
        /* float_below, eight lanes at once: outlier * sum / 32, rounded to float, one ulp down if above */
        const __m512d limit = _mm512_mul_pd(_mm512_mul_pd(sum, _mm512_set1_pd(outlier)), _mm512_set1_pd(1.0 / W4_BLOCK));
        __m256 f = _mm512_cvtpd_ps(limit);
        const __mmask8 up = _mm512_cmp_pd_mask(_mm512_cvtps_pd(f), limit, _CMP_GT_OQ) &
                            _mm256_cmp_ps_mask(f, _mm256_setzero_ps(), _CMP_GT_OQ);
        f = _mm256_castsi256_ps(_mm256_mask_sub_epi32(_mm256_castps_si256(f), up, _mm256_castps_si256(f), _mm256_set1_epi32(1)));
        _mm256_storeu_ps(below + 8 * h, f);
    }
    __m512 top;
    TRANSPOSE_REDUCE16(MAX_PS, m, top);
    _mm512_storeu_ps(amax, top);
    const __mmask16 searched = _mm512_cmp_ps_mask(top, _mm512_loadu_ps(below), _CMP_GT_OQ);
    for (uint32_t blocks = searched; blocks; blocks &= blocks - 1) {  /* ascending: outliers in input order */
        const int j = __builtin_ctz(blocks);
        const __m512 t = _mm512_set1_ps(below[j]);
        const __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(x + 32 * j)), v1 = _mm512_abs_ps(_mm512_loadu_ps(x + 32 * j + 16));
        const __mmask16 o0 = _mm512_cmp_ps_mask(v0, t, _CMP_GT_OQ), o1 = _mm512_cmp_ps_mask(v1, t, _CMP_GT_OQ);
        for (uint32_t bits = (uint32_t)o0 | ((uint32_t)o1 << 16); bits; bits &= bits - 1) {
            const int i = __builtin_ctz(bits);
            ok[*n_out] = (int32_t)(k0 + 32 * j + i), ov[*n_out] = x[32 * j + i], (*n_out)++;
        }
        amax[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_maskz_mov_ps((__mmask16)~o0, v0),
                                                     _mm512_maskz_mov_ps((__mmask16)~o1, v1)));
    }
}

/* quantize_block for 16 whole blocks at x: block j's 32 bytes at q + j * q_stride, with its threshold
   below[j] and 127 / amax inv[j]; the sum of each block's values into sums[j] */
static inline void blocks16_quantize_zmm(const float *x, const float *below, const float *inv, int8_t *q,
                                         int64_t q_stride, int32_t *sums) {
    /* two blocks' int32 values narrowed by three packs (vpackssdw twice, vpacksswb; each 128-bit
       lane's dwords then: block j's first half, its second, block j+1's first, its second) and one
       vpermd: four vpmovsdb, as many instructions, took ~40% of this function's time (Zen 5) */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 v[16];
    for (int j = 0; j < 16; j += 2) {
        __m512i qi[4];
        for (int h = 0; h < 4; h++) {  /* block j + h / 2, inputs 16 * (h % 2) .. */
            const int i = j + h / 2;
            const __m512 xv = _mm512_loadu_ps(x + 32 * i + 16 * (h % 2));
            const __mmask16 kept = _mm512_cmp_ps_mask(_mm512_abs_ps(xv), _mm512_set1_ps(below[i]), _CMP_LE_OQ);
            qi[h] = _mm512_cvtps_epi32(_mm512_maskz_mul_ps(kept, xv, _mm512_set1_ps(inv[i])));
        }
        const __m512i bytes = _mm512_permutexvar_epi32(
            order, _mm512_packs_epi16(_mm512_packs_epi32(qi[0], qi[1]), _mm512_packs_epi32(qi[2], qi[3])));
        _mm256_storeu_si256((__m256i *)(q + j * q_stride), _mm512_castsi512_si256(bytes));
        _mm256_storeu_si256((__m256i *)(q + (j + 1) * q_stride), _mm512_extracti64x4_epi64(bytes, 1));
        v[j] = _mm512_castsi512_ps(_mm512_add_epi32(qi[0], qi[1]));
        v[j + 1] = _mm512_castsi512_ps(_mm512_add_epi32(qi[2], qi[3]));
    }
    __m512 out;
    TRANSPOSE_REDUCE16(ADD_EPI32, v, out);
    _mm512_storeu_si512(sums, _mm512_castps_si512(out));
}
#undef ADD_EPI32
#undef MAX_PS
#undef TRANSPOSE_REDUCE16
#else
#define QUANTIZE_ZMM 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* One whole block's outliers, in registers: appended to ok / ov (inputs k0 + i) in input order;
   returns the amax of the block's other values and its threshold in *below. At one row the scalar
   loop (double compares, a rounding call per value) was ~6 ns a value: 40 us of a decode step's
   layer; and after SiLU-and-mul nine blocks in ten hold an outlier, so they must not fall back to it. */
static inline float block_outliers_avx2(const float *x, int32_t *ok, float *ov, int *n_out, int64_t k0,
                                        double outlier, float *below) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4];
    __m256d abs_sum = _mm256_setzero_pd();
    for (int i = 0; i < 4; i++) {
        a[i] = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i));
        abs_sum = _mm256_add_pd(abs_sum, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a[i])),
                                                       _mm256_cvtps_pd(_mm256_extractf128_ps(a[i], 1))));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, abs_sum);
    /* The double sum's order differs from the scalar loop's; for 32 floats that changes the limit by
       an ulp at most, and a decision only for an |x| within that ulp of it. */
    *below = float_below(outlier * ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) / (double)W4_BLOCK);
    const __m256 t = _mm256_set1_ps(*below);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        const __m256 out = _mm256_cmp_ps(a[i], t, _CMP_GT_OQ);
        for (int bits = _mm256_movemask_ps(out); bits; bits &= bits - 1) {
            const int j = 8 * i + __builtin_ctz((unsigned)bits);
            ok[*n_out] = (int32_t)(k0 + j), ov[*n_out] = x[j], (*n_out)++;
        }
        m = _mm256_max_ps(m, _mm256_andnot_ps(out, a[i]));  /* outliers do not set the scale */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

/* q[0..31] = round-half-even(x * inv) (cvtps rounds as nearbyintf in the default mode), zero where
   |x| > below (the outliers); returns their sum. */
static inline int32_t quantize_block_avx2(const float *x, float below, float inv_scalar, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f), t = _mm256_set1_ps(below), inv = _mm256_set1_ps(inv_scalar);
    __m256i qi[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 v = _mm256_loadu_ps(x + 8 * i);
        const __m256 kept = _mm256_andnot_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), t, _CMP_GT_OQ), v);
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(kept, inv));
        sum = _mm256_add_epi32(sum, qi[i]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int32_t s[8];
    _mm256_storeu_si256((__m256i *)s, sum);
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}
#endif

/* The outliers of the block of inputs k0 .. k1-1 (fewer than 32 only in a row's last block),
   appended to ok / ov; returns the amax of the rest, its threshold in *below. */
static inline float block_outliers(const float *xr, int64_t k0, int64_t k1, double outlier, int32_t *ok, float *ov,
                                   int *n_out, float *below) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k1 - k0 == W4_BLOCK) return block_outliers_avx2(xr + k0, ok, ov, n_out, k0, outlier, below);
#endif
    double abs_sum = 0.0;
    for (int64_t k = k0; k < k1; k++) abs_sum += fabs((double)xr[k]);
    *below = float_below(outlier * abs_sum / (double)(k1 - k0));
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        if (fabsf(xr[k]) > *below) ok[*n_out] = (int32_t)k, ov[*n_out] = xr[k], (*n_out)++;
        else amax = fmaxf(amax, fabsf(xr[k]));
    }
    return amax;
}

/* The block's inputs k0 .. k1-1 quantized into q[0..31] (zero past k1 and at the outliers); their sum. */
static inline int32_t quantize_block(const float *xr, int64_t k0, int64_t k1, float below, float inv, int8_t *q) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k1 - k0 == W4_BLOCK) return quantize_block_avx2(xr + k0, below, inv, q);
#endif
    int32_t sum = 0;
    for (int64_t k = k0; k < k0 + W4_BLOCK; k++) {
        const int32_t v = k < k1 && fabsf(xr[k]) <= below ? (int32_t)nearbyintf(xr[k] * inv) : 0;
        q[k - k0] = (int8_t)v, sum += v;
    }
    return sum;
}

/* One row of quantize_blocks_int8: block b's 32 bytes at q + b * q_stride, its scale at s[b * s_stride]
   (a row-major [M, Kp] or the VNNI tiles' layout); xg, on, ok, ov the row's own. */
static void quantize_row_int8(const float *xr, int64_t K, int64_t B, int64_t G, int64_t group, double outlier,
                              int64_t scale_blocks, int8_t *q, int64_t q_stride, float *s, int64_t s_stride, float *xg,
                              int32_t *on, int32_t *ok, float *ov) {
    float below[B], amax[B], inv[B]; /* B: a few KiB at most */
    int32_t sums[B];
    int n_out = 0;
    const int64_t whole = K / W4_BLOCK;  /* blocks of 32 real inputs */
    (void)whole;  /* read by the zmm paths only */
    int64_t b = 0;
#if QUANTIZE_ZMM
    for (; b + 16 <= whole; b += 16)
        blocks16_outliers_zmm(xr + b * W4_BLOCK, b * W4_BLOCK, outlier, ok, ov, &n_out, below + b, amax + b);
#endif
    for (; b < B; b++) {
        const int64_t k0 = b * W4_BLOCK, k1 = k0 + W4_BLOCK < K ? k0 + W4_BLOCK : K;
        amax[b] = block_outliers(xr, k0, k1, outlier, ok, ov, &n_out, &below[b]);
    }
    /* each run of blocks takes its largest amax (no division or modulo per block: an integer
       division a block was most of the quantizer's time) */
    float scale[B];
    int64_t b0 = 0;
#if QUANTIZE_ZMM
    if (scale_blocks == 1 || scale_blocks == 2 || scale_blocks == 4)  /* sixteen blocks a pass: each lane its
                                                                         run's largest amax, then both divisions */
        for (; b0 + 16 <= B; b0 += 16) {
            __m512 a = _mm512_loadu_ps(amax + b0);
            if (scale_blocks >= 2) a = _mm512_max_ps(a, _mm512_permute_ps(a, 0xB1));  /* lanes 2i, 2i+1 */
            if (scale_blocks == 4) a = _mm512_max_ps(a, _mm512_permute_ps(a, 0x4E));  /* and 4i .. 4i+3 */
            /* every lane of a run its first one's: with a NaN amax vmaxps's result depends on the
               order, and a run must keep one scale (the tiles read its last block's) */
            if (scale_blocks == 2) a = _mm512_permute_ps(a, 0xA0);
            if (scale_blocks == 4) a = _mm512_permute_ps(a, 0x00);
            _mm512_storeu_ps(inv + b0, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                           _mm512_set1_ps(127.0f), a));
            _mm512_storeu_ps(scale + b0, _mm512_div_ps(a, _mm512_set1_ps(127.0f)));
        }
#endif
    for (; b0 < B; b0 += scale_blocks) {
        const int64_t b1 = b0 + scale_blocks < B ? b0 + scale_blocks : B;
        float a = amax[b0];
        for (int64_t b = b0 + 1; b < b1; b++) a = a > amax[b] ? a : amax[b];
        const float run_inv = a > 0.0f ? 127.0f / a : 0.0f, run_scale = a / 127.0f;
        for (int64_t b = b0; b < b1; b++) inv[b] = run_inv, scale[b] = run_scale;
    }
    b = 0;
#if QUANTIZE_ZMM
    for (; b + 16 <= whole; b += 16) blocks16_quantize_zmm(xr + b * W4_BLOCK, below + b, inv + b, q + b * q_stride, q_stride, sums + b);
#endif
    for (; b < B; b++) {
        const int64_t k0 = b * W4_BLOCK, k1 = k0 + W4_BLOCK < K ? k0 + W4_BLOCK : K;
        sums[b] = quantize_block(xr, k0, k1, below[b], inv[b], q + b * q_stride);
    }
    for (int64_t b = 0; b < B; b++) s[b * s_stride] = scale[b];
    for (int64_t g = 0; g < G; g++) xg[g] = 0.0f;
    if (group >= K || group % W4_BLOCK == 0) {  /* groups of whole blocks (W4A8, VNNI), or one group */
        const int64_t per_group = group >= K ? B : group / W4_BLOCK;
        /* each group's sum in registers, four chains (fmaf, not left to the compiler): through memory,
           the store-to-load chain from one block to the next held the whole quantizer to it, and one
           chain of a row's blocks was still its longest wait */
        for (int64_t b0 = 0, g = 0; b0 < B; b0 += per_group, g++) {
            const int64_t b1 = b0 + per_group < B ? b0 + per_group : B;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int64_t b = b0;
            for (; b + 4 <= b1; b += 4) {
                s0 = fmaf(scale[b], (float)sums[b], s0), s1 = fmaf(scale[b + 1], (float)sums[b + 1], s1);
                s2 = fmaf(scale[b + 2], (float)sums[b + 2], s2), s3 = fmaf(scale[b + 3], (float)sums[b + 3], s3);
            }
            for (; b < b1; b++) s0 = fmaf(scale[b], (float)sums[b], s0);
            xg[g] = (s0 + s1) + (s2 + s3);
        }
    } else {
        for (int64_t b = 0; b < B; b++) xg[b * W4_BLOCK / group] = fmaf(scale[b], (float)sums[b], xg[b * W4_BLOCK / group]);
    }
    *on = n_out;
}

/* x [M, K] float32 -> xq [M, Kp] int8 (zero past K), xs [M, Kp / 32] and xg [M, ceil(K / group)]
   float32, and each row's outliers. An outlier is a value above `outlier` times its block's mean
   |x| (a hidden channel 20-100x the rest, as LLaMA/Qwen-class models have): it would set the
   scale and round the other values to a few levels, so it is taken out (xq = 0) and kept exactly,
   on[m] of them per row at ok[m, i] (input) and ov[m, i] (value), added in float32 by the GEMM.
   Of the rest, per run of `scale_blocks` blocks (every block of a run gets the run's scale, so that
   a GEMM sums the run in int32 before it scales it): scale = amax / 127, xq = round-half-even(x *
   (127 / amax)). The mean is summed in double so that the PyTorch reference decides alike. */
void quantize_blocks_int8(const float *x, int64_t M, int64_t K, int64_t Kp, int64_t group, double outlier,
                          int64_t scale_blocks, int8_t *xq, float *xs, float *xg, int32_t *on, int32_t *ok, float *ov,
                          int num_threads) {
    const int64_t B = Kp / W4_BLOCK, G = (K + group - 1) / group, E = B * W4_MAX_OUTLIERS;
    if (scale_blocks < 1) scale_blocks = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 32768)
    for (int64_t m = 0; m < M; m++)
        quantize_row_int8(x + m * K, K, B, G, group, outlier, scale_blocks, xq + m * Kp, W4_BLOCK, xs + m * B, 1,
                          xg + m * G, on + m, ok + m * E, ov + m * E);
}

/* Group g's scales and offsets for the panel at column n0 are at g * gstride + n0. The int8 and
   W4A16 layouts are [groups][Np] (gstride = Np); W4A8's are panel-major [panels][groups][16], which
   its drivers pass as gstride = 16 with the bases moved by n0 * (groups - 1) (W4A8_GROUPS). In
   [groups][Np] a panel's group scales sit Np * 4 bytes apart (16-24 KiB for Qwen3-0.6B), a stride
   no hardware prefetcher follows: streaming a one-row GEMM from memory, each group's first block
   waited on DRAM for them, so they are requested for this panel and the next when a tile starts.
   Panel-major, they are one sequential stream beside the weights' (int4 at 1-4 rows from DRAM
   1.17-1.24x faster than [groups][Np] with these prefetches, Zen 5, both tiles). */
static inline void prefetch_group_scales(const float *scales, const float *offsets, int64_t G, int64_t gstride,
                                         int64_t n0) {
    for (int64_t g = 0; g < G; g++) {
        __builtin_prefetch(scales + g * gstride + n0, 0, 3), __builtin_prefetch(offsets + g * gstride + n0, 0, 3);
        if (gstride > I8_PANEL && n0 + I8_PANEL < gstride)  /* [groups][Np]: the next panel's too */
            __builtin_prefetch(scales + g * gstride + n0 + I8_PANEL, 0, 3),
                __builtin_prefetch(offsets + g * gstride + n0 + I8_PANEL, 0, 3);
    }
}

/* W4A8's panel-major scales and offsets as the tiles address them (see prefetch_group_scales): three
   arguments (scales, offsets, gstride) for the panel at the caller's n0 */
#define W4A8_GROUPS(scales, offsets, G) (scales) + n0 * ((G) - 1), (offsets) + n0 * ((G) - 1), (int64_t)I8_PANEL

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void w4a8_tile(const int mb, const int8_t *xq, const float *xs,
                                                             const float *xg, const int32_t *on, const int32_t *ok,
                                                             const float *ov, int64_t m0, int64_t Kp, int64_t G,
                                                             int64_t run, const int8_t *panel_bytes_,
                                                             const float *scales, const float *offsets, int64_t gstride,
                                                             int64_t group, int64_t n0, int64_t nn, int64_t N,
                                                             const float *bias, float *y) {
    const uint8_t *panel = (const uint8_t *)panel_bytes_;
    const int64_t B = Kp / W4_BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi32(0x0F);
    const int64_t E = B * W4_MAX_OUTLIERS;
    /* float32 sums in memory, touched once per run, and the run's int32 sums, once per block: in
       registers they pushed the int16 ones out */
    float tile[6][I8_PANEL] = {{0}};
    int32_t sums[W4_ROWS][I8_PANEL] __attribute__((aligned(32))) = {{0}};  /* zeroed: GCC cannot see
                                                                           a run's first block writes them */
    /* blocks per group: a division per block (idiv, ~40 cycles on Zen 1) cost as much as its math */
    const int64_t per_group = G == 1 ? B : group / W4_BLOCK;
    if (G > 1) prefetch_group_scales(scales, offsets, G, gstride, n0);
    for (int64_t b0 = 0, g = 0, left = per_group; b0 < B; b0 += run) {
        const int64_t b1 = b0 + run < B ? b0 + run : B;
        for (int64_t b = b0; b < b1; b++) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                a31 = a00;
        const uint8_t *w = panel + b * W4_BLOCK * (I8_PANEL / 2);
        const int8_t *xb = xq + m0 * Kp + b * W4_BLOCK;
        for (int s = 0; s < W4_BLOCK / 8; s++, w += 64, xb += 8) {
            _mm_prefetch((const char *)w + W4_PREFETCH, _MM_HINT_T0);
            /* low nibbles (inputs 0-3 of the step) for every row, then high ones (4-7): few live registers */
            __m256i wa = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)w), nibble);
            __m256i wb = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 32)), nibble);
#define W4_ROW(r, lo, hi, at)                                                                               \
    if (mb > r) {                                                                                         \
        int32_t q4; /* 4 inputs, broadcast to the 8 columns */                                            \
        memcpy(&q4, xb + r * Kp + at, 4);                                                                 \
        const __m256i x4 = _mm256_set1_epi32(q4);                                                         \
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(wa, x4));                                          \
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(wb, x4));                                          \
        __asm__("" : "+x"(lo), "+x"(hi)); /* GCC regrouped the adds into trees of spilled products */    \
    }
            W4_ROW(0, a00, a01, 0) W4_ROW(1, a10, a11, 0) W4_ROW(2, a20, a21, 0) W4_ROW(3, a30, a31, 0)
            wa = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)w), 4), nibble);
            wb = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 32)), 4), nibble);
            W4_ROW(0, a00, a01, 4) W4_ROW(1, a10, a11, 4) W4_ROW(2, a20, a21, 4) W4_ROW(3, a30, a31, 4)
#undef W4_ROW
        }
        /* the block's int16 sums widened into the run's int32 ones (exact, as the VNNI tile's) */
#define W4_SUM(r, lo, hi)                                                                                   \
    if (mb > r) {                                                                                         \
        __m256i slo = _mm256_madd_epi16(lo, ones), shi = _mm256_madd_epi16(hi, ones);                     \
        if (b > b0) {                                                                                     \
            slo = _mm256_add_epi32(slo, _mm256_load_si256((const __m256i *)sums[r]));                     \
            shi = _mm256_add_epi32(shi, _mm256_load_si256((const __m256i *)(sums[r] + 8)));               \
        }                                                                                                 \
        _mm256_store_si256((__m256i *)sums[r], slo), _mm256_store_si256((__m256i *)(sums[r] + 8), shi);   \
    }
        W4_SUM(0, a00, a01) W4_SUM(1, a10, a11) W4_SUM(2, a20, a21) W4_SUM(3, a30, a31)
#undef W4_SUM
        }
        const __m256 s0 = _mm256_loadu_ps(scales + g * gstride + n0);
        const __m256 s1 = _mm256_loadu_ps(scales + g * gstride + n0 + 8);
#define W4_FLUSH(r)                                                                                         \
    if (mb > r) {                                                                                         \
        const __m256 xsb = _mm256_set1_ps(xs[(m0 + r) * B + b1 - 1]); /* the run's scale */              \
        _mm256_storeu_ps(tile[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)sums[r])), \
                                                  _mm256_mul_ps(s0, xsb), _mm256_loadu_ps(tile[r])));     \
        _mm256_storeu_ps(tile[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(sums[r] + 8))), \
                                                      _mm256_mul_ps(s1, xsb), _mm256_loadu_ps(tile[r] + 8))); \
    }
        W4_FLUSH(0) W4_FLUSH(1) W4_FLUSH(2) W4_FLUSH(3)
#undef W4_FLUSH
        left -= b1 - b0;  /* runs never span two groups: the next run starts the next group here */
        if (left == 0) g++, left = per_group;
    }
    /* Each row's zero-point term, the sum over groups of offset_g * xg_g in four chains (groups g % 4),
       added to its sums once; then its outliers: per group holding any, their v * q summed unscaled
       (q read from the panel), s * that + offset * their sum of v. Their inputs come in ascending
       order, so the group follows by counting, not by a division per outlier (~1% of a down
       projection's inputs are outliers after SiLU-and-mul). vnni_finish_rows does the same
       operations in the same order (the same bits). */
    for (int r = 0; r < mb; r++) {
        const float *xr = xg + (m0 + r) * G;
        const float *off = offsets + n0;
        __m256 z0l = _mm256_setzero_ps(), z1l = z0l, z2l = z0l, z3l = z0l, z0h = z0l, z1h = z0l, z2h = z0l, z3h = z0l;
#define W4_ZP(zl, zh, gg)                                                                                   \
    {                                                                                                     \
        const __m256 xsum = _mm256_set1_ps(xr[gg]);                                                       \
        zl = _mm256_fmadd_ps(xsum, _mm256_loadu_ps(off + (gg) * gstride), zl);                            \
        zh = _mm256_fmadd_ps(xsum, _mm256_loadu_ps(off + (gg) * gstride + 8), zh);                        \
    }
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) {
            W4_ZP(z0l, z0h, g) W4_ZP(z1l, z1h, g + 1) W4_ZP(z2l, z2h, g + 2) W4_ZP(z3l, z3h, g + 3)
        }
        if (g < G) W4_ZP(z0l, z0h, g)
        if (g + 1 < G) W4_ZP(z1l, z1h, g + 1)
        if (g + 2 < G) W4_ZP(z2l, z2h, g + 2)
#undef W4_ZP
        _mm256_storeu_ps(tile[r], _mm256_add_ps(_mm256_loadu_ps(tile[r]),
                                                _mm256_add_ps(_mm256_add_ps(z0l, z1l), _mm256_add_ps(z2l, z3l))));
        _mm256_storeu_ps(tile[r] + 8, _mm256_add_ps(_mm256_loadu_ps(tile[r] + 8),
                                                    _mm256_add_ps(_mm256_add_ps(z0h, z1h), _mm256_add_ps(z2h, z3h))));
    }
    for (int r = 0; r < mb; r++) {
        const int64_t m = m0 + r;
        if (on[m] == 0) continue;
        __m256 lo = _mm256_loadu_ps(tile[r]), hi = _mm256_loadu_ps(tile[r] + 8);
        const int32_t *ks = ok + m * E;
        const float *vs = ov + m * E;
        int32_t i = 0;
        for (int64_t g = 0, g_end = group; g < G && i < on[m]; g++, g_end += group) {
            if (ks[i] >= g_end) continue;
            __m256 vlo = _mm256_setzero_ps(), vhi = vlo;
            float vsum = 0.0f;
            for (; i < on[m] && ks[i] < g_end; i++) {
                const int64_t k = ks[i], kk = k % 8;
                const __m128i shift = _mm_cvtsi32_si128((int)(8 * (kk % 4) + 4 * (kk / 4)));
                const uint8_t *w = panel + (k / 8) * 64;
                const __m256i qlo = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)w), shift), low4);
                const __m256i qhi = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(w + 32)), shift), low4);
                const __m256 v = _mm256_set1_ps(vs[i]);
                vlo = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(qlo), vlo), vhi = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(qhi), vhi);
                vsum += vs[i];
            }
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(scales + g * gstride + n0), vlo, lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(scales + g * gstride + n0 + 8), vhi, hi);
            const __m256 v = _mm256_set1_ps(vsum);
            lo = _mm256_fmadd_ps(v, _mm256_loadu_ps(offsets + g * gstride + n0), lo);
            hi = _mm256_fmadd_ps(v, _mm256_loadu_ps(offsets + g * gstride + n0 + 8), hi);
        }
        _mm256_storeu_ps(tile[r], lo), _mm256_storeu_ps(tile[r] + 8, hi);
    }
    store_rows(mb, tile, y, m0, N, n0, nn, NULL, bias);
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* AVX-512 VNNI: the same W4A8 panels, and int8 weights, through vpdpbusd (zmm: 16 columns x 4    */
/* consecutive inputs, u8 weights times s8 activations summed into int32, 64 multiply-adds per    */
/* instruction; no int16 sums to widen or saturate). A W4A8 panel's 64 bytes for 8 inputs are    */
/* already that operand: low nibbles inputs 0-3, high nibbles 4-7, columns 0-15 in order. int8   */
/* weights are stored as u = q + 128 in [1, 255], [Kp / 4][16][4] bytes per panel, so that they  */
/* too are the unsigned operand and the activations the broadcast signed one; the 128 is a zero   */
/* point, offsets = -128 * s, through the W4A8 zero-point term (xg). Per run of                    */
/* activation_run_blocks blocks (one activation scale) and row: 4-bit weights, each float32 sum   */
/* updated by the same operations in the same order as the AVX2 W4A8 tile's, so both give the     */
/* same bits; int8 weights per channel, the column scale once at the end.                          */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define VNNI 1
#define VNNI_PREFETCH 8192 /* bytes ahead: the first row tile of a panel streams it from DRAM */
#define VNNI_ROWS 16 /* rows per tile, one int32 chain each (two for up to 8 rows): a decode step's 16 rows
                        multiply each weight as it streams in, where two 8-row tiles multiplied it from
                        cache for the second (1.5x at 16 rows) */


/* One row's exact outliers, added to its float32 sums acc (16 columns). Per group holding any: their
   v * u summed unscaled (u picked from the panel by one byte shuffle), then s * that + offset * (their
   sum of v): the rest of the zero-point term, offset * xg, is vnni_finish_rows' (per channel, with
   offset * (xg + the sum of v) here). Their inputs come in ascending order, so the group follows by
   counting, not by a division per outlier. */
static inline __m512 vnni_row_outliers(__m512 acc, const int bits, int64_t m, const int32_t *on, const int32_t *ok,
                                       const float *ov, int64_t E, const float *xg, int64_t G, const uint8_t *panel,
                                       const float *scales, const float *offsets, int64_t gstride, int64_t group,
                                       int64_t n0, const int per_channel) {
    /* byte c of every 32-bit lane, zero-extended: vpshufb indices per 128-bit lane */
    const __m512i pick0 = _mm512_set4_epi32((int)0x8080800C, (int)0x80808008, (int)0x80808004, (int)0x80808000);
    const int32_t *ks = ok + m * E;
    const float *vs = ov + m * E;
    int32_t i = 0;
    for (int64_t g = 0, g_end = group; g < G && (per_channel || i < on[m]); g++, g_end += group) {
        float vsum = 0.0f;
        if (i < on[m] && ks[i] < g_end) {
            __m512 vu = _mm512_setzero_ps();
            for (; i < on[m] && ks[i] < g_end; i++) {
                const int64_t k = ks[i];
                const int64_t chunk = bits == 8 ? k / 4 : k / 8;  /* the 64 bytes holding input k's 16 weights */
                const __m512i pick = _mm512_add_epi32(pick0, _mm512_set1_epi32((int)(k % 4)));
                __m512i u = _mm512_shuffle_epi8(_mm512_loadu_si512(panel + chunk * 64), pick);
                if (bits == 4) u = _mm512_and_si512(k % 8 >= 4 ? _mm512_srli_epi32(u, 4) : u, _mm512_set1_epi32(0x0F));
                vu = _mm512_fmadd_ps(_mm512_set1_ps(vs[i]), _mm512_cvtepi32_ps(u), vu);
                vsum += vs[i];
            }
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(scales + g * gstride + n0), vu, acc);
            if (!per_channel)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(vsum), _mm512_loadu_ps(offsets + g * gstride + n0), acc);
        }
        if (per_channel)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * G + g] + vsum), _mm512_loadu_ps(offsets + g * gstride + n0),
                                  acc);
    }
    return acc;
}

/* quantize_blocks_int8 straight into the tiles' layout: per tile of VNNI_ROWS rows and block of 32
   inputs, the rows' 32 bytes one after another (xt [tiles][B][VNNI_ROWS][32]) and their blocks'
   scales (xst [tiles][B][VNNI_ROWS]; a run of blocks shares one); rows past M zero (the asm tiles
   compute them). bf16 x is widened a row at a time. Row-major, the tile's row pointers and the
   weights' took more general registers than there are (GCC spilled them in the inner loop); a
   separate rearranging pass, and a float32 copy of bf16 x, cost ~5% of a 256-row GEMM. 1 without
   memory. */
static int quantize_tiles_int8(const void *x, int x_bf16, int64_t M, int64_t K, int64_t Kp, int64_t group,
                               double outlier, int64_t scale_blocks, int8_t *xt, float *xst, float *xg, int32_t *on,
                               int32_t *ok, float *ov, int num_threads) {
    const int64_t B = Kp / W4_BLOCK, G = (K + group - 1) / group, E = B * W4_MAX_OUTLIERS;
    const int64_t tiles = (M + VNNI_ROWS - 1) / VNNI_ROWS, tile_bytes = B * VNNI_ROWS * W4_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * K > 32768)
    {
        float *row = x_bf16 ? malloc(sizeof(float) * (size_t)K) : NULL;
        if (x_bf16 && row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < tiles * VNNI_ROWS; m++) {
            int8_t *q = xt + (m / VNNI_ROWS) * tile_bytes + (m % VNNI_ROWS) * W4_BLOCK;
            float *s = xst + (m / VNNI_ROWS) * B * VNNI_ROWS + m % VNNI_ROWS;
            if (m >= M) {  /* a last tile's rows past M */
                for (int64_t b = 0; b < B; b++) memset(q + b * VNNI_ROWS * W4_BLOCK, 0, W4_BLOCK), s[b * VNNI_ROWS] = 0.0f;
                continue;
            }
            const float *xr = row;
            if (!x_bf16) {
                xr = (const float *)x + m * K;
            } else {
                if (row == NULL) continue;
                const uint16_t *xb = (const uint16_t *)x + m * K;
                int64_t k = 0;
                for (; k + 16 <= K; k += 16) _mm512_storeu_ps(row + k, bf16x16_to_f32(xb + k));
                for (; k < K; k++) {
                    const uint32_t bits = (uint32_t)xb[k] << 16;
                    memcpy(row + k, &bits, 4);
                }
            }
            quantize_row_int8(xr, K, B, G, group, outlier, scale_blocks, q, VNNI_ROWS * W4_BLOCK, s, VNNI_ROWS,
                              xg + m * G, on + m, ok + m * E, ov + m * E);
        }
        free(row);
    }
    return failed;
}

/* A tile against one panel of `bits`-bit weights, all VNNI_ROWS rows (half: the first 8, two int32
   chains a row so that vpdpbusd's latency stays covered; rows past M are zero in xb): its float32
   sums into facc, scaled per run of `run` blocks (xst: the run's activation scales per row, as
   quantize_tiles_int8 laid them out; gscale: the weight group's column scales, or NULL per channel).
   vpdpbusd with each row's 4 inputs broadcast from memory ({1to16}) is one instruction a row and
   step, its accumulator tied to a register: through the intrinsic's destructive operand, GCC copied
   all sixteen accumulators every step (the tile ran at ~50% of vpdpbusd's peak). */
/* OP(accumulator, row, ...) over a tile's rows: rows 0-7 into a0-a7, rows 8-15 into a8-a15, or rows
   0-7 into their second chains a8-a15 */
#define ROWS_LOW(OP, wv, at) OP(0, 0, wv, at) OP(1, 1, wv, at) OP(2, 2, wv, at) OP(3, 3, wv, at) OP(4, 4, wv, at) \
    OP(5, 5, wv, at) OP(6, 6, wv, at) OP(7, 7, wv, at)
#define ROWS_HIGH(OP, wv, at) OP(8, 8, wv, at) OP(9, 9, wv, at) OP(10, 10, wv, at) OP(11, 11, wv, at)           \
    OP(12, 12, wv, at) OP(13, 13, wv, at) OP(14, 14, wv, at) OP(15, 15, wv, at)
#define ROWS_SECOND(OP, wv, at) OP(8, 0, wv, at) OP(9, 1, wv, at) OP(10, 2, wv, at) OP(11, 3, wv, at)           \
    OP(12, 4, wv, at) OP(13, 5, wv, at) OP(14, 6, wv, at) OP(15, 7, wv, at)
#define VNNI_DP(acc, r, wv, at) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a##acc) : "v"(wv), \
                                        "m"(*(const int32_t *)(xb + r * W4_BLOCK + (at))));
#define VNNI_DP8(wv, at) ROWS_LOW(VNNI_DP, wv, at)
#define VNNI_DP8_HIGH(wv, at) ROWS_HIGH(VNNI_DP, wv, at)
#define VNNI_DP8_SECOND(wv, at) ROWS_SECOND(VNNI_DP, wv, at)
/* one weight vector against the tile's rows: all 16, or rows 0-7 into their first (chain 0) or
   second (chain 1) accumulators */
#define VNNI_STEP(wv, at, chain)                                                                 \
    do {                                                                                         \
        if (!half) { VNNI_DP8(wv, at) VNNI_DP8_HIGH(wv, at) }                                    \
        else if (chain) { VNNI_DP8_SECOND(wv, at) }                                              \
        else { VNNI_DP8(wv, at) }                                                                \
    } while (0)
static inline __attribute__((always_inline)) void vnni_asm_tile(const int bits, const int half, const uint8_t *w,
                                                                 const int8_t *xb, const float *xst, int64_t B,
                                                                 int64_t run, int64_t per_group, const float *gscale,
                                                                 int64_t gstride, float facc[VNNI_ROWS][I8_PANEL]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < VNNI_ROWS; r++) _mm512_store_ps(facc[r], _mm512_setzero_ps());
    for (int64_t b0 = 0, g = 0, left = per_group; b0 < B; b0 += run) {
        const int64_t b1 = b0 + run < B ? b0 + run : B;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        __m512i a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
        for (int64_t b = b0; b < b1; b++, xb += VNNI_ROWS * W4_BLOCK) {
            if (bits == 8) {
                for (int s = 0; s < W4_BLOCK / 4; s += 2, w += 128) {
                    _mm_prefetch((const char *)w + VNNI_PREFETCH, _MM_HINT_T0);
                    _mm_prefetch((const char *)w + VNNI_PREFETCH + 64, _MM_HINT_T0);
                    const __m512i wa = _mm512_loadu_si512(w), wb = _mm512_loadu_si512(w + 64);
                    VNNI_STEP(wa, 4 * s, 0);
                    VNNI_STEP(wb, 4 * s + 4, 1);
                }
            } else {  /* W4A8's 64 bytes: low nibbles inputs 0-3 of the step, high ones 4-7 */
                for (int s = 0; s < W4_BLOCK / 8; s++, w += 64) {
                    _mm_prefetch((const char *)w + VNNI_PREFETCH, _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512(w);
                    const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    VNNI_STEP(lo, 8 * s, 0);
                    VNNI_STEP(hi, 8 * s + 4, 1);
                }
            }
        }
        if (half) {
            a0 = _mm512_add_epi32(a0, a8), a1 = _mm512_add_epi32(a1, a9), a2 = _mm512_add_epi32(a2, a10);
            a3 = _mm512_add_epi32(a3, a11), a4 = _mm512_add_epi32(a4, a12), a5 = _mm512_add_epi32(a5, a13);
            a6 = _mm512_add_epi32(a6, a14), a7 = _mm512_add_epi32(a7, a15);
        }
        const float *xsb = xst + (b1 - 1) * VNNI_ROWS;  /* the run's activation scale of each row */
        /* per channel the column scale waits for the end: the run's sums times the row's scale */
#define VNNI_FLUSH(r, x_scale) \
    _mm512_store_ps(facc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r), x_scale, _mm512_load_ps(facc[r])));
#define VNNI_FLUSH16(x_scale) VNNI_FLUSH(0, x_scale(0)) VNNI_FLUSH(1, x_scale(1)) VNNI_FLUSH(2, x_scale(2))        \
    VNNI_FLUSH(3, x_scale(3)) VNNI_FLUSH(4, x_scale(4)) VNNI_FLUSH(5, x_scale(5)) VNNI_FLUSH(6, x_scale(6))        \
    VNNI_FLUSH(7, x_scale(7)) if (!half) { VNNI_FLUSH(8, x_scale(8)) VNNI_FLUSH(9, x_scale(9))                     \
    VNNI_FLUSH(10, x_scale(10)) VNNI_FLUSH(11, x_scale(11)) VNNI_FLUSH(12, x_scale(12)) VNNI_FLUSH(13, x_scale(13)) \
    VNNI_FLUSH(14, x_scale(14)) VNNI_FLUSH(15, x_scale(15)) }
        if (gscale) {
            const __m512 s = _mm512_loadu_ps(gscale + g * gstride);
#define ROW_TIMES_GROUP(r) _mm512_mul_ps(s, _mm512_set1_ps(xsb[r]))
            VNNI_FLUSH16(ROW_TIMES_GROUP)
#undef ROW_TIMES_GROUP
        } else {
#define ROW_ONLY(r) _mm512_set1_ps(xsb[r])
            VNNI_FLUSH16(ROW_ONLY)
#undef ROW_ONLY
        }
#undef VNNI_FLUSH16
#undef VNNI_FLUSH
        left -= b1 - b0;  /* runs never span two groups */
        if (left == 0) g++, left = per_group;
    }
}
/* each instance its own function, its row count and weight width constants: the loops hold no
   branch on them, and the accumulators' registers are allocated for that loop alone */
#define VNNI_ASM_TILE(name, bits, half)                                                                      \
    static __attribute__((noinline)) void name(const uint8_t *w, const int8_t *xb, const float *xst, int64_t B, \
                                               int64_t run, int64_t per_group, const float *gscale,       \
                                               int64_t gstride, float facc[VNNI_ROWS][I8_PANEL]) {        \
        vnni_asm_tile(bits, half, w, xb, xst, B, run, per_group, gscale, gstride, facc);                       \
    }
VNNI_ASM_TILE(vnni_tile16_w8, 8, 0)
VNNI_ASM_TILE(vnni_tile8_w8, 8, 1)
VNNI_ASM_TILE(vnni_tile16_w4, 4, 0)
VNNI_ASM_TILE(vnni_tile8_w4, 4, 1)
#undef VNNI_ASM_TILE

/* Eight rows against two panels (32 columns), int8 weights: each row's 4 inputs broadcast once into
   a register and multiplied by both panels' weights. The 16-row tile broadcasts from memory for
   every vpdpbusd; a register-only loop of this pattern runs at ~99% of the instruction's peak, the
   16-row one at ~93% (Zen 5), and with each run's rescale 84-87% vs 80-84%. Rows 0-7 into a0-a7
   (panel 0), a8-a15 (panel 1); their float32 sums into facc0 / facc1, per run as in vnni_asm_tile. */
#define VNNI_DPR(acc, wv, xv) __asm__("vpdpbusd %2, %1, %0" : "+v"(a##acc) : "v"(wv), "v"(xv));
#define VNNI_PAIR_ROW(r, r2, at)                                                                  \
    {                                                                                             \
        int32_t x4;                                                                               \
        memcpy(&x4, xb + r * W4_BLOCK + (at), 4);                                                 \
        const __m512i xv = _mm512_set1_epi32(x4);                                                 \
        VNNI_DPR(r, u, xv) VNNI_DPR(r2, v, xv)                                                    \
    }
static __attribute__((noinline)) void vnni_pair_tile_w8(const uint8_t *w0, const uint8_t *w1, const int8_t *xb,
                                                        const float *xst, int64_t B, int64_t run, int64_t per_group,
                                                        const float *gscale0, const float *gscale1, int64_t gstride,
                                                        float facc0[VNNI_ROWS][I8_PANEL],
                                                        float facc1[VNNI_ROWS][I8_PANEL]) {
    for (int64_t b0 = 0, g = 0, left = per_group; b0 < B; b0 += run) {
        const int64_t b1 = b0 + run < B ? b0 + run : B;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        __m512i a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
        for (int64_t b = b0; b < b1; b++, xb += VNNI_ROWS * W4_BLOCK) {
            for (int s = 0; s < W4_BLOCK / 4; s++, w0 += 64, w1 += 64) {
                _mm_prefetch((const char *)w0 + VNNI_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)w1 + VNNI_PREFETCH, _MM_HINT_T0);
                const __m512i u = _mm512_loadu_si512(w0), v = _mm512_loadu_si512(w1);
                VNNI_PAIR_ROW(0, 8, 4 * s) VNNI_PAIR_ROW(1, 9, 4 * s) VNNI_PAIR_ROW(2, 10, 4 * s)
                VNNI_PAIR_ROW(3, 11, 4 * s) VNNI_PAIR_ROW(4, 12, 4 * s) VNNI_PAIR_ROW(5, 13, 4 * s)
                VNNI_PAIR_ROW(6, 14, 4 * s) VNNI_PAIR_ROW(7, 15, 4 * s)
            }
        }
        const float *xsb = xst + (b1 - 1) * VNNI_ROWS;  /* the run's activation scale of each row */
        const __m512 s0 = gscale0 ? _mm512_loadu_ps(gscale0 + g * gstride) : _mm512_set1_ps(1.0f);
        const __m512 s1 = gscale1 ? _mm512_loadu_ps(gscale1 + g * gstride) : _mm512_set1_ps(1.0f);
#define VNNI_PAIR_FLUSH(r, r2)                                                                    \
    {                                                                                             \
        const __m512 xs = _mm512_set1_ps(xsb[r]);                                                 \
        const __m512 x0 = gscale0 ? _mm512_mul_ps(s0, xs) : xs, x1 = gscale1 ? _mm512_mul_ps(s1, xs) : xs; \
        const __m512 p0 = _mm512_cvtepi32_ps(a##r), p1 = _mm512_cvtepi32_ps(a##r2);                \
        _mm512_store_ps(facc0[r], b0 ? _mm512_fmadd_ps(p0, x0, _mm512_load_ps(facc0[r])) : _mm512_mul_ps(p0, x0)); \
        _mm512_store_ps(facc1[r], b0 ? _mm512_fmadd_ps(p1, x1, _mm512_load_ps(facc1[r])) : _mm512_mul_ps(p1, x1)); \
    }
        VNNI_PAIR_FLUSH(0, 8) VNNI_PAIR_FLUSH(1, 9) VNNI_PAIR_FLUSH(2, 10) VNNI_PAIR_FLUSH(3, 11)
        VNNI_PAIR_FLUSH(4, 12) VNNI_PAIR_FLUSH(5, 13) VNNI_PAIR_FLUSH(6, 14) VNNI_PAIR_FLUSH(7, 15)
#undef VNNI_PAIR_FLUSH
        left -= b1 - b0;  /* runs never span two groups */
        if (left == 0) g++, left = per_group;
    }
}
#undef VNNI_PAIR_ROW
#undef VNNI_DPR
#undef VNNI_STEP
#undef VNNI_DP8_SECOND
#undef VNNI_DP8_HIGH
#undef VNNI_DP8
#undef VNNI_DP

/* A tile's rows m0 .. m0+mb-1 against one panel (columns n0 .. n0+nn-1) out of their float32 sums
   facc: the column scale (int8 per channel), the zero-point term and the outliers (vnni_row_outliers),
   the bias, stored in y's dtype. */
static inline void vnni_finish_rows(const int mb, const int bits, float facc[VNNI_ROWS][I8_PANEL], int64_t m0,
                                    const int32_t *on, const int32_t *ok, const float *ov, int64_t E, const float *xg,
                                    int64_t G, const uint8_t *panel, const float *scales, const float *offsets,
                                    int64_t gstride, int64_t group, int64_t n0, int64_t nn, int64_t N,
                                    const float *bias, void *y, const int y_bf16) {
    const int per_channel = bits == 8 && G == 1;
    const __mmask16 mask = (__mmask16)((1u << nn) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const __m512 column_scale = per_channel ? _mm512_loadu_ps(scales + n0) : _mm512_setzero_ps();
    const __m512 column_offset = per_channel ? _mm512_loadu_ps(offsets + n0) : _mm512_setzero_ps();
    /* in groups, each row's zero-point term, the sum over g of offset_g * xg_g, in four chains (groups
       g % 4) added to its sums once: through the sums, two dependent FMAs a group held int4 GEMMs
       ~10-15% back (Zen 5). Four rows at a time share each group's offsets, the last few rows one at
       a time (a row's arithmetic is the same whatever its neighbours). The AVX2 W4A8 tile does the
       same operations in the same order (the same bits). */
#define ZP_FMA(z, x, gg, o) z = _mm512_fmadd_ps(_mm512_set1_ps(x[gg]), o, z);
#define ZP_GROUPS(GROUP)                                                                         \
    {                                                                                            \
        int64_t g = 0;                                                                           \
        for (; g + 4 <= G; g += 4) {                                                             \
            GROUP(0, g) GROUP(1, g + 1) GROUP(2, g + 2) GROUP(3, g + 3)                          \
        }                                                                                        \
        if (g < G) GROUP(0, g)                                                                   \
        if (g + 1 < G) GROUP(1, g + 1)                                                           \
        if (g + 2 < G) GROUP(2, g + 2)                                                           \
    }
#define ZP_ADD(r, z)                                                                             \
    _mm512_store_ps(facc[r], _mm512_add_ps(_mm512_load_ps(facc[r]),                            \
                                           _mm512_add_ps(_mm512_add_ps(z##0, z##1), _mm512_add_ps(z##2, z##3))));
    const float *off = offsets + n0;
    int r0 = 0;
    for (; r0 + 4 <= mb && !per_channel; r0 += 4) {
        const float *x0 = xg + (m0 + r0) * G, *x1 = x0 + G, *x2 = x1 + G, *x3 = x2 + G;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        __m512 c0 = a0, c1 = a0, c2 = a0, c3 = a0, d0 = a0, d1 = a0, d2 = a0, d3 = a0;
#define ZP_GROUP4(j, gg)                                                                         \
    {                                                                                            \
        const __m512 o = _mm512_loadu_ps(off + (gg) * gstride);                                  \
        ZP_FMA(a##j, x0, gg, o) ZP_FMA(b##j, x1, gg, o) ZP_FMA(c##j, x2, gg, o) ZP_FMA(d##j, x3, gg, o) \
    }
        ZP_GROUPS(ZP_GROUP4)
#undef ZP_GROUP4
        ZP_ADD(r0, a) ZP_ADD(r0 + 1, b) ZP_ADD(r0 + 2, c) ZP_ADD(r0 + 3, d)
    }
    for (; r0 < mb && !per_channel; r0++) {
        const float *x0 = xg + (m0 + r0) * G;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define ZP_GROUP1(j, gg) ZP_FMA(a##j, x0, gg, _mm512_loadu_ps(off + (gg) * gstride))
        ZP_GROUPS(ZP_GROUP1)
#undef ZP_GROUP1
        ZP_ADD(r0, a)
    }
#undef ZP_ADD
#undef ZP_GROUPS
#undef ZP_FMA
    for (int r = 0; r < mb; r++) {
        __m512 f = _mm512_load_ps(facc[r]);
        if (per_channel) f = _mm512_mul_ps(f, column_scale);
        /* per channel without outliers (most rows): the zero-point term's one operation */
        __m512 acc = f;
        if (on[m0 + r] > 0)
            acc = vnni_row_outliers(f, bits, m0 + r, on, ok, ov, E, xg, G, panel, scales, offsets, gstride, group, n0,
                                    per_channel);
        else if (per_channel)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(xg[m0 + r]), column_offset, f);
        const __m512 out = bias ? _mm512_add_ps(acc, bv) : acc;
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + r) * N + n0, mask, f32x16_to_bf16(out));
        else
            _mm512_mask_storeu_ps((float *)y + (m0 + r) * N + n0, mask, out);
    }
}

/* Rows m0 .. m0+mb-1 (m0 a multiple of VNNI_ROWS) of the quantized x, as quantize_tiles_int8 laid them
   out, against one panel of `bits`-bit weights (4: W4A8's panel, 8: the int8 one). Named
   accumulators, as in the AVX2 tiles. */
static inline __attribute__((always_inline)) void vnni_tile(const int mb, const int bits, const int8_t *xq,
                                                             const float *xs, const float *xg, const int32_t *on,
                                                             const int32_t *ok, const float *ov, int64_t m0,
                                                             int64_t Kp, int64_t G, int64_t run,
                                                             const int8_t *panel_bytes_, const float *scales,
                                                             const float *offsets, int64_t gstride, int64_t group,
                                                             int64_t n0, int64_t nn, int64_t N, const float *bias,
                                                             void *y, const int y_bf16) {
    const uint8_t *panel = (const uint8_t *)panel_bytes_;
    const int64_t B = Kp / W4_BLOCK, E = B * W4_MAX_OUTLIERS, block_bytes = W4_BLOCK * I8_PANEL * bits / 8;
    /* this tile's activations, block by block (quantize_tiles_int8): one pointer, constant offsets */
    const int8_t *xt = xq + (m0 / VNNI_ROWS) * B * VNNI_ROWS * W4_BLOCK;
    const float *xst = xs + (m0 / VNNI_ROWS) * B * VNNI_ROWS;
    const int64_t per_group = G == 1 ? B : group / W4_BLOCK;
    if (G > 1) prefetch_group_scales(scales, offsets, G, gstride, n0);
    /* int8 per channel: the sums scaled by the activations' run scales only, the column scale once */
    const int per_channel = bits == 8 && G == 1;
    /* the loop below runs 1-4 rows: two int32 chains a row (a8 .. a11 take the odd steps or the high
       nibbles), so that vpdpbusd's latency stays covered */
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    /* float32 sums in memory (L1), touched once per run: in registers they left no room for 16 rows */
    float facc[VNNI_ROWS][I8_PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < mb; r++) _mm512_store_ps(facc[r], _mm512_setzero_ps());
    /* 5-16 rows: the asm tiles, over the zero rows past M too (a decode step streams the weights:
       their bytes take as long as the extra rows' math); 1-4 rows (int4 decode, the fewest bytes
       per row): the loop below, each row its own */
    const int asm_tile = mb > 4;
    if (asm_tile)
        (bits == 8 ? (mb > 8 ? vnni_tile16_w8 : vnni_tile8_w8) : (mb > 8 ? vnni_tile16_w4 : vnni_tile8_w4))(
            panel, xt, xst, B, run, per_group, per_channel ? NULL : scales + n0, gstride, facc);
    /* runs of `run` blocks (within one weight group), summed in int32, then scaled once */
    for (int64_t b0 = 0, g = 0, left = per_group; !asm_tile && b0 < B; b0 += run) {
        const int64_t b1 = b0 + run < B ? b0 + run : B;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        __m512i a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
        for (int64_t b = b0; b < b1; b++) {
        const uint8_t *w = panel + b * block_bytes;
        const int8_t *xb = xt + b * VNNI_ROWS * W4_BLOCK;
/* row r's 4 inputs at `at` broadcast to the 16 columns, into accumulator a<acc> */
#define VNNI_ROW(acc, r, wv, at)                                                                  \
    if (mb > r) {                                                                                 \
        int32_t q4;                                                                               \
        memcpy(&q4, xb + r * W4_BLOCK + (at), 4);                                                 \
        a##acc = _mm512_dpbusd_epi32(a##acc, wv, _mm512_set1_epi32(q4));                          \
    }
/* one weight vector against the (at most 4) rows, into their first (chain 0) or second (chain 1)
   int32 chains */
#define VNNI_STEP(wv, at, chain)                                                                  \
    do {                                                                                          \
        if (chain) { ROWS_SECOND(VNNI_ROW, wv, at) } else { ROWS_LOW(VNNI_ROW, wv, at) }          \
    } while (0)
        if (bits == 8) {
            for (int s = 0; s < W4_BLOCK / 4; s += 2) {
                _mm_prefetch((const char *)(w + 64 * s) + VNNI_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)(w + 64 * s) + VNNI_PREFETCH + 64, _MM_HINT_T0);
                const __m512i wa = _mm512_loadu_si512(w + 64 * s), wb = _mm512_loadu_si512(w + 64 * s + 64);
                VNNI_STEP(wa, 4 * s, 0);
                VNNI_STEP(wb, 4 * s + 4, 1);
            }
        } else {
            for (int s = 0; s < W4_BLOCK / 8; s++) {
                _mm_prefetch((const char *)(w + 64 * s) + VNNI_PREFETCH, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(w + 64 * s);
                const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                VNNI_STEP(lo, 8 * s, 0);
                VNNI_STEP(hi, 8 * s + 4, 1);
            }
        }
#undef VNNI_STEP
#undef VNNI_ROW
#undef ROWS_SECOND
#undef ROWS_HIGH
#undef ROWS_LOW
        }
        const float *xsb = xst + (b1 - 1) * VNNI_ROWS;  /* the run's activation scales (one per row) */
        a0 = _mm512_add_epi32(a0, a8), a1 = _mm512_add_epi32(a1, a9), a2 = _mm512_add_epi32(a2, a10);
        a3 = _mm512_add_epi32(a3, a11);
        /* per channel one scale per column, applied once after the last block; else W4A8's
           operations in its order */
        const __m512 s = per_channel ? _mm512_setzero_ps() : _mm512_loadu_ps(scales + g * gstride + n0);
#define VNNI_FLUSH(r)                                                                             \
    if (mb > r) {                                                                                 \
        const __m512 x_scale = per_channel ? _mm512_set1_ps(xsb[r]) : _mm512_mul_ps(s, _mm512_set1_ps(xsb[r])); \
        _mm512_store_ps(facc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r), x_scale, _mm512_load_ps(facc[r]))); \
    }
        VNNI_FLUSH(0) VNNI_FLUSH(1) VNNI_FLUSH(2) VNNI_FLUSH(3)
#undef VNNI_FLUSH
        left -= b1 - b0;  /* runs never span two groups: the next run starts the next group here */
        if (left == 0) g++, left = per_group;
    }
    vnni_finish_rows(mb, bits, facc, m0, on, ok, ov, E, xg, G, panel, scales, offsets, gstride, group, n0, nn, N, bias,
                     y, y_bf16);
}

#define VNNI_ROW_TILES(TILE, ...)                                                                \
    do {                                                                                         \
        int64_t m0 = r0;                                                                         \
        for (; m0 + VNNI_ROWS <= r1; m0 += VNNI_ROWS) TILE(VNNI_ROWS, __VA_ARGS__);              \
        switch (r1 - m0) {                                                                       \
            case 15: TILE(15, __VA_ARGS__); break;                                               \
            case 14: TILE(14, __VA_ARGS__); break;                                               \
            case 13: TILE(13, __VA_ARGS__); break;                                               \
            case 12: TILE(12, __VA_ARGS__); break;                                               \
            case 11: TILE(11, __VA_ARGS__); break;                                               \
            case 10: TILE(10, __VA_ARGS__); break;                                               \
            case 9: TILE(9, __VA_ARGS__); break;                                                 \
            case 8: TILE(8, __VA_ARGS__); break;                                                 \
            case 7: TILE(7, __VA_ARGS__); break;                                                 \
            case 6: TILE(6, __VA_ARGS__); break;                                                 \
            case 5: TILE(5, __VA_ARGS__); break;                                                 \
            case 4: TILE(4, __VA_ARGS__); break;                                                 \
            case 3: TILE(3, __VA_ARGS__); break;                                                 \
            case 2: TILE(2, __VA_ARGS__); break;                                                 \
            case 1: TILE(1, __VA_ARGS__); break;                                                 \
            default: break;                                                                      \
        }                                                                                        \
    } while (0)
#define vnni_tile_w4(mb, ...) vnni_tile(mb, 4, __VA_ARGS__)
#define vnni_tile_w8(mb, ...) vnni_tile(mb, 8, __VA_ARGS__)

/* int8 weights from VNNI_PAIR_MIN_ROWS rows: panels in pairs (vnni_pair_tile_w8), eight rows at a
   time (each 16-row tile of xt in two halves), an odd last panel by the 16-row tile. Fewer rows
   (decode) keep the 16-row tile, which multiplies each weight as it streams in from memory. */
#define VNNI_PAIR_MIN_ROWS 32
static void vnni_drive_pairs(const int8_t *xq, const float *xs, const float *xg, const int32_t *on, const int32_t *ok,
                             const float *ov, int64_t M, int64_t Kp, int64_t G, int64_t run, const int8_t *panels,
                             int64_t panel_bytes, const float *scales, const float *offsets, int64_t gstride,
                             int64_t group, int64_t N, const float *bias, void *y, const int y_bf16, int num_threads) {
    const int64_t B = Kp / W4_BLOCK, E = B * W4_MAX_OUTLIERS, num_panels = (N + I8_PANEL - 1) / I8_PANEL;
    const int64_t pairs = num_panels / 2, per_group = G == 1 ? B : group / W4_BLOCK;
    const int per_channel = G == 1;
    for (int64_t r0 = 0; r0 < M; r0 += I8_ROW_BLOCK) {  /* row blocks outermost, as I8_DRIVE */
        const int64_t r1 = M - r0 < I8_ROW_BLOCK ? M : r0 + I8_ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t q = 0; q < pairs + (num_panels & 1); q++) {
            const int64_t p = 2 * q, n0 = p * I8_PANEL;
            const int8_t *panel = panels + p * panel_bytes;
            if (q == pairs) {  /* the odd last panel */
                const int64_t nn = N - n0 < I8_PANEL ? N - n0 : I8_PANEL;
                VNNI_ROW_TILES(vnni_tile_w8, xq, xs, xg, on, ok, ov, m0, Kp, G, run, panel, scales, offsets, gstride,
                               group, n0, nn, N, bias, y, y_bf16);
                continue;
            }
            const int64_t n1 = n0 + I8_PANEL, nn1 = N - n1 < I8_PANEL ? N - n1 : I8_PANEL;
            float facc0[VNNI_ROWS][I8_PANEL] __attribute__((aligned(64)));
            float facc1[VNNI_ROWS][I8_PANEL] __attribute__((aligned(64)));
            for (int64_t m0 = r0; m0 < r1; m0 += 8) {
                const int mb = r1 - m0 < 8 ? (int)(r1 - m0) : 8;
                /* rows past M are zero in xq: the tile runs all eight */
                const int64_t tile = m0 / VNNI_ROWS, half = m0 % VNNI_ROWS;
                vnni_pair_tile_w8((const uint8_t *)panel, (const uint8_t *)panel + panel_bytes,
                                  xq + tile * B * VNNI_ROWS * W4_BLOCK + half * W4_BLOCK,
                                  xs + tile * B * VNNI_ROWS + half, B, run, per_group,
                                  per_channel ? NULL : scales + n0, per_channel ? NULL : scales + n1, gstride, facc0,
                                  facc1);
                vnni_finish_rows(mb, 8, facc0, m0, on, ok, ov, E, xg, G, (const uint8_t *)panel, scales, offsets,
                                 gstride, group, n0, I8_PANEL, N, bias, y, y_bf16);
                vnni_finish_rows(mb, 8, facc1, m0, on, ok, ov, E, xg, G, (const uint8_t *)panel + panel_bytes, scales,
                                 offsets, gstride, group, n1, nn1, N, bias, y, y_bf16);
            }
        }
    }
}
#else
#define VNNI 0
#endif

int vnni_supported(void) { return VNNI; }

/* W4A8 runs on the VNNI tile where the CPU has it (1, the default) or on the AVX2 one (0): for tests
   and bench.py, which compare the two. */
static int w4a8_vnni = VNNI;
void set_w4a8_vnni(int on) { w4a8_vnni = on && VNNI; }

/* y[M, N] = x[M, K] . ((u - z) * s)^T (+ bias) with `bits`-bit weights u in VNNI panels (4: the W4A8
   layout, its scales and offsets panel-major; 8: [ceil(N / 16)][Kp / 4][16][4] bytes, scales and
   offsets [groups][Np]). x quantized with one scale per activation_run_blocks
   blocks of 32 inputs (outliers found per block), as for the AVX2 W4A8 tile (4 bits: the same bits).
   Returns 1 without VNNI, 2 without memory for the quantized activations. */
static int vnni_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                     const float *offsets, int64_t group, const int bits, int64_t N, const float *bias, void *y,
                     const int y_bf16, int num_threads) {
#if VNNI
    const int64_t Kp = (K + W4_BLOCK - 1) / W4_BLOCK * W4_BLOCK, B = Kp / W4_BLOCK, E = B * W4_MAX_OUTLIERS;
    const int64_t Np = (N + I8_PANEL - 1) / I8_PANEL * I8_PANEL;
    const int64_t G = (K + group - 1) / group, panel_bytes = Kp * I8_PANEL * bits / 8;
    float *xg = malloc((size_t)(M * G) * sizeof(float));
    float *ov = malloc((size_t)(M * E) * sizeof(float));
    int32_t *on = malloc((size_t)M * sizeof(int32_t)), *ok = malloc((size_t)(M * E) * sizeof(int32_t));
    const int64_t Mt = (M + VNNI_ROWS - 1) / VNNI_ROWS * VNNI_ROWS;
    int8_t *xt = malloc((size_t)(Mt * Kp));
    float *xst = malloc((size_t)(Mt * B) * sizeof(float));
    /* a run never spans two weight groups; 4 bits: the AVX2 W4A8 tile's runs (the same bits) */
    const int64_t run = activation_run_blocks(group, K);
    int rc = 2;
    if (xg == NULL || ov == NULL || on == NULL || ok == NULL || xt == NULL || xst == NULL ||
        quantize_tiles_int8(x, x_bf16, M, K, Kp, group, W4_OUTLIER, run, xt, xst, xg, on, ok, ov, num_threads))
        goto done;
    if (bits == 8 && M >= VNNI_PAIR_MIN_ROWS)
        vnni_drive_pairs(xt, xst, xg, on, ok, ov, M, Kp, G, run, panels, panel_bytes, scales, offsets, Np, group, N,
                         bias, y, y_bf16, num_threads);
    else if (bits == 8)
        I8_DRIVE_TILES(VNNI_ROW_TILES, vnni_tile_w8, xt, xst, xg, on, ok, ov, m0, Kp, G, run, panel, scales, offsets, Np,
                       group, n0, nn, N, bias, y, y_bf16);
    else
        I8_DRIVE_TILES(VNNI_ROW_TILES, vnni_tile_w4, xt, xst, xg, on, ok, ov, m0, Kp, G, run, panel,
                       W4A8_GROUPS(scales, offsets, G), group, n0, nn, N, bias, y, y_bf16);
    rc = 0;
done:
    free(xg), free(ov), free(on), free(ok), free(xt), free(xst);
    return rc;
#else
    (void)bits; (void)x; (void)x_bf16; (void)M; (void)K; (void)panels; (void)scales; (void)offsets; (void)group; (void)N;
    (void)bias; (void)y; (void)y_bf16; (void)num_threads;
    return 1;
#endif
}

/* int8 weights (u = q + 128) through VNNI, on float32 or bf16 x and y (io: IO_* flags). group: a
   multiple of 32, or >= K. */
int int8_gemm_vnni(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads) {
    return vnni_gemm(x, io & 1, M, K, panels, scales, offsets, group, 8, N, bias, y, (io & 2) != 0, num_threads);
}

/* y[M, N] = x[M, K] . ((q - z) * s)^T (+ bias), x and y float32: x quantized here by
   quantize_blocks_int8 (one call does both: at one row the quantization is a few microseconds, its
   buffers from Python were ten times that), then the W4A8 panels; scales and offsets panel-major
   (prefetch_group_scales).
   group: a multiple of 32, or >= K (one group). Returns 1 without AVX2/FMA, 2 if the quantized
   activations cannot be allocated. */
static int int4_gemm_w4a8_f32(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t N, const float *bias, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t Kp = (K + W4_BLOCK - 1) / W4_BLOCK * W4_BLOCK, B = Kp / W4_BLOCK, E = B * W4_MAX_OUTLIERS;
    const int64_t G = (K + group - 1) / group, panel_bytes = Kp * (I8_PANEL / 2);
    int8_t *xq = malloc((size_t)(M * Kp));
    float *xs = malloc((size_t)(M * B) * sizeof(float)), *xg = malloc((size_t)(M * G) * sizeof(float));
    float *ov = malloc((size_t)(M * E) * sizeof(float));
    int32_t *on = malloc((size_t)M * sizeof(int32_t)), *ok = malloc((size_t)(M * E) * sizeof(int32_t));
    int rc = 2;
    if (xq == NULL || xs == NULL || xg == NULL || ov == NULL || on == NULL || ok == NULL) goto done;
    const int64_t run = activation_run_blocks(group, K);
    quantize_blocks_int8(x, M, K, Kp, group, W4_OUTLIER, run, xq, xs, xg, on, ok, ov, num_threads);
    I8_DRIVE_TILES(W4_ROW_TILES, w4a8_tile, xq, xs, xg, on, ok, ov, m0, Kp, G, run, panel,
                   W4A8_GROUPS(scales, offsets, G), group, n0, nn, N, bias, y);
    rc = 0;
done:
    free(xq), free(xs), free(xg), free(ov), free(on), free(ok);
    return rc;
#else
    (void)x; (void)M; (void)K; (void)panels; (void)scales; (void)offsets; (void)group; (void)N; (void)bias; (void)y;
    (void)num_threads;
    return 1;
#endif
}

/* int4_gemm_w4a8 on float32 or bf16 x and y (io: IO_* flags). */
int int4_gemm_w4a8(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads) {
    if (w4a8_vnni) return vnni_gemm(x, io & 1, M, K, panels, scales, offsets, group, 4, N, bias, y, (io & 2) != 0, num_threads);
    BF16_IO_ENTRY(int4_gemm_w4a8_f32, M, K, panels, scales, offsets, group, N, bias);
}

/* ------------------------------------------------------------------------------------------ */
/* Instruction peaks: register-only loops, no memory traffic, 12 independent dependency chains  */
/* per thread (more than latency x throughput on any AVX2 core). Each chain feeds its own       */
/* result back as the next input, so no two chains compute the same value (the compiler would  */
/* merge them) and nothing is loop-invariant (it would hoist it). Each returns the             */
/* multiply-adds done (one lane product = one), or 0 without AVX2/FMA; the caller times it.    */

#if defined(__AVX2__) && defined(__FMA__)
#define LAUNDER(v) __asm__ volatile("" : "+x"(v))
#define CHAINS(STEP) STEP(c0), STEP(c1), STEP(c2), STEP(c3), STEP(c4), STEP(c5), STEP(c6), STEP(c7), STEP(c8), \
                     STEP(c9), STEP(c10), STEP(c11)
#define SINK_ALL() do { LAUNDER(c0); LAUNDER(c1); LAUNDER(c2); LAUNDER(c3); LAUNDER(c4); LAUNDER(c5); \
                        LAUNDER(c6); LAUNDER(c7); LAUNDER(c8); LAUNDER(c9); LAUNDER(c10); LAUNDER(c11); } while (0)
#endif

/* vfmadd231ps ymm: 8 multiply-adds */
double peak_loop_fma_f32(int64_t iters, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
#pragma omp parallel num_threads(num_threads)
    {
        const __m256 a = _mm256_set1_ps(1e-7f), b = _mm256_set1_ps(0.999f);
        __m256 c0 = _mm256_set1_ps(0.f), c1 = _mm256_set1_ps(1.f), c2 = _mm256_set1_ps(2.f), c3 = _mm256_set1_ps(3.f);
        __m256 c4 = _mm256_set1_ps(4.f), c5 = _mm256_set1_ps(5.f), c6 = _mm256_set1_ps(6.f), c7 = _mm256_set1_ps(7.f);
        __m256 c8 = _mm256_set1_ps(8.f), c9 = _mm256_set1_ps(9.f), c10 = _mm256_set1_ps(10.f), c11 = _mm256_set1_ps(11.f);
        SINK_ALL();
#define STEP(c) c = _mm256_fmadd_ps(c, b, a)
        for (int64_t i = 0; i < iters; i++) CHAINS(STEP);
#undef STEP
        SINK_ALL();
    }
    return (double)iters * 12 * 8 * num_threads;
#else
    (void)iters; (void)num_threads;
    return 0.0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#define INT_CHAINS_INIT()                                                                                   \
    __m256i c0 = _mm256_set1_epi16(0), c1 = _mm256_set1_epi16(1), c2 = _mm256_set1_epi16(2),               \
            c3 = _mm256_set1_epi16(3), c4 = _mm256_set1_epi16(4), c5 = _mm256_set1_epi16(5),               \
            c6 = _mm256_set1_epi16(6), c7 = _mm256_set1_epi16(7), c8 = _mm256_set1_epi16(8),               \
            c9 = _mm256_set1_epi16(9), c10 = _mm256_set1_epi16(10), c11 = _mm256_set1_epi16(11);           \
    SINK_ALL()
#endif

/* One integer loop: SETUP declares what STEP uses; MACS multiply-adds per STEP of one chain. */
#if defined(__AVX2__) && defined(__FMA__)
#define INT_PEAK_LOOP(NAME, SETUP, STEP, MACS)                                                              \
    double NAME(int64_t iters, int num_threads) {                                                           \
        _Pragma("omp parallel num_threads(num_threads)")                                                    \
        {                                                                                                   \
            SETUP;                                                                                          \
            INT_CHAINS_INIT();                                                                              \
            for (int64_t i = 0; i < iters; i++) CHAINS(STEP);                                               \
            SINK_ALL();                                                                                     \
        }                                                                                                   \
        return (double)iters * 12 * (MACS) * num_threads;                                                   \
    }
#else
#define INT_PEAK_LOOP(NAME, SETUP, STEP, MACS)                                                              \
    double NAME(int64_t iters, int num_threads) {                                                           \
        (void)iters; (void)num_threads;                                                                     \
        return 0.0;                                                                                         \
    }
#endif

/* vpmaddwd + vpaddd ymm (the W8A8 kernel's pair): 16 multiply-adds */
#define MADD_I16(c) c = _mm256_add_epi32(_mm256_madd_epi16(c, w), w)
INT_PEAK_LOOP(peak_loop_madd_i16, const __m256i w = _mm256_set1_epi16(3), MADD_I16, 16)

/* vpmaddubsw + vpaddw ymm (u8 x s8 pair sums added in int16: the W4A8 kernel's inner pair, which
   widens with one vpmaddwd per eight of these): 32 multiply-adds */
#define MADDUBS_I16(c) c = _mm256_add_epi16(_mm256_maddubs_epi16(w, c), w)
INT_PEAK_LOOP(peak_loop_maddubs_i16, const __m256i w = _mm256_set1_epi8(3), MADDUBS_I16, 32)

/* vpmaddubsw + vpmaddwd(ones) + vpaddd ymm (u8 x s8, llama.cpp's AVX2 dot product): 32 multiply-adds */
#define MADDUBS_U8S8(c) c = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(c, w), ones), w)
INT_PEAK_LOOP(peak_loop_maddubs_u8s8, const __m256i ones = _mm256_set1_epi16(1); const __m256i w = _mm256_set1_epi8(3),
              MADDUBS_U8S8, 32)

/* AVX-512 (0 where the CPU or the build lacks it): the float32 FMA on zmm, the VNNI u8 x s8 dot
   product (vpdpbusd, the int8 VNNI kernel's) and the bf16 pair dot product (vdpbf16ps, oneDNN's bf16
   GEMM on AVX512-BF16). */
#define ZMM_PEAK_LOOP(NAME, ENABLED, TYPE, SETUP, INIT, STEP, MACS)                                        \
    double NAME(int64_t iters, int num_threads) {                                                           \
        if (!(ENABLED)) return 0.0 * (double)iters * num_threads;                                          \
        ZMM_PEAK_BODY(TYPE, SETUP, INIT, STEP, MACS)                                                        \
    }
#define ZLAUNDER(v) __asm__ volatile("" : "+v"(v))
#define ZCHAINS(S) S(c0) S(c1) S(c2) S(c3) S(c4) S(c5) S(c6) S(c7) S(c8) S(c9) S(c10) S(c11)
#define ZSINK(c) ZLAUNDER(c);
#define ZMM_PEAK_BODY(TYPE, SETUP, INIT, STEP, MACS)                                                        \
    _Pragma("omp parallel num_threads(num_threads)")                                                        \
    {                                                                                                       \
        SETUP;                                                                                              \
        TYPE c0 = INIT, c1 = INIT, c2 = INIT, c3 = INIT, c4 = INIT, c5 = INIT, c6 = INIT, c7 = INIT,        \
             c8 = INIT, c9 = INIT, c10 = INIT, c11 = INIT;                                                  \
        ZCHAINS(ZSINK)                                                                                      \
        for (int64_t i = 0; i < iters; i++) { ZCHAINS(STEP) }                                               \
        ZCHAINS(ZSINK)                                                                                      \
    }                                                                                                       \
    return (double)iters * 12 * (MACS) * num_threads;

#if defined(__AVX512F__)
#define FMA_ZMM(c) c = _mm512_fmadd_ps(c, b, a);
ZMM_PEAK_LOOP(peak_loop_fma_f32_zmm, 1, __m512, const __m512 a = _mm512_set1_ps(1e-7f); const __m512 b = _mm512_set1_ps(0.999f),
              _mm512_set1_ps(1.0f), FMA_ZMM, 16)
#else
double peak_loop_fma_f32_zmm(int64_t iters, int num_threads) { (void)iters; (void)num_threads; return 0.0; }
#endif
#if VNNI
#define DPBUSD_ZMM(c) c = _mm512_dpbusd_epi32(c, w, w);
ZMM_PEAK_LOOP(peak_loop_dpbusd, 1, __m512i, const __m512i w = _mm512_set1_epi8(3), _mm512_set1_epi32(1), DPBUSD_ZMM, 64)
#else
double peak_loop_dpbusd(int64_t iters, int num_threads) { (void)iters; (void)num_threads; return 0.0; }
#endif
#if defined(__AVX512BF16__)
#define DPBF16_ZMM(c) c = _mm512_dpbf16_ps(c, w, w);
ZMM_PEAK_LOOP(peak_loop_dpbf16, 1, __m512, const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80), _mm512_set1_ps(0.0f),
              DPBF16_ZMM, 32)
#else
double peak_loop_dpbf16(int64_t iters, int num_threads) { (void)iters; (void)num_threads; return 0.0; }
#endif
