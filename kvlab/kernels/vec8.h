// Eight floats at a time in GCC's vector types (two AVX registers' worth, or one), and the functions of
// them the kernels share: e^x, and a gated MLP's activation, whose bits must be the same wherever it runs
// (gemv.c's small op, quant_i8.c's gated bfloat16 products, the decode step through gemv.c).

#ifndef KVLAB_VEC8_H
#define KVLAB_VEC8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

typedef int32_t v8i __attribute__((vector_size(32)));

// e^x for 8 values whose 2^n below is a normal float (x in about [-87.3, 88.3]: the callers bound it),
// within about 1 ulp: x = n ln2 + r, |r| ≤ ln2 / 2, e^r by Cephes' polynomial, 2^n put in the exponent
// bits. Attention's softmax weights (attention.c) and the gated activations (gated8) use it.
static inline v8f exp_normal8(v8f x) {
    const float magic = 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
    const v8f n = (x * 1.44269504f + magic) - magic;
    const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: r exact enough
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f y = p * r * r + r + 1.0f;
    return y * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACTIVATIONS = 2 };  // the gated MLP's activation of its gate

// e^x for 8 values, x clamped to [-87.3, 88.3] (e^x and the 2^n it is built from normal floats)
static inline v8f exp_v8(v8f x) {
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8f hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    const v8i below = x < lo, above = x > hi;  // lanes of -1 where true
    return exp_normal8((v8f)(((v8i)x & ~(below | above)) | ((v8i)lo & below) | ((v8i)hi & above)));
}

// act(g) · u for 8 values: act SiLU (ACT_SILU) or GELU with tanh's approximation (ACT_GELU_TANH; PyTorch's
// approximate="tanh"). Both are g·σ(t): SiLU t = g; GELU's 0.5·(1 + tanh z) is σ(2z), t = 2z, z = √(2/π)(g +
// 0.044715 g³); σ(t) = 1 / (1 + e^−t). gemv.c's gated_act and quant_i8.c's gated bfloat16 products both call
// it, so a gated MLP has the same bits on either.
#define GELU_TANH_K2 (2.0f * 0.7978845608028654f)  // 2·sqrt(2 / pi)

static inline v8f gated8(v8f g, v8f u, int act) {
    const v8f t = act == ACT_GELU_TANH ? GELU_TANH_K2 * (g + 0.044715f * g * g * g) : g;
    return g / (1.0f + exp_v8(-t)) * u;
}

// gated8 for one value (a row's last I mod 8), with libm's expf
static inline float gated1(float g, float u, int act) {
    const float t = act == ACT_GELU_TANH ? GELU_TANH_K2 * (g + 0.044715f * g * g * g) : g;
    return g / (1.0f + expf(-t)) * u;
}

#endif
