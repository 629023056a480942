/*
 * Projections: y[t, n] = sum_k w_e[n, k] x[t, k] (+ bias) for n in [n0, n1) and every token t of one expert, each
 * stored row sent to its format's kernel (kernels_*.h): fused, in bf16 pairs, or decoded a SEGMENT at a time; rows
 * [N, K] streamed one after another, transposed [K, N] ones a tile of columns at a time.
 */
#pragma once
#include "kernels_4bit.h"
#include "kernels_dense.h"
#include "kernels_fp8.h"

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* how far ahead of the row being read a thread asks for its weights */
#endif
#define TILE 512            /* columns of a transposed matrix accumulated at a time */
#define ROWS_PER_PASS 4     /* rows of a transposed matrix added into the outputs per pass over them */
_Static_assert(ROWS_PER_PASS * TILE <= SEGMENT, "a transposed pass decodes its rows into one decode buffer");

/* whether an fp8 matrix in pairs takes dot8_pairs' runs: its blocks whole 64s */
static inline int fp8_runs(const amc_matrix *m) {
#if defined(AMC_FP8_RUNS)
    return m->format == AMC_FP8 && m->block_cols % 64 == 0;
#else
    (void)m;
    return 0;
#endif
}

/* where input k of m sits among its pairs path's bf16 inputs */
static inline int64_t input_position(const amc_matrix *m, int64_t k) {
    if (is_4bit(m)) return pair_position(k, m->k);
    return fp8_runs(m) ? fp8_position(k, m->k) : k;
}

/* Stored row r of expert e, columns [c0, c0 + len) (len <= SEGMENT), as float32: in `buf`, or the weights
 * themselves when they are float32. */
static const float *stored_row(const amc_matrix *m, int64_t e, int64_t r, int64_t c0, int64_t len, float *buf) {
    const uint8_t *row = expert_weight(m, e) + r * row_bytes(m);
    switch (m->format) {
    case AMC_F32: return (const float *)row + c0;
    case AMC_BF16: decode_bf16((const uint16_t *)row + c0, len, buf); return buf;
    case AMC_F16: decode_f16((const uint16_t *)row + c0, len, buf); return buf;
    case AMC_FP8: { /* one scale per (block_rows, block_cols) block: runs split at block edges */
        const int64_t blocks_per_row = cdiv(stored_cols(m), m->block_cols);
        const float *scales = (const float *)expert_scales(m, e) + (r / m->block_rows) * blocks_per_row;
        for (int64_t c = c0; c < c0 + len;) {
            int64_t end = min64(c0 + len, (c / m->block_cols + 1) * m->block_cols);
            decode_fp8(row + c, end - c, scales[c / m->block_cols], buf + (c - c0));
            c = end;
        }
        return buf;
    }
    case AMC_MXFP4: {
        decode_mxfp4(row + c0 / 2, group_scales(m, e, r) + c0 / 32, len, buf);
        return buf;
    }
    default: { /* AMC_INT4 */
        const uint16_t *scales = (const uint16_t *)group_scales(m, e, r);
        decode_int4(row + c0 / 2, scales + c0 / m->block_cols, m->block_cols, len, buf);
        return buf;
    }
    }
}

#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 3 /* __builtin_prefetch's: into every cache level (prefetcht0) */
#endif

/* ask for the cache lines of [p, p + bytes) */
static inline void prefetch(const uint8_t *p, int64_t bytes) {
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)(p + bytes); a += 64)
        __builtin_prefetch((const void *)a, 0, PREFETCH_LOCALITY);
}

#define DISPATCH_TOKENS(call)                                                                                          \
    switch (tb) {                                                                                                      \
    case 1: call(1); break;                                                                                            \
    case 2: call(2); break;                                                                                            \
    case 3: call(3); break;                                                                                            \
    case 4: call(4); break;                                                                                            \
    case 5: call(5); break;                                                                                            \
    case 6: call(6); break;                                                                                            \
    case 7: call(7); break;                                                                                            \
    default: call(8); break;                                                                                           \
    }

