// The kernels' thread pool (interface in pool.h): a pool of its own, not OpenMP.
//
// The caller and the workers claim chunks of items from one atomic counter, and the caller waits
// only for chunks already claimed. On a busy machine a worker that is not scheduled simply claims
// nothing, where an OpenMP barrier would stall every call until it runs (measured here: 20x slower
// decode while another process held a core).
//
// One caller holds the pool at a time; a second caller meanwhile computes alone instead of waiting
// (two engines in two threads, a server thread and an offline call). A forked child starts with a
// fresh pool: no workers (they were not copied), free, a new lock and conditions; it starts its
// own workers on first use.

#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 63            // one bit each in `asleep`
#define WARM_SECONDS 0.002        // a helper idle this long sleeps: decode calls come every ~100 us
#define CALLER_SPIN_SECONDS 5e-5  // then a caller waiting for claimed chunks yields its core to them
// A claim takes `chunk` items, or fewer near the job's end: a (2 · threads)th of the items left, but at
// least GUIDED_LEAST (or `chunk`, where that is smaller), so that no thread waits long for another's last
// long claim. Runs of a quarter of a job (claim_size in quant_i8.c, 16-64 rows) had one core idle
// for up to a run at the end of each product: on an Intel Xeon VM, 2 threads, int8, decode steps of 16
// alternated with the old rule in one process, SmolLM2 0.93-0.96x, Qwen2.5-Coder-0.5B 0.96x, a 512-token
// SmolLM2 prompt 0.95x; one-sequence steps and the exact products unchanged (1.00x).
#define GUIDED_LEAST 4

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

// Job g lives in jobs[g & 1]. A worker can wake late, after job g is finished and job g+1 has begun;
// it must neither read a half-written job nor count work under the wrong job. So a caller writes a
// slot only for job g+2, after claims are tagged g+1, and a worker checks the claim tag after copying
// its slot: a copy that could be torn always fails that check (a release fence before the slot's
// writes and an acquire fence after the worker's reads order the two, as in a seqlock). The fields
// are relaxed atomics because a late worker's reads do race with the next caller's writes.
typedef struct {
    _Atomic(PoolTask) task;
    _Atomic(void*) ctx;
    _Atomic uint32_t num_items, chunk;
    _Atomic int helpers;  // workers 0 .. helpers-1 claim chunks of this job; the others sleep
} Job;

static Job jobs[2];
// (tag << 32) | next item to hand out, the tag being the job's generation. Both halves are unsigned
// 32-bit: the generation wraps from 2^32 - 1 to 0 and tags are only compared for equality.
static _Atomic uint64_t claim;
static _Atomic uint32_t done_items;  // items finished in the current job
static _Atomic uint32_t generation;  // bumped once per job: what idle workers watch
static _Atomic uint64_t asleep;      // bit i: worker i waits on wake[i]
static atomic_flag busy = ATOMIC_FLAG_INIT;  // held by the caller whose job the pool runs
static _Atomic int num_workers;      // changed only by the holder of `busy`, or in a forked child
static _Atomic uint64_t wakeups, solo_calls;  // for tests and benchmarks
static pthread_mutex_t lock;
static pthread_cond_t wake[MAX_WORKERS];

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void run_chunks(uint32_t gen) {
    Job* slot = &jobs[gen & 1];
    PoolTask task = atomic_load_explicit(&slot->task, memory_order_relaxed);
    void* ctx = atomic_load_explicit(&slot->ctx, memory_order_relaxed);
    uint32_t num_items = atomic_load_explicit(&slot->num_items, memory_order_relaxed);
    uint32_t chunk = atomic_load_explicit(&slot->chunk, memory_order_relaxed);
    const uint32_t share = 2 * (uint32_t)(atomic_load_explicit(&slot->helpers, memory_order_relaxed) + 1);
    atomic_thread_fence(memory_order_acquire);  // the copy, then the tag check that validates it
    uint64_t v = atomic_load_explicit(&claim, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen) return;
        uint32_t begin = (uint32_t)v;
        if (begin >= num_items) return;
        const uint32_t left = num_items - begin, guided = left / share > GUIDED_LEAST ? left / share : GUIDED_LEAST;
        const uint32_t want = guided < chunk ? guided : chunk, take = want < left ? want : left;
        // acquire: this job's reset of done_items comes before our count below
        if (!atomic_compare_exchange_weak_explicit(&claim, &v, v + take, memory_order_acquire,
                                                   memory_order_relaxed))
            continue;
        const uint32_t end = begin + take;
        task(ctx, begin, end);
        atomic_fetch_add_explicit(&done_items, end - begin, memory_order_release);
        v = atomic_load_explicit(&claim, memory_order_relaxed);
    }
}

