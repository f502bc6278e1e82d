/* AVX-512 helpers shared by the C kernels (cpu_int8.c, cpu_dpbf16.c, cpu_kernels.c), static inline
   so that every caller inlines them: called per row of a GEMM tile, a function call spilled the
   tile's registers around it. */
#ifndef NANOSERVE_CPU_SIMD_H
#define NANOSERVE_CPU_SIMD_H
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 float32 lanes rounded to bf16 as cpu_kernels.c's f32_to_bf16 (nearest even; NaN quiet) */
static inline __m256i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

/* 16 float32 lanes rounded to bf16 as f32x16_to_bf16 does, left in float32 (what a bf16 op's output
   reads back as): the rounding without the narrowing and widening */
static inline __m512 round_bf16_ps(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32((int)0xffff0000);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), high);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* 16 bf16 values widened to float32 (a bf16 value is a float32's high half) */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x lane-wise, for x <= ~88: cpu_kernels.c's exp256_ps in zmm registers (2^k * e^r, x = k ln2 +
   r, e^r by Cephes' degree-6 polynomial, within 2 ulp of expf); below -87.3 it flushes toward 0 */
static inline __m512 exp512_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);  /* p * 2^k in one op (k >= -126 after the clamp: exact, as a built exponent) */
}
#endif
#endif
