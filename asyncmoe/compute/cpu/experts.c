/*
 * asyncmoe's CPU expert kernels and the request worker: the host as a second executor.
 *
 * The expert MLP of a set of (token, expert) pairs, computed from the host store where the experts live:
 *     out[p] = down_e(gate(up_e(x[t])))     for pair p = (t, e)
 * in float32 accumulation, for every format of asyncmoe/formats.py (dense f32/bf16/f16 in either layout, fp8
 * block-wise in either layout, mxfp4 and int4 stored [N, K/2]). With bf16 inputs the activation between the
 * projections is rounded to bf16, as the model computes it, and where the host has AVX512-BF16 weights stored
 * [N, K] are multiplied with bf16 inputs in pairs (dot4_pairs, dot16_pairs, dot8_pairs). Pairs are grouped by expert
 * so that each weight is read once for all of its tokens; each projection is split over output rows across a
 * persistent thread pool, so that one token uses every thread (at batch 1 the work is a stream of weights from
 * DRAM).
 *
 * The worker is a C thread that polls a request block in (pinned) host memory, written by the GPU inside a
 * captured decode step: it never takes the Python GIL and never calls the CUDA driver.
 *
 * Dims: E experts, T tokens, P pairs, H hidden, I intermediate; a projection maps K inputs to N outputs, stored
 * as R rows of Q columns ([N, K], or [K, N] when transposed).
 * Plain-torch definitions of the same math: reference.py; the ctypes side: kernels.py and worker.py.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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

/* ---------------------------------------------------------------------------------------------------------------
 * Vector primitives: VL floats at a time, AVX-512 where the compiler targets it, else AVX2, else scalar.
 */

#if defined(__AVX512F__) && !defined(AMC_SCALAR)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMC_BF16_PAIRS 1 /* 4-bit weights times bf16 inputs in pairs (VDPBF16PS): dot4_pairs below */
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
 * Decoding a run of stored weights to float32: `len` values, scaled as their format says.
 */

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

static void decode_fp8(const uint8_t *src, int64_t len, float scale, float *dst) {
    int64_t i = 0;
#if VL > 1
    vf s = vset1(scale);
    for (; i + VL <= len; i += VL) vstore(dst + i, vmul(vfp8(src + i), s));
#endif
    for (; i < len; i++) dst[i] = E4M3[src[i]] * scale;
}

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

/* where input k of K sits for dot8_pairs in blocks of whole 64s: each whole 64 as two runs of 32, run h lane 8L + i
 * holding input 16L + 8h + i (the 16-bit lanes that interleaving the low and the high bytes of 64 decoded codes
 * makes, 128 bits at a time); a last part of 64 in its own order */
static inline int64_t fp8_position(int64_t k, int64_t K) {
    if ((k | 63) >= K) return k;
    return (k & ~(int64_t)63) | (((k >> 3) & 1) << 5) | (((k >> 4) & 3) << 3) | (k & 7);
}

