/*
 * The thread pool: `threads` workers, the caller being thread 0. Between tasks a worker spins for `spin_ns`, then
 * sleeps on a condition variable; `pool_run` wakes sleepers only when there are any. The pool owns the expert MLP's
 * workspace and decode buffers, kept across calls; one computation at a time holds them (`busy`): its callers
 * (amc_experts and every worker sharing the pool) take turns through it.
 */
#pragma once
#include <pthread.h>
#include "isa.h"

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

