// Small-batch matrix-vector products for decode on a CPU: y[m, o] = sum_i x[m, i] * W[o, i] (+ b[o]).
//
// Decode multiplies a handful of activation rows by every weight matrix: the work is tiny and the
// time is the time to stream W from memory. BLAS sgemm with one row streams well under the machine's
// read bandwidth; this kernel reads W exactly once, in order, split between threads by output rows:
// each thread takes a block of 4 rows (one contiguous stretch of W), and every activation row is
// multiplied against that block while it sits in L1. Sixteen partial sums per row keep the loop
// vectorisable without reordering any float operation across lanes.
//
// Built at first use with the machine's own compiler and `-march=native` (see gemv.py).

#include <stdint.h>
#include <string.h>

#define LANES 16
#define BLOCK 4

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// One generator per weight type: W_T is the stored element, LOAD converts one to float.
#define DEFINE_ROWS(NAME, W_T, LOAD)                                                              \
    static void NAME(const W_T* w, const float* x, float* out, long n) {                       \
        float acc[BLOCK][LANES];                                                                  \
        memset(acc, 0, sizeof acc);                                                               \
        long i = 0;                                                                               \
        for (; i + LANES <= n; i += LANES)                                                        \
            for (int r = 0; r < BLOCK; r++)                                                       \
                for (int k = 0; k < LANES; k++)                                                   \
                    acc[r][k] += LOAD(w[r * n + i + k]) * x[i + k];                               \
        for (int r = 0; r < BLOCK; r++) {                                                         \
            float s = 0.0f;                                                                       \
            for (int k = 0; k < LANES; k++) s += acc[r][k];                                       \
            for (long j = i; j < n; j++) s += LOAD(w[r * n + j]) * x[j];                          \
            out[r] = s;                                                                           \
        }                                                                                         \
    }                                                                                             \
    static float NAME##_one(const W_T* w, const float* x, long n) {                             \
        float s = 0.0f;                                                                           \
        for (long j = 0; j < n; j++) s += LOAD(w[j]) * x[j];                                      \
        return s;                                                                                 \
    }

#define LOAD_F32(v) (v)
#define LOAD_BF16(v) bf16_to_f32(v)
#define LOAD_F16(v) ((float)(v))

DEFINE_ROWS(rows_f32, float, LOAD_F32)
DEFINE_ROWS(rows_bf16, uint16_t, LOAD_BF16)
DEFINE_ROWS(rows_f16, _Float16, LOAD_F16)

// x: [m, n] float32 (the caller converts 16-bit activations; they are a few KB)
// y: [m, out] float32; bias: [out] float32 or NULL
#define DEFINE_GEMV(NAME, ROWS, W_T)                                                              \
    void NAME(const W_T* w, const float* x, const float* bias, float* y, long m, long n,          \
              long out) {                                                                         \
        long blocks = out / BLOCK;                                                                \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (long b = 0; b < blocks; b++) {                                                       \
            const W_T* wb = w + b * BLOCK * n;                                                    \
            float res[BLOCK];                                                                     \
            for (long r = 0; r < m; r++) {                                                        \
                ROWS(wb, x + r * n, res, n);                                                      \
                for (int j = 0; j < BLOCK; j++)                                                   \
                    y[r * out + b * BLOCK + j] = res[j] + (bias ? bias[b * BLOCK + j] : 0.0f);    \
            }                                                                                     \
        }                                                                                         \
        for (long o = blocks * BLOCK; o < out; o++)                                               \
            for (long r = 0; r < m; r++)                                                          \
                y[r * out + o] = ROWS##_one(w + o * n, x + r * n, n) + (bias ? bias[o] : 0.0f);   \
    }

DEFINE_GEMV(kvlab_gemv_f32, rows_f32, float)
DEFINE_GEMV(kvlab_gemv_bf16, rows_bf16, uint16_t)
DEFINE_GEMV(kvlab_gemv_f16, rows_f16, _Float16)