static uint32_t sleep_until_next_job(int index, uint32_t seen) {
    const uint64_t bit = (uint64_t)1 << index;
    uint32_t gen;
    pthread_mutex_lock(&lock);
    atomic_fetch_or(&asleep, bit);  // seq_cst, before the look at generation: pairs with the caller's fence
    while ((gen = atomic_load(&generation)) == seen) {
        pthread_cond_wait(&wake[index], &lock);
        atomic_fetch_add_explicit(&wakeups, 1, memory_order_relaxed);
    }
    atomic_fetch_and(&asleep, ~bit);
    pthread_mutex_unlock(&lock);
    return gen;
}

static uint32_t wait_for_next_job(int index, uint32_t seen) {
    double idle_since = seconds();
    for (uint32_t spins = 1;; spins++) {
        uint32_t gen = atomic_load_explicit(&generation, memory_order_acquire);
        if (gen != seen) return gen;
        if (spins % 2000) {
            cpu_relax();
        } else if (seconds() - idle_since < WARM_SECONDS) {
            sched_yield();
        } else {
            return sleep_until_next_job(index, seen);
        }
    }
}

static void* worker(void* arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load_explicit(&generation, memory_order_acquire);
    int surplus = 0;  // the last job left this worker out: sleep until one asks for it, do not spin
    for (;;) {
        seen = surplus ? sleep_until_next_job(index, seen) : wait_for_next_job(index, seen);
        // a stale read (the slot may already hold job seen + 2) only decides whether to try
        surplus = index >= atomic_load_explicit(&jobs[seen & 1].helpers, memory_order_relaxed);
        if (!surplus) run_chunks(seen);
    }
    return NULL;
}

// A worker's stack: the kernels keep an item's sums there (quant.c's stored products: about 100 KB at a
// pass of 128 rows), close to what some C libraries give a thread by default (musl: 128 KB)
#define WORKER_STACK ((size_t)4 << 20)

// The number of workers up to `wanted` that exist (fewer only if a thread could not be created).
static int start_workers(int wanted) {
    int n = atomic_load_explicit(&num_workers, memory_order_relaxed);
    pthread_attr_t attr;
    const int sized = pthread_attr_init(&attr) == 0;
    if (sized) pthread_attr_setstacksize(&attr, WORKER_STACK);
    for (; n < wanted; n++) {
        pthread_t t;
        if (pthread_create(&t, sized ? &attr : NULL, worker, (void*)(intptr_t)n) != 0) break;
        pthread_detach(t);
        atomic_store_explicit(&num_workers, n + 1, memory_order_relaxed);
    }
    if (sized) pthread_attr_destroy(&attr);
    return n < wanted ? n : wanted;
}

// The caller's wait for chunks other threads claimed: a bounded spin (they are usually running and
// nearly done), then yields, since on an oversubscribed machine the thread holding the last chunk
// may be waiting for this very core.
static void wait_for_items(uint32_t num_items) {
    double yield_after = 0;
    for (uint32_t spins = 1; atomic_load_explicit(&done_items, memory_order_acquire) < num_items; spins++) {
        if (spins % 64) {
            cpu_relax();
            continue;
        }
        double now = seconds();
        if (yield_after == 0)
            yield_after = now + CALLER_SPIN_SECONDS;
        else if (now > yield_after)
            sched_yield();
    }
}

void kvlab_pool_run(PoolTask task, void* ctx, uint32_t num_items, uint32_t chunk, int threads) {
    if (chunk == 0) chunk = 1;
    if (num_items > UINT32_MAX - chunk) threads = 1;  // a claim's item half must never carry into its tag
    int64_t num_chunks = num_items / chunk + (num_items % chunk != 0);
    int64_t helpers = (int64_t)threads - 1;
    if (helpers > MAX_WORKERS) helpers = MAX_WORKERS;
    if (helpers > num_chunks - 1) helpers = num_chunks - 1;  // more would find nothing to claim
    if (helpers <= 0) {
        if (num_items) task(ctx, 0, num_items);
        return;
    }
    if (atomic_flag_test_and_set_explicit(&busy, memory_order_acquire)) {
        atomic_fetch_add_explicit(&solo_calls, 1, memory_order_relaxed);
        task(ctx, 0, num_items);  // the same result: no item depends on the thread that computes it
        return;
    }
    helpers = start_workers((int)helpers);

    uint32_t gen = atomic_load_explicit(&generation, memory_order_relaxed) + 1;
    Job* slot = &jobs[gen & 1];
    // The release half of the seqlock: claims tagged gen - 1 (stored by the previous holder, whose
    // release of `busy` we acquired) happen before any of the slot's new values can be read.
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&slot->task, task, memory_order_relaxed);
    atomic_store_explicit(&slot->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&slot->num_items, num_items, memory_order_relaxed);
    atomic_store_explicit(&slot->chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&slot->helpers, (int)helpers, memory_order_relaxed);
    atomic_store_explicit(&done_items, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, (uint64_t)gen << 32, memory_order_release);
    atomic_store_explicit(&generation, gen, memory_order_release);

    // The generation store before the look at `asleep`: a helper that sets its bit after this fence
    // sees the new generation before it waits; one that set it before is seen here and signalled.
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t sleeping = atomic_load_explicit(&asleep, memory_order_relaxed) & (((uint64_t)1 << helpers) - 1);
    if (sleeping) {
        pthread_mutex_lock(&lock);
        for (int i = 0; i < helpers; i++)
            if (sleeping >> i & 1) pthread_cond_signal(&wake[i]);
        pthread_mutex_unlock(&lock);
    }
    run_chunks(gen);
    wait_for_items(num_items);
    atomic_flag_clear_explicit(&busy, memory_order_release);
}

