/* The host half of kernels/engine_copy.py: a thread that polls the device's posted copy requests and issues
 * them to the copy engine. Plain C with no CUDA headers: the driver's entry points arrive as pointers, so it
 * builds with any C compiler (the one Triton needs) and runs without the GIL.
 *
 * A channel is one stream of requests (one cache's misses, or its prefetches). Its request row, in pinned
 * memory, is [count, expert[M], slot[M]]; the device writes it, then the request's number into posted[c]. The
 * thread sees posted[c] != served[c], copies every tensor of each expert into its slot on the channel's stream,
 * then has that stream write the number to the channel's `done` word in device memory, which the device waits
 * for. A channel has at most one request outstanding: its stream waits for `done` before posting again. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CHANNELS 4096
#define MAX_TENSORS 8

typedef int (*memcpy_async_fn)(uint64_t dst, uint64_t src, size_t bytes, void *stream);
typedef int (*write_value_fn)(void *stream, uint64_t addr, uint32_t value, unsigned int flags);
typedef int (*set_context_fn)(void *context);
typedef int (*capture_mode_fn)(int *mode);

typedef struct {
    const volatile int32_t *row;
    int32_t planned;  /* M */
    int32_t tensors;
    uint64_t host[MAX_TENSORS], slots[MAX_TENSORS], bytes[MAX_TENSORS]; /* one expert's bytes, per tensor */
    void *stream;
    uint64_t done; /* device address of an int32 */
    int32_t active;
} channel_t;

typedef struct {
    volatile int32_t *posted; /* [MAX_CHANNELS], pinned, written by the device */
    int32_t served[MAX_CHANNELS];
    channel_t channel[MAX_CHANNELS];
    int32_t high; /* channels [0, high) may be active */
    int32_t stop;
    int32_t error; /* the first failed driver call's CUresult, 0 if none */
    int64_t spin_ns, nap_ns;
    void *context;
    memcpy_async_fn memcpy_async;
    write_value_fn write_value;
    set_context_fn set_context;
    capture_mode_fn capture_mode;
    pthread_mutex_t lock; /* between add and remove; the thread reads `active` and `high` atomically */
    pthread_t thread;
} proxy_t;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int ok(proxy_t *p, int rc) {
    if (rc != 0) __atomic_compare_exchange_n(&p->error, &(int32_t){0}, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return rc == 0;
}

static void serve(proxy_t *p, channel_t *ch, int32_t number) {
    int32_t count = ch->row[0], M = ch->planned;
    if (count > M) count = M;
    for (int32_t i = 0; i < count; i++) {
        uint64_t expert = (uint64_t)ch->row[1 + i], slot = (uint64_t)ch->row[1 + M + i];
        for (int32_t t = 0; t < ch->tensors; t++) {
            uint64_t n = ch->bytes[t];
            if (!ok(p, p->memcpy_async(ch->slots[t] + slot * n, ch->host[t] + expert * n, n, ch->stream))) return;
        }
    }
    ok(p, p->write_value(ch->stream, ch->done, (uint32_t)number, 0)); /* not on failure: the device times out */
}

static void *run(void *arg) {
    proxy_t *p = arg;
    int relaxed = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED: no call here breaks another thread's capture */
    if (!ok(p, p->set_context(p->context)) || !ok(p, p->capture_mode(&relaxed))) return NULL;
    int64_t last = now_ns();
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        int busy = 0;
        int32_t high = __atomic_load_n(&p->high, __ATOMIC_ACQUIRE);
        for (int32_t c = 0; c < high; c++) {
            int32_t number = p->posted[c];
            if (number == p->served[c] || !__atomic_load_n(&p->channel[c].active, __ATOMIC_ACQUIRE)) continue;
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the row was written before the number */
            serve(p, &p->channel[c], number);
            p->served[c] = number;
            busy = 1;
        }
        if (busy) {
            last = now_ns();
        } else if (now_ns() - last < p->spin_ns) {
            sched_yield();
        } else {
            struct timespec nap = {0, p->nap_ns};
            nanosleep(&nap, NULL);
        }
    }
    return NULL;
}

/* fns: cuMemcpyAsync, cuStreamWriteValue32_v2, cuCtxSetCurrent, cuThreadExchangeStreamCaptureMode. */
void *engine_copy_start(volatile int32_t *posted, void *context, void **fns, int64_t spin_ns, int64_t nap_ns) {
    proxy_t *p = calloc(1, sizeof(proxy_t));
    if (!p) return NULL;
    p->posted = posted;
    p->context = context;
    p->memcpy_async = (memcpy_async_fn)fns[0];
    p->write_value = (write_value_fn)fns[1];
    p->set_context = (set_context_fn)fns[2];
    p->capture_mode = (capture_mode_fn)fns[3];
    p->spin_ns = spin_ns;
    p->nap_ns = nap_ns;
    pthread_mutex_init(&p->lock, NULL);
    if (pthread_create(&p->thread, NULL, run, p) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

/* A channel's index (its word in `posted`, zeroed here), or -1 when all MAX_CHANNELS are taken. */
int32_t engine_copy_add(proxy_t *p, const volatile int32_t *row, int32_t planned, int32_t tensors,
                        const uint64_t *host, const uint64_t *slots, const uint64_t *bytes, void *stream,
                        uint64_t done) {
    if (tensors < 1 || tensors > MAX_TENSORS) return -1;
    pthread_mutex_lock(&p->lock);
    int32_t c = 0;
    while (c < MAX_CHANNELS && __atomic_load_n(&p->channel[c].active, __ATOMIC_ACQUIRE)) c++;
    if (c < MAX_CHANNELS) {
        channel_t *ch = &p->channel[c];
        ch->row = row;
        ch->planned = planned;
        ch->tensors = tensors;
        memcpy(ch->host, host, tensors * sizeof(uint64_t));
        memcpy(ch->slots, slots, tensors * sizeof(uint64_t));
        memcpy(ch->bytes, bytes, tensors * sizeof(uint64_t));
        ch->stream = stream;
        ch->done = done;
        p->posted[c] = 0;
        p->served[c] = 0;
        __atomic_store_n(&ch->active, 1, __ATOMIC_RELEASE);
        if (c >= p->high) __atomic_store_n(&p->high, c + 1, __ATOMIC_RELEASE);
    } else {
        c = -1;
    }
    pthread_mutex_unlock(&p->lock);
    return c;
}

/* Stop serving channel c (its cache is gone); its index may be handed out again. */
void engine_copy_remove(proxy_t *p, int32_t c) {
    pthread_mutex_lock(&p->lock);
    __atomic_store_n(&p->channel[c].active, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&p->lock);
}

int32_t engine_copy_error(proxy_t *p) { return __atomic_load_n(&p->error, __ATOMIC_RELAXED); }

/* Stop and join the thread, free the proxy; returns its error. */
int32_t engine_copy_stop(proxy_t *p) {
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    pthread_join(p->thread, NULL);
    int32_t error = p->error;
    pthread_mutex_destroy(&p->lock);
    free(p);
    return error;
}
