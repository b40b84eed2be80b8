// One decoder layer of a decode step in one call: B sequences, one new token each, float32
// activations, the KV cache in any of its storage formats (kvlab/kv/formats.py).
//
// A decode step of a small model is a few hundred small operations; run one by one from Python each
// costs microseconds of dispatch, which with 4-bit weights is more than the products themselves take.
// Here a layer is: RMSNorm, the fused q/k/v product (+ bias), per-head q/k RMSNorm (Qwen3, Gemma 3),
// RoPE (the layer's own table: Python hands its rows), the new K and V written into the paged cache
// through their slots (quantized there into the cache's format), attention over the cached keys each
// sequence sees (all of them, or a sliding window's; read through its block table, straight from the
// stored codes; scores scaled by 1/sqrt(D) or the model's own scale), the o product (normalised again
// in Gemma's "sandwich" layers) and the residual, then RMSNorm, the fused gate/up product, SiLU(gate)·up
// or GELU-tanh(gate)·up (Gemma), the down product (normalised again in a sandwich) and the residual.
//
// The products are the library's own kernels (gemv.c for float matrices, quant.c for block formats,
// on the pool), so they give the same bits as the layer-by-layer path; RMSNorm and RoPE too (the
// same C functions). Attention and SiLU are computed here in float32: the same values as
// PyTorch's up to the order of sums and the exp implementation. A quantized key or value is decoded
// here to the very floats formats.py's `decode` gives (code × scale, one rounding at most), one row at
// a time into registers / L1, never into a float copy of the cache.
//
// Layout of the paged cache (kv/paged.py): each storage tensor is [block, offset, kv_head, ...]; token
// p of a sequence is in block table[p / block_size] at offset p % block_size, its vector for kv head g
// is number (slot · kv_heads + g) of every storage tensor of the layer.
//
// Keys, values or both may be stored rotated (kv/formats.py's `Rotated`: multiplied by H, Sylvester's
// Hadamard matrix / sqrt(n) on blocks of n values, symmetric, H·H = I). With `rotate_k` the new k
// (after RoPE) is rotated before it is quantized and q is rotated before scoring, (qH)·(kH) = q·k, so
// the keys are never rotated back; with `rotate_v` the new v is rotated before it is quantized and
// each head's output, a sum of rotated values, is rotated back once. H is applied as a fast
// Walsh–Hadamard transform (n log n adds), the same bits as formats.py's.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// the library's other kernels (gemv.c, quant.c)
void kvlab_gemv_f32(const float* w, const float* x, const float* bias, float* y, int64_t m, int64_t n, int64_t out,
                    int threads);
void kvlab_gemv_bf16(const uint16_t* w, const float* x, const float* bias, float* y, int64_t m, int64_t n,
                     int64_t out, int threads);
void kvlab_gemv_f16(const _Float16* w, const float* x, const float* bias, float* y, int64_t m, int64_t n,
                    int64_t out, int threads);
int kvlab_shm_allreduce(uint8_t* segment, int rank, int world, int64_t capacity, float* data, int64_t n, int64_t seq,
                        double timeout_s);
int kvlab_quant_matmul(int fmt, const uint8_t* w, int64_t ldw, const float* x, float* y, int64_t m, int64_t n,
                       int64_t ldy, int64_t out, int threads);
void kvlab_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);
void kvlab_rope_f32(float* x, const float* cos, const float* signed_sin, int64_t tokens, int64_t heads, int64_t d,
                    int64_t token_stride);

#define MAX_PARTS 3

// One matrix of a linear layer: a float matrix (kind FLOAT_*, one part, row-major [rows, n]) or the
// blocks of a GGUF format (kind BLOCKS, `fmt` a quant.c id, `ldw` bytes per row).
enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2, BLOCKS = 3 };

typedef struct {
    int32_t kind, fmt;
    const void* w;
    int64_t ldw, rows;
} Part;

typedef struct {
    int32_t num_parts;
    Part parts[MAX_PARTS];
    const float* bias;  // [out] or NULL
    int64_t in, out;
} Linear;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACTIVATIONS = 2 };  // the gated MLP's activation of its gate

// The activations' names (kvlab/config/layers.py's DenseMLP.activation), by id: Python asks for them
static const char* const ACT_NAMES[ACTIVATIONS] = {"silu", "gelu_pytorch_tanh"};

const char* kvlab_decode_activation(int id) { return id >= 0 && id < ACTIVATIONS ? ACT_NAMES[id] : 0; }

