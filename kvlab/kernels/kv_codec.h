// The KV cache's storage formats as decode.c's step reads and writes them (kvlab/kv/formats.py): the
// formats' ids, the storage of one layer's keys or values (KVStore), and the reading side — a stored
// vector decoded as it is read, prefetched ahead — inline, since attention calls it for every cached row.
// The writing side and the Hadamard rotation are kv_codec.c's.

#ifndef KVLAB_KV_CODEC_H
#define KVLAB_KV_CODEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec8.h"

// ---- the KV cache's storage formats (kvlab/kv/formats.py) --------------------------------------
//
//   KV_F32   D floats
//   KV_Q8_0  D int8 codes; D / 32 fp16 scales d = max|x| / 127;   x ≈ d · q
//   KV_Q4_0  D / 2 bytes (per 32 values 16 bytes: byte j holds value j low, value j + 16 high); D / 32
//            fp16 scales d = x_m / −8 (x_m the value of largest |x|);   x ≈ d · (q − 8)
//   KV_FP8   D float8 e4m3 codes (as bytes); one float32 scale s = max|x| / 448;   x ≈ s · e4m3(q)
//   KV_BF16  D bfloat16 values (rounded to nearest even, as PyTorch's .to(torch.bfloat16))
//   KV_F16   D float16 values (rounded to nearest even)
//
// Codes and scales are separate tensors with the same leading dimensions: vector number `vec` has its
// codes at codes + vec · (bytes of one vector's codes) and its scales at scales + vec · (scales each).


enum { KV_F32 = 0, KV_Q8_0 = 1, KV_Q4_0 = 2, KV_FP8 = 3, KV_BF16 = 4, KV_F16 = 5, KV_FORMATS = 6 };
#define QK 32                // values per q8_0 / q4_0 block
#define MAX_HEAD_DIM 512     // the row buffers of attention (decode.py checks head_dim)

typedef struct {
    int32_t fmt;   // KV_*
    void* codes;   // [num_blocks, block_size, kv_heads, one vector's codes]
    void* scales;  // [..., D / 32] fp16 (q8_0, q4_0), [..., 1] float32 (fp8_e4m3), NULL (float32)
} KVStore;

// the cache slot of a sequence's key t, through its block table of blocks of bs tokens
static inline int64_t slot_of(const int64_t* table, int64_t t, int64_t bs) { return table[t / bs] * bs + t % bs; }

static inline float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t as_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

// -- reading: one stored vector as D floats, the very values formats.py's `decode` gives (code × scale
// rounded once), into `buf` (a row in L1; the cache itself is never copied). A float32 row is returned
// where it lies.

#if defined(__F16C__)
// 8 e4m3 codes → their values / 256: the 7 bits below the sign are an fp16's exponent (bias 15, not 7)
// and top mantissa bits, subnormals included, so one fp16 conversion decodes them exactly
static inline v8f fp8x8_over_256(const uint8_t* c) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)c));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    return (v8f)_mm256_cvtph_ps(_mm_or_si128(sign, rest));
}
#endif

static inline float fp8_value(uint8_t code) {  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits
    const int e = (code >> 3) & 0xF, m = code & 7;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return code & 0x80 ? -v : v;
}

static inline const float* decode_vector(const KVStore* s, int64_t vec, int64_t D, float* buf) {
    if (s->fmt == KV_F32) return (const float*)s->codes + vec * D;
    if (s->fmt == KV_BF16) {  // exact: a bfloat16 is a float32's top half
        const uint16_t* h = (const uint16_t*)s->codes + vec * D;
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= D; i += 8) {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + i)));
            store8(buf + i, (v8f)_mm256_slli_epi32(wide, 16));
        }
