// The vector pieces attention is made of (attention.c's decode step, prompt_attention.c's prompt passes):
// dot products one and eight keys at a time, the largest of a run of scores, e^x for a softmax's
// weights, and o += p · v. Inline: every key of every step goes through them.

#ifndef KVLAB_ATTENTION_H
#define KVLAB_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

// a · b over D floats
static inline float dot(const float* a, const float* b, int64_t D) {
    v8f s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        s0 += load8(a + i) * load8(b + i);
        s1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= D; i += 8) s0 += load8(a + i) * load8(b + i);
    float s = hsum8(s0 + s1);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

// Eight keys' lane sums (acc[r]: key r's 8 lanes) → their eight dots, by one transposing reduction
// instead of a horizontal sum per key
static inline v8f sums8(const v8f* acc) {
#if defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]), t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]), t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes 0-3: halves of keys 0-3, 4-7
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8f out;
    for (int r = 0; r < 8; r++) out[r] = hsum8(acc[r]);
    return out;
#endif
}

// The dots of one query with 8 keys k[0..7] (D floats each): eight accumulators, then sums8
static inline __attribute__((always_inline)) v8f dot8(const float* q, const float* const k[8], int64_t D) {
    v8f acc[8] = {{0}};
    for (int64_t i = 0; i + 8 <= D; i += 8) {
        const v8f x = load8(q + i);
        for (int r = 0; r < 8; r++) acc[r] += x * load8(k[r] + i);
    }
    return sums8(acc);
}

typedef float v16f __attribute__((vector_size(64)));  // one AVX-512 register; two AVX ones elsewhere

static inline v16f load16(const float* p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float* p, v16f v) { memcpy(p, &v, sizeof v); }

// dot8 for D a multiple of 16, 16 lanes at a time: half the multiply-adds of 8 lanes on AVX-512. Each
// key's 16 lane sums are folded to 8 (lane i + lane i + 8), then reduced by sums8. Where a vector holds
// 8 floats (AVX2) the 16 lanes are two registers, written out: GCC's code for the 64-byte generic vector
// moved them through the stack, and eight keys' sums spilled; here the keys go four at a time, so that
// their sums fill half the 16 registers. The same operations per lane either way. With the values' 8-lane
// loop below (the 16-lane one AVX-512's only, the weights broadcast once a row), on an AMD EPYC Zen 3 VM
// (AVX2), SmolLM2's shape over 30 layers: 960 keys of one sequence in cache, one thread, 6.4 -> 2.4 ms;
// from memory, 2 threads, 4.9 -> 3.1; 16 sequences over 128 keys 9.9 -> 5.5; its decode step after 960
// tokens (int8) 11.3-13.7 -> 9.0-10.5 ms.
#if defined(__AVX512F__)
#define WIDE 1  // 16 lanes a register
#else
#define WIDE 0
#endif

#if WIDE
// Eight keys' 16 lane sums (acc[r]: key r's) → their eight dots: each key's lanes folded (lane i + lane
// i + 8), then sums8's additions, the same operands paired in the same order (the same bits), but two
// keys to a register from the first fold on: 24 instructions where a fold per key and sums8's
// horizontal adds (three micro-operations each) took 37.
static inline __attribute__((always_inline)) v8f sums8_wide(const v16f* acc) {
    __m512 h[4];  // h[j]: lanes 0-7 key 2j's folded lanes, 8-15 key 2j + 1's
    for (int j = 0; j < 4; j++) {
        const __m512 a = (__m512)acc[2 * j], b = (__m512)acc[2 * j + 1];
        h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    // in each 128-bit block, neighbours added (sums8's first hadd): blocks 0, 1 of p01 keys 0 and 2, 2, 3 keys 1 and 3
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], 0x88), _mm512_shuffle_ps(h[0], h[1], 0xDD));
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_ps(h[2], h[3], 0x88), _mm512_shuffle_ps(h[2], h[3], 0xDD));
    // again (its second): block 0 the first half's sums of keys 0, 2, 4, 6, block 1 their second half's,
    // blocks 2 and 3 the same of keys 1, 3, 5, 7
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(p01, p23, 0x88), _mm512_shuffle_ps(p01, p23, 0xDD));
    const __m512 s = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));  // first half + second half
    const __m512 order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), s);
    return (v8f)_mm512_castps512_ps256(order);
}
#endif

