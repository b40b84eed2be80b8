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
// Threads: the kernels' own pool (pool.c), not OpenMP. A product is a list of work items (blocks of
// output rows) that the calling thread and the pool's workers claim in chunks.
//
// Built at first use with the machine's own C compiler, -O3 -march=native -pthread (see gemv.py).
// GCC/Clang vector extensions keep it portable: 8-float vectors map to AVX/AVX2 registers, or are
// split by the compiler on narrower machines.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "step.h"  // the small ops' prototypes and the activations' ids
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
    static inline void NAME(const W_T* w, const float* x, float* out, int64_t n) {               \
        const W_T *w0 = w, *w1 = w + n, *w2 = w + 2 * n, *w3 = w + 3 * n;                         \
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};        \
        int64_t i = 0;                                                                             \
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
    static inline void NAME(const W_T* w, const float* x, float* out, int64_t n) {               \
        for (int r = 0; r < BLOCK; r++) {                                                          \
            const W_T* wr = w + r * n;                                                             \
            v8f a = {0}, b = {0}, c = {0}, d = {0};                                                \
            int64_t i = 0;                                                                         \
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

// ---- one product as the pool's work items --------------------------------------------------------

#define CHUNK 8  // items (blocks of 32 rows) claimed at a time

typedef void (*BlockFn)(const void* w, const float* x, float* out, int64_t n);
typedef float (*ScalarFn)(const void* w, int64_t i);

typedef struct {
    BlockFn dot;
    ScalarFn scalar;
    const char* w;
    int64_t w_row_bytes;
    const float *x, *bias;
    float* y;
    int64_t m, n, out;
} Gemv;

// Item b < out / BLOCK is output rows 4b .. 4b+3 for every activation row; one more item, when
// out % BLOCK rows are left, is those rows. Each output value is one thread's sum in one fixed order,
// so the result does not depend on the number of threads or on who ran which item.
static void gemv_items(void* ctx, uint32_t begin, uint32_t end) {
    const Gemv g = *(const Gemv*)ctx;
    const int64_t blocks = g.out / BLOCK;
    for (int64_t b = begin; b < end; b++) {
        if (b == blocks) {  // the scalar tail
            for (int64_t o = blocks * BLOCK; o < g.out; o++)
                for (int64_t r = 0; r < g.m; r++) {
                    float s = g.bias ? g.bias[o] : 0.0f;
                    for (int64_t i = 0; i < g.n; i++) s += g.scalar(g.w, o * g.n + i) * g.x[r * g.n + i];
                    g.y[r * g.out + o] = s;
                }
            continue;
        }
        float res[BLOCK];
        for (int64_t r = 0; r < g.m; r++) {
            g.dot(g.w + b * BLOCK * g.w_row_bytes, g.x + r * g.n, res, g.n);
            for (int k = 0; k < BLOCK; k++)
                g.y[r * g.out + b * BLOCK + k] = res[k] + (g.bias ? g.bias[b * BLOCK + k] : 0.0f);
        }
    }
}

// ---- the exported functions: one per weight type ----------------------------------------------
// x: [m, n] float32; y: [m, out] float32; bias: [out] float32 or NULL; W: [out, n]

#define DEFINE_GEMV(NAME, BLOCK_DOT, ROW_DOT, W_T, SCALAR)                                         \
    static void NAME##_block(const void* w, const float* x, float* out, int64_t n) {               \
        if (n <= SHORT_ROW)                                                                        \
            ROW_DOT((const W_T*)w, x, out, n);                                                     \
        else                                                                                       \
            BLOCK_DOT((const W_T*)w, x, out, n);                                                   \
    }                                                                                              \
    static float NAME##_scalar(const void* w, int64_t i) { return SCALAR(((const W_T*)w)[i]); }    \
    void NAME(const W_T* w, const float* x, const float* bias, float* y, int64_t m, int64_t n,     \
              int64_t out, int threads) {                                                          \
        Gemv g = {NAME##_block, NAME##_scalar, (const char*)w, n * (int64_t)sizeof(W_T),           \
                  x, bias, y, m, n, out};                                                          \
        uint32_t items = (uint32_t)(out / BLOCK + (out % BLOCK != 0)); /* gemv.py: out < 2^31 */   \
        kvlab_pool_run(gemv_items, &g, items, CHUNK, threads);                                     \
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
void kvlab_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        v8f acc = {0};
        int64_t i = 0;
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

// y[r, i] = act(gate) · up over `rows` rows of gate_up [rows, 2I] (gate in the first I columns): act
// step.h's ACT_* ids (vec8.h: gated8, 8 values at a time; gated1 the row's last I mod 8). The decode
// step's MLP and the modules' decode-sized passes both call this, so a gated MLP gives the same bits on
// both paths (PyTorch's vectorised tanh and exp differ from these by an ulp here and there).
// gate and up may be apart (row r of each at gate + r·gate_stride, up + r·up_stride): the two halves of
// one fused product, or two products
static void gated_act(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* y,
                      int64_t rows, int64_t I, int act) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float* out = y + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const v8f a = gated8(load_f32(g + i), load_f32(u + i), act);
            memcpy(out + i, &a, sizeof a);
        }
        for (; i < I; i++) out[i] = gated1(g[i], u[i], act);
    }
}

