// Small-batch matrix-vector products for decode on a CPU: y[m, o] = sum_i x[m, i] * W[o, i] (+ b[o]).
//
// Decode multiplies a handful of activation rows by every weight matrix: the arithmetic is tiny
// and the time is the time to stream W from memory. BLAS with one row streams well under the
// machine's read bandwidth; this kernel reads W exactly once, in order, in blocks of 4 output rows.
// Long rows are read as 4 interleaved streams, short rows (≤ 768 elements) one row after another:
// measured here, 4 streams of a 2.3 KB row read 15-20% slower than the same bytes as one stream,
// and 4 streams of 6-19 KB rows 5-15% faster. Every activation row is multiplied against the block
// while it sits in L1; the vector accumulators stay in registers.
// W may be float32, bfloat16 or float16; x, y and the sums are float32.
//
// Threads: a small pool of its own, not OpenMP. The caller and the workers claim chunks of blocks
// from one atomic counter, and the caller waits only for chunks already claimed. On a busy machine a
// worker that is not scheduled simply claims nothing, where an OpenMP barrier would stall every
// call until it runs (measured here: 20x slower decode while another process held a core).
//
// Built at first use with the machine's own C compiler, -O3 -march=native -pthread (see gemv.py).
// GCC/Clang vector extensions keep it portable: 8-float vectors map to AVX/AVX2 registers, or are
// split by the compiler on narrower machines.

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>  // one-instruction widening of 16-bit weights where the CPU has it
#endif

#define BLOCK 4  // output rows per work item

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef _Float16 v8f16 __attribute__((vector_size(16)));

