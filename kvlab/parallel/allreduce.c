// An all-reduce for tensor-parallel ranks on one host, through a shared memory segment.
//
// gloo's all-reduce of a few kilobytes costs one to two milliseconds here (two TCP round trips and
// thread wake-ups): with two per layer, most of a decode step. Ranks on one host can instead copy
// their tensor into their own slot of a shared segment, say so, wait until every rank has, and each
// sum all slots itself — in rank order, so that every rank gets the same bits.
//
// Segment layout: WORLD sequence words (one per rank, each on its own cache line), then two buffers
// (calls alternate between them) of WORLD slots of `capacity` floats. A rank writes only its own
// sequence word and its own slots. Reusing a buffer two calls later is safe: a rank reaches call s + 2
// only after every rank has announced call s + 1, which each does only after it finished reading s.

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define LINE 64  // bytes per sequence word: no two ranks' words share a cache line

static inline _Atomic int64_t* seq_word(uint8_t* segment, int rank) { return (_Atomic int64_t*)(segment + rank * LINE); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Sum `data` [n] over the ranks in place: call number `seq` (1, 2, ... the same on every rank).
// Returns 0, or -1 when some rank did not arrive within timeout_s (it died or hangs).
int kvlab_shm_allreduce(uint8_t* segment, int rank, int world, int64_t capacity, float* data, int64_t n, int64_t seq,
                        double timeout_s) {
    float* buffers = (float*)(segment + world * LINE);
    float* buffer = buffers + (seq % 2) * world * capacity;
    memcpy(buffer + rank * capacity, data, n * sizeof(float));
    atomic_store_explicit(seq_word(segment, rank), seq, memory_order_release);  // the slot is written
    double deadline = 0;
    for (int r = 0; r < world; r++) {
        for (int spins = 0; atomic_load_explicit(seq_word(segment, r), memory_order_acquire) < seq; spins++) {
            if (spins < 2000) continue;  // a peer usually arrives within microseconds
            if (deadline == 0) deadline = now_s() + timeout_s;
            if (now_s() > deadline) return -1;
            sched_yield();  // the peer may need this core
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float s = buffer[i];
        for (int r = 1; r < world; r++) s += buffer[r * capacity + i];
        data[i] = s;
    }
    return 0;
}
