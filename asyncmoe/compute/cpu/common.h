/*
 * What every part of the CPU kernels shares: the interface with ctypes (kernels.py and worker.py mirror its enums
 * and structs), the formats' scalar definitions (the lookup tables, bf16 / f16 conversions), where a matrix's bytes
 * are in the host store, and the sizes the kernels are tuned to.
 */
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------------------------------------------------------
 * The interface shared with kernels.py and worker.py (ctypes mirrors these structs field by field).
 */

enum { AMC_F32 = 0, AMC_BF16 = 1, AMC_F16 = 2, AMC_FP8 = 3, AMC_MXFP4 = 4, AMC_INT4 = 5 };
enum { AMC_GATE_NONE = 0, AMC_GATE_HALVES = 1, AMC_GATE_GPT_OSS = 2 };
enum { AMC_SILU = 0, AMC_GELU = 1, AMC_GELU_TANH = 2, AMC_RELU = 3, AMC_RELU2 = 4 };
enum {
    AMC_OK = 0,
    AMC_ERR_SEQUENCE = 1,  /* a request number other than the last one + 1; detail: the number expected */
    AMC_ERR_LAYER = 2,     /* a layer index out of range or never registered; detail: the index */
    AMC_ERR_PAIRS = 3,     /* pairs < 0 or above the channel's capacity; detail: pairs */
    AMC_ERR_TOKENS = 4,    /* tokens < 0 or above the channel's capacity; detail: tokens */
    AMC_ERR_TOKEN_ID = 5,  /* a token id outside [0, T); detail: the pair */
    AMC_ERR_EXPERT_ID = 6, /* an expert id outside [-1, E) (-1: skip the pair); detail: the pair */
    AMC_ERR_MEMORY = 7,    /* the workspace could not be allocated */
    AMC_ERR_DESCRIPTOR = 8 /* a layer descriptor the kernels cannot compute; detail: which check failed */
};

/* One weight matrix of every expert, as the host store holds it (contiguous [E, ...]). */
typedef struct {
    const void *weight; /* [E, N, K]; transposed: [E, K, N]; mxfp4 and int4: [E, N, K/2] uint8 */
    const void *scales; /* fp8: float32 [E, ceil(R/block_rows), ceil(Q/block_cols)]; mxfp4: uint8 e8m0 [E, N, K/group];
                           int4: bf16 [E, N, K/group]; dense: NULL */
    const void *bias;   /* [E, N] in bias_format, or NULL */
    int64_t n, k;
    int32_t format, bias_format, transposed;
    int32_t block_rows, block_cols; /* fp8: the scale block of the stored [R, Q]; 4-bit: the group in block_cols */
} amc_matrix;

typedef struct {
    amc_matrix up;   /* gate_up_proj (N = 2I, K = H) or, without a gate, up_proj (N = I) */
    amc_matrix down; /* down_proj (N = H, K = I) */
    int64_t experts;
    int32_t gate, act;
    float alpha, limit; /* GPT-OSS's gate */
} amc_layer;

/* mxfp4 code -> value: e2m1, the sign in bit 3 */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---------------------------------------------------------------------------------------------------------------
 * Scalar conversions: the tails of vector loops, biases, and the scalar build.
 */

static float E4M3[256];  /* fp8 e4m3fn code -> float */
static float E8M0[256];  /* mxfp4 scale code s -> 2^(s - 127), as formats.dequantize_mxfp4's ldexp */
static uint16_t CODES_BF16[2][32]; /* 4-bit code -> its unscaled value as bf16 (exact): [0] int4, [1] mxfp4; twice */
static uint16_t SUBNORMAL_BF16[32]; /* e4m3 magnitude m < 8 (exponent 0) -> m * 2^-9 as bf16 (exact) */
static uint8_t E4M3_BF16_BYTES[2][128]; /* e4m3 magnitude -> [0] the low, [1] the high byte of its bf16 (exact) */

