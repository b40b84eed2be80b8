// Small-batch matrix-vector products for decode on a CPU: y[m, o] = sum_i x[m, i] * W[o, i] (+ b[o]).
//
// Decode multiplies a handful of activation rows by every weight matrix: the arithmetic is tiny
// and the time is the time to stream W from memory. BLAS with one row streams well under the
// machine's read bandwidth; this kernel reads W exactly once, in order, split between threads by
// blocks of 4 output rows. Each block is 4 sequential streams (good for the prefetchers); every
// activation row is multiplied against the block while it sits in L1; 8 vector accumulators of
// 8 floats stay in registers. W may be float32, bfloat16 or float16; x, y and the sums are float32.
//
// Built at first use with the machine's own C compiler, -O3 -march=native -fopenmp (see gemv.py).
// GCC/Clang vector extensions keep it portable: 8-float vectors map to AVX/AVX2 registers, or are
// split by the compiler on narrower machines.

#include <stdint.h>
#include <string.h>

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

static inline v8f load_bf16(const uint16_t* p) {  // bfloat16 is the top half of a float32
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline v8f load_f16(const _Float16* p) {
    v8f16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}

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

// x: [m, n] float32; y: [m, out] float32; bias: [out] float32 or NULL; W: [out, n]
#define DEFINE_GEMV(NAME, BLOCK_DOT, W_T, SCALAR)                                                  \
    void NAME(const W_T* w, const float* x, const float* bias, float* y, long m, long n, long out) {\
        long blocks = out / BLOCK;                                                                 \
        _Pragma("omp parallel for schedule(static)")                                               \
        for (long b = 0; b < blocks; b++) {                                                        \
            float res[BLOCK];                                                                      \
            for (long r = 0; r < m; r++) {                                                         \
                BLOCK_DOT(w + b * BLOCK * n, x + r * n, res, n);                                   \
                for (int j = 0; j < BLOCK; j++)                                                    \
                    y[r * out + b * BLOCK + j] = res[j] + (bias ? bias[b * BLOCK + j] : 0.0f);     \
            }                                                                                      \
        }                                                                                          \
        for (long o = blocks * BLOCK; o < out; o++)  /* the last out % 4 rows */                   \
            for (long r = 0; r < m; r++) {                                                         \
                float s = bias ? bias[o] : 0.0f;                                                   \
                for (long i = 0; i < n; i++) s += SCALAR(w[o * n + i]) * x[r * n + i];              \
                y[r * out + o] = s;                                                                \
            }                                                                                      \
    }

DEFINE_BLOCK_DOT(block_dot_f32, float, load_f32, scalar_f32)
DEFINE_BLOCK_DOT(block_dot_bf16, uint16_t, load_bf16, scalar_bf16)
DEFINE_BLOCK_DOT(block_dot_f16, _Float16, load_f16, scalar_f16)

DEFINE_GEMV(kvlab_gemv_f32, block_dot_f32, float, scalar_f32)
DEFINE_GEMV(kvlab_gemv_bf16, block_dot_bf16, uint16_t, scalar_bf16)
DEFINE_GEMV(kvlab_gemv_f16, block_dot_f16, _Float16, scalar_f16)