// A tensor-parallel rank's all-reduce after its row-parallel products (o, down), over the shared-memory
// segment of allreduce.c: the same call, and the same call counter, as kvlab/parallel/shm.py's.
typedef struct {
    uint8_t* segment;
    int32_t rank, world;
    int64_t capacity;  // floats per rank's slot
    int64_t* calls;    // the calls made so far, shared with Python's (each call's number is its sequence)
    double timeout_s;
} Reduce;

// One decoder layer as the model's modules describe it (kernels/decode.py builds it from them; the
// struct is written once, here, and Python checks its size against its own at load).
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    float qk_scale;                             // scores = q · k · qk_scale (1/sqrt(D), or the model's)
    int32_t activation;                         // ACT_*
    int64_t window;                             // 0: every key; W: the query and the W − 1 keys before it
    const float *attn_norm, *mlp_norm;          // [hidden]: before attention, before the MLP
    const float *attn_out_norm, *mlp_out_norm;  // [hidden]: on their outputs (Gemma's sandwich), or NULL
    const float *q_norm, *k_norm;               // [head_dim], or NULL
    Linear qkv, o, gate_up, down;
    const Reduce* reduce;                       // a tensor-parallel rank: o's and down's sums over ranks; or NULL
} Layer;

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

// The formats' names, by id: Python asks for them (kvlab_kv_format) instead of copying the numbers
static const char* const KV_NAMES[KV_FORMATS] = {"float32", "q8_0", "q4_0", "fp8_e4m3", "bfloat16", "float16"};

const char* kvlab_kv_format(int id) { return id >= 0 && id < KV_FORMATS ? KV_NAMES[id] : 0; }
#define QK 32                // values per q8_0 / q4_0 block
#define MAX_HEAD_DIM 512     // the row buffers of attention (decode.py checks head_dim)

typedef struct {
    int32_t fmt;   // KV_*
    void* codes;   // [num_blocks, block_size, kv_heads, one vector's codes]
    void* scales;  // [..., D / 32] fp16 (q8_0, q4_0), [..., 1] float32 (fp8_e4m3), NULL (float32)
} KVStore;

typedef float v8f __attribute__((vector_size(32)));

// the cache slot of a sequence's key t, through its block table of blocks of bs tokens
static inline int64_t slot_of(const int64_t* table, int64_t t, int64_t bs) { return table[t / bs] * bs + t % bs; }

