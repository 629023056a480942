/*
 * The dense formats' kernels (f32, bf16, f16), and the dot over decoded float32 weights every stored row that does
 * not take a fused path goes through: decode_* write a run of stored weights as float32, dot_fixed multiplies them
 * with TOKENS_PER_READ tokens at a time, dot16_pairs multiplies bf16 weights with bf16 inputs in pairs.
 */
#pragma once
#include "isa.h"

static void decode_bf16(const uint16_t *src, int64_t len, float *dst) {
    int64_t i = 0;
#if VL > 1
    for (; i + VL <= len; i += VL) vstore(dst + i, vbf16(src + i));
#endif
    for (; i < len; i++) dst[i] = bf16_to_f32(src[i]);
}

static void decode_f16(const uint16_t *src, int64_t len, float *dst) {
    int64_t i = 0;
#if VL > 1
    for (; i + VL <= len; i += VL) vstore(dst + i, vf16(src + i));
#endif
    for (; i < len; i++) dst[i] = f16_to_f32(src[i]);
}

/* The loop of the float32 dots (dot_fixed, dot8_fixed's blocks), written once and expanded in each: declares k and,
 * over the whole VLs of [start, end), makes sum_j acc[j][t] = sum_k LOAD(k) x[t * ldx + k] for t < tb, j < CHAINS(tb);
 * k ends where they stop. LOAD(i): the VL weights from input i as float32, written `base + i` (unparenthesised, so the
 * address adds as the loops always wrote it). Each token keeps CHAINS(tb) partial sums, so that at least four FMA
 * chains are in flight even for one token (a single chain waits out the FMA's latency at every step, slower than a
 * thread's share of DRAM bandwidth for 4-bit). A macro, not an inline function taking the load: the function compiled
 * to other machine code (docs/decisions.md#one-loop-for-the-float32-dots). */
#define CHAINS(tb) ((tb) == 1 ? 4 : (tb) == 2 ? 2 : 1)
#define DOT_CHAINS(LOAD, acc, x, ldx, k, start, end, tb)                                                              \
    for (int j = 0; j < CHAINS(tb); j++)                                                                               \
        for (int t = 0; t < (tb); t++) acc[j][t] = vzero();                                                            \
    int64_t k = (start);                                                                                               \
    for (; k + CHAINS(tb) * VL <= (end); k += CHAINS(tb) * VL)                                                         \
        for (int j = 0; j < CHAINS(tb); j++) {                                                                         \
            vf w_ = LOAD(k + j * VL);                                                                                  \
            for (int t = 0; t < (tb); t++) acc[j][t] = vfma(w_, vload((x) + t * (ldx) + k + j * VL), acc[j][t]);       \
        }                                                                                                              \
    for (; k + VL <= (end); k += VL) {                                                                                 \
        vf w_ = LOAD(k);                                                                                               \
        for (int t = 0; t < (tb); t++) acc[0][t] = vfma(w_, vload((x) + t * (ldx) + k), acc[0][t]);                    \
    }

/* out[t] = sum_k w[k] x[t * ldx + k] for t < tb; tb a constant once inlined, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void dot_fixed(const float *w, const float *x, int64_t ldx, int64_t len,
                                                            int tb, float *out) {
    vf acc[4][TOKENS_PER_READ];
#define LOAD_F32(i) vload(w + i)
    DOT_CHAINS(LOAD_F32, acc, x, ldx, k, 0, len, tb);
#undef LOAD_F32
    for (int t = 0; t < tb; t++) {
        for (int j = 1; j < CHAINS(tb); j++) acc[0][t] = vadd(acc[0][t], acc[j][t]);
        float s = vsum(acc[0][t]);
        for (int64_t j = k; j < len; j++) s += w[j] * x[t * ldx + j];
        out[t] = s;
    }
}

#if defined(AMC_PAIRS_EMULATED)
/* weight k of a row, as float32: how pairs_lanes reads a row's format */
typedef float (*weight_fn)(const void *row, int64_t k);

/* The loop of the emulated pairs dots (dot16_pairs, dot8_pairs' blocks), VDPBF16PS's order for one token: lane l of
 * acc, for each whole 32 of [k, end), adds the products at 2l + 1 and 2l; returns where the whole 32s stop */
static inline __attribute__((always_inline)) int64_t pairs_lanes(weight_fn weight, const void *row, const uint16_t *xt,
                                                                 int64_t k, int64_t end, float *acc) {
    for (; k + 32 <= end; k += 32)
        for (int l = 0; l < 16; l++) {
            acc[l] += weight(row, k + 2 * l + 1) * bf16_to_f32(xt[k + 2 * l + 1]);
            acc[l] += weight(row, k + 2 * l) * bf16_to_f32(xt[k + 2 * l]);
        }
    return k;
}

