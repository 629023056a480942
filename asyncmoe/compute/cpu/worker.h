/*
 * The request channel with the GPU and the worker that serves it: one block of (pinned) host memory the GPU writes
 * requests into inside a captured decode step, and a C thread that polls it and computes them on its pool, never
 * taking the Python GIL nor calling the CUDA driver. worker.py and request.py are the two other sides.
 */
#pragma once
#include <sched.h>
#include "mlp.h"

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
