/*
 * The vector wrappers: VL floats at a time under one set of names (vload, vfma, vfp8, v4bit_32...) over AVX-512,
 * AVX2 or plain C, whichever the build targets (build.py's ISA flags), so that each kernel is written once; and
 * which bf16 pairs paths (AVX512-BF16, AVX512-VBMI, or their plain-C emulation for tests) the build takes.
 */
#pragma once
#include "common.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && !defined(AMC_SCALAR)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMC_BF16_PAIRS 1 /* 4-bit weights times bf16 inputs in pairs (VDPBF16PS): kernels_4bit.h's dot4_pairs */
#define AMC_ISA "avx512-bf16"
#else
#define AMC_ISA "avx512"
#endif
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
/* bf16 is the top half of a float32: widen and shift */
static inline vf vbf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf vf16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* e4m3 to float32 in the integer domain, never through float arithmetic on a denormal (each would cost a microcode
 * assist): a normal code's exponent is rebiased from 7 to 127; a subnormal one (exponent 0) is its mantissa * 2^-9;
 * 0x7F and 0xFF are NaN */
static inline vf vfp8(const uint8_t *p) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    vf subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    vf v = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal), is_subnormal, subnormal);
    v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
}
/* 32 4-bit codes (16 bytes) -> dst[0:16] the even inputs' values (low nibbles), dst[16:32] the odd ones' (high) */
static inline void vmxfp4_32(const uint8_t *p, vf scale, float *dst) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    vf e2m1 = _mm512_loadu_ps(E2M1);
    vstore(dst, vmul(_mm512_permutexvar_ps(bytes, e2m1), scale)); /* the lookup reads an index's low 4 bits */
    vstore(dst + 16, vmul(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), e2m1), scale));
}
/* scale_lo for inputs 0..15 of the 32, scale_hi for 16..31 (groups of 16) */
static inline void vint4_32(const uint8_t *p, float scale_lo, float scale_hi, float *dst) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    vf scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale_lo), _mm512_set1_ps(scale_hi));
    __m512i eight = _mm512_set1_epi32(8);
    __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), high = _mm512_srli_epi32(bytes, 4);
    vstore(dst, vmul(_mm512_cvtepi32_ps(_mm512_sub_epi32(low, eight)), scale));
    vstore(dst + 16, vmul(_mm512_cvtepi32_ps(_mm512_sub_epi32(high, eight)), scale));
}
/* 32 4-bit codes (16 bytes), unscaled, in registers: w[0] the even inputs' values, w[1] the odd ones' (as above) */
static inline void v4bit_32(const uint8_t *p, int mx, vf *w) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), high = _mm512_srli_epi32(bytes, 4);
    if (mx) {
        vf e2m1 = _mm512_loadu_ps(E2M1);
        w[0] = _mm512_permutexvar_ps(low, e2m1);
        w[1] = _mm512_permutexvar_ps(high, e2m1);
    } else {
        w[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(low, _mm512_set1_epi32(8)));
        w[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(high, _mm512_set1_epi32(8)));
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(AMC_SCALAR)
#define AMC_ISA "avx2"
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vbf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf vf16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vfp8(const uint8_t *p) { /* as the AVX-512 version */
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    vf subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    vf v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), subnormal, is_subnormal);
    v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
    __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
}
/* as the AVX-512 versions, 8 bytes (16 codes) at a time: inputs 16h..16h+15 of the 32 go to lanes 8h.. of the
 * even and odd halves */
static inline vf vmxfp4_8(__m256i codes) { /* the magnitude from e2m1's first 8 values, the sign from bit 3 */
    vf magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1), codes);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}
static inline void vmxfp4_32(const uint8_t *p, vf scale, float *dst) {
    for (int h = 0; h < 2; h++) {
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        vstore(dst + 8 * h, vmul(vmxfp4_8(bytes), scale));
        vstore(dst + 16 + 8 * h, vmul(vmxfp4_8(_mm256_srli_epi32(bytes, 4)), scale));
    }
}
static inline void vint4_32(const uint8_t *p, float scale_lo, float scale_hi, float *dst) {
    for (int h = 0; h < 2; h++) {
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        __m256i eight = _mm256_set1_epi32(8);
        __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)), high = _mm256_srli_epi32(bytes, 4);
        vf scale = vset1(h ? scale_hi : scale_lo);
        vstore(dst + 8 * h, vmul(_mm256_cvtepi32_ps(_mm256_sub_epi32(low, eight)), scale));
        vstore(dst + 16 + 8 * h, vmul(_mm256_cvtepi32_ps(_mm256_sub_epi32(high, eight)), scale));
    }
}
/* as the AVX-512 version: w[h] the even inputs 8h.., w[2 + h] the odd ones */
static inline void v4bit_32(const uint8_t *p, int mx, vf *w) {
    for (int h = 0; h < 2; h++) {
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)), high = _mm256_srli_epi32(bytes, 4);
        if (mx) {
            w[h] = vmxfp4_8(low);
            w[2 + h] = vmxfp4_8(high);
        } else {
            w[h] = _mm256_cvtepi32_ps(_mm256_sub_epi32(low, _mm256_set1_epi32(8)));
            w[2 + h] = _mm256_cvtepi32_ps(_mm256_sub_epi32(high, _mm256_set1_epi32(8)));
        }
    }
}

#else
#define AMC_ISA "scalar"
#define VL 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf v) { *p = v; }
static inline vf vset1(float a) { return a; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
#endif

/* A build for tests (build.py's "pairs-emulated"): the pairs kernels as plain C, so that hosts without AVX512-BF16
 * run the pairs paths' layout and wiring */
#if defined(AMC_EMULATE_PAIRS) && VL > 1 && !defined(AMC_BF16_PAIRS)
#define AMC_BF16_PAIRS 1
#define AMC_PAIRS_EMULATED 1
#undef AMC_ISA
#define AMC_ISA "avx2-pairs-emulated"
#endif

/* fp8 in pairs, in blocks of whole 64s, decodes 64 codes at a time by byte lookups (VPERMI2B, AVX512-VBMI; emulated
 * with the pairs) in fp8_position's order */
#if defined(AMC_BF16_PAIRS) && (defined(__AVX512VBMI__) || defined(AMC_PAIRS_EMULATED))
#define AMC_FP8_RUNS 1
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