static void dot_tokens(const float *w, const float *x, int64_t ldx, int64_t len, int tb, float *out) {
#define DOT(TB) dot_fixed(w, x, ldx, len, TB, out)
    DISPATCH_TOKENS(DOT)
#undef DOT
}

#if defined(AMC_BF16_PAIRS)
/* out[t] for row n of expert e of a matrix that takes pairs, inputs in bf16 (input_position's order), tb tokens */
static void dot_row_pairs(const amc_matrix *m, int64_t e, int64_t n, const uint16_t *x, int64_t ldx, int tb,
                          float *out) {
    const int64_t K = m->k;
    const uint8_t *row = expert_weight(m, e) + n * row_bytes(m);
    if (m->format == AMC_BF16) {
#define PAIRS16(TB) dot16_pairs((const uint16_t *)row, x, ldx, K, TB, out)
        DISPATCH_TOKENS(PAIRS16)
#undef PAIRS16
        return;
    }
    if (m->format == AMC_FP8) {
        const float *scales = fp8_row_scales(m, e, n);
#define PAIRS8(TB) dot8_pairs(row, scales, m->block_cols, fp8_runs(m), x, ldx, K, TB, out)
        DISPATCH_TOKENS(PAIRS8)
#undef PAIRS8
        return;
    }
    const int shift = group_shift(m);
    const uint8_t *scales = group_scales(m, e, n);
#define PAIRS_MXFP4(TB) dot4_pairs(row, scales, 1, shift, x, ldx, K, TB, out)
#define PAIRS_INT4(TB) dot4_pairs(row, scales, 0, shift, x, ldx, K, TB, out)
    if (m->format == AMC_MXFP4) DISPATCH_TOKENS(PAIRS_MXFP4)
    else DISPATCH_TOKENS(PAIRS_INT4)
#undef PAIRS_MXFP4
#undef PAIRS_INT4
}
#endif

#if VL > 1
/* Whether rows of `m` take the fused path: fp8, mxfp4, and int4 in groups of at least 32, stored [N, K] */
static int fused(const amc_matrix *m) {
    if (m->transposed) return 0;
    return m->format == AMC_FP8 || m->format == AMC_MXFP4 || (m->format == AMC_INT4 && m->block_cols >= 32);
}

/* out[t] for row n of expert e of a fused matrix, tb tokens */
static void dot_row_fused(const amc_matrix *m, int64_t e, int64_t n, const float *x, int64_t ldx, int tb, float *out) {
    const uint8_t *row = expert_weight(m, e) + n * row_bytes(m);
    const int64_t K = m->k;
    if (m->format == AMC_FP8) {
        const float *scales = fp8_row_scales(m, e, n);
#define DOT8(TB) dot8_fixed(row, scales, m->block_cols, x, ldx, K, TB, out)
        DISPATCH_TOKENS(DOT8)
#undef DOT8
        return;
    }
    const int mx = m->format == AMC_MXFP4, shift = group_shift(m);
    const uint8_t *scales = group_scales(m, e, n);
#define DOT4(TB) dot4_fixed(row, scales, mx, shift, x, ldx, K, TB, out)
    DISPATCH_TOKENS(DOT4)
#undef DOT4
}
#else
static int fused(const amc_matrix *m) {
    (void)m;
    return 0;
}
static void dot_row_fused(const amc_matrix *m, int64_t e, int64_t n, const float *x, int64_t ldx, int tb, float *out) {
    (void)m, (void)e, (void)n, (void)x, (void)ldx, (void)tb, (void)out;
}
#endif

/* Whether `m`, given bf16 inputs, is multiplied in bf16 pairs on a build with AVX512-BF16: a fused 4-bit matrix
 * (dot4_pairs), or one stored [N, K] in bf16 (dot16_pairs) or in fp8 with blocks of whole 32s (dot8_pairs) */