void kvlab_gated_act_f32(const float* gate_up, float* y, int64_t rows, int64_t I, int act) {
    gated_act(gate_up, 2 * I, gate_up + I, 2 * I, y, rows, I, act);
}

// Rotate, in place, `heads` heads of head_dim D in each of `tokens` tokens (token t starts at
// x + t·token_stride): x[i] ← x[i]·cos[i] + x[(i + D/2) mod D]·signed_sin[i], with the tables' row t.
void kvlab_rope_f32(float* x, const float* cos, const float* signed_sin, int64_t tokens, int64_t heads, int64_t d,
                    int64_t token_stride) {
    float tmp[1024];
    if (d > 1024) return;  // never called so (gemv.py checks); head dims are 64-256
    int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = signed_sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float* v = x + t * token_stride + h * d;
            memcpy(tmp, v, d * sizeof(float));
            for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (int64_t i = half; i < d; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
    }
}

// ---- the same small ops over a prompt's rows, on the pool --------------------------------------
// A prompt pass's norms, rotations and activations are hundreds of rows; each row is the functions
// above on its own, so the rows split over the threads give the same bits as one thread. Run in
// PyTorch instead they took OpenMP's threads, which then spun on the core the pool's products need.

enum { OP_RMS_NORM, OP_GATED_ACT, OP_ROPE };

typedef struct {
    int op, act;
    const float *a, *b;  // x and w (norm), gate and up (act), cos and signed_sin (rope)
    float* y;            // the output (norm, act), the rows rotated in place (rope)
    int64_t n, heads, stride, stride_b;  // a row's size; heads (rope); row strides: rope's x or gate, up
    float eps;
} RowOp;

static void row_range(const RowOp* o, int64_t r, int64_t rows) {
    if (o->op == OP_RMS_NORM)
        kvlab_rms_norm_f32(o->a + r * o->n, o->b, o->y + r * o->n, rows, o->n, o->eps);
    else if (o->op == OP_GATED_ACT)
        gated_act(o->a + r * o->stride, o->stride, o->b + r * o->stride_b, o->stride_b, o->y + r * o->n, rows, o->n, o->act);
    else
        kvlab_rope_f32(o->y + r * o->stride, o->a + r * o->n, o->b + r * o->n, rows, o->heads, o->n, o->stride);
}

static void row_op(void* ctx, uint32_t begin, uint32_t end) { row_range(ctx, begin, (int64_t)end - begin); }

#define OP_CHUNK_FLOATS 16384  // about a chunk of work per claim: 64 KB of a row op's input

static void run_row_op(const RowOp* o, int64_t rows, int64_t floats_per_row, int threads) {
    int64_t chunk = OP_CHUNK_FLOATS / (floats_per_row > 0 ? floats_per_row : 1);
    if (chunk < 1) chunk = 1;
    if (threads <= 1 || rows <= chunk || rows > UINT32_MAX) {
        row_range(o, 0, rows);
        return;
    }
    kvlab_pool_run(row_op, (void*)o, (uint32_t)rows, (uint32_t)chunk, threads);
}

