/*
 * fp8 (e4m3, block-wise scales) kernels: decode_fp8 for the decoded path, dot8_fixed fusing decode and dot over a
 * stored row (the decoded weights never leave registers, each block's scale applied once to its partial sums), and
 * dot8_pairs multiplying the codes, decoded to bf16, with bf16 inputs in pairs (AVX512-BF16, or its emulation).
 */
#pragma once
#include "kernels_dense.h"

static void decode_fp8(const uint8_t *src, int64_t len, float scale, float *dst) {
    int64_t i = 0;
#if VL > 1
    vf s = vset1(scale);
    for (; i + VL <= len; i += VL) vstore(dst + i, vmul(vfp8(src + i), s));
#endif
    for (; i < len; i++) dst[i] = E4M3[src[i]] * scale;
}

/* where input k of K sits for dot8_pairs in blocks of whole 64s: each whole 64 as two runs of 32, run h lane 8L + i
 * holding input 16L + 8h + i (the 16-bit lanes that interleaving the low and the high bytes of 64 decoded codes
 * makes, 128 bits at a time); a last part of 64 in its own order */
static inline int64_t fp8_position(int64_t k, int64_t K) {
    if ((k | 63) >= K) return k;
    return (k & ~(int64_t)63) | (((k >> 3) & 1) << 5) | (((k >> 4) & 3) << 3) | (k & 7);
}

#if VL > 1
/* an fp8 row of K bytes whose scales change every B inputs: each block by DOT_CHAINS, its sums scaled once */
static inline __attribute__((always_inline)) void dot8_fixed(const uint8_t *row, const float *scales, int64_t B,
                                                             const float *x, int64_t ldx, int64_t K, int tb,
                                                             float *out) {
    vf acc[TOKENS_PER_READ], part[4][TOKENS_PER_READ];
    float tail[TOKENS_PER_READ] = {0};
    for (int t = 0; t < tb; t++) acc[t] = vzero();
    for (int64_t b0 = 0; b0 < K; b0 += B) {
        const int64_t end = min64(K, b0 + B);
        const float scale = scales[b0 / B];
#define LOAD_FP8(i) vfp8(row + i)
        DOT_CHAINS(LOAD_FP8, part, x, ldx, k, b0, end, tb);
#undef LOAD_FP8
        for (int t = 0; t < tb; t++) {
            for (int j = 1; j < CHAINS(tb); j++) part[0][t] = vadd(part[0][t], part[j][t]);
            acc[t] = vfma(vset1(scale), part[0][t], acc[t]);
            float rest = 0.0f;
            for (int64_t i = k; i < end; i++) rest += E4M3[row[i]] * x[t * ldx + i];
            tail[t] += scale * rest;
        }
    }
    for (int t = 0; t < tb; t++) out[t] = vsum(acc[t]) + tail[t];
}
#endif

#if defined(AMC_PAIRS_EMULATED)
static inline float weight_fp8(const void *row, int64_t k) { return E4M3[((const uint8_t *)row)[k]]; }

/* dot8_pairs below, lane for lane: with `runs` (fp8_runs), lane l of each whole 64 adds the pairs at positions 2l,
 * 2l + 1 of each of fp8_position's two runs into that run's sum; then each 32 (the other blocks, a last part of 64) by
 * pairs_lanes into the first; each block's two sums added, then scaled; the last K % 32 inputs one by one */
static inline void dot8_pairs(const uint8_t *row, const float *scales, int64_t B, int runs, const uint16_t *x,
                              int64_t ldx, int64_t K, int tb, float *out) {
    for (int t = 0; t < tb; t++) {
        const uint16_t *xt = x + t * ldx;
        float acc[16] = {0}, tail = 0.0f;
        for (int64_t b0 = 0; b0 < K; b0 += B) {
            const int64_t end = min64(K, b0 + B);
            float part[2][16] = {{0}};
            int64_t k = b0;
            for (; runs && k + 64 <= end; k += 64)
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 16; l++)
                        for (int i = 1; i >= 0; i--) { /* lane p = 2l + i of run h: input 16 (p / 8) + 8h + p % 8 */
                            const int p = 2 * l + i;
                            const float w = E4M3[row[k + 16 * (p >> 3) + 8 * h + (p & 7)]];
                            part[h][l] += w * bf16_to_f32(xt[k + 32 * h + p]);
                        }
            k = pairs_lanes(weight_fp8, row, xt, k, end, part[0]);
            for (int l = 0; l < 16; l++) acc[l] = fmaf(part[0][l] + part[1][l], scales[b0 / B], acc[l]);
            float rest = 0.0f;
            for (; k < end; k++) rest += E4M3[row[k]] * bf16_to_f32(xt[k]);
            tail += scales[b0 / B] * rest;
        }
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += acc[l];
        out[t] = total + tail;
    }
}
#elif defined(AMC_BF16_PAIRS)
/* 32 e4m3 codes -> bf16, exactly, in the integer domain: a normal code's exponent rebiased from 7 to 127 and its
 * mantissa moved up, a subnormal one (exponent 0) looked up, 0x7F NaN, the sign moved to bit 15 */
