/* The bounce ring's chunk loop in native threads (offload_core/bounce.py, _NativeRing; built with
 * stream_copy.c by offload_core/streamcopy.py).
 *
 * The Python ring takes the GIL several times per chunk in each of its threads: a 16 MiB chunk at 50
 * GB/s is 3,000 chunks a second, each taken and put back by a fill thread and the issuer, beside
 * the engine's own thread, which takes the GIL back after every torch op it launches. Here the
 * fill threads are pthreads that never touch Python, and the issuer's per-chunk work (wait for the
 * fill, queue the H2D copy, record the buffer's event) is one call per unit, made without the GIL.
 *
 * Sequence numbers: request() hands each chunk the next number s; it goes through buffer s % nbuf.
 * A fill thread takes the next s, waits until buffer b's last occupant (s - nbuf) has had its copy
 * queued and that copy has completed (the buffer's event), copies the pageable source into b and
 * marks b filled with s. copy() walks a unit's numbers in order, waits for each fill, queues the
 * copy on the caller's stream (CUDA) or copies at once (host), records b's event and marks b
 * consumed with s. The CUDA calls go through the driver API (libcuda.so.1, looked up at run time):
 * a stream's and an event's handles are the same objects the runtime, and so torch, uses.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void oj_stream_copy(void *dst, const void *src, size_t n);

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

#define OJ_EVENT_FLAGS 0x3 /* CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING: a waiter sleeps */

struct oj_cu {
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*error_string)(CUresult, const char **);
};

struct oj_task {
    uint64_t src;
    uint64_t n;
};

typedef struct oj_ring {
    int nbuf, nthreads, cuda, streaming, started;
    size_t chunk;
    unsigned char *base;
    struct oj_cu cu;
    CUcontext ctx;
    CUevent *events;
    int *recorded;
    int64_t *filled, *consumed; /* per buffer: the number it holds; the number whose copy is queued */
    struct oj_task *tasks;      /* by number % ntasks */
    int64_t ntasks;             /* chunks requested and not yet copied, at most (sized by the caller) */
    int conds_ready;
    int64_t seq;                /* the next number request() hands out */
    int64_t next_fill;          /* the next number a fill thread takes */
    int64_t copied;             /* numbers below this one are consumed */
    int64_t fail_at;            /* a test's injected failure: the fill of this number fails (-1: none) */
    pthread_mutex_t mu;
    pthread_cond_t task_cv;
    pthread_cond_t *buf_cv;
    pthread_t *threads;
    cpu_set_t cpus; /* where the fill threads run (ncpus 0: anywhere) */
    int ncpus;
    int stop, failed;
    char error[512];
    uint64_t fill_bytes;
    double fill_s, wait_s;
} oj_ring;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The first failure wins; every waiter wakes and returns it. Called with mu held. */
static void fail_locked(oj_ring *r, const char *msg)
{
    int i;
    if (!r->failed) {
        r->failed = 1;
        snprintf(r->error, sizeof r->error, "%s", msg);
    }
    pthread_cond_broadcast(&r->task_cv);
    for (i = 0; i < r->nbuf; i++)
        pthread_cond_broadcast(&r->buf_cv[i]);
}

static void fail_cu(oj_ring *r, const char *where, CUresult err)
{
    const char *name = NULL;
    char msg[256];
    if (r->cu.error_string == NULL || r->cu.error_string(err, &name) != 0 || name == NULL)
        name = "unknown CUDA error";
    snprintf(msg, sizeof msg, "%s failed: CUDA error %d: %s", where, err, name);
    pthread_mutex_lock(&r->mu);
    fail_locked(r, msg);
    pthread_mutex_unlock(&r->mu);
}

static int load_cuda(oj_ring *r)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(r->error, sizeof r->error, "libcuda.so.1 would not load: %s", dlerror());
        return -1;
    }
#define OJ_SYM(field, name)                                                                      \
    do {                                                                                         \
        *(void **)(&r->cu.field) = dlsym(lib, name);                                             \
        if (r->cu.field == NULL) {                                                               \
            snprintf(r->error, sizeof r->error, "libcuda.so.1 has no %s", name);                 \
            return -1;                                                                           \
        }                                                                                        \
    } while (0)
    OJ_SYM(ctx_get, "cuCtxGetCurrent");
    OJ_SYM(ctx_set, "cuCtxSetCurrent");
    OJ_SYM(event_create, "cuEventCreate");
    OJ_SYM(event_record, "cuEventRecord");
    OJ_SYM(event_sync, "cuEventSynchronize");
    OJ_SYM(event_destroy, "cuEventDestroy_v2");
    OJ_SYM(memcpy_htod, "cuMemcpyHtoDAsync_v2");
    OJ_SYM(error_string, "cuGetErrorString");