#endif
        for (; i < D; i++) buf[i] = as_float((uint32_t)h[i] << 16);
        return buf;
    }
    if (s->fmt == KV_F16) {  // exact
        const _Float16* h = (const _Float16*)s->codes + vec * D;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= D; i += 8) store8(buf + i, (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
        for (; i < D; i++) buf[i] = (float)h[i];
        return buf;
    }
    if (s->fmt == KV_Q8_0) {
        const int8_t* q = (const int8_t*)s->codes + vec * D;
        const _Float16* scales = (const _Float16*)s->scales + vec * (D / QK);
        for (int64_t b = 0; b < D / QK; b++) {
            const float d = (float)scales[b];
#if defined(__AVX2__)
            for (int i = 0; i < QK; i += 8) {
                const __m128i codes = _mm_loadl_epi64((const __m128i*)(q + b * QK + i));
                store8(buf + b * QK + i, (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)) * d);
            }
#else
            for (int i = 0; i < QK; i++) buf[b * QK + i] = (float)q[b * QK + i] * d;
#endif
        }
    } else if (s->fmt == KV_Q4_0) {
        const uint8_t* packed = (const uint8_t*)s->codes + vec * (D / 2);
        const _Float16* scales = (const _Float16*)s->scales + vec * (D / QK);
        for (int64_t b = 0; b < D / QK; b++) {
            const float d = (float)scales[b];
            const uint8_t* p = packed + b * (QK / 2);
            float* out = buf + b * QK;
#if defined(__AVX2__)
            const __m128i bytes = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
            const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
            const __m128i nibbles[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
            for (int part = 0; part < 4; part++) {  // values 0-7, 8-15 (low nibbles), 16-23, 24-31 (high)
                const v8f q = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles[part]));
                store8(out + 8 * part, (q - 8.0f) * d);
            }
#else
            for (int j = 0; j < QK / 2; j++) out[j] = (float)((int)(p[j] & 0x0F) - 8) * d;
            for (int j = 0; j < QK / 2; j++) out[j + QK / 2] = (float)((int)(p[j] >> 4) - 8) * d;
#endif
        }
    } else {  // KV_FP8
        const uint8_t* q = (const uint8_t*)s->codes + vec * D;
        const float scale = ((const float*)s->scales)[vec];
        int64_t i = 0;
#if defined(__F16C__)
        const float scale256 = scale * 256.0f;  // exact: (value / 256) · (256 · s) rounds as value · s does
        for (; i + 8 <= D; i += 8) store8(buf + i, fp8x8_over_256(q + i) * scale256);
#endif
        for (; i < D; i++) buf[i] = fp8_value(q[i]) * scale;
    }
    return buf;
}

// -- prefetching: a decode step reads each cached row once, so it waits on memory unless the rows a
// few tokens ahead are already on their way (the hardware's prefetcher does not follow block tables)

#define PREFETCH_AHEAD 8  // tokens

static inline int64_t code_bytes(int32_t fmt, int64_t D) {
    return fmt == KV_F32 ? D * 4 : fmt == KV_BF16 || fmt == KV_F16 ? D * 2 : fmt == KV_Q4_0 ? D / 2 : D;
}

// A line on its way to L1 (TO_L2 = 0) or to L2 only (1). As asm: GCC deleted the loops of
// __builtin_prefetch over a vector's lines inlined in attention.c's chunk loops (none were left in
// the object code), so the attention's prefetching had never run.
static inline void prefetch_line(const void* p, const int TO_L2) {
#if defined(__x86_64__) || defined(__i386__)
    if (TO_L2) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char*)p));
    else __asm__ volatile("prefetcht0 %0" : : "m"(*(const char*)p));
#else
    if (TO_L2) __builtin_prefetch(p, 0, 2);
    else __builtin_prefetch(p, 0, 3);
#endif
}

static inline void prefetch_vector_to(const KVStore* s, int64_t vec, int64_t D, const int TO_L2) {
    const int64_t bytes = code_bytes(s->fmt, D);
    const char* codes = (const char*)s->codes + vec * bytes;
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line(codes + off, TO_L2);
    if (s->fmt == KV_Q8_0 || s->fmt == KV_Q4_0)
        prefetch_line((const char*)s->scales + vec * (D / QK) * 2, TO_L2);
    else if (s->fmt == KV_FP8)
        prefetch_line((const float*)s->scales + vec, TO_L2);
}

static inline void prefetch_vector(const KVStore* s, int64_t vec, int64_t D) { prefetch_vector_to(s, vec, D, 0); }

// x [D] into its format: vector number `vec` of the store, bit for bit what formats.py's `encode` writes
void kvlab_kv_encode_vector(const KVStore* s, const float* x, int64_t vec, int64_t D);

// x [D] ← x · H, H the block-diagonal Hadamard matrix of kv/formats.py's `hadamard` (its bits); rows of them
void kvlab_kv_hadamard(float* x, int64_t D);
void kvlab_hadamard_f32(float* x, int64_t rows, int64_t D);

#endif