void kvlab_rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps, int threads) {
    RowOp o = {OP_RMS_NORM, 0, x, w, y, n, 0, 0, 0, eps};
    run_row_op(&o, rows, n, threads);
}

void kvlab_gated_act_rows(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* y,
                          int64_t rows, int64_t I, int act, int threads) {
    RowOp o = {OP_GATED_ACT, act, gate, up, y, I, 0, gate_stride, up_stride, 0.0f};
    run_row_op(&o, rows, 3 * I, threads);
}

void kvlab_rope_rows(float* x, const float* cos, const float* signed_sin, int64_t tokens, int64_t heads, int64_t d,
                     int64_t token_stride, int threads) {
    RowOp o = {OP_ROPE, 0, cos, signed_sin, x, d, heads, token_stride, 0, 0.0f};
    run_row_op(&o, tokens, heads * d, threads);
}

// ---- greedy picks: each row's argmax ------------------------------------------------------------
// The index of the first of a row's largest values, a NaN counting as the largest (the first NaN's
// index then), as PyTorch's max(dim=-1).indices gives it on a CPU. Per row: eight running maxima and
// whether a NaN was seen, then the first index holding the largest (or the first NaN). The rows of a
// batch split over the threads.

typedef int32_t v8i32 __attribute__((vector_size(32)));

// the larger of v and m lane by lane, m where v is NaN or not larger (the scalar rule below)
static inline v8f max_lanes(v8f v, v8f m) {
#if defined(__AVX__)
    return (v8f)_mm256_max_ps((__m256)v, (__m256)m);  // vmaxps(v, m): v if v > m, else m (NaN included)
#else
    const v8i32 above = v > m;
    return (v8f)(((v8i32)v & above) | ((v8i32)m & ~above));
#endif
}

static int64_t argmax_row(const float* x, int64_t n) {
    const float inf = INFINITY;
    v8f m[4] = {{-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf}};
    for (int j = 1; j < 4; j++) m[j] = m[0];
    v8i32 nan = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)  // four running maxima: no chain of dependent maxima
        for (int j = 0; j < 4; j++) {
            const v8f v = load_f32(x + i + 8 * j);
            m[j] = max_lanes(v, m[j]);
            nan |= v != v;
        }
    for (; i + 8 <= n; i += 8) {
        const v8f v = load_f32(x + i);
        m[0] = max_lanes(v, m[0]);
        nan |= v != v;
    }
    float top = -inf;
    int any_nan = 0;
    for (int j = 0; j < 8; j++) {
        for (int k = 0; k < 4; k++) top = m[k][j] > top ? m[k][j] : top;
        any_nan |= nan[j];
    }
    for (int64_t k = i; k < n; k++) top = x[k] > top ? x[k] : top, any_nan |= x[k] != x[k];
    int64_t k = 0;
    if (any_nan) {
        while (x[k] == x[k]) k++;
        return k;
    }
    for (; k + 8 <= n; k += 8) {
        const v8i32 hit = load_f32(x + k) == top;
        int mask = 0;
        for (int j = 0; j < 8; j++) mask |= (hit[j] & 1) << j;
        if (mask) return k + __builtin_ctz(mask);
    }
    while (x[k] != top) k++;
    return k;
}

typedef struct {
    const float* x;
    int64_t n;
    int64_t* out;
} Argmax;

static void argmax_rows(void* ctx, uint32_t begin, uint32_t end) {
    const Argmax* a = ctx;
    for (uint32_t r = begin; r < end; r++) a->out[r] = argmax_row(a->x + r * a->n, a->n);
}

// out[r] = the argmax of row r of x [rows, n] (n ≥ 1)
void kvlab_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out, int threads) {
    Argmax a = {x, n, out};
    if (rows <= 1 || threads <= 1) {
        argmax_rows(&a, 0, (uint32_t)rows);
        return;
    }
    kvlab_pool_run(argmax_rows, &a, (uint32_t)rows, 1, threads);
}