#undef OJ_SYM
    return 0; /* the library stays loaded: the process's CUDA uses it anyway */
}

static void *fill_loop(void *arg)
{
    oj_ring *r = (oj_ring *)arg;
    if (r->ncpus > 0)
        pthread_setaffinity_np(pthread_self(), sizeof r->cpus, &r->cpus); /* best effort, as the Python ring's */
    if (r->cuda) {
        CUresult err = r->cu.ctx_set(r->ctx);
        if (err != 0) {
            fail_cu(r, "a fill thread's cuCtxSetCurrent", err);
            return NULL;
        }
    }
    pthread_mutex_lock(&r->mu);
    for (;;) {
        int64_t s;
        int b, sync;
        struct oj_task t;
        double t0, dt;
        while (!r->stop && !r->failed && r->next_fill >= r->seq)
            pthread_cond_wait(&r->task_cv, &r->mu);
        if (r->stop || r->failed)
            break;
        s = r->next_fill++;
        t = r->tasks[s % r->ntasks];
        b = (int)(s % r->nbuf);
        /* the buffer's last occupant must have had its copy queued ... */
        while (!r->stop && !r->failed && r->consumed[b] < s - r->nbuf)
            pthread_cond_wait(&r->buf_cv[b], &r->mu);
        if (r->stop || r->failed)
            break;
        sync = r->cuda && r->recorded[b];
        if (s == r->fail_at) {
            fail_locked(r, "fill thread failed: an injected failure (a test's)");
            break;
        }
        pthread_mutex_unlock(&r->mu);
        if (sync) { /* ... and completed; the issuer records this event again only after this fill */
            CUresult err = r->cu.event_sync(r->events[b]);
            if (err != 0) {
                fail_cu(r, "a fill thread's wait for a copy", err);
                return NULL;
            }
        }
        t0 = now_s();
        if (r->streaming)
            oj_stream_copy(r->base + (size_t)b * r->chunk, (const void *)(uintptr_t)t.src, (size_t)t.n);
        else
            memmove(r->base + (size_t)b * r->chunk, (const void *)(uintptr_t)t.src, (size_t)t.n);
        dt = now_s() - t0;
        pthread_mutex_lock(&r->mu);
        r->filled[b] = s;
        r->fill_bytes += t.n;
        r->fill_s += dt;
        pthread_cond_broadcast(&r->buf_cv[b]);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

const char *oj_ring_error(oj_ring *r)
{
    return r->error;
}

int oj_ring_failed(oj_ring *r)
{
    int f;
    pthread_mutex_lock(&r->mu);
    f = r->failed;
    pthread_mutex_unlock(&r->mu);
    return f;
}

/* The ring and its threads; NULL only if memory runs out. A ring that could not start (CUDA not
 * loadable, a thread not created) is returned failed: oj_ring_failed says so and oj_ring_error why. */
oj_ring *oj_ring_new(int nbuf, size_t chunk, void *base, int nthreads, int cuda, int streaming, const int *cpus,
                     int ncpus, int64_t ntasks)
{
    oj_ring *r = (oj_ring *)calloc(1, sizeof *r);
    int i;
    if (r == NULL)
        return NULL;
    CPU_ZERO(&r->cpus);
    for (i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) {
            CPU_SET(cpus[i], &r->cpus);
            r->ncpus++;
        }
    r->nbuf = nbuf;
    r->chunk = chunk;
    r->base = (unsigned char *)base;
    r->nthreads = nthreads;
    r->cuda = cuda;
    r->streaming = streaming;
    r->fail_at = -1;
    r->ntasks = ntasks > 64 ? ntasks : 64;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->task_cv, NULL);
    r->buf_cv = (pthread_cond_t *)calloc((size_t)nbuf, sizeof *r->buf_cv);
    r->events = (CUevent *)calloc((size_t)nbuf, sizeof *r->events);
    r->recorded = (int *)calloc((size_t)nbuf, sizeof *r->recorded);
    r->filled = (int64_t *)malloc((size_t)nbuf * sizeof *r->filled);
    r->consumed = (int64_t *)malloc((size_t)nbuf * sizeof *r->consumed);
    r->tasks = (struct oj_task *)calloc((size_t)r->ntasks, sizeof *r->tasks);
    r->threads = (pthread_t *)calloc((size_t)nthreads, sizeof *r->threads);
    if (!r->buf_cv || !r->events || !r->recorded || !r->filled || !r->consumed || !r->tasks || !r->threads) {
        r->failed = 1;
        snprintf(r->error, sizeof r->error, "out of memory for the ring's tables");
        return r;
    }
    for (i = 0; i < nbuf; i++) {
        pthread_cond_init(&r->buf_cv[i], NULL);
        r->filled[i] = -1;
        r->consumed[i] = -1;
    }
    r->conds_ready = 1;
    if (cuda) {
        CUresult err;
        if (load_cuda(r) != 0) {
            r->failed = 1;
            return r;
        }
        err = r->cu.ctx_get(&r->ctx);
        if (err != 0 || r->ctx == NULL) {
            r->failed = 1;
            snprintf(r->error, sizeof r->error, "no current CUDA context on the calling thread (error %d)", err);
            return r;
        }
        for (i = 0; i < nbuf; i++) {
            err = r->cu.event_create(&r->events[i], OJ_EVENT_FLAGS);
            if (err != 0) {
                r->failed = 1;
                snprintf(r->error, sizeof r->error, "cuEventCreate failed: CUDA error %d", err);
                return r;
            }
        }
    }
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&r->threads[i], NULL, fill_loop, r) != 0) {
            pthread_mutex_lock(&r->mu);
            fail_locked(r, "a fill thread could not be created");
            pthread_mutex_unlock(&r->mu);
            break;
        }
        r->started++;
