/*
 * 4-bit kernels (mxfp4 with e8m0 scales, int4 with bf16 scales; codes stored [N, K/2]): the decoders, the input
 * orders they and the pairs kernels read (split_position, pair_position), dot4_fixed fusing decode and dot over a
 * stored row (each group's scale applied once to its partial sums), and dot4_pairs with bf16 inputs in pairs.
 */
#pragma once
#include "isa.h"

/* 4-bit runs start on a multiple of 32 inputs and span whole 32s (K is a multiple of the group, segments of
 * SEGMENT). Each 32 inputs' weights are written as the 16 even inputs' then the 16 odd ones' (the low nibbles, then
 * the high: no interleaving shuffle); the inputs they multiply are put in the same order (split_even_odd). */
static void decode_mxfp4(const uint8_t *src, const uint8_t *scales, int64_t len, float *dst) {
    for (int64_t b = 0; b < len / 32; b++, src += 16, dst += 32) {
        float scale = E8M0[scales[b]];
#if VL > 1
        vmxfp4_32(src, vset1(scale), dst);
#else
        for (int i = 0; i < 16; i++) {
            dst[i] = E2M1[src[i] & 0xF] * scale;
            dst[16 + i] = E2M1[src[i] >> 4] * scale;
        }
#endif
    }
}

static void decode_int4(const uint8_t *src, const uint16_t *scales, int64_t group, int64_t len, float *dst) {
    const int shift = __builtin_ctzll((unsigned long long)group); /* groups are powers of two: no division per 32 */
    for (int64_t b = 0; b < len / 32; b++, src += 16, dst += 32) {
        float scale_lo = bf16_to_f32(scales[(b * 32) >> shift]);
        float scale_hi = bf16_to_f32(scales[(b * 32 + 16) >> shift]);
#if VL > 1
        vint4_32(src, scale_lo, scale_hi, dst);
#else
        for (int i = 0; i < 16; i++) {
            float scale = i < 8 ? scale_lo : scale_hi;
            dst[i] = (float)((src[i] & 0xF) - 8) * scale;
            dst[16 + i] = (float)((src[i] >> 4) - 8) * scale;
        }
#endif
    }
}

/* where input k sits in the order the 4-bit decoders write */
static inline int64_t split_position(int64_t k) { return (k & ~(int64_t)31) | ((k & 1) << 4) | ((k & 31) >> 1); }

/* where input k of K sits for dot4_pairs: each whole 128 inputs as four runs of 32, run r holding the inputs 4j + r
 * (the nibbles a 16-bit lane j of 64 bytes of codes holds, shifted by 4r); a last whole 64 as their 32 even ones
 * then their 32 odd ones (the low nibbles of 32 bytes, then the high); a last 32 as split_position */
static inline int64_t pair_position(int64_t k, int64_t K) {
    if ((k | 127) < K) return (k & ~(int64_t)127) | ((k & 3) << 5) | ((k & 127) >> 2);
    if ((k | 63) < K) return (k & ~(int64_t)63) | ((k & 1) << 5) | ((k & 63) >> 1);
    return split_position(k);
}

/* v[0:len] (len a multiple of 32) reordered as the 4-bit decoders write their weights */
static void split_even_odd(float *v, int64_t len) {
    for (int64_t b = 0; b < len; b += 32) {
        float t[32];
        memcpy(t, v + b, sizeof(t));
        for (int i = 0; i < 32; i++) v[b + split_position(i)] = t[i];
    }
}