static inline v8f load8(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

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

SEPARATE_ROUNDINGS static void encode_vector(const KVStore* s, const float* x, int64_t vec, int64_t D) {
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

static float fp8_value(uint8_t code) {  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits
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

static inline void prefetch_vector(const KVStore* s, int64_t vec, int64_t D) {
    const int64_t bytes = code_bytes(s->fmt, D);
    const char* codes = (const char*)s->codes + vec * bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(codes + off);
    if (s->fmt == KV_Q8_0 || s->fmt == KV_Q4_0)
        __builtin_prefetch((const char*)s->scales + vec * (D / QK) * 2);
    else if (s->fmt == KV_FP8)
        __builtin_prefetch((const float*)s->scales + vec);
}

// -- the Hadamard rotation: x ← x · H, H block-diagonal with blocks of n = the largest power of two
// dividing D, each Sylvester's Hadamard(n) / sqrt(n) (kv/formats.py's `hadamard`). The fast
// Walsh–Hadamard transform: log2 n rounds of butterflies (a, b) → (a + b, a − b), then × 1/sqrt(n):
// the same operations in the same order as formats.py's, so the same bits.

static void hadamard(float* x, int64_t D) {
    const int64_t n = D & -D;
    for (int64_t h = 1; h < n; h *= 2)  // groups of 2h ≤ n values never straddle two blocks
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = (float)(1.0 / sqrt((double)n));  // n ** -0.5, rounded once to float32
    for (int64_t i = 0; i < D; i++) x[i] *= norm;
}

// -- the same functions for the tests (tests/test_fused_decode_kv.py): `vectors` vectors of D values,
// contiguous; codes and scales as one layer's storage tensors of that many vectors

int kvlab_kv_encode(int fmt, const float* x, int64_t vectors, int64_t D, void* codes, void* scales) {
    if (fmt < 0 || fmt >= KV_FORMATS || ((fmt == KV_Q8_0 || fmt == KV_Q4_0) && D % QK)) return -1;
    const KVStore s = {fmt, codes, scales};
    for (int64_t v = 0; v < vectors; v++) encode_vector(&s, x + v * D, v, D);
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
    for (int64_t r = 0; r < rows; r++) hadamard(x + r * D, D);
}

typedef struct {
    int64_t batch;                       // B sequences, one new token each
    const float *cos, *signed_sin;       // [B, head_dim]: each token's RoPE angles (kvlab/model/rope.py)
    KVStore k, v;                        // this layer's keys and values, each in its format
    int64_t block_size;
    const int64_t* slots;                // [B]: where each new token's K/V goes
    const int64_t* block_tables;         // [B, table_stride]
    int64_t table_stride;
    const int64_t* num_keys;             // [B]: keys in each sequence's table, its new token included
    const int64_t* first_key;            // [B]: the first of them the layer's window shows (0 without one)
    int64_t max_keys;
    float* scratch;                      // kvlab_decode_scratch_floats(...) floats
    int32_t rotate_k, rotate_v;          // keys / values stored Hadamard-rotated (KVFormats.rotate_k, _v)
} Step;

// The structs' sizes, for kernels/decode.py to check its own against at load
void kvlab_decode_struct_sizes(int64_t* out) {
    out[0] = sizeof(Part);
    out[1] = sizeof(Linear);
    out[2] = sizeof(Layer);
    out[3] = sizeof(KVStore);
    out[4] = sizeof(Step);
    out[5] = sizeof(Reduce);
}

// Attention splits each sequence's keys into chunks of CHUNK_KEYS (a fixed size, so that no value
// depends on the thread count): one work item per (sequence, chunk), every head at once. Each item
// leaves, per query head, its chunk's largest score, sum of weights and weighted sum of values; the
// chunks are then merged (flash-decoding). At one sequence and a long context that keeps every thread
// busy, whatever the number of kv heads, and each item reads whole blocks of the cache in order.
#define CHUNK_KEYS 128

static inline int64_t num_chunks(int64_t max_keys) { return (max_keys + CHUNK_KEYS - 1) / CHUNK_KEYS; }

// Floats of scratch a step needs: qkv, attention output, a norm's output, gate/up, SiLU·up, the score
// rows of every (sequence, head), and each chunk's partial results (max, sum, D values) per head.
int64_t kvlab_decode_scratch_floats(int64_t batch, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t intermediate, int64_t max_keys) {
    int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    return batch * (qkv + heads * head_dim + hidden + 3 * intermediate) + batch * heads * max_keys +
           batch * num_chunks(max_keys) * heads * (head_dim + 2);
}

// y [m, l->out] (row stride ldy) = x [m, l->in] · Wᵀ + bias, part by part into its columns
static void linear(const Linear* l, const float* x, float* y, int64_t m, int64_t ldy, int threads) {
    int64_t column = 0;
    for (int p = 0; p < l->num_parts; p++) {
        const Part* part = &l->parts[p];
        if (part->kind == BLOCKS) {
            kvlab_quant_matmul(part->fmt, part->w, part->ldw, x, y + column, m, l->in, ldy, part->rows, threads);
        } else {  // a float matrix is a layer's only part, written with its bias, as the unfused path does
            if (part->kind == FLOAT32)
                kvlab_gemv_f32(part->w, x, l->bias, y, m, l->in, l->out, threads);
            else if (part->kind == BFLOAT16)
                kvlab_gemv_bf16(part->w, x, l->bias, y, m, l->in, l->out, threads);
            else
                kvlab_gemv_f16(part->w, x, l->bias, y, m, l->in, l->out, threads);
            return;
        }
        column += part->rows;
    }
    if (l->bias)  // the blocks' products, then the bias: one rounding, as PackedLinear adds it
        for (int64_t i = 0; i < m; i++)
            for (int64_t o = 0; o < l->out; o++) y[i * ldy + o] += l->bias[o];
}

// ---- attention: one work item per (sequence, chunk of keys), every head ------------------------
//
// A kv head's group of query heads share its keys and values: each cached row is decoded once and
// used by all of them. Per chunk: scores first (q · k / sqrt(D) for each key), then each head's
// softmax over the chunk (relative to the chunk's largest score), then the weighted sum of the
// values. `merge` then combines the chunks of each head, exactly as one softmax over all keys.

typedef struct {
    const Layer* layer;
    const Step* step;
    const float* qkv;  // [B, (H + 2 Hkv) · D], q and k rotated (RoPE; and Hadamard with `rotate_k`)
    float* out;        // [B, H · D]
    float* scores;     // [B · H, max_keys]
    float* partial;    // [B, chunks, H, D + 2]: per chunk and head, its max score, sum of weights, Σ weight · v
    int64_t chunks;    // chunks per sequence (num_chunks(max_keys))
} Attend;

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

// The dots of one query with 8 keys k[0..7] (D floats each): eight accumulators, then one transposing
// reduction for all eight instead of a horizontal sum per key
static inline v8f dot8(const float* q, const float* const k[8], int64_t D) {
    v8f acc[8] = {{0}};
    for (int64_t i = 0; i + 8 <= D; i += 8) {
        const v8f x = load8(q + i);
        for (int r = 0; r < 8; r++) acc[r] += x * load8(k[r] + i);
    }
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
// below NEGLIGIBLE (and -inf, NaN), 0.
// x = n ln2 + r, |r| ≤ ln2 / 2: e^r by Cephes' polynomial, 2^n put in the exponent bits.
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f exp8(v8f x) {
    const v8i keep = x >= NEGLIGIBLE;      // lanes of -1 (kept) or 0
    x = (v8f)((v8i)x & keep);              // e^0 computed where the weight is 0 anyway: no overflow
    const float magic = 12582912.0f;       // 1.5 · 2^23: adding it rounds to an integer
    const v8f n = (x * 1.44269504f + magic) - magic;
    const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: r exact enough
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f y = p * r * r + r + 1.0f;
    const v8i exponent = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n, n ≥ -93 here: a normal float
    return (v8f)((v8i)(y * (v8f)exponent) & keep);
}

static void attend_items(void* ctx, uint32_t begin, uint32_t end) {
    const Attend* a = ctx;
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = L->head_dim, H = L->heads, Hkv = L->kv_heads, group = H / Hkv;
    const int64_t qkv_row = (H + 2 * Hkv) * D, bs = S->block_size, stride = S->max_keys;
    const float scale = L->qk_scale;
    float kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM], kbuf8[8 * MAX_HEAD_DIM];
    for (uint32_t item = begin; item < end; item++) {
        const int64_t b = item / a->chunks, c = item % a->chunks, n = S->num_keys[b], first = S->first_key[b];
        const int64_t start = c * CHUNK_KEYS, hi = start + CHUNK_KEYS < n ? start + CHUNK_KEYS : n;
        if (start >= n || hi <= first) continue;  // past this sequence's keys, or before its window (merge skips it)
        const int64_t lo = start > first ? start : first;  // a window may begin inside the chunk
        const int64_t* table = S->block_tables + b * S->table_stride;
        const float* q = a->qkv + b * qkv_row;       // H query heads, kv head g's group at g · group
        float* scores = a->scores + b * H * stride;  // row h: head h's scores
        float* partial = a->partial + (b * a->chunks + c) * H * (D + 2);

        // scores: every key decoded once, dotted with each query head of its kv head's group; eight
        // keys at a time (D a multiple of 8), then one by one
        int64_t t = lo;
        if (D % 8 == 0)
            for (; t + 8 <= hi; t += 8) {
                int64_t slots[8];
                for (int r = 0; r < 8; r++) slots[r] = slot_of(table, t + r, bs);
                const int64_t ahead = t + 8 + PREFETCH_AHEAD < hi ? t + 8 + PREFETCH_AHEAD : -1;
                for (int64_t g = 0; g < Hkv; g++) {
                    if (ahead >= 0)
                        for (int r = 0; r < 8; r++)
                            prefetch_vector(&S->k, slot_of(table, ahead + r, bs) * Hkv + g, D);
                    const float* k[8];
                    for (int r = 0; r < 8; r++) k[r] = decode_vector(&S->k, slots[r] * Hkv + g, D, kbuf8 + r * D);
                    for (int64_t h = g * group; h < (g + 1) * group; h++)
                        store8(scores + h * stride + t, dot8(q + h * D, k, D) * scale);
                }
            }
        for (; t < hi; t++) {
            const int64_t slot = slot_of(table, t, bs), ahead = t + PREFETCH_AHEAD;
            const int64_t slot_ahead = ahead < hi ? slot_of(table, ahead, bs) : -1;
            for (int64_t g = 0; g < Hkv; g++) {
                if (slot_ahead >= 0) prefetch_vector(&S->k, slot_ahead * Hkv + g, D);
                const float* k = decode_vector(&S->k, slot * Hkv + g, D, kbuf);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    scores[h * stride + t] = dot(q + h * D, k, D) * scale;
            }
        }
        // each head's weights over the chunk, relative to the chunk's largest score
        for (int64_t h = 0; h < H; h++) {
            float* s = scores + h * stride;
            float top = -INFINITY, sum = 0.0f;
            for (int64_t t = lo; t < hi; t++) top = s[t] > top ? s[t] : top;
            int64_t t = lo;
            v8f sums = {0};
            for (; t + 8 <= hi; t += 8) {
                const v8f e = exp8(load8(s + t) - top);
                store8(s + t, e);
                sums += e;
            }
            sum = hsum8(sums);
            for (; t < hi; t++) {
                s[t] = s[t] - top < NEGLIGIBLE ? 0.0f : expf(s[t] - top);
                sum += s[t];
            }
            float* part = partial + h * (D + 2);
            part[0] = top;
            part[1] = sum;
            memset(part + 2, 0, D * sizeof(float));
        }
        // the weighted sum of the values: every value decoded once, added to each head of its group;
        // eight values at a time (each head's output read and written once per eight), then one by one
        t = lo;
        if (D % 8 == 0)
            for (; t + 8 <= hi; t += 8) {
                int64_t slots[8];
                for (int r = 0; r < 8; r++) slots[r] = slot_of(table, t + r, bs);
                const int64_t ahead = t + 8 + PREFETCH_AHEAD < hi ? t + 8 + PREFETCH_AHEAD : -1;
                for (int64_t g = 0; g < Hkv; g++) {
                    if (ahead >= 0)
                        for (int r = 0; r < 8; r++)
                            prefetch_vector(&S->v, slot_of(table, ahead + r, bs) * Hkv + g, D);
                    const float* v[8];
                    for (int r = 0; r < 8; r++) v[r] = decode_vector(&S->v, slots[r] * Hkv + g, D, kbuf8 + r * D);
                    for (int64_t h = g * group; h < (g + 1) * group; h++) {
                        const float* p = scores + h * stride + t;
                        float* o = partial + h * (D + 2) + 2;
                        for (int64_t i = 0; i + 8 <= D; i += 8) {
                            v8f acc = load8(o + i);
                            for (int r = 0; r < 8; r++) acc += p[r] * load8(v[r] + i);
                            store8(o + i, acc);
                        }
                    }
                }
            }
        for (; t < hi; t++) {
            const int64_t slot = slot_of(table, t, bs), ahead = t + PREFETCH_AHEAD;
            const int64_t slot_ahead = ahead < hi ? slot_of(table, ahead, bs) : -1;
            for (int64_t g = 0; g < Hkv; g++) {
                if (slot_ahead >= 0) prefetch_vector(&S->v, slot_ahead * Hkv + g, D);
                const float* v = decode_vector(&S->v, slot * Hkv + g, D, vbuf);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    axpy(partial + h * (D + 2) + 2, scores[h * stride + t], v, D);
            }
        }
    }
}

// Each head's output from its chunks: Σ_c e^(m_c − m) · o_c / Σ_c e^(m_c − m) · l_c (m the largest
// m_c), rotated back when the cache holds rotated values (a sum of rotated values; H · H = I).
static void merge(const Attend* a) {
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = L->head_dim, H = L->heads;
    for (int64_t b = 0; b < S->batch; b++) {
        const int64_t used = num_chunks(S->num_keys[b]), skipped = S->first_key[b] / CHUNK_KEYS;
        for (int64_t h = 0; h < H; h++) {
            const float* part = a->partial + b * a->chunks * H * (D + 2) + h * (D + 2);
            const int64_t step = H * (D + 2);  // from one chunk's partials to the next one's
            float top = -INFINITY, sum = 0.0f;
            for (int64_t c = skipped; c < used; c++) top = part[c * step] > top ? part[c * step] : top;
            float* o = a->out + b * H * D + h * D;
            memset(o, 0, D * sizeof(float));
            for (int64_t c = skipped; c < used; c++) {
                const float* pc = part + c * step;
                if (pc[0] - top < NEGLIGIBLE) continue;
                const float w = pc[0] == top ? 1.0f : expf(pc[0] - top);
                sum += w * pc[1];
                axpy(o, w, pc + 2, D);
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
            if (S->rotate_v) hadamard(o, D);
        }
    }
}

// ---- the layer ----------------------------------------------------------------------------------

// x += y [B, E], y normalised first where the layer normalises its outputs (Gemma's sandwich; in place)
static void add_residual(float* x, float* y, const float* out_norm, int64_t B, int64_t E, float eps) {
    if (out_norm) kvlab_rms_norm_f32(y, out_norm, y, B, E, eps);
    for (int64_t i = 0; i < B * E; i++) x[i] += y[i];
}

// GELU with tanh's approximation (PyTorch's approximate="tanh", transformers' gelu_pytorch_tanh)
static inline float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// y [n] summed over the ranks in place (a row-parallel product's partial sums); 0, or -1 when a rank did
// not arrive within the timeout
static int reduce(const Reduce* r, float* y, int64_t n) {
    if (!r) return 0;
    *r->calls += 1;
    return kvlab_shm_allreduce(r->segment, r->rank, r->world, r->capacity, y, n, *r->calls, r->timeout_s);
}

// x [B, hidden] float32, updated in place: x + attention(x), then + MLP(that). Returns 0, or -1 when
// another tensor-parallel rank did not reach an all-reduce (x is then not to be used).
int kvlab_decode_layer(const Layer* L, const Step* S, float* x, int threads) {
    const int64_t B = S->batch, E = L->hidden, D = L->head_dim, H = L->heads, Hkv = L->kv_heads;
    const int64_t I = L->intermediate, qkv_row = (H + 2 * Hkv) * D;
    float* qkv = S->scratch;
    float* attn = qkv + B * qkv_row;
    float* normed = attn + B * H * D;
    float* gate_up = normed + B * E;
    float* act = gate_up + B * 2 * I;
    float* scores = act + B * I;
    float* partial = scores + B * H * S->max_keys;

    kvlab_rms_norm_f32(x, L->attn_norm, normed, B, E, L->eps);
    linear(&L->qkv, normed, qkv, B, qkv_row, threads);
    if (L->q_norm) {  // each head of q and of k normalised over its D values, before the rotation
        for (int64_t b = 0; b < B; b++) {
            float* row = qkv + b * qkv_row;
            kvlab_rms_norm_f32(row, L->q_norm, row, H, D, L->eps);
            kvlab_rms_norm_f32(row + H * D, L->k_norm, row + H * D, Hkv, D, L->eps);
        }
    }
    kvlab_rope_f32(qkv, S->cos, S->signed_sin, B, H + Hkv, D, qkv_row);  // q heads, then k heads, per token
    for (int64_t b = 0; b < B; b++) {  // into the Hadamard basis the cache stores: q and k, v
        float* row = qkv + b * qkv_row;
        if (S->rotate_k) kvlab_hadamard_f32(row, H + Hkv, D);
        if (S->rotate_v) kvlab_hadamard_f32(row + (H + Hkv) * D, Hkv, D);
    }
    for (int64_t b = 0; b < B; b++) {  // the new token's K and V into its slot, in the cache's formats
        const float* row = qkv + b * qkv_row;
        for (int64_t g = 0; g < Hkv; g++) {
            encode_vector(&S->k, row + (H + g) * D, S->slots[b] * Hkv + g, D);
            encode_vector(&S->v, row + (H + Hkv + g) * D, S->slots[b] * Hkv + g, D);
        }
    }
    const int64_t chunks = num_chunks(S->max_keys);
    Attend a = {L, S, qkv, attn, scores, partial, chunks};
    kvlab_pool_run(attend_items, &a, (uint32_t)(B * chunks), 1, threads);
    merge(&a);
    linear(&L->o, attn, normed, B, E, threads);
    if (reduce(L->reduce, normed, B * E)) return -1;
    add_residual(x, normed, L->attn_out_norm, B, E, L->eps);

    kvlab_rms_norm_f32(x, L->mlp_norm, normed, B, E, L->eps);
    linear(&L->gate_up, normed, gate_up, B, 2 * I, threads);
    for (int64_t b = 0; b < B; b++) {
        const float *g = gate_up + b * 2 * I, *u = g + I;
        float* out = act + b * I;
        if (L->activation == ACT_GELU_TANH)
            for (int64_t i = 0; i < I; i++) out[i] = gelu_tanh(g[i]) * u[i];
        else
            for (int64_t i = 0; i < I; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    linear(&L->down, act, normed, B, E, threads);
    if (reduce(L->reduce, normed, B * E)) return -1;
    add_residual(x, normed, L->mlp_out_norm, B, E, L->eps);
    return 0;
}