// Items [begin, end) of the whole, each range handed to the job it belongs to
static void job_items(void* ctx, uint32_t begin, uint32_t end) {
    const PoolJobs* jobs = ctx;
    for (int j = 0; j < jobs->num && begin < end; j++) {
        const uint32_t lo = jobs->first[j], hi = jobs->first[j + 1];
        if (begin >= hi) continue;
        const uint32_t stop = end < hi ? end : hi;
        jobs->task[j](jobs->ctx[j], begin - lo, stop - lo);
        begin = stop;
    }
}

void kvlab_pool_run_jobs(PoolJobs* jobs, uint32_t chunk, int threads) {
    kvlab_pool_run(job_items, jobs, jobs->first[jobs->num], chunk, threads);
}

// A fresh pool, at load and in a forked child. The child's only thread is the one that called fork:
// whatever the parent's threads held or were doing (a job, the lock, a wait) has no thread left.
static void reset_pool(void) {
    pthread_mutex_init(&lock, NULL);
    for (int i = 0; i < MAX_WORKERS; i++) pthread_cond_init(&wake[i], NULL);
    atomic_store(&asleep, 0);
    atomic_store(&num_workers, 0);
    atomic_flag_clear(&busy);
}

__attribute__((constructor)) static void init_pool(void) {
    reset_pool();
    pthread_atfork(NULL, NULL, reset_pool);
}

// ---- for tests and benchmarks -------------------------------------------------------------------

typedef struct {
    uint64_t generation, workers, asleep, wakeups, solo_calls;
} PoolStats;

void kvlab_pool_stats(PoolStats* s) {
    s->generation = atomic_load(&generation);
    s->workers = atomic_load(&num_workers);
    s->asleep = __builtin_popcountll(atomic_load(&asleep));
    s->wakeups = atomic_load(&wakeups);
    s->solo_calls = atomic_load(&solo_calls);
}

// Make g the last job's generation (to test the counter near 2^31 and 2^32): 0, or -1 if the pool is busy.
int kvlab_pool_set_generation(uint32_t g) {
    if (atomic_flag_test_and_set_explicit(&busy, memory_order_acquire)) return -1;
    // tagged g with nothing left to hand out: a worker that sees g finds no chunk in any slot
    atomic_store_explicit(&claim, (uint64_t)g << 32 | UINT32_MAX, memory_order_release);
    atomic_store_explicit(&generation, g, memory_order_release);
    atomic_flag_clear_explicit(&busy, memory_order_release);
    return 0;
}

typedef struct {
    uint32_t *counts, *sizes;
} Cover;

static void cover_items(void* ctx, uint32_t begin, uint32_t end) {
    const Cover* c = ctx;
    for (uint32_t i = begin; i < end; i++) __atomic_fetch_add(&c->counts[i], 1, __ATOMIC_RELAXED);
    c->sizes[begin] = end - begin;  // a claim's first item is no other claim's
}

// A job of num_items items: counts[i] += 1 for each time item i was computed, sizes[b] = the size of
// the claim that began at item b (the others untouched)
void kvlab_pool_cover(uint32_t num_items, uint32_t chunk, int threads, uint32_t* counts, uint32_t* sizes) {
    Cover c = {counts, sizes};
    kvlab_pool_run(cover_items, &c, num_items, chunk, threads);
}

// Take the pool as a caller would (hold = 1; 0, or -1 if busy) or give it back (hold = 0).
int kvlab_pool_hold(int hold) {
    if (!hold) {
        atomic_flag_clear_explicit(&busy, memory_order_release);
        return 0;
    }
    return atomic_flag_test_and_set_explicit(&busy, memory_order_acquire) ? -1 : 0;
}