static int takes_pairs(const amc_matrix *m) {
#if defined(AMC_BF16_PAIRS)
    if (m->transposed) return 0;
    return is_4bit(m) ? fused(m) : m->format == AMC_BF16 || (m->format == AMC_FP8 && m->block_cols % 32 == 0);
#else
    (void)m;
    return 0;
#endif
}
#if !defined(AMC_BF16_PAIRS)
static void dot_row_pairs(const amc_matrix *m, int64_t e, int64_t n, const uint16_t *x, int64_t ldx, int tb,
                          float *out) { /* never called: no matrix takes pairs */
    (void)m, (void)e, (void)n, (void)x, (void)ldx, (void)tb, (void)out;
}
#endif

/* y[0:len] += sum_r a[r] * w[r][0:len] over `rows` rows: the outputs are loaded and stored once per pass */
static inline void axpy_rows(float *y, const float *a, const float *const *w, int rows, int64_t len) {
    int64_t i = 0;
    if (rows == ROWS_PER_PASS) {
        vf a0 = vset1(a[0]), a1 = vset1(a[1]), a2 = vset1(a[2]), a3 = vset1(a[3]);
        for (; i + VL <= len; i += VL) {
            vf acc = vfma(a0, vload(w[0] + i), vload(y + i));
            acc = vfma(a1, vload(w[1] + i), acc);
            acc = vfma(a2, vload(w[2] + i), acc);
            vstore(y + i, vfma(a3, vload(w[3] + i), acc));
        }
    }
    for (; i < len; i++)
        for (int r = 0; r < rows; r++) y[i] += a[r] * w[r][i];
}

#if defined(AMC_BF16_PAIRS)
#define PAIRED_ROWS_FROM 16 /* tokens from which bf16 rows in pairs take two rows a pass over the inputs */

/* rows n and n + 1 of a bf16 matrix in pairs, every token: dot16_pairs2 a block of tokens. Not inlined, so that
 * project_rows' other paths compile as they would without it. */
static __attribute__((noinline)) void two_rows_pairs(const amc_matrix *m, int64_t e, int64_t n, const uint16_t *xb,
                                                     int64_t tokens, float *y, int64_t ldy) {
    const int64_t K = m->k;
    const uint16_t *r0 = (const uint16_t *)(expert_weight(m, e) + n * row_bytes(m)), *r1 = r0 + K;
    for (int64_t t0 = 0; t0 < tokens; t0 += TOKENS_PER_READ) {
        float p0[TOKENS_PER_READ], p1[TOKENS_PER_READ];
        int tb = (int)min64(TOKENS_PER_READ, tokens - t0);
        if (tb >= 3) {
#define PAIRS16X2(TB) dot16_pairs2(r0, r1, xb + t0 * K, K, K, TB, p0, p1)
            DISPATCH_TOKENS(PAIRS16X2)
#undef PAIRS16X2
        } else {
            dot_row_pairs(m, e, n, xb + t0 * K, K, tb, p0);
            dot_row_pairs(m, e, n + 1, xb + t0 * K, K, tb, p1);
        }
        for (int t = 0; t < tb; t++) y[(t0 + t) * ldy + n] = p0[t], y[(t0 + t) * ldy + n + 1] = p1[t];
    }
}
#endif

/* [N, K] rows per output: rows n0..n1 of an expert are one contiguous stream, each row decoded once (a segment at a
 * time) and multiplied by every token, TOKENS_PER_READ at a time. */