static inline __m512i e4m3_bf16(const uint8_t *p) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512(SUBNORMAL_BF16));
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7FC0));
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}

#if defined(AMC_FP8_RUNS)
/* 64 e4m3 codes -> bf16 exactly in fp8_position's two runs: each code's magnitude indexes the low and the high byte of
 * its bf16 (two 128-byte tables, subnormals and NaN included), the sign is ORed into the high byte, and the bytes are
 * interleaved into 16-bit lanes, 128 bits at a time */
static inline __attribute__((always_inline)) void e4m3_bf16_runs(const uint8_t *p, const __m512i *tables, __m512bh *w) {
    const __m512i codes = _mm512_loadu_si512(p);
    const __m512i low = _mm512_permutex2var_epi8(tables[0], codes, tables[1]);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tables[2], codes, tables[3]), codes,
                                                   _mm512_set1_epi8((char)0x80), 0xF8); /* high | (codes & 0x80) */
    w[0] = (__m512bh)_mm512_unpacklo_epi8(low, high);
    w[1] = (__m512bh)_mm512_unpackhi_epi8(low, high);
}
#endif

/* an fp8 row against bf16 inputs (input_position's order), its scales changing every B inputs (a multiple of 32):
 * with `runs` (fp8_runs: B a multiple of 64) 64 codes at a time (e4m3_bf16_runs), each run into its own sum, else 32
 * at a time (e4m3_bf16), multiplied in pairs (VDPBF16PS), each block's sums scaled once; the last K % 32 inputs one
 * by one */
static inline __attribute__((always_inline)) void dot8_pairs(const uint8_t *row, const float *scales, int64_t B,
                                                             int runs, const uint16_t *x, int64_t ldx, int64_t K,
                                                             int tb, float *out) {
    __m512 acc[TOKENS_PER_READ], part[2][TOKENS_PER_READ];
    float tail[TOKENS_PER_READ] = {0};
#if defined(AMC_FP8_RUNS)
    const __m512i tables[4] = {
        _mm512_loadu_si512(E4M3_BF16_BYTES[0]), _mm512_loadu_si512(E4M3_BF16_BYTES[0] + 64),
        _mm512_loadu_si512(E4M3_BF16_BYTES[1]), _mm512_loadu_si512(E4M3_BF16_BYTES[1] + 64)};
#else
    (void)runs; /* fp8_runs is 0 without AVX512-VBMI */
#endif
    for (int t = 0; t < tb; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < K; b0 += B) {
        const int64_t end = min64(K, b0 + B);
        const float scale = scales[b0 / B];
        for (int t = 0; t < tb; t++) part[0][t] = part[1][t] = _mm512_setzero_ps();
        int64_t k = b0;
#if defined(AMC_FP8_RUNS)
        for (; runs && k + 64 <= end; k += 64) {
            __m512bh w[2];
            e4m3_bf16_runs(row + k, tables, w);
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < tb; t++)
                    part[h][t] =
                        _mm512_dpbf16_ps(part[h][t], w[h], (__m512bh)_mm512_loadu_si512(x + t * ldx + k + 32 * h));
        }
#endif
        for (; k + 32 <= end; k += 32) {
            __m512bh w = (__m512bh)e4m3_bf16(row + k);
            for (int t = 0; t < tb; t++)
                part[0][t] = _mm512_dpbf16_ps(part[0][t], w, (__m512bh)_mm512_loadu_si512(x + t * ldx + k));
        }
        for (int t = 0; t < tb; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_add_ps(part[0][t], part[1][t]), _mm512_set1_ps(scale), acc[t]);
            float rest = 0.0f;
            for (int64_t i = k; i < end; i++) rest += E4M3[row[i]] * bf16_to_f32(x[t * ldx + i]);
            tail[t] += scale * rest;
        }
    }
    for (int t = 0; t < tb; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}
#endif