static inline float weight_bf16(const void *row, int64_t k) { return bf16_to_f32(((const uint16_t *)row)[k]); }

/* dot16_pairs below, lane for lane: each 32 inputs by pairs_lanes; the last K % 32 inputs one by one */
static inline void dot16_pairs(const uint16_t *row, const uint16_t *x, int64_t ldx, int64_t K, int tb, float *out) {
    for (int t = 0; t < tb; t++) {
        const uint16_t *xt = x + t * ldx;
        float acc[16] = {0};
        int64_t k = pairs_lanes(weight_bf16, row, xt, 0, K, acc);
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += acc[l];
        for (; k < K; k++) total += bf16_to_f32(row[k]) * bf16_to_f32(xt[k]);
        out[t] = total;
    }
}

/* dot16_pairs of two rows */
static inline void dot16_pairs2(const uint16_t *r0, const uint16_t *r1, const uint16_t *x, int64_t ldx, int64_t K,
                                int tb, float *out0, float *out1) {
    dot16_pairs(r0, x, ldx, K, tb, out0);
    dot16_pairs(r1, x, ldx, K, tb, out1);
}
#elif defined(AMC_BF16_PAIRS)
/* a bf16 row against bf16 inputs in their own order: 32 weights a load, no decoding, into float32 by VDPBF16PS;
 * `u` chains for one or two tokens; the last K % 32 inputs one by one */
static inline __attribute__((always_inline)) void dot16_pairs(const uint16_t *row, const uint16_t *x, int64_t ldx,
                                                              int64_t K, int tb, float *out) {
    const int u = tb == 1 ? 4 : tb == 2 ? 2 : 1;
    __m512 acc[4][TOKENS_PER_READ];
    for (int j = 0; j < u; j++)
        for (int t = 0; t < tb; t++) acc[j][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * u <= K; k += 32 * u)
        for (int j = 0; j < u; j++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512(row + k + 32 * j);
            for (int t = 0; t < tb; t++)
                acc[j][t] = _mm512_dpbf16_ps(acc[j][t], w, (__m512bh)_mm512_loadu_si512(x + t * ldx + k + 32 * j));
        }
    for (; k + 32 <= K; k += 32) {
        __m512bh w = (__m512bh)_mm512_loadu_si512(row + k);
        for (int t = 0; t < tb; t++)
            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w, (__m512bh)_mm512_loadu_si512(x + t * ldx + k));
    }
    for (int t = 0; t < tb; t++) {
        for (int j = 1; j < u; j++) acc[0][t] = _mm512_add_ps(acc[0][t], acc[j][t]);
        float s = _mm512_reduce_add_ps(acc[0][t]);
        for (int64_t i = k; i < K; i++) s += bf16_to_f32(row[i]) * bf16_to_f32(x[t * ldx + i]);
        out[t] = s;
    }
}

/* dot16_pairs of two rows at once, for tb >= 3 (one chain a token, as there): every input vector loaded once for
 * both rows, so that a token block's loads feed twice the products; each row's sums bit for bit dot16_pairs' */
static inline __attribute__((always_inline)) void dot16_pairs2(const uint16_t *r0, const uint16_t *r1,
                                                               const uint16_t *x, int64_t ldx, int64_t K, int tb,
                                                               float *out0, float *out1) {
    __m512 a0[TOKENS_PER_READ], a1[TOKENS_PER_READ];
    for (int t = 0; t < tb; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(r0 + k), w1 = (__m512bh)_mm512_loadu_si512(r1 + k);
        for (int t = 0; t < tb; t++) {
            __m512bh xt = (__m512bh)_mm512_loadu_si512(x + t * ldx + k);
            a0[t] = _mm512_dpbf16_ps(a0[t], w0, xt);
            a1[t] = _mm512_dpbf16_ps(a1[t], w1, xt);
        }
    }
    for (int t = 0; t < tb; t++) {
        float s0 = _mm512_reduce_add_ps(a0[t]), s1 = _mm512_reduce_add_ps(a1[t]);
        for (int64_t i = k; i < K; i++) {
            s0 += bf16_to_f32(r0[i]) * bf16_to_f32(x[t * ldx + i]);
            s1 += bf16_to_f32(r1[i]) * bf16_to_f32(x[t * ldx + i]);
        }
        out0[t] = s0, out1[t] = s1;
    }
}
#endif