static inline v8f load_f32(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX2__)
static inline v8f load_bf16(const uint16_t* p) {  // bfloat16 is the top half of a float32
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
static inline v8f load_bf16(const uint16_t* p) {  // bfloat16 is the top half of a float32
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#endif

#if defined(__F16C__)
static inline v8f load_f16(const _Float16* p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
static inline v8f load_f16(const _Float16* p) {
    v8f16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}
#endif

static inline float scalar_f32(float v) { return v; }
static inline float scalar_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float scalar_f16(_Float16 h) { return (float)h; }

static inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// out[0..3] = dot(W rows 0..3 of the block, x), n elements each
#define DEFINE_BLOCK_DOT(NAME, W_T, LOAD, SCALAR)                                                  \
    static inline void NAME(const W_T* w, const float* x, float* out, long n) {                  \
        const W_T *w0 = w, *w1 = w + n, *w2 = w + 2 * n, *w3 = w + 3 * n;                         \
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};        \
        long i = 0;                                                                                \
        for (; i + 16 <= n; i += 16) {                                                             \
            v8f x0 = load_f32(x + i), x1 = load_f32(x + i + 8);                                    \
            a0 += LOAD(w0 + i) * x0; b0 += LOAD(w0 + i + 8) * x1;                                  \
            a1 += LOAD(w1 + i) * x0; b1 += LOAD(w1 + i + 8) * x1;                                  \
            a2 += LOAD(w2 + i) * x0; b2 += LOAD(w2 + i + 8) * x1;                                  \
            a3 += LOAD(w3 + i) * x0; b3 += LOAD(w3 + i + 8) * x1;                                  \
        }                                                                                          \
        float s0 = hsum(a0 + b0), s1 = hsum(a1 + b1), s2 = hsum(a2 + b2), s3 = hsum(a3 + b3);     \
        for (; i < n; i++) {                                                                       \
            s0 += SCALAR(w0[i]) * x[i]; s1 += SCALAR(w1[i]) * x[i];                                \
            s2 += SCALAR(w2[i]) * x[i]; s3 += SCALAR(w3[i]) * x[i];                                \
        }                                                                                          \
        out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;                                        \
    }

#define SHORT_ROW 768  // elements: at most this, a block's rows are read one after another

// the same for short rows, each row in turn: the block is one sequential stream
#define DEFINE_ROW_DOT(NAME, W_T, LOAD, SCALAR)                                                    \
    static inline void NAME(const W_T* w, const float* x, float* out, long n) {                  \
        for (int r = 0; r < BLOCK; r++) {                                                          \
            const W_T* wr = w + r * n;                                                             \
            v8f a = {0}, b = {0}, c = {0}, d = {0};                                                \
            long i = 0;                                                                            \
            for (; i + 32 <= n; i += 32) {                                                         \
                a += LOAD(wr + i) * load_f32(x + i);                                               \
                b += LOAD(wr + i + 8) * load_f32(x + i + 8);                                       \
                c += LOAD(wr + i + 16) * load_f32(x + i + 16);                                     \
                d += LOAD(wr + i + 24) * load_f32(x + i + 24);                                     \
            }                                                                                      \
            for (; i + 8 <= n; i += 8) a += LOAD(wr + i) * load_f32(x + i);                        \
            float s = hsum((a + b) + (c + d));                                                     \
            for (; i < n; i++) s += SCALAR(wr[i]) * x[i];                                          \
            out[r] = s;                                                                            \
        }                                                                                          \
    }

// ---- the job and the thread pool ----------------------------------------------------------------

#define CHUNK 8  // blocks (32 rows) claimed at a time
#define MAX_WORKERS 63

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

typedef void (*BlockFn)(const void* w, const float* x, float* out, long n);

typedef struct {
    BlockFn dot;
    const char* w;
    long w_row_bytes;
    const float *x, *bias;
    float* y;
    long m, n, out, blocks;
    int helpers;  // workers allowed to claim chunks of this job
} Job;

// Job g lives in jobs[g & 1]. A worker can wake late, after job g is finished and job g+1 has begun;
// it must neither read a half-written job nor count work under the wrong job. So the driver writes a
// slot only for job g+2, after claims are tagged g+1, and a worker checks the claim tag after copying
// its slot: a copy that could be torn always fails that check (fences on both sides order the two).
static Job jobs[2];
static atomic_long claim;         // (generation << 32) | next block to hand out
static atomic_long done_blocks;   // blocks finished in the current job
static atomic_long generation;    // bumped once per job: what idle workers watch
static atomic_int sleepers;
static int num_workers;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static void run_chunks(long gen) {
    const Job j = jobs[gen & 1];  // valid while claims are tagged `gen` (checked below, after the copy)
    atomic_thread_fence(memory_order_acquire);
    for (;;) {
        long v = atomic_load_explicit(&claim, memory_order_acquire), b0;
        do {
            if ((v >> 32) != gen) return;
            b0 = v & 0xffffffffL;
            if (b0 >= j.blocks) return;
        } while (!atomic_compare_exchange_weak_explicit(&claim, &v, v + CHUNK, memory_order_acq_rel,
                                                        memory_order_acquire));
        long b1 = b0 + CHUNK < j.blocks ? b0 + CHUNK : j.blocks;
        for (long b = b0; b < b1; b++) {
            float res[BLOCK];
            for (long r = 0; r < j.m; r++) {
                j.dot(j.w + b * BLOCK * j.w_row_bytes, j.x + r * j.n, res, j.n);
                for (int k = 0; k < BLOCK; k++)
                    j.y[r * j.out + b * BLOCK + k] = res[k] + (j.bias ? j.bias[b * BLOCK + k] : 0.0f);
            }
        }
        atomic_fetch_add_explicit(&done_blocks, b1 - b0, memory_order_release);
    }
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void* worker(void* arg) {
    int index = (int)(intptr_t)arg;
    long seen = atomic_load(&generation);
    for (;;) {
        double idle_since = seconds();
        long gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < 2000) {
                cpu_relax();
                continue;
            }
            spins = 0;
            if (seconds() - idle_since < 0.002) {  // decode calls come every ~100 us: stay warm
                sched_yield();
                continue;
            }
            pthread_mutex_lock(&lock);  // idle for 2 ms: sleep until the next job
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = gen;
        if (index < jobs[gen & 1].helpers) run_chunks(gen);  // a stale read only decides whether to try
    }
    return NULL;
}

static void ensure_workers(int n) {
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    while (num_workers < n) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void*)(intptr_t)num_workers) != 0) return;
        pthread_detach(t);
        num_workers++;
    }
}

