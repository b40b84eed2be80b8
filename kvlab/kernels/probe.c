// The machine's arithmetic roof: how many float32 multiply-adds a second its vector units make, on the
// kernels' own threads (kernels/probe.py binds it; the lab's batching experiment sets a decode step's
// multiply-adds against it). A decode step of one sequence waits on its read of the weights; a step of
// many makes one multiply-add per weight and sequence, and this rate bounds how fast those can go.
//
// Each work item runs CHAINS independent accumulators through TURNS multiply-adds each (a·m + c, which
// GCC contracts to one FMA), enough chains to cover an FMA's latency on every unit that issues one a
// cycle. The accumulators start from a value the compiler cannot know, so it can neither fold the loop
// nor merge the chains, and they stay finite (m < 1: each converges to c / (1 − m)). A vector is 16
// floats: one AVX-512 register, two AVX2 ones, four NEON ones; the rate counts floats either way.
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#define CHAINS 12
#define TURNS 4096
#define ITEMS_PER_THREAD 32  // items of one timed job per thread: about 0.1-0.5 ms of work each

typedef float vf __attribute__((vector_size(64)));
#define LANES (int)(sizeof(vf) / sizeof(float))

typedef struct {
    float seed;   // 1 here; read from memory, so that nothing is known at compile time
    float* sink;  // one float per item: each item's sum, so that no chain is dead code
} MacProbe;

static void mac_items(void* ctx, uint32_t begin, uint32_t end) {
    const MacProbe* p = ctx;
    const vf m = (vf){0} + 0.5f * p->seed, c = (vf){0} + 0.25f * p->seed;
    for (uint32_t item = begin; item < end; item++) {
        vf acc[CHAINS];
        for (int i = 0; i < CHAINS; i++) acc[i] = (vf){0} + p->seed * (float)(i + item);
        for (int t = 0; t < TURNS; t++)
#pragma GCC unroll 12
            for (int i = 0; i < CHAINS; i++) acc[i] = acc[i] * m + c;
        vf sum = acc[0];
        for (int i = 1; i < CHAINS; i++) sum += acc[i];
        p->sink[item] = sum[0];
    }
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// The most float32 multiply-adds a second (in 1e9) one job of the pool reached on `threads` threads,
// over jobs run for about `duration` seconds (the best job: the roof, not a busy machine's average);
// −1 where no memory was left for the sinks.
double kvlab_mac_rate(int threads, double duration) {
    if (threads < 1) threads = 1;
    const uint32_t items = (uint32_t)threads * ITEMS_PER_THREAD;
    float* sink = malloc(items * sizeof(float));
    if (!sink) return -1.0;
    MacProbe p = {1.0f, sink};
    double best = 0.0;
    const double start = seconds();
    do {
        const double t0 = seconds();
        kvlab_pool_run(mac_items, &p, items, 1, threads);
        const double rate = (double)items * TURNS * CHAINS * LANES / (seconds() - t0) / 1e9;
        if (rate > best) best = rate;
    } while (seconds() - start < duration);
    free(sink);
    return best;
}
