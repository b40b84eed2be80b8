// The KV cache's storage formats, the writing side (kvlab/kv/formats.py): a new token's key or value
// encoded into its format in C, the same bytes as the format's `encode`; the Hadamard rotation with
// formats.py's bits; the formats' names for Python's handshake; and both directions as functions of
// their own for the tests (tests/test_fused_decode_kv.py). The reading side is kv_codec.h's.

#include "kv_codec.h"
#include "pool.h"

// The formats' names, by id: Python asks for them (kvlab_kv_format) instead of copying the numbers
static const char* const KV_NAMES[KV_FORMATS] = {"float32", "q8_0", "q4_0", "fp8_e4m3", "bfloat16", "float16"};

const char* kvlab_kv_format(int id) { return id >= 0 && id < KV_FORMATS ? KV_NAMES[id] : 0; }

// -- writing: one vector of D floats into its format, bit for bit what formats.py's `encode` stores.
// PyTorch rounds each operation on its own (x · inv, then + 8.5), so no multiply-add may be fused here.

#if defined(__GNUC__) && !defined(__clang__)
#define SEPARATE_ROUNDINGS __attribute__((optimize("fp-contract=off")))
#else
#define SEPARATE_ROUNDINGS
#endif

// float → float8 e4m3fn, rounded to nearest even, as PyTorch converts (c10's fp8e4m3fn_from_fp32_value):
// 480 and beyond become NaN (0x7F), the encoder's values never exceed 448 by more than a rounding
static uint8_t fp8_e4m3_from_float(float f) {
    uint32_t bits = as_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t code;
    if (bits >= (1087u << 20)) {  // |f| ≥ 480 (or NaN)
        code = 0x7F;
    } else if (bits < (121u << 23)) {  // |f| < 2^-6: a subnormal code: + 2^14 (ulp 2^-9, their step) rounds it
        const uint32_t magic = 141u << 23;
        code = (uint8_t)(as_bits(as_float(bits) + as_float(magic)) - magic);
    } else {  // normal: rebias the exponent, round the 20 dropped mantissa bits to nearest even
        const uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF + odd;
        code = (uint8_t)(bits >> 20);
    }
    return code | (uint8_t)(sign >> 24);
}

// float → bfloat16, rounded to nearest even (c10's round_to_nearest_even); a NaN stays a quiet NaN
static inline uint16_t bf16_from_float(float f) {
    const uint32_t bits = as_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

SEPARATE_ROUNDINGS void kvlab_kv_encode_vector(const KVStore* s, const float* x, int64_t vec, int64_t D) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    if (s->fmt == KV_F32) {
        memcpy((float*)s->codes + vec * D, x, D * sizeof(float));
    } else if (s->fmt == KV_BF16) {
        uint16_t* out = (uint16_t*)s->codes + vec * D;
        for (int64_t i = 0; i < D; i++) out[i] = bf16_from_float(x[i]);
    } else if (s->fmt == KV_F16) {
        _Float16* out = (_Float16*)s->codes + vec * D;
        for (int64_t i = 0; i < D; i++) out[i] = (_Float16)x[i];  // the hardware's conversion: nearest even
    } else if (s->fmt == KV_Q8_0) {
        int8_t* q = (int8_t*)s->codes + vec * D;
        _Float16* scales = (_Float16*)s->scales + vec * (D / QK);
        for (int64_t b = 0; b < D / QK; b++) {
            const float* xb = x + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const _Float16 d = (_Float16)(amax / 127.0f);  // the scale as stored: codes are made with it
            const float inv = (float)d == 0.0f ? 0.0f : 1.0f / (float)d;
            for (int i = 0; i < QK; i++) {
                float v = nearbyintf(xb[i] * inv);  // torch.round: half to even
                v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
                q[b * QK + i] = (int8_t)v;
            }
            scales[b] = d;
        }
    } else if (s->fmt == KV_Q4_0) {
        uint8_t* packed = (uint8_t*)s->codes + vec * (D / 2);
        _Float16* scales = (_Float16*)s->scales + vec * (D / QK);
        for (int64_t b = 0; b < D / QK; b++) {
            const float* xb = x + b * QK;
            int at = 0;  // the first value of largest |x| (torch.argmax)
            for (int i = 1; i < QK; i++)
                if (fabsf(xb[i]) > fabsf(xb[at])) at = i;
            const _Float16 d = (_Float16)(xb[at] / -8.0f);
            const float inv = (float)d == 0.0f ? 0.0f : 1.0f / (float)d;
            uint8_t q[QK];
            for (int i = 0; i < QK; i++) {
                float v = xb[i] * inv;
                v = v + 8.5f;
                v = truncf(v);
                v = v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v;
                q[i] = (uint8_t)v;
            }
            for (int j = 0; j < QK / 2; j++) packed[b * (QK / 2) + j] = q[j] | (uint8_t)(q[j + QK / 2] << 4);
            scales[b] = d;
        }
    } else {  // KV_FP8
        uint8_t* q = (uint8_t*)s->codes + vec * D;
        float amax = 0.0f;
        for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
        float scale = amax / 448.0f;
        if (scale == 0.0f) scale = 1.0f;
        for (int64_t i = 0; i < D; i++) q[i] = fp8_e4m3_from_float(x[i] / scale);
        ((float*)s->scales)[vec] = scale;
    }
}