// The scalar tail (out % 4 rows) and the one-job-at-a-time driver shared by every weight type.
static void gemv(BlockFn dot, const void* w, long elem_bytes, float (*scalar)(const void*, long),
                 const float* x, const float* bias, float* y, long m, long n, long out, int threads) {
    long blocks = out / BLOCK;
    int helpers = threads > 1 ? threads - 1 : 0;
    ensure_workers(helpers);
    long gen = atomic_load(&generation) + 1;
    atomic_thread_fence(memory_order_seq_cst);  // claims tagged gen-1 are visible before the slot changes
    jobs[gen & 1] = (Job){dot, (const char*)w, n * elem_bytes, x, bias, y, m, n, out, blocks, helpers};
    atomic_store_explicit(&done_blocks, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, gen << 32, memory_order_release);
    atomic_store_explicit(&generation, gen, memory_order_release);
    if (helpers && atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    run_chunks(gen);
    while (atomic_load_explicit(&done_blocks, memory_order_acquire) < blocks) cpu_relax();
    for (long o = blocks * BLOCK; o < out; o++)
        for (long r = 0; r < m; r++) {
            float s = bias ? bias[o] : 0.0f;
            for (long i = 0; i < n; i++) s += scalar(w, o * n + i) * x[r * n + i];
            y[r * out + o] = s;
        }
}

// ---- the exported functions: one per weight type ----------------------------------------------
// x: [m, n] float32; y: [m, out] float32; bias: [out] float32 or NULL; W: [out, n]

#define DEFINE_GEMV(NAME, BLOCK_DOT, ROW_DOT, W_T, SCALAR)                                         \
    static void NAME##_block(const void* w, const float* x, float* out, long n) {                  \
        if (n <= SHORT_ROW)                                                                        \
            ROW_DOT((const W_T*)w, x, out, n);                                                     \
        else                                                                                       \
            BLOCK_DOT((const W_T*)w, x, out, n);                                                   \
    }                                                                                              \
    static float NAME##_scalar(const void* w, long i) { return SCALAR(((const W_T*)w)[i]); }      \
    void NAME(const W_T* w, const float* x, const float* bias, float* y, long m, long n, long out, \
              int threads) {                                                                       \
        gemv(NAME##_block, w, sizeof(W_T), NAME##_scalar, x, bias, y, m, n, out, threads);         \
    }

DEFINE_BLOCK_DOT(block_dot_f32, float, load_f32, scalar_f32)
DEFINE_BLOCK_DOT(block_dot_bf16, uint16_t, load_bf16, scalar_bf16)
DEFINE_BLOCK_DOT(block_dot_f16, _Float16, load_f16, scalar_f16)
DEFINE_ROW_DOT(row_dot_f32, float, load_f32, scalar_f32)
DEFINE_ROW_DOT(row_dot_bf16, uint16_t, load_bf16, scalar_bf16)
DEFINE_ROW_DOT(row_dot_f16, _Float16, load_f16, scalar_f16)

DEFINE_GEMV(kvlab_gemv_f32, block_dot_f32, row_dot_f32, float, scalar_f32)
DEFINE_GEMV(kvlab_gemv_bf16, block_dot_bf16, row_dot_bf16, uint16_t, scalar_bf16)
DEFINE_GEMV(kvlab_gemv_f16, block_dot_f16, row_dot_f16, _Float16, scalar_f16)

// ---- the small ops around the products in a decode step, float32 ------------------------------
// In PyTorch each is several dispatched kernels of a few microseconds apiece; here, one call.

// y[r] = x[r] / sqrt(mean(x[r]²) + eps) · w, for each of `rows` rows of n (transformers' order)
void kvlab_rms_norm_f32(const float* x, const float* w, float* y, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        v8f acc = {0};
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            v8f v = load_f32(xr + i);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) y[r * n + i] = w[i] * (xr[i] * inv);
    }
}

// Rotate, in place, `heads` heads of head_dim D in each of `tokens` tokens (token t starts at
// x + t·token_stride): x[i] ← x[i]·cos[i] + x[(i + D/2) mod D]·signed_sin[i], with the tables' row t.
void kvlab_rope_f32(float* x, const float* cos, const float* signed_sin, long tokens, long heads, long d,
                    long token_stride) {
    float tmp[1024];
    if (d > 1024) return;  // never called so (gemv.py checks); head dims are 64-256
    long half = d / 2;
    for (long t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = signed_sin + t * d;
        for (long h = 0; h < heads; h++) {
            float* v = x + t * token_stride + h * d;
            memcpy(tmp, v, d * sizeof(float));
            for (long i = 0; i < half; i++) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (long i = half; i < d; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
    }
}