static inline __attribute__((always_inline)) v8f dot8_wide(const float* q, const float* const k[8], int64_t D) {
#if WIDE
    v16f acc[8] = {{0}};
    for (int64_t i = 0; i < D; i += 16) {
        const v16f x = load16(q + i);
        for (int r = 0; r < 8; r++) acc[r] += x * load16(k[r] + i);
    }
    return sums8_wide(acc);
#else
    v8f half[8];
    for (int r0 = 0; r0 < 8; r0 += 4) {
        v8f lo[4] = {{0}}, hi[4] = {{0}};
        for (int64_t i = 0; i < D; i += 16) {
            const v8f xl = load8(q + i), xh = load8(q + i + 8);
            for (int r = 0; r < 4; r++) lo[r] += xl * load8(k[r0 + r] + i), hi[r] += xh * load8(k[r0 + r] + i + 8);
        }
        for (int r = 0; r < 4; r++) half[r0 + r] = lo[r] + hi[r];
    }
    return sums8(half);
#endif
}

// the largest of s[lo .. hi − 1] (−inf if none): eight running maxima, then the largest of them. Max
// is exact in any order; a NaN score is passed over, as by the one-at-a-time comparison
static inline float max_of(const float* s, int64_t lo, int64_t hi) {
    float top = -INFINITY;
    int64_t t = lo;
    if (hi - lo >= 8) {
        v8f m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (; t + 8 <= hi; t += 8) {
            const v8f x = load8(s + t);
            const v8i above = x > m;  // lanes of -1 where x is the larger (never where either is NaN)
            m = (v8f)(((v8i)x & above) | ((v8i)m & ~above));
        }
        for (int j = 0; j < 8; j++) top = m[j] > top ? m[j] : top;
    }
    for (; t < hi; t++) top = s[t] > top ? s[t] : top;
    return top;
}

// o += p · v over D floats
static inline void axpy(float* o, float p, const float* v, int64_t D) {
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) store8(o + i, load8(o + i) + p * load8(v + i));
    for (; i < D; i++) o[i] += p * v[i];
}

// below e^-64 of the largest a weight is 0: it cannot move a sum of weights ≥ 1 (float's epsilon is
// e^-16), and the subnormal products it would make cost a hundred cycles each
#define NEGLIGIBLE (-64.0f)

// e^x for 8 values x ≤ 0 at once (a softmax's weights), within about 1 ulp (measured over [-64, 0]);
// below NEGLIGIBLE (and -inf, NaN), 0
static inline v8f exp8(v8f x) {
    const v8i keep = x >= NEGLIGIBLE;          // lanes of -1 (kept) or 0
    x = (v8f)((v8i)x & keep);                  // e^0 computed where the weight is 0 anyway: no overflow
    return (v8f)((v8i)exp_normal8(x) & keep);  // x ≥ -64 here: 2^n a normal float
}

// s[lo .. hi − 1] ← e^(s − top), relative to their largest score `top`: eight at a time, then one by one;
// returns their sum (the eight lanes' sums, then the rest, in that order)
static inline float softmax_weights(float* s, int64_t lo, int64_t hi, float top) {
    int64_t t = lo;
    v8f sums = {0};
    for (; t + 8 <= hi; t += 8) {
        const v8f e = exp8(load8(s + t) - top);
        store8(s + t, e);
        sums += e;
    }
    float sum = hsum8(sums);
    for (; t < hi; t++) {
        s[t] = s[t] - top < NEGLIGIBLE ? 0.0f : expf(s[t] - top);
        sum += s[t];
    }
    return sum;
}

#endif