#ifdef __linux__
        {
            char name[16];
            snprintf(name, sizeof name, "oj-fill-%d", i % 1000);
            pthread_setname_np(r->threads[i], name);
        }
#endif
    }
    return r;
}

/* A test's injected failure: the fill of chunk number s fails (s < 0: the next chunk requested). */
void oj_ring_fail_at(oj_ring *r, int64_t s)
{
    pthread_mutex_lock(&r->mu);
    r->fail_at = s < 0 ? r->seq : s;
    pthread_mutex_unlock(&r->mu);
}

/* Queue the chunks of n bytes at src, after every earlier request's; *count gets their number.
 * With ramp (the fill threads idle: the copy stream waits for this unit's first chunk), the first
 * chunk's worth goes in pieces of 1/16, 1/16, 1/8, 1/4 and 1/2 of a chunk, filled side by side.
 * Returns the first chunk's number, or -1 (failed or closed: oj_ring_error). */
int64_t oj_ring_request(oj_ring *r, uint64_t src, uint64_t n, int64_t *count)
{
    static const int ramp[] = {16, 16, 8, 4, 2};
    uint64_t o = 0;
    int64_t first, need;
    size_t i;
    pthread_mutex_lock(&r->mu);
    if (r->failed || r->stop) {
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    need = (int64_t)(n / r->chunk) + 8;
    if (r->seq + need - r->copied > r->ntasks) {
        fail_locked(r, "more chunks requested ahead of the copies than the ring's table holds");
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    first = r->seq;
    if (r->next_fill == r->seq) {
        for (i = 0; i < sizeof ramp / sizeof ramp[0] && o < n; i++) {
            uint64_t m = r->chunk / (uint64_t)ramp[i];
            if (m > n - o)
                m = n - o;
            r->tasks[r->seq % r->ntasks].src = src + o;
            r->tasks[r->seq % r->ntasks].n = m;
            r->seq++;
            o += m;
        }
    }
    for (; o < n; o += r->chunk) {
        uint64_t m = n - o < r->chunk ? n - o : r->chunk;
        r->tasks[r->seq % r->ntasks].src = src + o;
        r->tasks[r->seq % r->ntasks].n = m;
        r->seq++;
    }
    *count = r->seq - first;
    pthread_cond_broadcast(&r->task_cv);
    pthread_mutex_unlock(&r->mu);
    return first;
}

/* Copy chunks first..first+count-1, as they are filled, to dst: queued on stream (CUDA; the buffer
 * is filled again once its event completes) or copied now (host memory). 0, or -1 (oj_ring_error). */
static int copy_chunks(oj_ring *r, int64_t first, int64_t count, uint64_t dst, void *stream);

/* The calling thread's CUDA context is the ring's during the copies and is given back after. */
int oj_ring_copy(oj_ring *r, int64_t first, int64_t count, uint64_t dst, void *stream)
{
    CUcontext prev = NULL;
    int rc;
    if (r->cuda) {
        CUresult err = r->cu.ctx_get(&prev);
        if (err == 0 && prev != r->ctx)
            err = r->cu.ctx_set(r->ctx);
        if (err != 0) {
            fail_cu(r, "the issuer's cuCtxSetCurrent", err);
            return -1;
        }
    }
    rc = copy_chunks(r, first, count, dst, stream);
    if (r->cuda && prev != r->ctx)
        r->cu.ctx_set(prev);
    return rc;
}

static int copy_chunks(oj_ring *r, int64_t first, int64_t count, uint64_t dst, void *stream)
{
    uint64_t off = 0;
    int64_t s;
    for (s = first; s < first + count; s++) {
        int b = (int)(s % r->nbuf);
        uint64_t n;
        pthread_mutex_lock(&r->mu);
        if (r->filled[b] != s) {
            double t0 = now_s();
            while (r->filled[b] != s && !r->failed && !r->stop)
                pthread_cond_wait(&r->buf_cv[b], &r->mu);
            r->wait_s += now_s() - t0;
        }
        if (r->failed || r->stop) {
            if (!r->failed)
                fail_locked(r, "used after close()");
            pthread_mutex_unlock(&r->mu);
            return -1;
        }
        n = r->tasks[s % r->ntasks].n;
        pthread_mutex_unlock(&r->mu);
        if (r->cuda) {
            CUresult err = r->cu.memcpy_htod((CUdeviceptr)(dst + off), r->base + (size_t)b * r->chunk, (size_t)n,
                                             (CUstream)stream);
            if (err == 0)
                err = r->cu.event_record(r->events[b], (CUstream)stream);
            if (err != 0) {
                fail_cu(r, "a chunk's copy to the device", err);
                return -1;
            }
        } else {
            memcpy((void *)(uintptr_t)(dst + off), r->base + (size_t)b * r->chunk, (size_t)n);
        }
        off += n;
        pthread_mutex_lock(&r->mu);
        r->recorded[b] = r->cuda;
        r->consumed[b] = s;
        r->copied = s + 1;
        pthread_cond_broadcast(&r->buf_cv[b]);
        pthread_mutex_unlock(&r->mu);
    }
    return 0;
}

/* fill bytes, the fill threads' copy seconds (summed), the issuer's seconds waiting for fills */
void oj_ring_stats(oj_ring *r, double out[3])
{
    pthread_mutex_lock(&r->mu);
    out[0] = (double)r->fill_bytes;
    out[1] = r->fill_s;
    out[2] = r->wait_s;
    pthread_mutex_unlock(&r->mu);
}

int oj_ring_threads(oj_ring *r)
{
    return r->started;
}

/* Wake and stop every thread, and fail every wait (a copy() under way returns -1); frees nothing. */
void oj_ring_stop(oj_ring *r)
{
    int i;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->task_cv);
    for (i = 0; i < r->nbuf && r->buf_cv; i++)
        pthread_cond_broadcast(&r->buf_cv[i]);
    pthread_mutex_unlock(&r->mu);
}

/* Stop the fill threads and join them (none waits on the issuer once stopped): after this no thread
 * of the ring reads the caller's masters. */
void oj_ring_join(oj_ring *r)
{
    int i;
    oj_ring_stop(r);
    for (i = 0; i < r->started; i++)
        pthread_join(r->threads[i], NULL);
    r->started = 0;
}

/* Stop and join the threads, then free the ring (the pinned buffers are the caller's). Waits for
 * the last copies out of the buffers first: the caller frees them next. */
void oj_ring_close(oj_ring *r)
{
    int i;
    oj_ring_join(r);
    if (r->cuda && r->events && r->cu.event_destroy && r->ctx) {
        CUcontext prev = NULL;
        r->cu.ctx_get(&prev);
        if (prev != r->ctx)
            r->cu.ctx_set(r->ctx);
        for (i = 0; i < r->nbuf; i++) {
            if (r->events[i]) {
                if (r->recorded[i])
                    r->cu.event_sync(r->events[i]);
                r->cu.event_destroy(r->events[i]);
            }
        }
        if (prev != r->ctx)
            r->cu.ctx_set(prev);
    }
    if (r->conds_ready)
        for (i = 0; i < r->nbuf; i++)
            pthread_cond_destroy(&r->buf_cv[i]);
    pthread_cond_destroy(&r->task_cv);
    pthread_mutex_destroy(&r->mu);
    free(r->buf_cv);
    free(r->events);
    free(r->recorded);
    free(r->filled);
    free(r->consumed);
    free(r->tasks);
    free(r->threads);
    free(r);
}
