// The kernels' thread pool: one job at a time, split into work items that threads claim in chunks.
//
// A kernel describes its work as items 0..num_items-1 (a GEMV: blocks of output rows) and a task
// that computes a range of them; kvlab_pool_run hands chunks of `chunk` items to the calling thread
// and up to threads - 1 workers. An item must not depend on which thread computes it, or on how the
// items were split: then a result is bit-identical at any thread count, and a call that finds the
// pool busy (another caller holds it) simply runs every item on its own thread.

#ifndef KVLAB_POOL_H
#define KVLAB_POOL_H

#include <stdint.h>

#define KVLAB_HIDDEN __attribute__((visibility("hidden")))  // bound inside the library, never interposed

// Computes items [begin, end) of the job described by ctx.
typedef void (*PoolTask)(void* ctx, uint32_t begin, uint32_t end);

// Runs task over [0, num_items) on up to `threads` threads (the caller among them); returns when every
// item is done. ctx must stay valid until then. Safe to call from several threads at once, and after fork.
KVLAB_HIDDEN void kvlab_pool_run(PoolTask task, void* ctx, uint32_t num_items, uint32_t chunk, int threads);

// Several jobs as one (the parts of a fused matrix: q, k and v; gate and up): job j's items are items
// first[j] .. first[j + 1] − 1 of the whole, so that one dispatch, not one per part, computes them all.
#define KVLAB_MAX_JOBS 8
typedef struct {
    int num;
    PoolTask task[KVLAB_MAX_JOBS];
    void* ctx[KVLAB_MAX_JOBS];
    uint32_t first[KVLAB_MAX_JOBS + 1];  // first[num]: the total
} PoolJobs;

KVLAB_HIDDEN void kvlab_pool_run_jobs(PoolJobs* jobs, uint32_t chunk, int threads);

#endif