// -- the Hadamard rotation: x ← x · H, H block-diagonal with blocks of n = the largest power of two
// dividing D, each Sylvester's Hadamard(n) / sqrt(n) (kv/formats.py's `hadamard`). The fast
// Walsh–Hadamard transform: log2 n rounds of butterflies (a, b) → (a + b, a − b), then × 1/sqrt(n):
// the same operations in the same order as formats.py's, so the same bits.

#if defined(__AVX512F__)
// Rounds h = 1, 2, 4 and 8 on 16 values in a register: each lane's partner is lane ^ h, the lanes with bit
// h clear take a + b (self + partner), the others a − b (partner − self); the same operations on the
// same values as the loops below. Those left them to scalar code, 24 calls of D 64 a layer and sequence
// in a decode step with a rotated cache (q, k and v, and each head's output): SmolLM2, q8_0 KV, 16
// sequences, 6% of the step's samples, on the thread the other waited for.
static inline void butterflies16(float* x) {
    __m512 v = _mm512_loadu_ps(x);
    for (int h = 1; h < 16; h *= 2) {
        const __m512i partner = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(h));
        const __mmask16 high = h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00;
        const __m512 p = _mm512_permutexvar_ps(partner, v);
        v = _mm512_mask_blend_ps(high, _mm512_add_ps(v, p), _mm512_sub_ps(p, v));
    }
    _mm512_storeu_ps(x, v);
}
#endif

void kvlab_kv_hadamard(float* x, int64_t D) {
    const int64_t n = D & -D;
    int64_t first = 1;
#if defined(__AVX512F__)
    if (n >= 16) {  // each block of 16 through its first four rounds (they never mix two such blocks)
        for (int64_t i = 0; i < D; i += 16) butterflies16(x + i);
        first = 16;
    }
#endif
    for (int64_t h = first; h < n; h *= 2)  // groups of 2h ≤ n values never straddle two blocks
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = (float)(1.0 / sqrt((double)n));  // n ** -0.5, rounded once to float32
    for (int64_t i = 0; i < D; i++) x[i] *= norm;
}