/* v[0:len] (len a multiple of 32) reordered as the 4-bit decoders write their weights */
static void split_even_odd(float *v, int64_t len) {
    for (int64_t b = 0; b < len; b += 32) {
        float t[32];
        memcpy(t, v + b, sizeof(t));
        for (int i = 0; i < 32; i++) v[b + split_position(i)] = t[i];
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * Where a matrix's bytes are: stored rows R x columns Q, per expert.
 */

static inline int is_4bit(const amc_matrix *m) { return m->format == AMC_MXFP4 || m->format == AMC_INT4; }

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

#define SEGMENT 2048 /* values of a stored row decoded at a time: an 8 KB buffer per thread, in L1 */

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

/* ---------------------------------------------------------------------------------------------------------------
 * Projections: y[t, n] = sum_k w_e[n, k] x[t, k] (+ bias) for n in [n0, n1) and every token t of one expert.
 */

#define TOKENS_PER_READ 8   /* tokens multiplied by each decoded weight vector while it is in registers */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* how far ahead of the row being read a thread asks for its weights */
#endif
#define TILE 512            /* columns of a transposed matrix accumulated at a time */
#define ROWS_PER_PASS 4     /* rows of a transposed matrix added into the outputs per pass over them */
_Static_assert(ROWS_PER_PASS * TILE <= SEGMENT, "a transposed pass decodes its rows into one decode buffer");

/* out[t] = sum_k w[k] x[t * ldx + k] for t < tb; tb a constant once inlined, so the accumulators stay in registers.
 * Each token keeps `u` partial sums, so that at least four FMA chains are in flight even for one token (a single
 * chain waits out the FMA's latency at every step, slower than a thread's share of DRAM bandwidth for 4-bit). */
static inline __attribute__((always_inline)) void dot_fixed(const float *w, const float *x, int64_t ldx, int64_t len,
                                                            int tb, float *out) {
    const int u = tb == 1 ? 4 : tb == 2 ? 2 : 1;
    vf acc[4][TOKENS_PER_READ];
    for (int j = 0; j < u; j++)
        for (int t = 0; t < tb; t++) acc[j][t] = vzero();
    int64_t k = 0;
    for (; k + u * VL <= len; k += u * VL) {
        for (int j = 0; j < u; j++) {
            vf wv = vload(w + k + j * VL);
            for (int t = 0; t < tb; t++) acc[j][t] = vfma(wv, vload(x + t * ldx + k + j * VL), acc[j][t]);
        }
    }
    for (; k + VL <= len; k += VL) {
        vf wv = vload(w + k);
        for (int t = 0; t < tb; t++) acc[0][t] = vfma(wv, vload(x + t * ldx + k), acc[0][t]);
    }
    for (int t = 0; t < tb; t++) {
        for (int j = 1; j < u; j++) acc[0][t] = vadd(acc[0][t], acc[j][t]);
        float s = vsum(acc[0][t]);
        for (int64_t j = k; j < len; j++) s += w[j] * x[t * ldx + j];
        out[t] = s;
    }
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

#if VL > 1
/* Fused decode and dot over one whole stored row, the decoded weights never leaving registers, each group's (or
 * block's) scale applied once to its partial sums: out[t] = sum_k w[k] x[t * ldx + k] for t < tb. */

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

/* an fp8 row of K bytes whose scales change every B inputs */
static inline __attribute__((always_inline)) void dot8_fixed(const uint8_t *row, const float *scales, int64_t B,
                                                             const float *x, int64_t ldx, int64_t K, int tb,
                                                             float *out) {
    const int u = tb == 1 ? 4 : tb == 2 ? 2 : 1;
    vf acc[TOKENS_PER_READ], part[4][TOKENS_PER_READ];
    float tail[TOKENS_PER_READ] = {0};
    for (int t = 0; t < tb; t++) acc[t] = vzero();
    for (int64_t b0 = 0; b0 < K; b0 += B) {
        const int64_t end = min64(K, b0 + B);
        const float scale = scales[b0 / B];
        for (int j = 0; j < u; j++)
            for (int t = 0; t < tb; t++) part[j][t] = vzero();
        int64_t k = b0;
        for (; k + u * VL <= end; k += u * VL)
            for (int j = 0; j < u; j++) {
                vf w = vfp8(row + k + j * VL);
                for (int t = 0; t < tb; t++) part[j][t] = vfma(w, vload(x + t * ldx + k + j * VL), part[j][t]);
            }
        for (; k + VL <= end; k += VL) {
            vf w = vfp8(row + k);
            for (int t = 0; t < tb; t++) part[0][t] = vfma(w, vload(x + t * ldx + k), part[0][t]);
        }
        for (int t = 0; t < tb; t++) {
            for (int j = 1; j < u; j++) part[0][t] = vadd(part[0][t], part[j][t]);
            acc[t] = vfma(vset1(scale), part[0][t], acc[t]);
            float rest = 0.0f;
            for (int64_t i = k; i < end; i++) rest += E4M3[row[i]] * x[t * ldx + i];
            tail[t] += scale * rest;
        }
    }
    for (int t = 0; t < tb; t++) out[t] = vsum(acc[t]) + tail[t];
}

#if defined(AMC_BF16_PAIRS)
static inline float scale4(const void *scales, int mx, int64_t g) {
    return mx ? E8M0[((const uint8_t *)scales)[g]] : bf16_to_f32(((const uint16_t *)scales)[g]);
}

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

/* dot16_pairs below, lane for lane: lane l of each 32 inputs adds the products at 2l + 1 and 2l; the last K % 32
 * inputs one by one */
static inline void dot16_pairs(const uint16_t *row, const uint16_t *x, int64_t ldx, int64_t K, int tb, float *out) {
    for (int t = 0; t < tb; t++) {
        const uint16_t *xt = x + t * ldx;
        float acc[16] = {0};
        int64_t k = 0;
        for (; k + 32 <= K; k += 32)
            for (int l = 0; l < 16; l++) {
                float sum = acc[l] + bf16_to_f32(row[k + 2 * l + 1]) * bf16_to_f32(xt[k + 2 * l + 1]);
                acc[l] = sum + bf16_to_f32(row[k + 2 * l]) * bf16_to_f32(xt[k + 2 * l]);
            }
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += acc[l];
        for (; k < K; k++) total += bf16_to_f32(row[k]) * bf16_to_f32(xt[k]);
        out[t] = total;
    }
}

/* dot8_pairs below, lane for lane: with `runs` (fp8_runs), lane l of each whole 64 adds the pairs at positions 2l,
 * 2l + 1 of each of fp8_position's two runs into that run's sum; then each 32 (the other blocks, a last part of 64) as
 * dot16_pairs sums them into the first; each block's two sums added, then scaled; the last K % 32 inputs one by
 * one */
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
            for (; k + 32 <= end; k += 32)
                for (int l = 0; l < 16; l++) {
                    part[0][l] += E4M3[row[k + 2 * l + 1]] * bf16_to_f32(xt[k + 2 * l + 1]);
                    part[0][l] += E4M3[row[k + 2 * l]] * bf16_to_f32(xt[k + 2 * l]);
                }
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
#else

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

/* [N, K] rows per output: rows n0..n1 of an expert are one contiguous stream, each row decoded once (a segment at a
 * time) and multiplied by every token, TOKENS_PER_READ at a time. */
static void project_rows(const amc_matrix *m, int64_t e, int64_t n0, int64_t n1, const float *x, const uint16_t *xb,
                         int64_t tokens, float *y, int64_t ldy, float *buf) {
    const int64_t K = m->k, stride = row_bytes(m);
    const uint8_t *first = expert_weight(m, e) + n0 * stride, *end = expert_weight(m, e) + n1 * stride;
    const int in_registers = xb || fused(m);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ahead = first + (n - n0) * stride + PREFETCH_BYTES;
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

/* ---------------------------------------------------------------------------------------------------------------
 * Activations, in float32.
 */

static inline float activation(int32_t act, float v) {
    switch (act) {
    case AMC_SILU: return v / (1.0f + expf(-v));
    case AMC_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case AMC_GELU_TANH: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case AMC_RELU: return v > 0.0f ? v : 0.0f;
    default: return v > 0.0f ? v * v : 0.0f; /* AMC_RELU2 */
    }
}

/* transformers' GptOssExperts._apply_gate: gate clamped above, up clamped both ways,
 * (up + 1) * gate * sigmoid(alpha * gate); comparisons written so that NaN passes through, as torch.clamp lets it */
static inline float gpt_oss_gate(float gate, float up, float alpha, float limit) {
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
    return (up + 1.0f) * (gate / (1.0f + expf(-alpha * gate)));
}

/* a[j] for j in [j0, j1), one token's up-projection row h: act(gate) * up (halves), GPT-OSS's gate, or act(up);
 * rounded to bf16 when the inputs are bf16 (the model's own precision between its projections), and placed where
 * the down-projection reads input j: float32 in `a` (split_position's order when `split`), or bf16 in `ab`
 * (input_position's order) where ab is not NULL */
static void activate(const amc_layer *L, const float *h, float *a, uint16_t *ab, int64_t j0, int64_t j1, int split,
                     int bf16) {
    const int64_t I = L->down.k;
    for (int64_t j = j0; j < j1; j++) {
        float v;
        switch (L->gate) {
        case AMC_GATE_HALVES: v = activation(L->act, h[j]) * h[I + j]; break;
        case AMC_GATE_GPT_OSS: v = gpt_oss_gate(h[2 * j], h[2 * j + 1], L->alpha, L->limit); break;
        default: v = activation(L->act, h[j]); break;
        }
        if (ab) ab[input_position(&L->down, j)] = f32_to_bf16(v);
        else a[split ? split_position(j) : j] = bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * The thread pool: `threads` workers, the caller being thread 0. Between tasks a worker spins for `spin_ns`, then
 * sleeps on a condition variable; `pool_run` wakes sleepers only when there are any. Its callers (amc_experts and
 * every worker sharing it) take turns through `busy`, which also guards the workspace.
 */

typedef void (*task_fn)(void *arg, int tid, int threads);

typedef struct amc_pool amc_pool;
typedef struct {
    amc_pool *pool;
    int tid;
} worker_arg;

typedef struct { /* pairs [start, start + count) of the sorted order all go to `expert` */
    int32_t expert, start, count;
} group;

typedef struct {
    int64_t pairs, experts, hidden, up, inter; /* capacities */
    float *x, *h, *a, *o; /* [P, H] inputs, [P, N_up] up-projections, [P, I] activations, [P, H] outputs, sorted */
    uint16_t *xb, *ab;    /* [P, H] inputs, [P, I] activations, bf16 for dot4_pairs */
    int32_t *order;       /* [P]: sorted position -> pair */
    int32_t *counts;      /* [E + 1] */
    group *groups;        /* [P] */
} workspace;

struct amc_pool {
    int threads;
    int64_t spin_ns;
    pthread_t *workers;
    worker_arg *args;
    float *buffers; /* a SEGMENT-float decode buffer per thread, a cache line apart */
    task_fn task;
    void *arg;
    uint64_t generation; /* bumped to start a task */
    uint64_t nudges;     /* bumped by pool_nudge: sleepers wake and spin again */
    int pending;         /* workers still running it */
    int sleepers;
    int stop;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t busy; /* one computation at a time owns the workspace */
    workspace ws;
};

static float *thread_buffer(amc_pool *p, int tid) { return p->buffers + (int64_t)tid * (SEGMENT + 16); }

/* Wait for a generation other than `seen`: spin, then sleep; a nudge (pool_nudge) since the spin began starts
 * another spin. Sleeping announces itself in `sleepers` before the last check of `generation` and `nudges`, and
 * pool_run and pool_nudge bump theirs before reading `sleepers` (all sequentially consistent): either the sleeper
 * sees the new value or the waker sees the sleeper and broadcasts under the lock the sleeper holds until it waits. */
static uint64_t wait_generation(amc_pool *p, uint64_t seen) {
    for (;;) {
        const uint64_t nudged = __atomic_load_n(&p->nudges, __ATOMIC_SEQ_CST);
        int64_t start = now_ns();
        for (int i = 1;; i++) {
            uint64_t g = __atomic_load_n(&p->generation, __ATOMIC_ACQUIRE);
            if (g != seen) return g;
            cpu_relax();
            if (i % 256 == 0 && now_ns() - start > p->spin_ns) break;
        }
        pthread_mutex_lock(&p->lock);
        __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
        uint64_t g;
        while ((g = __atomic_load_n(&p->generation, __ATOMIC_SEQ_CST)) == seen &&
               __atomic_load_n(&p->nudges, __ATOMIC_SEQ_CST) == nudged)
            pthread_cond_wait(&p->wake, &p->lock);
        __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&p->lock);
        if (g != seen) return g;
    }
}

static void *pool_thread(void *opaque) {
    worker_arg *w = opaque;
    amc_pool *p = w->pool;
    uint64_t seen = 0;
    for (;;) {
        seen = wait_generation(p, seen);
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
        p->task(p->arg, w->tid, p->threads);
        __atomic_sub_fetch(&p->pending, 1, __ATOMIC_RELEASE);
    }
}

static void broadcast_if_sleeping(amc_pool *p) {
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
}

static void wake_all(amc_pool *p) {
    __atomic_add_fetch(&p->generation, 1, __ATOMIC_SEQ_CST);
    broadcast_if_sleeping(p);
}

/* wake sleeping workers to spin for another spin_ns with no task: a request is likely soon, and waking a sleeping
 * pool costs a request more than its experts */
static void pool_nudge(amc_pool *p) {
    __atomic_add_fetch(&p->nudges, 1, __ATOMIC_SEQ_CST);
    broadcast_if_sleeping(p);
}

/* task(arg, tid, threads) on every thread, the caller as thread 0; returns when all are done */
static void pool_run(amc_pool *p, task_fn task, void *arg) {
    p->task = task;
    p->arg = arg;
    __atomic_store_n(&p->pending, p->threads - 1, __ATOMIC_RELAXED);
    wake_all(p); /* the generation's release publishes task and arg */
    task(arg, 0, p->threads);
    while (__atomic_load_n(&p->pending, __ATOMIC_ACQUIRE) > 0) cpu_relax();
}

static void workspace_free(workspace *ws) {
    free(ws->x);
    free(ws->h);
    free(ws->a);
    free(ws->o);
    free(ws->xb);
    free(ws->ab);
    free(ws->order);
    free(ws->counts);
    free(ws->groups);
    memset(ws, 0, sizeof(*ws));
}

static void *alloc64(int64_t bytes) { return aligned_alloc(64, (size_t)cdiv(max64(bytes, 64), 64) * 64); }

/* room for P pairs of a layer (E experts, H hidden, N_up, I), kept across calls and grown as needed */
static int workspace_reserve(workspace *ws, int64_t P, int64_t E, int64_t H, int64_t N_up, int64_t I) {
    if (P <= ws->pairs && E <= ws->experts && H <= ws->hidden && N_up <= ws->up && I <= ws->inter) return AMC_OK;
    workspace grown = {.pairs = max64(P, ws->pairs), .experts = max64(E, ws->experts), .hidden = max64(H, ws->hidden),
                       .up = max64(N_up, ws->up), .inter = max64(I, ws->inter)};
    workspace_free(ws);
    *ws = grown;
    int64_t f = sizeof(float);
    ws->x = alloc64(ws->pairs * ws->hidden * f);
    ws->h = alloc64(ws->pairs * ws->up * f);
    ws->a = alloc64(ws->pairs * ws->inter * f);
    ws->o = alloc64(ws->pairs * ws->hidden * f);
    ws->xb = alloc64(ws->pairs * ws->hidden * 2);
    ws->ab = alloc64(ws->pairs * ws->inter * 2);
    ws->order = alloc64(ws->pairs * 4);
    ws->counts = alloc64((ws->experts + 1) * 4);
    ws->groups = alloc64(ws->pairs * (int64_t)sizeof(group));
    if (ws->x && ws->h && ws->a && ws->o && ws->xb && ws->ab && ws->order && ws->counts && ws->groups) return AMC_OK;
    workspace_free(ws);
    return AMC_ERR_MEMORY;
}

void amc_pool_destroy(amc_pool *p);

amc_pool *amc_pool_create(int32_t threads, int64_t spin_ns) {
    amc_pool *p = calloc(1, sizeof(amc_pool));
    if (!p) return NULL;
    p->threads = threads < 1 ? 1 : threads;
    p->spin_ns = spin_ns;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_mutex_init(&p->busy, NULL);
    p->buffers = alloc64((int64_t)p->threads * (SEGMENT + 16) * sizeof(float));
    p->workers = calloc(p->threads, sizeof(pthread_t));
    p->args = calloc(p->threads, sizeof(worker_arg));
    if (!p->buffers || !p->workers || !p->args) {
        amc_pool_destroy(p);
        return NULL;
    }
    for (int i = 1; i < p->threads; i++) {
        p->args[i] = (worker_arg){p, i};
        if (pthread_create(&p->workers[i], NULL, pool_thread, &p->args[i]) != 0) {
            p->threads = i; /* destroy joins the ones started */
            amc_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

void amc_pool_destroy(amc_pool *p) {
    if (!p) return;
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    wake_all(p);
    for (int i = 1; i < p->threads; i++)
        if (p->workers && p->workers[i]) pthread_join(p->workers[i], NULL);
    workspace_free(&p->ws);
    free(p->buffers);
    free(p->workers);
    free(p->args);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->busy);
    free(p);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The expert MLP of P pairs: check, sort by expert, convert the inputs, then two parallel phases (up-projection
 * with the activation, down-projection), each thread taking the same slice of every expert's outputs.
 */

typedef struct {
    const amc_layer *layer;
    amc_pool *pool;
    const group *groups;
    int64_t ngroups, pairs;
    int bf16;   /* the inputs are bf16: the activations are rounded to bf16, and 4-bit matrices take dot4_pairs */
    float *out; /* [P, H], in the caller's pair order */
} step;

/* this thread's share [lo, hi) of `total` outputs, in multiples of `align` */
static void share(int64_t total, int64_t align, int tid, int threads, int64_t *lo, int64_t *hi) {
    int64_t chunks = cdiv(total, align);
    *lo = min64(total, chunks * tid / threads * align);
    *hi = min64(total, chunks * (tid + 1) / threads * align);
}

static void up_task(void *arg, int tid, int threads) {
    const step *s = arg;
    const amc_layer *L = s->layer;
    const workspace *ws = &s->pool->ws;
    const int64_t H = L->up.k, N = L->up.n, I = L->down.k;
    const int interleaved = L->gate == AMC_GATE_GPT_OSS; /* unit j: columns 2j, 2j+1 */
    const int split = is_4bit(&L->down);                 /* activations in the 4-bit decoders' order */
    const int up_pairs = s->bf16 && takes_pairs(&L->up), down_pairs = s->bf16 && takes_pairs(&L->down);
    /* shares of whole cache lines of activations and of 32s or 64s of the reorder, so that no two threads write one
     * line, but for a 128 of the 4-bit pairs order or a 64 of the fp8 one split between two (its lines shared: shares
     * of whole runs would leave threads idle, 23 of them over 15 threads for GPT-OSS's 2880) */
    const int64_t block = split ? (down_pairs ? 64 : 32) : (down_pairs ? 32 : 1);
    int64_t j0, j1, align = max64(1, split_align(&L->up) / (interleaved ? 2 : 1));
    share(I, max64(align, block), tid, threads, &j0, &j1);
    if (j0 >= j1) return;
    float *buf = thread_buffer(s->pool, tid);
    for (int64_t g = 0; g < s->ngroups; g++) {
        const group *G = &s->groups[g];
        const float *x = ws->x + G->start * H;
        const uint16_t *xb = up_pairs ? ws->xb + G->start * H : NULL;
        float *h = ws->h + G->start * N, *a = ws->a + G->start * I;
        uint16_t *ab = down_pairs ? ws->ab + G->start * I : NULL;
        if (interleaved) {
            project(&L->up, G->expert, 2 * j0, 2 * j1, x, xb, G->count, h, N, buf);
        } else {
            project(&L->up, G->expert, j0, j1, x, xb, G->count, h, N, buf);
            if (L->gate == AMC_GATE_HALVES) project(&L->up, G->expert, I + j0, I + j1, x, xb, G->count, h, N, buf);
        }
        for (int64_t t = 0; t < G->count; t++)
            activate(L, h + t * N, a + t * I, ab ? ab + t * I : NULL, j0, j1, split, s->bf16);
    }
}

static void down_task(void *arg, int tid, int threads) {
    const step *s = arg;
    const amc_layer *L = s->layer;
    const workspace *ws = &s->pool->ws;
    const int64_t H = L->down.n, I = L->down.k;
    int64_t n0, n1;
    share(H, split_align(&L->down), tid, threads, &n0, &n1);
    if (n0 >= n1) return;
    float *buf = thread_buffer(s->pool, tid);
    const int down_pairs = s->bf16 && takes_pairs(&L->down);
    for (int64_t g = 0; g < s->ngroups; g++) {
        const group *G = &s->groups[g];
        const uint16_t *ab = down_pairs ? ws->ab + G->start * I : NULL;
        project(&L->down, G->expert, n0, n1, ws->a + G->start * I, ab, G->count, ws->o + G->start * H, H, buf);
    }
    for (int64_t i = 0; i < s->pairs; i++)
        memcpy(s->out + ws->order[i] * H + n0, ws->o + i * H + n0, (n1 - n0) * sizeof(float));
}

static int check_pairs(const amc_layer *L, int64_t P, const int32_t *token_ids, const int32_t *expert_ids,
                       int64_t T, int64_t *detail) {
    for (int64_t p = 0; p < P; p++) {
        if (token_ids[p] < 0 || token_ids[p] >= T) return *detail = p, AMC_ERR_TOKEN_ID;
        if (expert_ids[p] < -1 || expert_ids[p] >= L->experts) return *detail = p, AMC_ERR_EXPERT_ID;
    }
    return AMC_OK;
}

/* counting sort of the pairs by expert (stable), skipping pairs of expert -1: ws->order, ws->groups; returns the
 * number of groups, and the pairs sorted in `sorted` */
static int64_t sort_by_expert(workspace *ws, int64_t E, int64_t P, const int32_t *expert_ids, int64_t *sorted) {
    int32_t *counts = ws->counts;
    memset(counts, 0, (E + 1) * sizeof(int32_t));
    for (int64_t p = 0; p < P; p++)
        if (expert_ids[p] >= 0) counts[expert_ids[p] + 1]++;
    int64_t ngroups = 0;
    for (int64_t e = 0; e < E; e++) {
        if (counts[e + 1]) ws->groups[ngroups++] = (group){(int32_t)e, counts[e], counts[e + 1]};
        counts[e + 1] += counts[e]; /* counts[e]: the first sorted position of expert e */
    }
    *sorted = counts[E];
    for (int64_t p = 0; p < P; p++)
        if (expert_ids[p] >= 0) ws->order[counts[expert_ids[p]]++] = (int32_t)p;
    return ngroups;
}

static void convert_row(const void *x, int32_t format, int64_t row, int64_t H, float *dst) {
    switch (format) {
    case AMC_BF16: decode_bf16((const uint16_t *)x + row * H, H, dst); break;
    case AMC_F16: decode_f16((const uint16_t *)x + row * H, H, dst); break;
    default: memcpy(dst, (const float *)x + row * H, H * sizeof(float)); break;
    }
}

/* ... and the number of distinct experts computed in `groups`, of pairs in `computed` */
static int run_experts(amc_pool *pool, const amc_layer *L, int64_t P, const int32_t *token_ids,
                       const int32_t *expert_ids, const void *x, int32_t x_format, int64_t T, float *out,
                       int64_t *detail, int64_t *groups, int64_t *computed) {
    const int64_t H = L->up.k;
    if (P < 0) return *detail = P, AMC_ERR_PAIRS;
    int err = check_pairs(L, P, token_ids, expert_ids, T, detail);
    if (err || P == 0) return err;
    workspace *ws = &pool->ws;
    if ((err = workspace_reserve(ws, P, L->experts, H, L->up.n, L->down.k))) return err;
    int64_t sorted, ngroups = sort_by_expert(ws, L->experts, P, expert_ids, &sorted);
    *groups = ngroups, *computed = sorted;
    if (!sorted) return AMC_OK;
    const int bf16 = x_format == AMC_BF16, up_pairs = bf16 && takes_pairs(&L->up);
    for (int64_t i = 0; i < sorted; i++) {
        const int64_t token = token_ids[ws->order[i]];
        if (up_pairs) {
            const uint16_t *row = (const uint16_t *)x + token * H;
            if (!is_4bit(&L->up) && !fp8_runs(&L->up)) memcpy(ws->xb + i * H, row, H * sizeof(uint16_t));
            else
                for (int64_t k = 0; k < H; k++) ws->xb[i * H + input_position(&L->up, k)] = row[k];
            continue;
        }
        convert_row(x, x_format, token, H, ws->x + i * H);
        if (is_4bit(&L->up)) split_even_odd(ws->x + i * H, H);
    }
    step s = {L, pool, ws->groups, ngroups, sorted, bf16, out};
    pool_run(pool, up_task, &s);
    pool_run(pool, down_task, &s);
    return AMC_OK;
}

/* Which check a layer descriptor fails (a positive number), or 0: the Python side refuses with a clear message
 * first; this keeps a bad descriptor from reading out of bounds. */
static int matrix_problem(const amc_matrix *m) {
    if (!m->weight || m->n <= 0 || m->k <= 0) return 1;
    if (m->format < AMC_F32 || m->format > AMC_INT4) return 2;
    if (m->bias && (m->bias_format < AMC_F32 || m->bias_format > AMC_F16)) return 3;
    if (m->format == AMC_FP8 && (!m->scales || m->block_rows <= 0 || m->block_cols <= 0)) return 4;
    if (is_4bit(m)) {
        int group_ok = m->format == AMC_MXFP4 ? m->block_cols == 32
                                              : (m->block_cols == 16 || m->block_cols == 32 || m->block_cols == 64 ||
                                                 m->block_cols == 128);
        if (!m->scales || m->transposed || !group_ok || m->k % m->block_cols) return 5;
    }
    return 0;
}

static int32_t layer_problem(const amc_layer *L) {
    int p;
    if ((p = matrix_problem(&L->up))) return 10 + p;
    if ((p = matrix_problem(&L->down))) return 20 + p;
    if (L->experts <= 0) return 31;
    if (L->gate < AMC_GATE_NONE || L->gate > AMC_GATE_GPT_OSS || L->act < AMC_SILU || L->act > AMC_RELU2) return 32;
    if (L->down.n != L->up.k || L->up.n != (L->gate == AMC_GATE_NONE ? 1 : 2) * L->down.k) return 33;
    return 0;
}

/* The expert MLP of P pairs (token_ids[p], expert_ids[p]) of x [T, H] (f32, bf16 or f16): out [P, H] float32. A pair
 * of expert -1 is skipped: its row of `out` is left as it was (the hybrid's GPU computes it).
 * Returns AMC_OK or an AMC_ERR_* code with `detail` (out is then untouched); `groups`: the distinct experts computed.
 * Calls from several threads take turns (the pool's `busy` lock). */
int32_t amc_experts(amc_pool *pool, const amc_layer *L, int64_t P, const int32_t *token_ids,
                    const int32_t *expert_ids, const void *x, int32_t x_format, int64_t T, float *out,
                    int64_t *detail, int64_t *groups) {
    int64_t problem = layer_problem(L);
    if (problem) return *detail = problem, AMC_ERR_DESCRIPTOR;
    pthread_mutex_lock(&pool->busy);
    int64_t computed = 0;
    *groups = 0;
    int err = run_experts(pool, L, P, token_ids, expert_ids, x, x_format, T, out, detail, groups, &computed);
    pthread_mutex_unlock(&pool->busy);
    return err;
}

const char *amc_isa(void) { return AMC_ISA; }

/* ---------------------------------------------------------------------------------------------------------------
 * The request channel: one block of host memory, written by a producer (the GPU) and a worker (below).
 *
 *   offset  0: int64 request     the producer's sequence number, stored last, after the payload and a fence
 *   offset  8: int64 awake       the producer's: changed by a call that sends nothing, so the worker keeps its pool
 *                                awake for the requests of the calls after it
 *   offset 64: int64 done        the worker's: the number of the request served, stored last (release), with
 *                                AMC_REFUSED set where it was refused
 *   offset 72: int32 error       AMC_OK, or what was wrong with request `done` (nothing was computed)
 *   offset 80: int64 detail      the offending value or pair
 *   offset 128: int32 layer, int32 pairs (P), int32 tokens (T)
 *   then, each 64-byte aligned: int32 token_ids[max_pairs], int32 expert_ids[max_pairs],
 *   x [max_tokens, hidden] in x_format, out [max_pairs, hidden] float32
 * `request` and `done` sit on cache lines of their own: each has one writer.
 */

/* set in `done` beside the request number when the worker refused it (`error` says why): one load tells a waiter
 * both that the request is answered and whether its outputs are there (request.py's DONE_REFUSED) */
#define AMC_REFUSED ((int64_t)1 << 62)

typedef struct {
    int64_t request;
    int64_t awake;
    int64_t pad0[6];
    int64_t done;
    int32_t error, pad1;
    int64_t detail;
    int64_t pad2[5];
    int32_t layer, pairs, tokens;
} amc_header;

typedef struct {
    int64_t max_pairs, max_tokens, hidden;
    int32_t x_format, pad;
    int64_t request, awake, done, error, detail, layer, pairs, tokens; /* byte offsets of the header's fields */
    int64_t token_ids, expert_ids, x, out, nbytes;              /* byte offsets of the arrays; the block's size */
} amc_channel_layout;

static int64_t align64(int64_t n) { return cdiv(n, 64) * 64; }

int32_t amc_channel_layout_init(amc_channel_layout *l, int64_t max_pairs, int64_t max_tokens, int64_t hidden,
                                int32_t x_format) {
    if (max_pairs < 0 || max_tokens < 0 || hidden <= 0 || x_format < AMC_F32 || x_format > AMC_F16) return -1;
    memset(l, 0, sizeof(*l));
    l->max_pairs = max_pairs, l->max_tokens = max_tokens, l->hidden = hidden, l->x_format = x_format;
    l->request = offsetof(amc_header, request), l->awake = offsetof(amc_header, awake);
    l->done = offsetof(amc_header, done);
    l->error = offsetof(amc_header, error), l->detail = offsetof(amc_header, detail);
    l->layer = offsetof(amc_header, layer), l->pairs = offsetof(amc_header, pairs);
    l->tokens = offsetof(amc_header, tokens);
    l->token_ids = align64(sizeof(amc_header));
    l->expert_ids = align64(l->token_ids + max_pairs * 4);
    l->x = align64(l->expert_ids + max_pairs * 4);
    l->out = align64(l->x + max_tokens * hidden * format_bytes(x_format));
    l->nbytes = align64(l->out + max_pairs * hidden * 4);
    return 0;
}

/* the producer's last store: the payload written before it is visible to a worker that sees `seq` */
void amc_request_publish(void *channel, int64_t seq) {
    __atomic_store_n(&((amc_header *)channel)->request, seq, __ATOMIC_RELEASE);
}

/* Wait until `done` is `seq`: the request's error code, or -1 after timeout_ns. Spins, then yields the core
 * between polls after YIELD_AFTER_NS (a host waiter must not starve the worker it waits for). */
#define YIELD_AFTER_NS 100000
int32_t amc_done_wait(void *channel, int64_t seq, int64_t timeout_ns) {
    amc_header *h = channel;
    int64_t start = now_ns(), waited = 0;
    for (int i = 1;; i++) {
        if ((__atomic_load_n(&h->done, __ATOMIC_ACQUIRE) & ~AMC_REFUSED) == seq) return h->error;
        if (waited > YIELD_AFTER_NS) sched_yield();
        else cpu_relax();
        if (i % 256 == 0 && (waited = now_ns() - start) > timeout_ns) return -1;
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * The worker: a thread polling `request`. Layers are registered before it starts and never change afterwards.
 * A request numbered other than the last + 1 is answered with AMC_ERR_SEQUENCE (and the worker takes its number
 * as the last), so a producer waiting for its number never waits forever and never reads garbage as outputs.
 */

typedef struct {
    uint8_t *channel;
    amc_channel_layout layout;
    amc_layer *layers;
    uint8_t *registered;
    int32_t num_layers;
    amc_pool *pool;
    int64_t idle_spin_ns, idle_sleep_ns;
    int64_t *stats;     /* [num_layers, AMC_STATS]: what each layer's requests computed (amc_worker_stats) */
    int64_t first_seen; /* `request` when started: the next one is first_seen + 1 */
    pthread_t thread;
    int started, stop;
} amc_worker;

/* per layer, counted by the worker over the requests it computed */
enum { AMC_STAT_REQUESTS, AMC_STAT_PAIRS, AMC_STAT_EXPERTS, AMC_STAT_BYTES, AMC_STAT_NS, AMC_STATS };

static void count(int64_t *row, int stat, int64_t n) { __atomic_add_fetch(&row[stat], n, __ATOMIC_RELAXED); }

static int32_t serve(amc_worker *w, int64_t *detail) {
    const amc_channel_layout *l = &w->layout;
    const amc_header *h = (const amc_header *)w->channel;
    int32_t layer = h->layer, P = h->pairs, T = h->tokens;
    if (layer < 0 || layer >= w->num_layers || !w->registered[layer]) return *detail = layer, AMC_ERR_LAYER;
    if (P < 0 || P > l->max_pairs) return *detail = P, AMC_ERR_PAIRS;
    if (T < 0 || T > l->max_tokens) return *detail = T, AMC_ERR_TOKENS;
    uint8_t *c = w->channel;
    const amc_layer *L = &w->layers[layer];
    pthread_mutex_lock(&w->pool->busy); /* the pool may serve other workers and in-line callers too */
    int64_t start = now_ns(), groups = 0, computed = 0;
    int32_t err = run_experts(w->pool, L, P, (const int32_t *)(c + l->token_ids), (const int32_t *)(c + l->expert_ids),
                              c + l->x, l->x_format, T, (float *)(c + l->out), detail, &groups, &computed);
    pthread_mutex_unlock(&w->pool->busy);
    if (err) return err;
    int64_t *row = w->stats + (int64_t)layer * AMC_STATS;
    count(row, AMC_STAT_REQUESTS, 1);
    count(row, AMC_STAT_PAIRS, computed);
    count(row, AMC_STAT_EXPERTS, groups);
    count(row, AMC_STAT_BYTES, groups * (matrix_bytes(&L->up) + matrix_bytes(&L->down)));
    count(row, AMC_STAT_NS, now_ns() - start);
    return AMC_OK;
}

static void *worker_thread(void *opaque) {
    amc_worker *w = opaque;
    amc_header *h = (amc_header *)w->channel;
    int64_t seen = w->first_seen, last_active = now_ns(), awake = __atomic_load_n(&h->awake, __ATOMIC_RELAXED);
    int napping = 0; /* idle for longer than idle_spin_ns: sleep between polls */
    for (int i = 1; !__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE); i++) {
        int64_t seq = __atomic_load_n(&h->request, __ATOMIC_ACQUIRE); /* the payload's reads come after this */
        if (seq == seen) {
            int64_t now_awake = __atomic_load_n(&h->awake, __ATOMIC_RELAXED);
            if (now_awake != awake) { /* a call that sent nothing: the next calls' requests find the pool awake */
                awake = now_awake;
                pool_nudge(w->pool);
                last_active = now_ns();
                napping = 0;
            } else if (napping) {
                struct timespec nap = {0, w->idle_sleep_ns};
                nanosleep(&nap, NULL);
            } else {
                cpu_relax();
                napping = i % 256 == 0 && now_ns() - last_active > w->idle_spin_ns;
            }
            continue;
        }
        int64_t detail = 0;
        int32_t err = seq == seen + 1 ? serve(w, &detail) : (detail = seen + 1, AMC_ERR_SEQUENCE);
        h->error = err;
        h->detail = detail;
        __atomic_store_n(&h->done, err ? seq | AMC_REFUSED : seq, __ATOMIC_RELEASE); /* outputs, error before it */
        seen = seq;
        last_active = now_ns();
        napping = 0;
    }
    return NULL;
}

void amc_worker_destroy(amc_worker *w);

/* `pool` computes the requests; it may be shared (amc_experts, other workers) and must outlive the worker */
amc_worker *amc_worker_create(void *channel, const amc_channel_layout *layout, int32_t num_layers, amc_pool *pool,
                              int64_t idle_spin_ns, int64_t idle_sleep_ns) {
    amc_worker *w = calloc(1, sizeof(amc_worker));
    if (!w) return NULL;
    w->channel = channel;
    w->layout = *layout;
    w->num_layers = num_layers;
    w->idle_spin_ns = idle_spin_ns;
    w->idle_sleep_ns = idle_sleep_ns < 1 ? 1 : (idle_sleep_ns > 999999999 ? 999999999 : idle_sleep_ns);
    w->layers = calloc(num_layers > 0 ? num_layers : 1, sizeof(amc_layer));
    w->registered = calloc(num_layers > 0 ? num_layers : 1, 1);
    w->stats = calloc((num_layers > 0 ? num_layers : 1) * AMC_STATS, sizeof(int64_t));
    w->pool = pool;
    if (!w->layers || !w->registered || !w->stats || !w->pool) {
        amc_worker_destroy(w);
        return NULL;
    }
    return w;
}

/* 0, or which check failed: -1 the worker runs already, -2 index out of range, -3 hidden size differs from the
 * channel's, a positive number: layer_problem's */
int32_t amc_worker_set_layer(amc_worker *w, int32_t index, const amc_layer *layer) {
    if (w->started) return -1;
    if (index < 0 || index >= w->num_layers) return -2;
    int32_t problem = layer_problem(layer);
    if (problem) return problem;
    if (layer->up.k != w->layout.hidden) return -3;
    w->layers[index] = *layer;
    w->registered[index] = 1;
    return 0;
}

/* Start polling, with the workspace already sized for the channel's largest request. */
int32_t amc_worker_start(amc_worker *w) {
    if (w->started) return -1;
    int32_t err = AMC_OK;
    pthread_mutex_lock(&w->pool->busy);
    for (int32_t i = 0; i < w->num_layers && !err; i++) {
        const amc_layer *L = &w->layers[i];
        if (w->registered[i] &&
            workspace_reserve(&w->pool->ws, w->layout.max_pairs, L->experts, L->up.k, L->up.n, L->down.k))
            err = AMC_ERR_MEMORY;
    }
    pthread_mutex_unlock(&w->pool->busy);
    if (err) return err;
    w->first_seen = __atomic_load_n(&((amc_header *)w->channel)->request, __ATOMIC_ACQUIRE);
    if (pthread_create(&w->thread, NULL, worker_thread, w) != 0) return -2;
    w->started = 1;
    return 0;
}

void amc_worker_destroy(amc_worker *w) {
    if (!w) return;
    if (w->started) {
        __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
        pthread_join(w->thread, NULL);
    }
    free(w->layers);
    free(w->registered);
    free(w->stats);
    free(w);
}

/* how many of the worker's pool threads sleep now (not spinning for a task) */
int32_t amc_worker_sleeping(amc_worker *w) { return __atomic_load_n(&w->pool->sleepers, __ATOMIC_SEQ_CST); }

/* The counters of every layer into out [num_layers, AMC_STATS] (a consistent row only while no request is being
 * served); then zero them if `reset`. */
void amc_worker_stats(amc_worker *w, int64_t *out, int32_t reset) {
    for (int64_t i = 0; i < (int64_t)w->num_layers * AMC_STATS; i++)
        out[i] = reset ? __atomic_exchange_n(&w->stats[i], 0, __ATOMIC_RELAXED)
                       : __atomic_load_n(&w->stats[i], __ATOMIC_RELAXED);
}
