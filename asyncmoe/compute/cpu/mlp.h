/*
 * The expert MLP of P pairs (amc_experts): check, sort by expert, convert the inputs, then two parallel phases on
 * the pool (up-projection with the activation, down-projection), each thread taking the same slice of every expert's
 * outputs. The activations are computed in float32.
 */
#pragma once
#include "pool.h"
#include "project.h"

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