// -- a prompt pass's keys or values into the cache (kv/paged.py's write, through kernels/decode.py's
// kv_write): vector h of token n of x [N, Hkv, D] (at x + n·sn + h·sh floats, D contiguous), rotated by H
// first where `rotate`, into vector slots[n]·Hkv + h of the store, in one pass: the bytes formats.py's
// encode and index_copy_ write, without their temporaries (the formats it pays for: backends/ops.py's
// KV_WRITES). 0, or −1 where the format cannot take D.
int kvlab_kv_write(int fmt, int rotate, const float* x, int64_t sn, int64_t sh, int64_t N, int64_t Hkv, int64_t D,
                   const int64_t* slots, void* codes, void* scales) {
    if (fmt < 0 || fmt >= KV_FORMATS || ((fmt == KV_Q8_0 || fmt == KV_Q4_0) && D % QK) || D > MAX_HEAD_DIM) return -1;
    const KVStore s = {fmt, codes, scales};
    float buf[MAX_HEAD_DIM];
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < Hkv; h++) {
            const float* v = x + n * sn + h * sh;
            if (rotate) {
                memcpy(buf, v, D * sizeof(float));
                kvlab_kv_hadamard(buf, D);
                v = buf;
            }
            kvlab_kv_encode_vector(&s, v, slots[n] * Hkv + h, D);
        }
    return 0;
}

// -- the same functions for the tests (tests/test_fused_decode_kv.py): `vectors` vectors of D values,
// contiguous; codes and scales as one layer's storage tensors of that many vectors

int kvlab_kv_encode(int fmt, const float* x, int64_t vectors, int64_t D, void* codes, void* scales) {
    if (fmt < 0 || fmt >= KV_FORMATS || ((fmt == KV_Q8_0 || fmt == KV_Q4_0) && D % QK)) return -1;
    const KVStore s = {fmt, codes, scales};
    for (int64_t v = 0; v < vectors; v++) kvlab_kv_encode_vector(&s, x + v * D, v, D);
    return 0;
}

// -- a prompt pass's reading: the stored keys or values of whole blocks (kv/paged.py's gather, through
// kernels/decode.py's kv_gather), each vector decoded (and rotated back by H where `rotate`) into out
// [num, per_block, D] in the order the block ids come: the values formats.py's decode gives. PyTorch's
// decode of a rotated q8_0 cache (index_select, code × scale, the butterflies as a dozen tensor ops over
// the whole gather) was 30% of a SmolLM2 int8 run's samples over 64 prompts of 256 tokens whose steps
// carried decodes.

typedef struct {
    KVStore s;
    int rotate;
    const int64_t* blocks;
    int64_t per_block, D;
    float* out;
} Gather;

static void gather_blocks(void* ctx, uint32_t begin, uint32_t end) {
    const Gather* g = ctx;
    for (int64_t i = begin; i < end; i++)
        for (int64_t v = 0; v < g->per_block; v++) {
            float* dst = g->out + (i * g->per_block + v) * g->D;
            const float* row = decode_vector(&g->s, g->blocks[i] * g->per_block + v, g->D, dst);
            if (row != dst) memcpy(dst, row, g->D * sizeof(float));
            if (g->rotate) kvlab_kv_hadamard(dst, g->D);
        }
}

int kvlab_kv_gather(int fmt, int rotate, const void* codes, const void* scales, const int64_t* blocks, int64_t num,
                    int64_t per_block, int64_t D, float* out, int threads) {
    if (fmt < 0 || fmt >= KV_FORMATS || ((fmt == KV_Q8_0 || fmt == KV_Q4_0) && D % QK) || D > MAX_HEAD_DIM ||
        num < 0 || num >= UINT32_MAX)
        return -1;
    const Gather g = {{fmt, (void*)codes, (void*)scales}, rotate, blocks, per_block, D, out};
    kvlab_pool_run(gather_blocks, (void*)&g, (uint32_t)num, 1, threads);
    return 0;
}

int kvlab_kv_decode(int fmt, const void* codes, const void* scales, int64_t vectors, int64_t D, float* out) {
    if (fmt < 0 || fmt >= KV_FORMATS || ((fmt == KV_Q8_0 || fmt == KV_Q4_0) && D % QK) || D > MAX_HEAD_DIM) return -1;
    const KVStore s = {fmt, (void*)codes, (void*)scales};
    float buf[MAX_HEAD_DIM];
    for (int64_t v = 0; v < vectors; v++) memcpy(out + v * D, decode_vector(&s, v, D, buf), D * sizeof(float));
    return 0;
}

void kvlab_hadamard_f32(float* x, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) kvlab_kv_hadamard(x + r * D, D);
}