#if VL > 1
/* a 4-bit row (K / 2 bytes) in groups of 2^shift >= 32 inputs, x in the decoders' order (split_even_odd) */
static inline __attribute__((always_inline)) void dot4_fixed(const uint8_t *row, const void *scales, int mx, int shift,
                                                             const float *x, int64_t ldx, int64_t K, int tb,
                                                             float *out) {
    enum { NW = 32 / VL };
    const int u = tb == 1 ? NW : 1; /* independent FMA chains for one token */
    const int64_t G = (int64_t)1 << shift;
    vf acc[TOKENS_PER_READ], part[NW][TOKENS_PER_READ];
    for (int t = 0; t < tb; t++) acc[t] = vzero();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        for (int j = 0; j < u; j++)
            for (int t = 0; t < tb; t++) part[j][t] = vzero();
        for (int64_t c = g0; c < g0 + G; c += 32) {
            vf w[NW];
            v4bit_32(row + c / 2, mx, w);
            for (int j = 0; j < NW; j++)
                for (int t = 0; t < tb; t++)
                    part[j % u][t] = vfma(w[j], vload(x + t * ldx + c + j * VL), part[j % u][t]);
        }
        vf scale = vset1(mx ? E8M0[((const uint8_t *)scales)[g0 >> shift]]
                            : bf16_to_f32(((const uint16_t *)scales)[g0 >> shift]));
        for (int t = 0; t < tb; t++) {
            for (int j = 1; j < u; j++) part[0][t] = vadd(part[0][t], part[j][t]);
            acc[t] = vfma(scale, part[0][t], acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = vsum(acc[t]);
}
#endif

#if defined(AMC_BF16_PAIRS)
static inline float scale4(const void *scales, int mx, int64_t g) {
    return mx ? E8M0[((const uint8_t *)scales)[g]] : bf16_to_f32(((const uint16_t *)scales)[g]);
}
#endif

#if defined(AMC_PAIRS_EMULATED)
/* input k's 4-bit code in a row packed two to a byte, the lower input in the low nibble */
static inline int code4(const uint8_t *row, int64_t k) { return (row[k / 2] >> (4 * (k & 1))) & 0xF; }

/* dot4_pairs below, lane for lane (VDPBF16PS adds a pair's odd product first): lane l of each whole 128 inputs sums,
 * run by run, the pairs at positions 2l, 2l + 1 of the four runs (inputs 8l to 8l + 7), scaled by their group's
 * scale; lane l of a last whole 64 sums the pairs at 2l, 2l + 1 of the even half and of the odd half, scaled by the
 * first 32 inputs' group for l < 8 and the next 32's for l >= 8; a last 32 inputs fill all 16 lanes from one
 * register */
static inline void dot4_pairs(const uint8_t *row, const void *scales, int mx, int shift, const uint16_t *x, int64_t ldx,
                              int64_t K, int tb, float *out) {
    const int u = tb == 1 ? 2 : 1;
    for (int t = 0; t < tb; t++) {
        const uint16_t *xt = x + t * ldx;
        float acc[2][16] = {{0}};
        int64_t c = 0;
        for (int j = 0; c + 128 <= K; c += 128, j ^= u - 1)
            for (int l = 0; l < 16; l++) {
                float sum = 0.0f;
                for (int r = 0; r < 4; r++)
                    for (int i = 1; i >= 0; i--) /* lane 2l + i of run r: input 4 (2l + i) + r */
                        sum += bf16_to_f32(CODES_BF16[mx][code4(row, c + 4 * (2 * l + i) + r)]) *
                               bf16_to_f32(xt[c + 32 * r + 2 * l + i]);
                acc[j][l] = fmaf(sum, scale4(scales, mx, (c + 8 * l) >> shift), acc[j][l]);
            }
        if (c + 64 <= K) {
            const float s0 = scale4(scales, mx, c >> shift), s1 = scale4(scales, mx, (c + 32) >> shift);
            for (int l = 0; l < 16; l++) {
                float sum = 0.0f;
                for (int half = 0; half < 2; half++) /* the even inputs' weights are the low nibbles */
                    for (int i = 1; i >= 0; i--)
                        sum += bf16_to_f32(CODES_BF16[mx][code4(row, c + 2 * (2 * l + i) + half)]) *
                               bf16_to_f32(xt[c + 32 * half + 2 * l + i]);
                acc[0][l] = fmaf(sum, l < 8 ? s0 : s1, acc[0][l]);
            }
            c += 64;
        }
        if (c < K) {
            const float s = scale4(scales, mx, c >> shift);
            for (int l = 0; l < 16; l++) { /* lanes 0-7 the even inputs' pairs, 8-15 the odd ones' */
                float sum = 0.0f;
                for (int i = 1; i >= 0; i--) {
                    const int64_t k = c + 2 * ((2 * l + i) & 15) + (l >= 8);
                    sum += bf16_to_f32(CODES_BF16[mx][code4(row, k)]) * bf16_to_f32(xt[c + 2 * l + i]);
                }
                acc[0][l] = fmaf(sum, s, acc[0][l]);
            }
        }
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += acc[0][l] + acc[1][l];
        out[t] = total;
    }
}

#elif defined(AMC_BF16_PAIRS)
/* lane l: the scale of the group of inputs c + 8l to c + 8l + 7, c a multiple of 128 within a whole 128: mxfp4's four
 * e8m0 codes (groups of 32) from one load, each s as 2^(s - 127), the float bits s << 23 (s = 0: 2^-127, bits
 * 1 << 22; s = 255: infinity, as E8M0 holds it); int4's one,
 * two or four bf16 scales, as many as groups of 2^shift fill 128 inputs */
static inline __attribute__((always_inline)) __m512 scales128(const void *scales, int mx, int shift, int64_t c) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i group = _mm512_srlv_epi32(_mm512_slli_epi32(lane, 3), _mm512_set1_epi32(shift));
    if (mx) {
        uint32_t codes;
        memcpy(&codes, (const uint8_t *)scales + (c >> 5), 4);
        __m512i s = _mm512_srlv_epi32(_mm512_set1_epi32((int)codes), _mm512_slli_epi32(group, 3));
        s = _mm512_slli_epi32(_mm512_and_si512(s, _mm512_set1_epi32(0xFF)), 23);
        return _mm512_castsi512_ps(_mm512_max_epu32(s, _mm512_set1_epi32(1 << 22)));
    }
    const __mmask8 groups = (__mmask8)((1 << (128 >> shift)) - 1);
    const __m128i bf = _mm_maskz_loadu_epi16(groups, (const uint16_t *)scales + (c >> shift));
    const __m512i s = _mm512_permutexvar_epi32(group, _mm512_cvtepu16_epi32(_mm256_castsi128_si256(bf)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
}

/* 128 inputs of a 4-bit row from input c (pair_position's four runs) into acc[t]: 64 bytes of codes read as 32
 * 16-bit lanes, each lane's four nibbles looked up as bf16 (exact; the table twice over, so that the fifth index bit
 * the shift leaves is ignored) and multiplied with the inputs in pairs into float32 by VDPBF16PS, then scaled, one
 * FMA for the four runs: lane l of the sums holds inputs 8l to 8l + 7. */
static inline __attribute__((always_inline)) void pairs4_128(const uint8_t *row, const void *scales, int mx, int shift,
                                                             const uint16_t *x, int64_t ldx, int64_t c, int tb,
                                                             __m512i table, __m512 *acc) {
    const __m512i codes = _mm512_loadu_si512(row + c / 2);
    __m512bh w[4];
    for (int r = 0; r < 4; r++) w[r] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4 * r), table);
    const __m512 scale = scales128(scales, mx, shift, c);
    for (int t = 0; t < tb; t++) {
        const uint16_t *xt = x + t * ldx + c;
        __m512 sum = _mm512_setzero_ps();
        for (int r = 0; r < 4; r++) sum = _mm512_dpbf16_ps(sum, w[r], (__m512bh)_mm512_loadu_si512(xt + 32 * r));
        acc[t] = _mm512_fmadd_ps(sum, scale, acc[t]);
    }
}

/* a 4-bit row against bf16 inputs in pair_position's order: whole 128s by pairs4_128 (one token's alternating
 * between two accumulators, unrolled so that both stay in registers), then a last whole 64 as the 32 even inputs'
 * weights and the 32 odd ones', lanes 0-7 the first 32 inputs' products, 8-15 the next 32's, then a last 32 in one
 * register; mx a constant once inlined */
static inline __attribute__((always_inline)) void dot4_pairs(const uint8_t *row, const void *scales, int mx, int shift,
                                                             const uint16_t *x, int64_t ldx, int64_t K, int tb,
                                                             float *out) {
    const __m512i table = _mm512_loadu_si512(CODES_BF16[mx]), nibble = _mm512_set1_epi16(0xF);
    __m512 acc[TOKENS_PER_READ], odd_blocks[1] = {_mm512_setzero_ps()};
    for (int t = 0; t < tb; t++) acc[t] = _mm512_setzero_ps();
    int64_t c = 0;
    if (tb == 1)
        for (; c + 256 <= K; c += 256) {
            pairs4_128(row, scales, mx, shift, x, ldx, c, 1, table, acc);
            pairs4_128(row, scales, mx, shift, x, ldx, c + 128, 1, table, odd_blocks);
        }
    for (; c + 128 <= K; c += 128) pairs4_128(row, scales, mx, shift, x, ldx, c, tb, table, acc);
    if (c + 64 <= K) {
        __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + c / 2)));
        __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(codes, nibble), table);
        __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
        __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale4(scales, mx, c >> shift)),
                                            _mm512_set1_ps(scale4(scales, mx, (c + 32) >> shift)));
        for (int t = 0; t < tb; t++) {
            const uint16_t *xt = x + t * ldx + c;
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), even, (__m512bh)_mm512_loadu_si512(xt));
            sum = _mm512_dpbf16_ps(sum, odd, (__m512bh)_mm512_loadu_si512(xt + 32));
            acc[t] = _mm512_fmadd_ps(sum, scale, acc[t]);
        }
        c += 64;
    }
    if (c < K) { /* a last 32 inputs: 16 bytes, the even inputs' weights then the odd ones' in one register */
        __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + c / 2)));
        __m512i index = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(codes, _mm256_set1_epi16(0xF))), _mm256_srli_epi16(codes, 4), 1);
        __m512bh w = (__m512bh)_mm512_permutexvar_epi16(index, table);
        __m512 scale = _mm512_set1_ps(scale4(scales, mx, c >> shift));
        for (int t = 0; t < tb; t++) {
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(x + t * ldx + c));
            acc[t] = _mm512_fmadd_ps(sum, scale, acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = _mm512_reduce_add_ps(tb == 1 ? _mm512_add_ps(acc[0], odd_blocks[0]) : acc[t]);
}

#endif