__attribute__((constructor)) static void build_tables(void) {
    for (int b = 0; b < 256; b++) {
        int exponent = (b >> 3) & 0xF, mantissa = b & 7;
        float v = exponent ? ldexpf((float)(8 + mantissa), exponent - 10) : ldexpf((float)mantissa, -9);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = (b & 0x80) ? -v : v;
        E8M0[b] = ldexpf(1.0f, b - 127);
    }
    for (int m = 0; m < 128; m++) {
        uint32_t u;
        memcpy(&u, &E4M3[m], 4);
        const uint16_t h = m == 0x7F ? 0x7FC0 : (uint16_t)(u >> 16);
        if (m < 8) SUBNORMAL_BF16[m] = h;
        E4M3_BF16_BYTES[0][m] = (uint8_t)h, E4M3_BF16_BYTES[1][m] = (uint8_t)(h >> 8);
    }
    for (int c = 0; c < 32; c++) {
        float v[2] = {(float)((c & 0xF) - 8), E2M1[c & 0xF]};
        for (int mx = 0; mx < 2; mx++) {
            uint32_t u;
            memcpy(&u, &v[mx], 4);
            CODES_BF16[mx][c] = (uint16_t)(u >> 16);
        }
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bf16, rounded to nearest even as torch rounds; NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float v;
    if (exponent == 0) v = ldexpf((float)mantissa, -24); /* zero and subnormals */
    else if (exponent == 31) v = mantissa ? NAN : INFINITY;
    else v = ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (h & 0x8000) ? -v : v;
}

/* element i of a dense f32 / bf16 / f16 array */
static inline float dense_at(const void *p, int32_t format, int64_t i) {
    switch (format) {
    case AMC_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case AMC_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * Where a matrix's bytes are: stored rows R x columns Q, per expert.
 */

static inline int is_4bit(const amc_matrix *m) { return m->format == AMC_MXFP4 || m->format == AMC_INT4; }

static inline int64_t stored_rows(const amc_matrix *m) { return m->transposed ? m->k : m->n; }
static inline int64_t stored_cols(const amc_matrix *m) { return m->transposed ? m->n : m->k; }

static int64_t format_bytes(int32_t format) {
    return format == AMC_F32 ? 4 : (format == AMC_BF16 || format == AMC_F16) ? 2 : 1;
}

static inline int64_t row_bytes(const amc_matrix *m) {
    return is_4bit(m) ? m->k / 2 : stored_cols(m) * format_bytes(m->format);
}

static inline const uint8_t *expert_weight(const amc_matrix *m, int64_t e) {
    return (const uint8_t *)m->weight + e * stored_rows(m) * row_bytes(m);
}

static inline const uint8_t *expert_scales(const amc_matrix *m, int64_t e) {
    int64_t bytes;
    if (m->format == AMC_FP8)
        bytes = cdiv(stored_rows(m), m->block_rows) * cdiv(stored_cols(m), m->block_cols) * 4;
    else
        bytes = m->n * (m->k / m->block_cols) * (m->format == AMC_INT4 ? 2 : 1);
    return (const uint8_t *)m->scales + e * bytes;
}

/* the scales of stored row n (a [N, K] matrix) of expert e: fp8's, one float a block of columns */
static inline const float *fp8_row_scales(const amc_matrix *m, int64_t e, int64_t n) {
    return (const float *)expert_scales(m, e) + (n / m->block_rows) * cdiv(m->k, m->block_cols);
}

/* ... a 4-bit format's, one a group of 2^group_shift(m) inputs (uint8 e8m0 for mxfp4, bf16 for int4) */
static inline int group_shift(const amc_matrix *m) { return __builtin_ctzll((unsigned long long)m->block_cols); }
static inline const uint8_t *group_scales(const amc_matrix *m, int64_t e, int64_t n) {
    return expert_scales(m, e) + n * (m->k >> group_shift(m)) * (m->format == AMC_MXFP4 ? 1 : 2);
}

/* bytes one expert of `m` occupies in the host store: weights, scales and bias */
static int64_t matrix_bytes(const amc_matrix *m) {
    int64_t bytes = stored_rows(m) * row_bytes(m);
    if (m->scales) bytes += expert_scales(m, 1) - expert_scales(m, 0);
    if (m->bias) bytes += m->n * format_bytes(m->bias_format);
    return bytes;
}

#define SEGMENT 2048      /* values of a stored row decoded at a time: an 8 KB buffer per thread, in L1 */
#define TOKENS_PER_READ 8 /* tokens multiplied by each decoded weight vector while it is in registers */