static void project_rows(const amc_matrix *m, int64_t e, int64_t n0, int64_t n1, const float *x, const uint16_t *xb,
                         int64_t tokens, float *y, int64_t ldy, float *buf) {
    const int64_t K = m->k, stride = row_bytes(m);
    const uint8_t *first = expert_weight(m, e) + n0 * stride, *end = expert_weight(m, e) + n1 * stride;
    const int in_registers = xb || fused(m);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ahead = first + (n - n0) * stride + PREFETCH_BYTES;
#if defined(AMC_BF16_PAIRS)
        if (xb && m->format == AMC_BF16 && tokens >= PAIRED_ROWS_FROM && n + 1 < n1) {
            ahead += stride; /* as far ahead of the second row */
            if (ahead < end) prefetch(ahead, min64(2 * stride, end - ahead));
            two_rows_pairs(m, e, n, xb, tokens, y, ldy);
            n++;
            continue;
        }
#endif
        if (ahead < end) prefetch(ahead, min64(stride, end - ahead));
        if (in_registers) {
            for (int64_t t0 = 0; t0 < tokens; t0 += TOKENS_PER_READ) {
                float part[TOKENS_PER_READ];
                int tb = (int)min64(TOKENS_PER_READ, tokens - t0);
                if (xb) dot_row_pairs(m, e, n, xb + t0 * K, K, tb, part);
                else dot_row_fused(m, e, n, x + t0 * K, K, tb, part);
                for (int t = 0; t < tb; t++) y[(t0 + t) * ldy + n] = part[t];
            }
            continue;
        }
        for (int64_t t = 0; t < tokens; t++) y[t * ldy + n] = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += SEGMENT) {
            int64_t len = min64(SEGMENT, K - k0);
            const float *w = stored_row(m, e, n, k0, len, buf);
            for (int64_t t0 = 0; t0 < tokens; t0 += TOKENS_PER_READ) {
                float part[TOKENS_PER_READ];
                int tb = (int)min64(TOKENS_PER_READ, tokens - t0);
                dot_tokens(w, x + t0 * K + k0, K, len, tb, part);
                for (int t = 0; t < tb; t++) y[(t0 + t) * ldy + n] += part[t];
            }
        }
    }
}

/* [K, N] rows per input: columns n0..n1 of each input row k, decoded once and added, times x[t, k], into every
 * token's outputs, ROWS_PER_PASS rows at a time; rows a few KB ahead are prefetched, as the hardware does not follow
 * this strided stream. */
static void project_cols(const amc_matrix *m, int64_t e, int64_t n0, int64_t n1, const float *x, int64_t tokens,
                         float *y, int64_t ldy, float *buf) {
    const int64_t K = m->k, stride = row_bytes(m), bytes = format_bytes(m->format);
    const uint8_t *weights = expert_weight(m, e);
    for (int64_t c0 = n0; c0 < n1; c0 += TILE) {
        int64_t len = min64(TILE, n1 - c0), ahead = max64(1, PREFETCH_BYTES / (len * bytes));
        for (int64_t t = 0; t < tokens; t++) memset(y + t * ldy + c0, 0, len * sizeof(float));
        for (int64_t k = 0; k < K; k += ROWS_PER_PASS) {
            const int rows = (int)min64(ROWS_PER_PASS, K - k);
            const float *w[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) {
                if (k + r + ahead < K) prefetch(weights + (k + r + ahead) * stride + c0 * bytes, len * bytes);
                w[r] = stored_row(m, e, k + r, c0, len, buf + r * TILE);
            }
            for (int64_t t = 0; t < tokens; t++) axpy_rows(y + t * ldy + c0, x + t * K + k, w, rows, len);
        }
    }
}

/* ... from x [tokens, K] float32 (in split_position's order for a 4-bit m), or from xb (input_position's order, bf16)
 * where it is not NULL, which only a matrix that takes `pairs` is given */
static void project(const amc_matrix *m, int64_t e, int64_t n0, int64_t n1, const float *x, const uint16_t *xb,
                    int64_t tokens, float *y, int64_t ldy, float *buf) {
    if (n0 >= n1) return;
    if (m->transposed) project_cols(m, e, n0, n1, x, tokens, y, ldy, buf);
    else project_rows(m, e, n0, n1, x, xb, tokens, y, ldy, buf);
    if (!m->bias) return;
    for (int64_t n = n0; n < n1; n++) {
        float b = dense_at(m->bias, m->bias_format, e * m->n + n);
        for (int64_t t = 0; t < tokens; t++) y[t * ldy + n] += b;
    }
}

/* Outputs n0..n1 of a projection, in multiples that keep threads off each other's cache lines: 16 float32 outputs,
 * or a transposed row's 64 bytes. */
static int64_t split_align(const amc_matrix *m) {
    return m->transposed ? max64(16, 64 / format_bytes(m->format)) : 16;
}
