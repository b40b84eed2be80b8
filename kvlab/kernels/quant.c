// Products with weights in GGUF block formats, read from the blocks themselves: y[m, o] = sum_i x[m, i] * W[o, i].
//
// A decode step is the time to read the weights, and a 4-bit block holds 7x more weights per byte than
// float32: streaming the blocks instead of an expanded copy is the whole gain. The price is
// arithmetic: every weight must become a float before it meets an activation (activations stay
// float32; quantizing them to int8, as llama.cpp does, would change the results), and at 4-5 bits a
// weight that decoding costs more than reading it. So the AVX-512 path below decodes with as few
// instructions as it can (codes as indices into a table of the block's values) and multiplies each
// block by every activation row while it sits in registers; the AVX2 path does the same with codes
// widened and converted (for Q4_K and Q8_0 scaling a sub-block's sum, not each weight); elsewhere a
// portable path expands each chunk
// of a work item's rows into an L1 float buffer and multiplies that.
//
// Work items are groups of ROWS output rows, claimed through the kernels' pool (pool.c). Every output
// value is one thread's sum in one fixed order: lane-wise partial sums (in one accumulator on the
// AVX-512 and AVX2 paths, in two, even and odd vectors, on the portable one), folded in a fixed tree at
// the end.
// The bits do not depend on the number of threads, nor on how many activation rows came in the same
// call. Each part of a fused matrix writes its own columns of y (row stride ldy).
//
// For many rows at once (a batch of decode steps) the arithmetic is the bound, one FMA per weight and
// row: the AVX-512 path decodes each chunk once and runs register tiles of 4 weight rows by 6 activation
// rows (24 accumulators) over it. Measured on the AMX Xeon (SmolLM2's Q4_1 gate/up, 16 rows, one
// thread), the tiles ran at about 65% of the FMA rate a register-only loop reaches there (7.5 G vector
// FMAs a second), and the whole product at 45%: decoding the chunks took 16%. Keeping the accumulators
// in registers over spans of 512-2,048 inputs measured no better (the buffers left L1). The opt-in
// 8-bit activations of quant_i8.c go past that bound: the formats named "<fmt>x16" below are theirs.
//
// The dequantize kernel (for prompt-sized products, then BLAS) gives the exact bits of the gguf
// package's numpy arithmetic, products and sums rounded one by one: its functions are compiled
// without FMA contraction.
//
// Formats (see kvlab/quant/formats.py): the byte layouts of ggml's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K
// and Q6_K, and plain F32, F16 and BF16 rows as blocks of one value.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "quant_i8.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define VL 16  // floats per vector
#define MT 2   // activation rows per register tile: 4 x 2 x 2 accumulators of 32 registers
#else
#define VL 8   // AVX2 (or split by the compiler on narrower machines)
#define MT 1   // 16 registers: 4 x 1 x 2 accumulators, 4 weight vectors, one activation vector
#endif

#define ROWS 8       // output rows per work item
#define TILE 4       // output rows per register tile
#define CK 256       // input values per chunk: a K-quant super-block, or 8 blocks of 32
#define MAX_M 128    // activation rows per pass over the weights at most (pass_rows); more take several passes
#define BUFFERED_M 64  // the same for buffered_items (float rows: their sums take twice the stack a row)
#define PARTS_M 32   // activation rows up to which a fused matrix's parts go as one job of the pool
#define CHUNK 8      // work items claimed at a time
#define QK_K 256     // values in a K-quant super-block

typedef float vf __attribute__((vector_size(VL * 4)));

// Every fp16 number as a float32, filled when the library is loaded and read-only after. A block's
// scale is then two loads and no arithmetic: a scalar conversion chained each block to the last
// through its merged register (vcvtsh2ss: Q4_0 products 2.7x slower), and gathering eight scales for
// one vector conversion cost a quarter of a one-row product here.
static float f16_table[1 << 16];

__attribute__((constructor)) static void fill_f16_table(void) {
    for (uint32_t h = 0; h < 1u << 16; h++) {
        _Float16 v;
        uint16_t bits = (uint16_t)h;
        memcpy(&v, &bits, sizeof v);
        f16_table[h] = (float)v;
    }
}

static inline float half(const uint8_t* p) {  // the fp16 number at p
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_table[h];
}

static inline float bf16(const uint8_t* p) {  // bfloat16 is the top half of a float32
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// K-quants: 12 bytes hold a 6-bit scale and min for each of 8 groups of 32. Bytes 0-3 carry scales
// 0-3, bytes 4-7 mins 0-3; groups 4-7 take their low 4 bits from bytes 8-11 (scale in the low
// nibble, min in the high one) and their top 2 bits from the top of bytes 0-3 and 4-7.
static inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

// ---- expanding blocks into floats, exactly as the reference does ------------------------------
// dequant(w, ldw, rows, blocks, out, ldo): `blocks` blocks of each of `rows` rows, row r's starting at
// w + r·ldw, into out + r·ldo. Products and sums are rounded one at a time, as numpy rounds them.

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF  // clang contracts within one expression only; this turns even that off here
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

typedef void (*DequantFn)(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo);

// Written for the machine's own vector width: GCC did not vectorize the plain loops (16 and 32 values,
// nibbles and bit fields), and it lowers wider generic vectors and byte-to-float conversions one lane
// at a time. Machines without AVX2 compute every product through these.
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vi widen(const uint8_t* p, int is_signed) {  // VL bytes → VL int32 lanes
#if defined(__AVX512F__)
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    __m128i b = _mm_loadl_epi64((const __m128i*)p);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi v;
    for (int i = 0; i < VL; i++) v[i] = is_signed ? (int8_t)p[i] : p[i];
    return v;
#endif
}

static inline vf floats(vi v) { return __builtin_convertvector(v, vf); }
static inline vf splat(float f) { return (vf){0} + f; }
static inline void put(float* o, vf v) { memcpy(o, &v, sizeof v); }

static void dequant_q8_0(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 34 bytes: fp16 d, int8 q[32]; w = q·d
            const uint8_t* p = w + r * ldw + b * 34;
            const vf d = splat(half(p));
            for (int j = 0; j < 32; j += VL) put(out + r * ldo + b * 32 + j, floats(widen(p + 2 + j, 1)) * d);
        }
}

static void dequant_q4_0(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 18 bytes: fp16 d, nibbles (j low, j + 16 high); w = d·(q − 8)
            const uint8_t* p = w + r * ldw + b * 18;
            float* o = out + r * ldo + b * 32;
            const vf d = splat(half(p));
            for (int j = 0; j < 16; j += VL) {
                const vi q = widen(p + 2 + j, 0);
                put(o + j, d * floats((q & 15) - 8));
                put(o + 16 + j, d * floats((q >> 4) - 8));
            }
        }
}

static void dequant_q4_1(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 20 bytes: fp16 d, fp16 m, nibbles; w = d·q + m
            const uint8_t* p = w + r * ldw + b * 20;
            float* o = out + r * ldo + b * 32;
            const vf d = splat(half(p)), m = splat(half(p + 2));
            for (int j = 0; j < 16; j += VL) {
                const vi q = widen(p + 4 + j, 0);
                put(o + j, d * floats(q & 15) + m);
                put(o + 16 + j, d * floats(q >> 4) + m);
            }
        }
}

static void dequant_q5_0(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 22 bytes: fp16 d, 32 fifth bits (bit j: weight j), nibbles
            const uint8_t* p = w + r * ldw + b * 22;
            float* o = out + r * ldo + b * 32;
            uint32_t qh;
            memcpy(&qh, p + 2, sizeof qh);
            const vf d = splat(half(p));
            const vi bits = (vi){0} + (int32_t)qh;
            for (int j = 0; j < 16; j += VL) {
                const vi q = widen(p + 6 + j, 0);
                const vi low = (bits >> (lane + j)) & 1, high = (bits >> (lane + j + 16)) & 1;  // bit 0: bit j of qh
                put(o + j, d * floats(((q & 15) | low << 4) - 16));
                put(o + 16 + j, d * floats(((q >> 4) | high << 4) - 16));
            }
        }
}

static void dequant_q4_k(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 144 bytes: fp16 d, dmin, 12 B of scales, 128 B of nibbles
            const uint8_t *p = w + r * ldw + b * 144, *qs = p + 16;
            float* o = out + r * ldo + b * QK_K;
            const float d = half(p), dmin = half(p + 2);
            uint8_t sc[8], mn[8];
            k_scales(p + 4, sc, mn);
            for (int g = 0; g < 8; g++) {  // 32 bytes hold group g (g even: low nibbles, odd: high); w = (d·sc)·q − dmin·m
                const vf scale = splat(d * (float)sc[g]), offset = splat(dmin * (float)mn[g]);
                for (int l = 0; l < 32; l += VL) {
                    const vi q = (widen(qs + 32 * (g / 2) + l, 0) >> 4 * (g & 1)) & 15;
                    put(o + 32 * g + l, scale * floats(q) - offset);
                }
            }
        }
}

static void dequant_q5_k(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {  // 176 bytes: as Q4_K, with 32 B of fifth bits before the nibbles
            const uint8_t *p = w + r * ldw + b * 176, *qh = p + 16, *qs = p + 48;
            float* o = out + r * ldo + b * QK_K;
            const float d = half(p), dmin = half(p + 2);
            uint8_t sc[8], mn[8];
            k_scales(p + 4, sc, mn);
            for (int g = 0; g < 8; g++) {  // the fifth bit of weight l of group g: bit g of qh[l]
                const vf scale = splat(d * (float)sc[g]), offset = splat(dmin * (float)mn[g]);
                for (int l = 0; l < 32; l += VL) {
                    const vi q = ((widen(qs + 32 * (g / 2) + l, 0) >> 4 * (g & 1)) & 15) | ((widen(qh + l, 0) >> g) & 1) << 4;
                    put(o + 32 * g + l, scale * floats(q) - offset);
                }
            }
        }
}

// Q6_K, 210 bytes: 128 B of low nibbles, 64 B of 2-bit high parts, 16 int8 scales (groups of 16), fp16 d.
// Weight 128h + 32t + l: low nibble t / 2 of ql[64h + 32(t % 2) + l], high bits t of qh[32h + l];
// w = (d·sc)·(q − 32).
static void dequant_q6_k(const uint8_t* w, int64_t ldw, int rows, int64_t blocks, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* p = w + r * ldw + b * 210;
            const int8_t* scales = (const int8_t*)(p + 192);
            float* o = out + r * ldo + b * QK_K;
            const float d = half(p + 208);
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < 32; l += VL) {  // a scale per 16 weights
                        const vi low = (widen(p + 64 * h + 32 * (t & 1) + l, 0) >> 4 * (t / 2)) & 15;
                        const vi top = (widen(p + 128 + 32 * h + l, 0) >> 2 * t) & 3;
                        const vf scale = splat(d * (float)scales[8 * h + 2 * t + l / 16]);
                        put(o + 128 * h + 32 * t + l, scale * floats((low | top << 4) - 32));
                    }
        }
}

// plain rows: a "block" is one value
static void dequant_f32(const uint8_t* w, int64_t ldw, int rows, int64_t n, float* out, int64_t ldo) {
    for (int r = 0; r < rows; r++) memcpy(out + r * ldo, w + r * ldw, n * sizeof(float));
}

// 16-bit rows: F16, or BF16 (a bfloat16 is the top half of a float32)
static inline void dequant_16bit(const uint8_t* w, int64_t ldw, int rows, int64_t n, float* out, int64_t ldo, int is_bf16) {
    for (int r = 0; r < rows; r++) {
        const uint8_t* p = w + r * ldw;
        float* o = out + r * ldo;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i*)(p + 2 * i));
            _mm512_storeu_ps(o + i, is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                            : _mm512_cvtph_ps(h));
        }
#endif
        for (; i < n; i++) o[i] = is_bf16 ? bf16(p + 2 * i) : half(p + 2 * i);
    }
}

static void dequant_f16(const uint8_t* w, int64_t ldw, int rows, int64_t n, float* out, int64_t ldo) {
    dequant_16bit(w, ldw, rows, n, out, ldo, 0);
}

static void dequant_bf16(const uint8_t* w, int64_t ldw, int rows, int64_t n, float* out, int64_t ldo) {
    dequant_16bit(w, ldw, rows, n, out, ldo, 1);
}

#if defined(__clang__)
#pragma STDC FP_CONTRACT ON
#else
#pragma GCC pop_options
#endif

enum { F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, INTERLEAVED, TILED = INTERLEAVED + 7 };  // FORMATS' order
_Static_assert((int)Q8_0 == (int)KVLAB_Q8_0 && (int)Q6_K == (int)KVLAB_Q6_K, "quant_i8.h numbers the formats as FORMATS does");

typedef struct {
    const char* name;  // the GGML type name, as kvlab/quant/formats.py spells it
    int values, bytes;  // per block
    DequantFn dequant;
} Format;

// The ids are the Python side's (it reads them back with kvlab_quant_format)
static const Format FORMATS[] = {
    {"F32", 1, 4, dequant_f32},       {"F16", 1, 2, dequant_f16},       {"BF16", 1, 2, dequant_bf16},
    {"Q8_0", 32, 34, dequant_q8_0},   {"Q4_0", 32, 18, dequant_q4_0},   {"Q4_1", 32, 20, dequant_q4_1},
    {"Q5_0", 32, 22, dequant_q5_0},   {"Q4_K", QK_K, 144, dequant_q4_k}, {"Q5_K", QK_K, 176, dequant_q5_k},
    {"Q6_K", QK_K, 210, dequant_q6_k},
    // the same formats interleaved 16 rows at a time for 8-bit activations (quant_i8.c): INTERLEAVED + k
    // is format Q8_0 + k's; one "block" is one row's sub-block of an item's group
    {"Q8_0x16", 32, 36, NULL}, {"Q4_0x16", 32, 20, NULL}, {"Q4_1x16", 32, 24, NULL}, {"Q5_0x16", 32, 36, NULL},
    {"Q4_Kx16", 32, 24, NULL}, {"Q5_Kx16", 32, 40, NULL}, {"Q6_Kx16", 16, 20, NULL},
    // the same bytes multiplied exactly on AMX bfloat16 tiles (quant_i8.c's kvlab_t16_matmul): TILED + k
    {"Q8_0t16", 32, 36, NULL}, {"Q4_0t16", 32, 20, NULL}, {"Q4_1t16", 32, 24, NULL}, {"Q5_0t16", 32, 36, NULL},
    {"Q4_Kt16", 32, 24, NULL}, {"Q5_Kt16", 32, 40, NULL}, {"Q6_Kt16", 16, 20, NULL},
};
_Static_assert(sizeof FORMATS / sizeof FORMATS[0] == TILED + 7, "an interleaved and a tiled form for each of Q8_0 .. Q6_K");
#define NUM_FORMATS (int)(sizeof FORMATS / sizeof FORMATS[0])

// Which exact product this build has: "avx512" (codes looked up), "avx2" (codes converted) or "portable"
// (chunks expanded to floats first); quant.py sends prompt-sized passes to BLAS where the tiles lose.
const char* kvlab_quant_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

// Format `id`'s name and block size; NULL past the last one.
const char* kvlab_quant_format(int id, int* values, int* bytes) {
    if (id < 0 || id >= NUM_FORMATS) return NULL;
    *values = FORMATS[id].values, *bytes = FORMATS[id].bytes;
    return FORMATS[id].name;
}

// ---- the product ------------------------------------------------------------------------------
// Work item b is output rows ROWS·b .. ROWS·b + ROWS − 1 against every activation row. The last item
// may have fewer rows; it computes its last row in the missing places and drops those sums.

typedef struct {
    int fmt;
    const uint8_t* w;   // the blocks of output row 0
    int64_t ldw;        // bytes from one output row's blocks to the next
    const float* x;     // [m, n], in the lane order of the format's decoder (see to_lane_order)
    float* y;           // [m, ·] with row stride ldy
    int64_t m, n, ldy, out;
    const float* xs;    // x's sums over sub-blocks for AVX2's factored Q4_K (see x_sums), or NULL
} Product;

// An item's ROWS weight rows from output row o0 (`rows` of them real: the missing ones repeat the last)
static inline void item_rows(const Product* p, int64_t o0, int rows, const uint8_t** row) {
    for (int r = 0; r < ROWS; r++) row[r] = p->w + (o0 + (r < rows ? r : rows - 1)) * p->ldw;
}

static inline vf load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

// The sums of ROWS accumulator vectors, each folded in one fixed order: lane i + lane i + VL/2, then
// i + VL/4, ... Only the order matters for the bits, so the AVX-512 version folds four at once with
// shuffles (a scalar fold per output cost as much as a 16-row product's FMAs).
#if defined(__AVX512F__)
// The four sums of a, b, c and d in lanes 0, 4, 8 and 12, each folded in the same fixed order
static inline __m512 hsum4_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
    // [a0 + a2, a1 + a3, b0 + b2, b1 + b3] in 128-bit quarters: lane i + lane i + 8 of a, then of b
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    // quarter k: output k's lanes i + i + 4
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));  // i + i + 2
    return _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));  // i + i + 1
}
#endif

static inline void hsum4(const vf* v, float* sums) {
#if defined(__AVX512F__)
    float all[16];
    _mm512_storeu_ps(all, hsum4_lanes((__m512)v[0], (__m512)v[1], (__m512)v[2], (__m512)v[3]));
    for (int k = 0; k < 4; k++) sums[k] = all[4 * k];
#else
    for (int k = 0; k < 4; k++) {
        float a[VL];
        memcpy(a, &v[k], sizeof a);
        for (int width = VL / 2; width > 0; width /= 2)
            for (int i = 0; i < width; i++) a[i] += a[i + width];
        sums[k] = a[0];
    }
#endif
}

// The portable path: every sum has two accumulators, one for the even vectors of a row and one for the
// odd ones, so that a block's two vectors are not one chain of dependent FMAs (4 cycles each) in the
// one-row products. The two are added, then folded, at the end.
// Each sum sees the same operations in the same order whatever the number of rows, so a row's result
// does not depend on the batch it came in.

// acc[(i·ROWS + r)·2 + k] += wb[r·CK + j] · x[i·ldx + j] over the chunk's whole vectors (k: the parity of
// j / VL), for M activation rows and TILE weight rows
#define DEFINE_TILE(NAME, M)                                                                        \
    static __attribute__((noinline)) void NAME(const float* wb, const float* x, int64_t ldx, int64_t len, \
                                               vf* saved) {                                         \
        vf acc[M][TILE][2];                                                                         \
        for (int i = 0; i < M; i++)                                                                 \
            for (int r = 0; r < TILE; r++)                                                          \
                for (int k = 0; k < 2; k++) acc[i][r][k] = saved[(i * ROWS + r) * 2 + k];           \
        int64_t j = 0;                                                                              \
        for (; j + 2 * VL <= len; j += 2 * VL) {                                                    \
            STEP(M, 0, j)                                                                           \
            STEP(M, 1, j + VL)                                                                      \
        }                                                                                           \
        if (j + VL <= len) STEP(M, 0, j)                                                            \
        for (int i = 0; i < M; i++)                                                                 \
            for (int r = 0; r < TILE; r++)                                                          \
                for (int k = 0; k < 2; k++) saved[(i * ROWS + r) * 2 + k] = acc[i][r][k];           \
    }
#define STEP(M, k, at)                                                                              \
    {                                                                                               \
        vf w0 = load(wb + (at)), w1 = load(wb + CK + (at)), w2 = load(wb + 2 * CK + (at)), w3 = load(wb + 3 * CK + (at)); \
        for (int i = 0; i < M; i++) {                                                               \
            vf xv = load(x + i * ldx + (at));                                                       \
            acc[i][0][k] += w0 * xv, acc[i][1][k] += w1 * xv, acc[i][2][k] += w2 * xv, acc[i][3][k] += w3 * xv; \
        }                                                                                           \
    }

DEFINE_TILE(tile_1, 1)
#if MT == 2
DEFINE_TILE(tile_2, 2)
static void (*const TILES[MT])(const float*, const float*, int64_t, int64_t, vf*) = {tile_1, tile_2};
#else
static void (*const TILES[MT])(const float*, const float*, int64_t, int64_t, vf*) = {tile_1};
#endif

// The chunk's float weights (row r at wb + r·CK, len values) times every activation row.
static void multiply_chunk(const float* wb, const float* x, int64_t ldx, int64_t m, int64_t len, vf* acc) {
    for (int h = 0; h < ROWS; h += TILE)
        for (int64_t i = 0; i < m; i += MT)
            TILES[(m - i < MT ? m - i : MT) - 1](wb + h * CK, x + i * ldx, ldx, len, acc + (i * ROWS + h) * 2);
}

static void finish_item(const Product* p, int64_t o0, int rows, const vf* acc, const float* tail) {
    for (int64_t i = 0; i < p->m; i++) {
        vf both[ROWS];
        float sums[ROWS];
        for (int r = 0; r < ROWS; r++) both[r] = acc[(i * ROWS + r) * 2] + acc[(i * ROWS + r) * 2 + 1];
        for (int h = 0; h < ROWS; h += TILE) hsum4(both + h, sums + h);
        for (int r = 0; r < rows; r++) p->y[i * p->ldy + o0 + r] = sums[r] + (tail ? tail[i * ROWS + r] : 0.0f);
    }
}

// Every format, any machine: each chunk expanded in order by the exact dequantizer, then tiled.
static void buffered_items(void* ctx, uint32_t begin, uint32_t end) {
    const Product p = *(const Product*)ctx;
    const Format* f = &FORMATS[p.fmt];
    float wb[ROWS * CK] __attribute__((aligned(64)));  // the chunk's weights as floats: L1-resident
    vf acc[BUFFERED_M * ROWS * 2];
    float tail[BUFFERED_M * ROWS];  // plain rows whose length is no multiple of VL: the last values, in order
    for (int64_t item = begin; item < end; item++) {
        const int64_t o0 = item * ROWS;
        const int rows = p.out - o0 < ROWS ? (int)(p.out - o0) : ROWS;
        if (rows < ROWS) memset(wb + rows * CK, 0, (ROWS - rows) * CK * sizeof(float));
        memset(acc, 0, p.m * ROWS * 2 * sizeof acc[0]);
        memset(tail, 0, p.m * ROWS * sizeof tail[0]);
        for (int64_t c = 0; c < p.n; c += CK) {
            const int64_t len = p.n - c < CK ? p.n - c : CK;
            f->dequant(p.w + o0 * p.ldw + c / f->values * f->bytes, p.ldw, rows, len / f->values, wb, CK);
            multiply_chunk(wb, p.x + c, p.n, p.m, len, acc);
            for (int64_t j = len / VL * VL; j < len; j++)
                for (int64_t i = 0; i < p.m; i++)
                    for (int r = 0; r < ROWS; r++) tail[i * ROWS + r] += wb[r * CK + j] * p.x[i * p.n + c + j];
        }
        finish_item(&p, o0, rows, acc, tail);
    }
}

// ---- AVX-512: the product straight from the blocks -------------------------------------------
// A 4-bit code needs no widening before a lookup: vpermps reads only an index's low 4 bits. So 16
// bytes of codes are broadcast to the four 128-bit quarters of a register (a plain load) and each
// quarter shifted by its own amount (vpsrlvd): lane L then holds, in its low bits, a code of byte
// 4·(L % 4) + L / 4. That fixed 4 x 4 transpose of every 16 weights ("lane order") is undone on the
// activations instead, once per call (to_lane_order), and the decoders keep the shuffle port for the
// table lookups. Fifth bits reach bit 4 by a per-lane rotation. Q6_K instead assembles its six-bit
// codes as bytes, 128 at a time (q6k_bytes), and widens 16 of them per vector, in value order: 1.13-1.17x
// faster at one or two rows than looking them up lane by lane (896 x 4864, 2 threads: 178 -> 152 us).
//
// Every weight decoded here is the reference's value exactly: each is d·q, (d·sc)·q − dmin·m, d·q + m
// or (d·sc)·(q − 32) of an fp16 scale and small integers, products that float32 holds without
// rounding, then at most the one rounding of the reference's add.
//
// Up to 4 activation rows, a work item decodes each block into registers and multiplies it at once
// (fused); more rows, it stores each chunk's weights to an L1 buffer once and tiles over the rows.
// Both paths make the same FMAs in the same order for every (row, output): one accumulator per sum,
// vector after vector (16 rows of Q4_1 at 576 × 1536: 1.6-1.9× faster than the two-accumulator tiles
// this replaced, 0.8 FMAs a cycle).

#if defined(__AVX512F__) && defined(__AVX512VL__)
#if !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

#define SROW 64  // floats per row of a chunk's scales: 32, then (Q6_K) 128 bytes of codes (q6k_bytes)

static const int32_t LANE_BYTE[16] = {0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24};  // 8·(L / 4)
#define BYTE_SHIFT _mm512_loadu_si512(LANE_BYTE)
#define BCAST16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(p)))
#define NIBBLE_SHIFT(nibble) _mm512_add_epi32(BYTE_SHIFT, _mm512_set1_epi32(4 * (nibble)))
#define CODES(bytes, nibble) _mm512_srlv_epi32(bytes, NIBBLE_SHIFT(nibble))
// lane L's rotation that brings bit k of byte 4·(L % 4) + L / 4 (within its dword) to bit 4
#define BIT4_ROTATION(k) _mm512_add_epi32(BYTE_SHIFT, _mm512_set1_epi32(((k) + 28) & 31))
#define LOW4_THEN(a, b) _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(15), 0xE4)  // a's bits 0-3, b's above

// lane L of a vector in lane order holds value 4·(L % 4) + L / 4 of its 16: a 4 x 4 transpose, its own inverse
#define LANE_ORDER _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)

static inline void to_lane_order(const float* x, float* xt, int64_t count) {  // count: a multiple of 16
    for (int64_t i = 0; i < count; i += 16) _mm512_storeu_ps(xt + i, _mm512_permutexvar_ps(LANE_ORDER, _mm512_loadu_ps(x + i)));
}

static inline int in_lane_order(int fmt) { return fmt >= Q4_0 && fmt < Q6_K; }  // Q6_K: its codes as bytes, in order
static inline int wants_sums(int fmt) { (void)fmt; return 0; }
static inline int64_t sums_stride(int64_t n) { return n; }
static void x_sums(const float* x, int64_t m, int64_t n, float* xs) { (void)x, (void)m, (void)n, (void)xs; }

// K-quants: per chunk (one super-block), for each row r, what its decoders share: s[r][u] = d·sc and
// s[r][8 + u] = dmin·m of group u (Q4_K, Q5_K); s[r][g] = d·sc and s[r][16 + g] = 32·d·sc of group g of
// 16 (Q6_K).
static inline void chunk_scales(int fmt, const int R, const uint8_t* const* row, int64_t c, float (*s)[SROW]) {
    const Format* f = &FORMATS[fmt];
    for (int r = 0; r < R; r++) {
        const uint8_t* p = row[r] + c / QK_K * f->bytes;
        if (fmt == Q6_K) {
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 192))));
            __m512 scale = _mm512_mul_ps(_mm512_set1_ps(half(p + 208)), sc);
            _mm512_storeu_ps(s[r], scale);
            _mm512_storeu_ps(s[r] + 16, _mm512_mul_ps(scale, _mm512_set1_ps(32)));
            continue;
        }
        // k_scales on the words a, b, c of bytes 4-15, in one register: lanes [a, c, b, c] and [a, a, b, b] give
        // [a & 63s, (c & 15s) | (a >> 2 & 48s), b & 63s, (c >> 4 & 15s) | (b >> 2 & 48s)]: scales 0-3, 4-7, mins 0-3, 4-7
        __m128i v = _mm_loadu_si128((const __m128i*)(p + 4));
        __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4));
        __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        __m128i sc = _mm_ternarylogic_epi32(low, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F), top, 0xEA);
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc));
        __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half(p)), _mm512_set1_ps(half(p + 2)));
        _mm512_storeu_ps(s[r], _mm512_mul_ps(d, q));  // d·sc for groups 0-7, dmin·m in 8-15
    }
}

// A K-quant unit's shifts depend on the unit, not the row: made once per unit for all rows.
typedef struct {
    __m512i codes, bits;  // the per-lane shifts to the unit's nibbles, the rotations of its high bits to bit 4
} UnitShifts;

static inline __attribute__((always_inline)) UnitShifts unit_shifts(int fmt, int u) {
    UnitShifts k = {NIBBLE_SHIFT(u & 1), BIT4_ROTATION(u)};  // Q4_K, Q5_K: group u
    if (fmt == Q6_K) k.codes = NIBBLE_SHIFT((u % 4) >> 1), k.bits = BIT4_ROTATION(2 * (u % 4));
    return k;
}

// Q6_K's six-bit codes of half h (128 values) of a chunk, as bytes in value order, into the row's
// share of s after its scales (s + 32: 128 bytes). Value 128h + 32t + l has low nibble t / 2 of
// ql[64h + 32(t % 2) + l] and bits 2t, 2t + 1 of qh[32h + l]: the 64 bytes of ql hold t = 0, 1 as their
// low nibbles and t = 2, 3 as their high ones, and the 32 of qh, loaded into both halves of a register,
// meet each with its own shift (word shifts: the masks drop what crosses a byte). 7 operations per 128
// codes, where assembling them in int32 lanes took 4 per 16; each unit then widens 16 bytes at a time.
static inline __attribute__((always_inline)) void q6k_bytes(const uint8_t* row, int64_t c, int h, float* s) {
    const uint8_t* p = row + c / QK_K * FORMATS[Q6_K].bytes;
    const __m512i ql = _mm512_loadu_si512(p + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h)));
    const __m512i low4 = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
    // t = 0 | 1: qh's bits 0-1 | 2-3 to bits 4-5; t = 2 | 3: bits 4-5 | 6-7
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i t01 = _mm512_ternarylogic_epi32(ql, _mm512_sllv_epi16(qh, up), low4, 0xE4);  // low4 ? ql : high
    const __m512i t23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_srlv_epi16(qh, down), low4, 0xE4);
    uint8_t* out = (uint8_t*)(s + 32);
    _mm512_store_si512(out, _mm512_and_si512(t01, six));
    _mm512_store_si512(out + 64, _mm512_and_si512(t23, six));
}

// Unit u of a chunk starting at value c: weights c + 32u .. + 31 as two vectors (lane order, Q8_0 in order)
static inline __attribute__((always_inline)) void decode(int fmt, const uint8_t* row, int64_t c, int u, const float* s,
                                                          const UnitShifts* k, __m512* w) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 sixteen = _mm512_set1_ps(16);
    const Format* f = &FORMATS[fmt];
    const uint8_t* p = f->values == 32 ? row + (c / 32 + u) * f->bytes : row + c / QK_K * f->bytes;
    __m512 table, hi_table;
    switch (fmt) {
    case Q8_0: {
        __m512 d = _mm512_set1_ps(half(p));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)))), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 18)))), d);
        return;
    }
    case Q4_0:
    case Q4_1: {  // d·(q − 8), or d·q + m: 16 values
        __m512i bytes = BCAST16(p + (fmt == Q4_0 ? 2 : 4));
        __m512 d = _mm512_set1_ps(half(p));
        table = fmt == Q4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8)))
                            : _mm512_fmadd_ps(d, iota, _mm512_set1_ps(half(p + 2)));  // d·q is exact: one rounding either way
        w[0] = _mm512_permutexvar_ps(CODES(bytes, 0), table);
        w[1] = _mm512_permutexvar_ps(CODES(bytes, 1), table);
        return;
    }
    case Q5_0: {  // d·(q − 16): 32 values, q's fifth bit j from the 32-bit field
        __m512i bytes = BCAST16(p + 6), high;
        uint32_t qh;
        memcpy(&qh, p + 2, sizeof qh);
        high = _mm512_set1_epi32((int)qh);
        __m512 d = _mm512_set1_ps(half(p));
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, sixteen)), hi_table = _mm512_mul_ps(d, iota);
        // weight j = 4·(L % 4) + L / 4 of each half: bit j (or 16 + j) of qh, rotated to bit 4
        const __m512i j = LANE_ORDER;
        __m512i bit0 = _mm512_rorv_epi32(high, _mm512_add_epi32(j, _mm512_set1_epi32(28)));
        __m512i bit1 = _mm512_rorv_epi32(high, _mm512_add_epi32(j, _mm512_set1_epi32(12)));
        w[0] = _mm512_permutex2var_ps(table, LOW4_THEN(CODES(bytes, 0), bit0), hi_table);
        w[1] = _mm512_permutex2var_ps(table, LOW4_THEN(CODES(bytes, 1), bit1), hi_table);
        return;
    }
    case Q4_K:
    case Q5_K: {  // group u: (d·sc)·q − dmin·m; codes in the low (u even) or high nibbles of 32 bytes
        const uint8_t* codes = p + (fmt == Q4_K ? 16 : 48) + 32 * (u / 2);
        __m512 scale = _mm512_set1_ps(s[u]), offset = _mm512_set1_ps(s[8 + u]);
        __m512i lo = _mm512_srlv_epi32(BCAST16(codes), k->codes), hi = _mm512_srlv_epi32(BCAST16(codes + 16), k->codes);
        table = _mm512_fmsub_ps(scale, iota, offset);  // (d·sc)·q is exact: one rounding either way
        if (fmt == Q4_K) {
            w[0] = _mm512_permutexvar_ps(lo, table);
            w[1] = _mm512_permutexvar_ps(hi, table);
            return;
        }
        hi_table = _mm512_fmsub_ps(scale, _mm512_add_ps(iota, sixteen), offset);
        // the fifth bit of weight l of group u: bit u of byte l of the 32 bytes at p + 16
        w[0] = _mm512_permutex2var_ps(table, LOW4_THEN(lo, _mm512_rorv_epi32(BCAST16(p + 16), k->bits)), hi_table);
        w[1] = _mm512_permutex2var_ps(table, LOW4_THEN(hi, _mm512_rorv_epi32(BCAST16(p + 32), k->bits)), hi_table);
        return;
    }
    default: {  // Q6_K, unit u = 4h + t: values 128h + 32t .. + 31, their codes made by q6k_bytes in order
        const uint8_t* codes = (const uint8_t*)(s + 32) + 32 * (u % 4);
        for (int half = 0; half < 2; half++) {  // weights 16·half .. + 15: one scale
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(codes + 16 * half))));
            // (d·sc)·(q − 32) = (d·sc)·q − 32·(d·sc): both exact, so the one rounding of the FMA is the reference's
            w[half] = _mm512_fmsub_ps(_mm512_set1_ps(s[2 * u + half]), q, _mm512_set1_ps(s[16 + 2 * u + half]));
        }
        return;
    }
    }
}

// While the item's rows are multiplied, ask for the same place in the next item's rows (which this
// thread most likely takes next), one line per row and unit until the chunk's lines are asked for.
// Eight interleaved rows of a few hundred bytes are no stream the hardware prefetchers follow: from
// memory, one thread's Q4_1 product read 6 GB/s without these and 9 with them, against 15 for a
// plain sequential read. (Always inlined: GCC dropped the prefetch of an inline function inlined into
// an always_inline caller.)
static inline __attribute__((always_inline)) void prefetch_next(const Product* p, const uint8_t* row, int64_t c, int u) {
    const Format* f = &FORMATS[p->fmt];
    const int64_t from = c / f->values * f->bytes, line = (from & ~63) + 64 * u;
    if (line < from + CK / f->values * f->bytes) _mm_prefetch((const char*)row + ROWS * p->ldw + line, _MM_HINT_T1);
}

// M ≤ 4 activation rows: every unit of R rows decoded into registers and multiplied at once, with
// R·M accumulators (R = 8 rows for one activation row, 4 for two, 2 for three or four): at least six
// independent chains of FMAs, enough to hide their latency.
static inline __attribute__((always_inline)) void fused_rows(int fmt, const int M, const int R, const Product* p,
                                                             const uint8_t* const* row, __m512* out) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    float s[ROWS][SROW] __attribute__((aligned(64)));
    for (int64_t c = 0; c < p->n; c += CK) {
        const int units = (int)((p->n - c < CK ? p->n - c : CK) / 32);
        if (FORMATS[fmt].values == QK_K) chunk_scales(fmt, R, row, c, s);
        for (int u = 0; u < units; u++) {
            const UnitShifts shifts = unit_shifts(fmt, u);
            __m512 x[4][2];
            for (int i = 0; i < M; i++)
                x[i][0] = _mm512_loadu_ps(p->x + i * p->n + c + 32 * u), x[i][1] = _mm512_loadu_ps(p->x + i * p->n + c + 32 * u + 16);
            // unrolled, so that the accumulators stay in registers (GCC kept Q6_K's long body rolled, the
            // accumulators in memory: 1.2x slower)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                prefetch_next(p, row[r], c, u);
                if (fmt == Q6_K && u % 4 == 0) q6k_bytes(row[r], c, u / 4, s[r]);
                __m512 w[2];
                decode(fmt, row[r], c, u, s[r], &shifts, w);
#pragma GCC unroll 4
                for (int i = 0; i < M; i++) {
                    acc[r][i] = _mm512_fmadd_ps(w[0], x[i][0], acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(w[1], x[i][1], acc[r][i]);
                }
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

// y[i, o0 + r] for the item's rows: each sum's one accumulator folded in hsum4's fixed order, the
// item's sums of a row gathered into one vector and stored at once (a store a sum and their reload
// through memory were 2-3% of a long prompt's products)
static void finish_block_item(const Product* p, int64_t o0, int rows, int64_t m, const __m512* acc) {
    _Static_assert(ROWS == 2 * TILE && TILE == 4, "an item's sums: two hsum4_lanes, 8 lanes");
    const __m512i gather = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask8 keep = (__mmask8)((1u << rows) - 1);
    for (int64_t i = 0; i < m; i++) {
        const __m512* a = acc + i * ROWS;
        const __m512 low = hsum4_lanes(a[0], a[1], a[2], a[3]), high = hsum4_lanes(a[4], a[5], a[6], a[7]);
        const __m256 sums = _mm512_castps512_ps256(_mm512_permutex2var_ps(low, gather, high));
        _mm256_mask_storeu_ps(p->y + i * p->ldy + o0, keep, sums);
    }
}

static inline __attribute__((always_inline)) void fused_item(int fmt, const int M, const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    __m512 acc[4 * ROWS];
    const int R = M == 1 ? 8 : M == 2 ? 4 : 2;
    for (int h = 0; h < ROWS; h += R) fused_rows(fmt, M, R, p, row + h, acc + h);
    finish_block_item(p, o0, rows, M, acc);
}

// A register tile of the stored path: TILE weight rows (wb, row stride wbs) times MX activation rows
// (x, row stride ldx) over len values, into acc[i·ROWS + r], which stays in registers for the span:
// 4·MX accumulators, and per vector of values TILE + MX loads for 4·MX FMAs.
#define MX 6  // activation rows per tile: 24 accumulators, 4 weight vectors and one activation vector
static inline __attribute__((always_inline)) void tile_rows(const int M, const float* wb, int64_t wbs, const float* x,
                                                            int64_t ldx, int64_t len, int first, __m512* acc) {
    __m512 a[MX][TILE];
    for (int i = 0; i < M; i++)  // the first chunk starts from zeros (no pass to clear acc beforehand)
        for (int r = 0; r < TILE; r++) a[i][r] = first ? _mm512_setzero_ps() : acc[i * ROWS + r];
    for (int64_t j = 0; j < len; j += 16) {
        __m512 w0 = _mm512_load_ps(wb + j), w1 = _mm512_load_ps(wb + wbs + j);
        __m512 w2 = _mm512_load_ps(wb + 2 * wbs + j), w3 = _mm512_load_ps(wb + 3 * wbs + j);
        // kept in registers too: at 1-4 rows GCC otherwise folds the weights' loads into every FMA (a load
        // per FMA, where this core loads one vector a cycle: tiles of 3 and 4 rows 20% slower)
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
#pragma GCC unroll 6
        for (int i = 0; i < M; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + j);
            __asm__("" : "+v"(xv));  // kept in a register: else GCC reloads it for each weight row's FMA
            a[i][0] = _mm512_fmadd_ps(w0, xv, a[i][0]), a[i][1] = _mm512_fmadd_ps(w1, xv, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(w2, xv, a[i][2]), a[i][3] = _mm512_fmadd_ps(w3, xv, a[i][3]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < TILE; r++) acc[i * ROWS + r] = a[i][r];
}

// The span's tiles, a tile's activation rows taken for both halves of the item in turn (read from L2
// once a span, not once a half: pass_rows)
static void tiles(const float* wb, int64_t wbs, const float* x, int64_t ldx, int64_t m, int64_t len, int first,
                  __m512* acc) {
    for (int64_t i = 0; i < m; i += MX)
        for (int h = 0; h < ROWS; h += TILE) {
            const float* xi = x + i * ldx;
            __m512* ai = acc + i * ROWS + h;
            switch (m - i < MX ? m - i : MX) {
            case 1: tile_rows(1, wb + h * wbs, wbs, xi, ldx, len, first, ai); break;
            case 2: tile_rows(2, wb + h * wbs, wbs, xi, ldx, len, first, ai); break;
            case 3: tile_rows(3, wb + h * wbs, wbs, xi, ldx, len, first, ai); break;
            case 4: tile_rows(4, wb + h * wbs, wbs, xi, ldx, len, first, ai); break;
            case 5: tile_rows(5, wb + h * wbs, wbs, xi, ldx, len, first, ai); break;
            default: tile_rows(6, wb + h * wbs, wbs, xi, ldx, len, first, ai);
            }
        }
}

// more rows: a span of chunks decoded once into a buffer, then tiled over the rows. Each sum sees the
// same FMAs in the same order as in the fused path, so a row's bits do not depend on its company.
// The span is 2 chunks (512 values) up to 32 rows, else 4: a tile's accumulators are loaded and stored
// once a span, so longer spans spend less of a tile on that. Alternated builds, 2 threads, Zen 4 VM
// (2026-12-07), against one chunk a span: Qwen2.5-Coder-0.5B's 4,864 × 896 and 896 × 4,864 matrices
// 2-6% faster at 16 rows, 5-10% at 128 and 512; 4 chunks at 16 rows were 3-5% slower on Q8_0 than 2.
// A last span shorter than a chunk joins the one before: SmolLM2's 576-input matrices at 16 rows 4-7%
// faster as one span than as 512 + 64 values.
#define SPAN (4 * CK)  // the most values of a row the buffer holds
static inline __attribute__((always_inline)) void stored_item(int fmt, const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    float wb[ROWS * SPAN] __attribute__((aligned(64)));
    float s[ROWS][SROW] __attribute__((aligned(64)));
    __m512 acc[MAX_M * ROWS];  // set by the first span's tiles (no inputs at all: zeros)
    for (int64_t k = 0; p->n == 0 && k < p->m * ROWS; k++) acc[k] = _mm512_setzero_ps();
    const int64_t span = p->m <= 32 ? 2 * CK : SPAN;  // values a span takes (the buffer's row stride: len)
    for (int64_t c = 0, len; c < p->n; c += len) {
        const int64_t left = p->n - c;  // a short last span (576 inputs: 512 + 64) joins the one before
        len = left <= SPAN && left < span + CK ? left : span;
        for (int64_t cc = c; cc < c + len; cc += CK) {
            const int64_t clen = p->n - cc < CK ? p->n - cc : CK;
            if (FORMATS[fmt].values == QK_K) chunk_scales(fmt, ROWS, row, cc, s);
            for (int r = 0; r < ROWS; r++) {
                for (int u = 0; u < clen / 32; u++) {
                    const UnitShifts shifts = unit_shifts(fmt, u);
                    prefetch_next(p, row[r], cc, u);
                    if (fmt == Q6_K && u % 4 == 0) q6k_bytes(row[r], cc, u / 4, s[r]);
                    __m512 w[2];
                    decode(fmt, row[r], cc, u, s[r], &shifts, w);
                    _mm512_store_ps(wb + r * len + (cc - c) + 32 * u, w[0]);
                    _mm512_store_ps(wb + r * len + (cc - c) + 32 * u + 16, w[1]);
                }
            }
        }
        tiles(wb, len, p->x + c, p->n, p->m, len, c == 0, acc);
    }
    finish_block_item(p, o0, rows, p->m, acc);
}

// Dequantization with the same decoders, every vector put back in order.
static void expand_row(int fmt, const uint8_t* row, int64_t n, float* y) {
    float s[1][SROW] __attribute__((aligned(64)));
    for (int64_t c = 0; c < n; c += CK) {
        const int units = (int)((n - c < CK ? n - c : CK) / 32);
        if (FORMATS[fmt].values == QK_K) chunk_scales(fmt, 1, &row, c, s);
        for (int u = 0; u < units; u++) {
            const UnitShifts shifts = unit_shifts(fmt, u);
            __m512 w[2];
            if (fmt == Q6_K && u % 4 == 0) q6k_bytes(row, c, u / 4, s[0]);
            decode(fmt, row, c, u, s[0], &shifts, w);
            if (in_lane_order(fmt)) w[0] = _mm512_permutexvar_ps(LANE_ORDER, w[0]), w[1] = _mm512_permutexvar_ps(LANE_ORDER, w[1]);
            _mm512_storeu_ps(y + c + 32 * u, w[0]);
            _mm512_storeu_ps(y + c + 32 * u + 16, w[1]);
        }
    }
}

#if !defined(__clang__)
#pragma GCC pop_options
#endif

// ---- AVX2: the product straight from the blocks -------------------------------------------------
// Without AVX-512 there is no 16-entry permute to look codes up in, so codes are widened to int32
// lanes (vpmovzxbd of 8 bytes), masked or shifted and converted. Two ways to meet x from there:
//  - direct (Q4_0, Q4_1, Q5_0, Q5_K): each weight made, the reference's value exactly (d·q,
//    (d·sc)·q − dmin·m: products float32 holds, then at most the reference's one rounding of the add,
//    fused here), then one FMA with x.
//  - factored (Q4_K, Q6_K, Q8_0): the codes meet x as they are and each sub-block's sum is scaled once
//    (and the K-quants' offsets meet x's sums over their sub-blocks): one FMA per 8 weights instead of
//    two, 1.2x faster for one row (Q6_K: 1.2-1.3x at 1-4 rows, 0.9x at 16), within float32 tolerance of
//    the reference but not its roundings. Q6_K assembles its six-bit codes as bytes, 32 at a time,
//    before widening them (q6k_codes).
//
// One widened load of codes serves every vector whose codes it holds (a byte's two nibbles, Q6_K's
// four uses of its high bits), so a chunk's vectors come out in the decoder's order, not the values'
// (`vec_offset`: where vector v of a chunk starts). Up to 4 activation rows a work item decodes each
// group of vectors into registers and multiplies it at once, the rows' chains of FMAs interleaved; more
// rows, it stores each chunk's vectors (weights, or codes) to an L1 buffer once and runs register tiles
// over them. Both make the same operations in the same order for every (row, output) — one accumulator
// per sum — folded as hsum4 folds, so a row's bits do not depend on its company.

#elif defined(__AVX2__) && defined(__FMA__)

static inline __m256i widen8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256 cvt8(__m256i q) { return _mm256_cvtepi32_ps(q); }
#define LOW4(q) _mm256_and_si256(q, _mm256_set1_epi32(15))
#define HIGH4(q) _mm256_srli_epi32(q, 4)
#define FIFTH(q, k) _mm256_and_si256(_mm256_slli_epi32(q, 4 - (k)), _mm256_set1_epi32(16))  // bit k (≤ 4) to bit 4

static inline int in_lane_order(int fmt) { (void)fmt; return 0; }
static inline void to_lane_order(const float* x, float* xt, int64_t count) { (void)x, (void)xt, (void)count; }

#define GROUP 4  // vectors a decode of a group emits: one block of 32, or 32 values of a super-block

// Where group g's vectors start, in values from the chunk's first: at group_start + in_group(v), v = 0..3
static inline int group_start(int fmt, int g) {
    switch (fmt) {
    case Q4_K:
    case Q5_K: return 64 * (g / 2) + 16 * (g % 2);  // 32 bytes: groups 2P (low nibbles) and 2P + 1 (high)
    case Q6_K: return 128 * (g / 4) + 8 * (g % 4);  // bytes l serve values l + 32t, t = 0..3
    default: return 32 * g;                         // a block of 32
    }
}

static inline int in_group(int fmt, int v) {
    switch (fmt) {
    case Q8_0: return 8 * v;
    case Q4_0:
    case Q4_1:
    case Q5_0: return (int[]){0, 16, 8, 24}[v];  // bytes 0-7 hold values 0-7 and 16-23
    case Q4_K:
    case Q5_K: return (int[]){0, 32, 8, 40}[v];
    default: return 32 * v;  // Q6_K
    }
}

static inline int vec_offset(int fmt, int v) { return group_start(fmt, v / 4) + in_group(fmt, v % 4); }

// K-quants, per chunk (one super-block) and row r: s[r][u] = d·sc and s[r][8 + u] = dmin·m of group u
// (Q4_K, Q5_K); s[r][g] = d·sc and s[r][16 + g] = 32·d·sc of group g of 16 (Q6_K).
static inline void chunk_scales(int fmt, const int R, const uint8_t* const* row, int64_t c, float (*s)[32]) {
    const Format* f = &FORMATS[fmt];
    for (int r = 0; r < R; r++) {
        const uint8_t* p = row[r] + c / QK_K * f->bytes;
        if (fmt == Q6_K) {
            const __m256 d = _mm256_set1_ps(half(p + 208)), d32 = _mm256_mul_ps(d, _mm256_set1_ps(32));
            for (int h = 0; h < 2; h++) {
                const __m256 sc = cvt8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 192 + 8 * h))));
                _mm256_storeu_ps(s[r] + 8 * h, _mm256_mul_ps(d, sc));
                _mm256_storeu_ps(s[r] + 16 + 8 * h, _mm256_mul_ps(d32, sc));  // 32·d·sc: as exact as d·sc
            }
            continue;
        }
        // k_scales on the words a, b, c of bytes 4-15, in one register: lanes [a, c, b, c] and [a, a, b, b] give
        // [a & 63s, (c & 15s) | (a >> 2 & 48s), b & 63s, (c >> 4 & 15s) | (b >> 2 & 48s)]: scales 0-3, 4-7, mins 0-3, 4-7
        const __m128i v = _mm_loadu_si128((const __m128i*)(p + 4));
        const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4));
        const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        const __m128i sc = _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F)), top);
        _mm256_storeu_ps(s[r], _mm256_mul_ps(_mm256_set1_ps(half(p)), cvt8(_mm256_cvtepu8_epi32(sc))));
        _mm256_storeu_ps(s[r] + 8, _mm256_mul_ps(_mm256_set1_ps(half(p + 2)), cvt8(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8)))));
    }
}

// Q5_0's 32 codes of a block as signed bytes in value order (c = q − 16), made 32 at a time in a register: the
// nibbles placed, the fifth bits spread to bytes; stored in buf, so that each vector's widening reads them
// from memory (per-lane, the fifth bit alone took a broadcast, a variable shift, a shift, a mask and an OR
// for every 8 values). Q4_0 (q − 8) has the same form, measured slower than decode_group's own.
static inline __attribute__((always_inline)) void q5_0_codes(const uint8_t* blk, int8_t* buf) {
    const __m128i qs = _mm_loadu_si128((const __m128i*)(blk + 6));  // values j (low nibbles) and 16 + j (high)
    const __m256i q = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1),
                                       _mm256_set1_epi8(0x0F));
    // byte j gets bit j of the 32-bit field; where it is 0, q − 16 is the nibble with 0xF0 set
    uint32_t qh;
    memcpy(&qh, blk + 2, sizeof qh);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);  // every bit but byte j's bit j % 8
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    _mm256_store_si256((__m256i*)buf, _mm256_or_si256(q, _mm256_andnot_si256(set, _mm256_set1_epi8((char)0xF0))));
    __asm__ volatile("" : : "r"(buf) : "memory");  // the widening loads read them back from memory, as planned
}

// Weight vector v (0..3, decode_group's order) of a Q5_0 block from its codes: d·c, exact
static inline __m256 q5_0_vector(const int8_t* codes, __m256 d, int v) {
    return _mm256_mul_ps(d, cvt8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(codes + in_group(Q5_0, v))))));
}

// Group g of a chunk starting at value c: vectors 4g .. 4g + 3 of the chunk (values at vec_offset),
// each widened load of codes serving two vectors (Q6_K's high bits four)
static inline __attribute__((always_inline)) void decode_group(int fmt, const uint8_t* row, int64_t c, int g,
                                                               const float* s, __m256* w) {
    const Format* f = &FORMATS[fmt];
    switch (fmt) {
    case Q8_0: {  // block g: d·q
        const uint8_t* p = row + (c / 32 + g) * f->bytes;
        const __m256 d = _mm256_set1_ps(half(p));
        for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(cvt8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 2 + 8 * k)))), d);
        return;
    }
    case Q5_0: {  // block g: d·c, c = q − 16 (q5_0_codes): the same exact weights as d·q − 16d
        const uint8_t* p = row + (c / 32 + g) * f->bytes;
        int8_t q[32] __attribute__((aligned(32)));
        q5_0_codes(p, q);
        const __m256 d = _mm256_set1_ps(half(p));
        for (int v = 0; v < 4; v++) w[v] = q5_0_vector(q, d, v);
        return;
    }
    case Q4_0:
    case Q4_1: {  // block g: bytes 8k .. 8k + 7 hold values 8k .. (low nibbles) and 16 + 8k .. (high); d·q + m, m = −8d
        const uint8_t* p = row + (c / 32 + g) * f->bytes;
        const __m256 d = _mm256_set1_ps(half(p));
        const __m256 m = fmt == Q4_1 ? _mm256_set1_ps(half(p + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8));
        const uint8_t* qs = p + (fmt == Q4_0 ? 2 : 4);
        for (int k = 0; k < 2; k++) {
            const __m256i z = widen8(qs + 8 * k);
            w[2 * k] = _mm256_fmadd_ps(d, cvt8(LOW4(z)), m), w[2 * k + 1] = _mm256_fmadd_ps(d, cvt8(HIGH4(z)), m);  // d·q exact
        }
        return;
    }
    case Q4_K:
    case Q5_K: {  // pair P = g / 2 of groups, bytes 16·(g % 2) .. + 15 of its 32: (d·sc)·q − dmin·m
        const uint8_t* p = row + c / QK_K * f->bytes;
        const int P = g / 2;
        const __m256 s0 = _mm256_set1_ps(s[2 * P]), m0 = _mm256_set1_ps(s[8 + 2 * P]);
        const __m256 s1 = _mm256_set1_ps(s[2 * P + 1]), m1 = _mm256_set1_ps(s[9 + 2 * P]);
        for (int e = 0; e < 2; e++) {
            const int k = 2 * (g % 2) + e;
            const __m256i z = widen8(p + (fmt == Q4_K ? 16 : 48) + 32 * P + 8 * k);
            __m256i lo = LOW4(z), hi = HIGH4(z);
            if (fmt == Q5_K) {  // the fifth bit of value l of group u: bit u of byte l of the 32 at p + 16
                const __m256i bits = _mm256_srli_epi32(widen8(p + 16 + 8 * k), 2 * P);
                lo = _mm256_or_si256(lo, FIFTH(bits, 0)), hi = _mm256_or_si256(hi, FIFTH(bits, 1));
            }
            w[2 * e] = _mm256_fmsub_ps(s0, cvt8(lo), m0), w[2 * e + 1] = _mm256_fmsub_ps(s1, cvt8(hi), m1);
        }
        return;
    }
    default: {  // Q6_K, half h = g / 4, bytes l = 8·(g % 4) ..: value 128h + 32t + l has low nibble t / 2 of
                // ql[64h + 32(t % 2) + l] and bits 2t of qh[32h + l]; (d·sc)·(q − 32), a scale per 16 values
        const uint8_t* p = row + c / QK_K * f->bytes;
        const int h = g / 4, k = g % 4;
        const __m256i a = widen8(p + 64 * h + 8 * k), b = widen8(p + 64 * h + 32 + 8 * k);
        const __m256i top = widen8(p + 128 + 32 * h + 8 * k), six = _mm256_set1_epi32(0x30);
        const __m256i q[4] = {
            _mm256_or_si256(LOW4(a), _mm256_and_si256(_mm256_slli_epi32(top, 4), six)),
            _mm256_or_si256(LOW4(b), _mm256_and_si256(_mm256_slli_epi32(top, 2), six)),
            _mm256_or_si256(HIGH4(a), _mm256_and_si256(top, six)),
            _mm256_or_si256(HIGH4(b), _mm256_and_si256(_mm256_srli_epi32(top, 2), six)),
        };
        for (int t = 0; t < 4; t++) {  // (d·sc)·q − 32·(d·sc): the exact d·sc·(q − 32), rounded once
            const int group = 8 * h + 2 * t + k / 2;
            w[t] = _mm256_fmsub_ps(_mm256_set1_ps(s[group]), cvt8(q[t]), _mm256_set1_ps(s[16 + group]));
        }
        return;
    }
    }
}

// Q6_K, a half h (128 values) at a time: its codes assembled as bytes, 32 at a time, then stored, so that
// each vector's widening reads them (vpmovzxbd from memory): the masks, shifts and ORs that place the
// high bits serve 32 codes each instead of 8 (decode_group's Q6_K spends them on int32 lanes). Code
// 128h + 32t + l lands at buf[32t + l].
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t* row, int64_t c, int h, uint8_t* buf) {
    const uint8_t* p = row + c / QK_K * FORMATS[Q6_K].bytes;
    const __m256i a = _mm256_loadu_si256((const __m256i*)(p + 64 * h)), b = _mm256_loadu_si256((const __m256i*)(p + 64 * h + 32));
    const __m256i top = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi8(0x30);
    _mm256_store_si256((__m256i*)buf, _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(top, 4), six)));
    _mm256_store_si256((__m256i*)(buf + 32), _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(top, 2), six)));
    _mm256_store_si256((__m256i*)(buf + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(top, six)));
    _mm256_store_si256((__m256i*)(buf + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), _mm256_and_si256(_mm256_srli_epi16(top, 2), six)));
    __asm__ volatile("" : : "r"(buf) : "memory");  // the widening loads read them back from memory, as planned
}

// as the AVX-512 path's: while the item's rows are multiplied, ask for the next item's rows at the same
// chunk (which this thread most likely takes next), every line of it, at the chunk's start
static inline __attribute__((always_inline)) void prefetch_chunk(const Product* p, const uint8_t* row, int64_t c) {
    const Format* f = &FORMATS[p->fmt];
    const int64_t from = c / f->values * f->bytes, to = from + CK / f->values * f->bytes;
    for (int64_t line = from & ~63; line < to; line += 64) _mm_prefetch((const char*)row + ROWS * p->ldw + line, _MM_HINT_T1);
}

// The next item's row at byte `offset`, asked for while this item's rows are multiplied: a line at a time,
// spread over the item (the M ≤ 4 paths but Q8_0's; prefetch_chunk asks for a chunk's lines at once, which
// left them waiting on memory: measured from memory 1.16x on Q4_K, 1.1x on Q4_1, 1.0-1.09x on Q5_0/Q5_K/Q6_K)
static inline __attribute__((always_inline)) void prefetch_next(const Product* p, const uint8_t* row, int64_t offset) {
    _mm_prefetch((const char*)row + ROWS * p->ldw + offset, _MM_HINT_T0);
}

// hsum4's order for one vector: lane i + lane i + 4, then i + i + 2, then i + i + 1
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// M ≤ 4 activation rows: R·M accumulators (R = 8 weight rows for one activation row, 4 for two, 2 for
// three or four), each group of vectors decoded into registers and multiplied at once
static inline __attribute__((always_inline)) void fused_rows(int fmt, const int M, const int R, const Product* p,
                                                             const uint8_t* const* row, __m256* out) {
    const int G = GROUP;
    __m256 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm256_setzero_ps();
    float s[ROWS][32];
    for (int64_t c = 0; c < p->n; c += CK) {
        const int groups = (int)((p->n - c < CK ? p->n - c : CK) / (8 * G));
        const Format* f = &FORMATS[fmt];
        if (f->values == QK_K) chunk_scales(fmt, R, row, c, s);
        for (int g = 0; g < groups; g++) {
            const float* xg = p->x + c + group_start(fmt, g);
            const int64_t at = f->values == QK_K ? c / QK_K * f->bytes + g * f->bytes / 8 : (c / 32 + g) * f->bytes;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m256 w[4];
                prefetch_next(p, row[r], at);
                decode_group(fmt, row[r], c, g, s[r], w);
#pragma GCC unroll 4
                for (int v = 0; v < G; v++)
#pragma GCC unroll 4
                    for (int i = 0; i < M; i++)
                        acc[r][i] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xg + i * p->n + in_group(fmt, v)), acc[r][i]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

// Q5_0, one or two activation rows: the R rows' codes of a block made as bytes first (q5_0_codes), then
// each row's four weights d·c multiplied in, the rows' chains of FMAs interleaved. The weights and the
// order of every sum are fused_rows' (decode_group's), so the bits are too: a row gets the same numbers
// whichever path its batch takes. (Slower than fused_rows at 3-4 rows; for Q4_0, whose nibbles need no
// fifth bit, slower at every count.)
static inline __attribute__((always_inline)) void q5_0_rows(const int M, const int R, const Product* p,
                                                            const uint8_t* const* row, __m256* out) {
    const int bytes = FORMATS[Q5_0].bytes;
    __m256 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm256_setzero_ps();
    int8_t codes[ROWS][32] __attribute__((aligned(32)));
    for (int64_t c = 0; c < p->n; c += CK) {
        const int blocks = (int)((p->n - c < CK ? p->n - c : CK) / 32);
        for (int64_t block = c / 32; block < c / 32 + blocks; block++) {
            for (int r = 0; r < R; r++) prefetch_next(p, row[r], block * bytes), q5_0_codes(row[r] + block * bytes, codes[r]);
            const float* xg = p->x + 32 * block;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m256 d = _mm256_set1_ps(half(row[r] + block * bytes));
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    const __m256 w = q5_0_vector(codes[r], d, v);
#pragma GCC unroll 4
                    for (int i = 0; i < M; i++) acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + i * p->n + in_group(Q5_0, v)), acc[r][i]);
                }
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

static void finish_block_item(const Product* p, int64_t o0, int rows, int64_t m, const __m256* acc) {
    for (int64_t i = 0; i < m; i++)
        for (int r = 0; r < rows; r++) p->y[i * p->ldy + o0 + r] = hsum8(acc[i * ROWS + r]);
}

static inline __attribute__((always_inline)) void direct_fused_item(int fmt, const int M, const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    __m256 acc[4 * ROWS];
    const int R = M == 1 ? 8 : M == 2 ? 4 : 2;
    for (int h = 0; h < ROWS; h += R) {
        if (fmt == Q5_0 && M <= 2) q5_0_rows(M, R, p, row + h, acc + h);  // measured: 1.4x (1 row), 1.3x (2)
        else fused_rows(fmt, M, R, p, row + h, acc + h);
    }
    finish_block_item(p, o0, rows, M, acc);
}

// A register tile of the stored path: TILE weight rows (wb, vectors in the decoder's order, row stride
// CK) by M ≤ 2 activation rows (x at the chunk, its vectors at off[v]): 8 accumulators, 4 weight
// vectors and 2 activation vectors of the 16 registers
static inline __attribute__((always_inline)) void tile_rows(const int M, const float* wb, const float* x, int64_t ldx,
                                                            const int* off, int vectors, __m256* acc) {
    __m256 a[2][TILE];
    for (int i = 0; i < M; i++)
        for (int r = 0; r < TILE; r++) a[i][r] = acc[i * ROWS + r];
    for (int v = 0; v < vectors; v++) {
        __m256 w0 = _mm256_load_ps(wb + 8 * v), w1 = _mm256_load_ps(wb + CK + 8 * v);
        __m256 w2 = _mm256_load_ps(wb + 2 * CK + 8 * v), w3 = _mm256_load_ps(wb + 3 * CK + 8 * v);
        // held in registers for both activation rows: folded into the FMAs, each was loaded twice and the
        // loads, not the FMAs, bounded the tile (1.27x at 16 rows)
        if (M > 1) __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
        for (int i = 0; i < M; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + off[v]);
            __asm__("" : "+x"(xv));  // kept in a register, not reloaded for each weight row's FMA
            a[i][0] = _mm256_fmadd_ps(w0, xv, a[i][0]), a[i][1] = _mm256_fmadd_ps(w1, xv, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(w2, xv, a[i][2]), a[i][3] = _mm256_fmadd_ps(w3, xv, a[i][3]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < TILE; r++) acc[i * ROWS + r] = a[i][r];
}

static inline __attribute__((always_inline)) void direct_stored_item(int fmt, const Product* p, int64_t o0, int rows) {
    const int G = GROUP;
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    float wb[ROWS * CK] __attribute__((aligned(32)));
    float s[ROWS][32];
    int off[CK / 8];
    for (int v = 0; v < CK / 8; v++) off[v] = vec_offset(fmt, v);
    __m256 acc[MAX_M * ROWS];
    for (int64_t k = 0; k < p->m * ROWS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < p->n; c += CK) {
        const int vectors = (int)((p->n - c < CK ? p->n - c : CK) / 8);
        if (FORMATS[fmt].values == QK_K) chunk_scales(fmt, ROWS, row, c, s);
        for (int r = 0; r < ROWS; r++) {
            prefetch_chunk(p, row[r], c);
            for (int g = 0; g < vectors / G; g++) {
                __m256 w[4];
                decode_group(fmt, row[r], c, g, s[r], w);
                for (int v = 0; v < G; v++) _mm256_store_ps(wb + r * CK + 8 * (G * g + v), w[v]);
            }
        }
        for (int h = 0; h < ROWS; h += TILE)
            for (int64_t i = 0; i < p->m; i += 2) {
                const float* x = p->x + i * p->n + c;
                if (p->m - i >= 2) tile_rows(2, wb + h * CK, x, p->n, off, vectors, acc + i * ROWS + h);
                else tile_rows(1, wb + h * CK, x, p->n, off, vectors, acc + i * ROWS + h);
            }
    }
    finish_block_item(p, o0, rows, p->m, acc);
}

// ---- Q4_K, factored: a row's sum is Σ_u (d·sc_u)·(Σ_{v in u} q_v·x_v) − Σ_u (dmin·m_u)·X_u ----
// The codes are converted and multiplied by x as they are; each sub-block's sum is scaled into the
// accumulator once, and the offsets meet X_u, x's sums over the sub-blocks, made once per call
// (x_sums). One FMA per 8 weights where the weights themselves took two (made, then multiplied):
// 1.2x faster for one row. The numbers are within float32 tolerance of the reference's weights times
// x (the tests hold every path to 1e-5 of Σ|w·x|), not its roundings; every sum still sees the same
// operations in the same order alone or in any batch: per chunk the offsets' FNMADD, then per pair P
// of sub-blocks (2P: the low nibbles of 32 bytes, 2P + 1: the high), Σ q·x of each (a multiply, then
// FMAs, vector k = 0..3 in order), scaled in, 2P first.

static inline int wants_sums(int fmt) { return fmt == Q4_K || fmt == Q6_K; }  // x_sums for the offsets (Q8_0 has none)
// per row: X over each 32 values (Q4_K's sub-blocks), then over each 16 (Q6_K's groups, from sums16), 8 spare
static inline int64_t sums_stride(int64_t n) { return n / 32 + n / 16 + 8; }
static inline int64_t sums16(int64_t n) { return n / 32; }

static void x_sums(const float* x, int64_t m, int64_t n, float* xs) {
    for (int64_t i = 0; i < m; i++, xs += sums_stride(n)) {
        for (int64_t u = 0; u < n / 32; u++) {
            const float* v = x + i * n + 32 * u;
            const __m256 a = _mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8));
            const __m256 b = _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24));
            xs[u] = hsum8(_mm256_add_ps(a, b));
            xs[sums16(n) + 2 * u] = hsum8(a), xs[sums16(n) + 2 * u + 1] = hsum8(b);
        }
        memset(xs + sums16(n) + n / 16, 0, 8 * sizeof(float));
    }
}

// The codes of vector k (0..3) of sub-block 2P + j (j = 0: low nibbles, 1: high) of a chunk, as floats
static inline __attribute__((always_inline)) __m256 k_codes(const uint8_t* p, int P, int j, int k) {
    const __m256i z = widen8(p + 16 + 32 * P + 8 * k);
    return cvt8(j ? HIGH4(z) : LOW4(z));
}

// x's vector for vector k of sub-block 2P + j: decode_group's places (group 2P + k / 2, its vector 2(k % 2) + j)
static inline int k_offset(int fmt, int P, int j, int k) { return vec_offset(fmt, 8 * P + 2 * k + j); }

static inline __attribute__((always_inline)) void factored_rows(int fmt, const int M, const int R, const Product* p,
                                                                const uint8_t* const* row, __m256* out) {
    const float* x = p->x;
    const float* xs = p->xs;
    __m256 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm256_setzero_ps();
    float s[ROWS][32];
    for (int64_t c = 0; c < p->n; c += CK) {
        chunk_scales(fmt, R, row, c, s);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < M; i++)
                acc[r][i] = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 8), _mm256_loadu_ps(xs + i * sums_stride(p->n) + c / 32), acc[r][i]);
        for (int P = 0; P < 4; P++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t* b = row[r] + c / QK_K * FORMATS[fmt].bytes;
                prefetch_next(p, row[r], c / QK_K * FORMATS[fmt].bytes + P * FORMATS[fmt].bytes / 4);
#pragma GCC unroll 2
                for (int j = 0; j < 2; j++) {
                    __m256 sub[4];
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) {
                        const __m256 q = k_codes(b, P, j, k);
#pragma GCC unroll 4
                        for (int i = 0; i < M; i++) {
                            const __m256 xv = _mm256_loadu_ps(x + i * p->n + c + k_offset(fmt, P, j, k));
                            sub[i] = k ? _mm256_fmadd_ps(q, xv, sub[i]) : _mm256_mul_ps(q, xv);
                        }
                    }
                    const __m256 scale = _mm256_broadcast_ss(&s[r][2 * P + j]);
                    for (int i = 0; i < M; i++) acc[r][i] = _mm256_fmadd_ps(scale, sub[i], acc[r][i]);
                }
            }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

// More rows: each chunk's codes stored as floats in L1 (row r at wb + r·CK, vector 8P + 2k + j), then
// tiles of 2 weight rows by M ≤ 2 activation rows, both sub-blocks of a pair at once (8 chains of FMAs;
// a weight vector loaded once for both activation rows)
static inline __attribute__((always_inline)) void factored_tile(const int M, const float* wb, const float* s, const float* x,
                                                                int64_t ldx, const int* off, __m256* acc) {
    __m256 a[2][2];
    for (int i = 0; i < M; i++)
        for (int r = 0; r < 2; r++) a[i][r] = acc[i * ROWS + r];
    for (int P = 0; P < 4; P++) {
        __m256 sub[2][2][2];  // [j][i][r]
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            __m256 xv[2];
            for (int i = 0; i < M; i++) {
                xv[i] = _mm256_loadu_ps(x + i * ldx + off[8 * P + v]);
                __asm__("" : "+x"(xv[i]));
            }
            for (int r = 0; r < 2; r++) {
                __m256 w = _mm256_load_ps(wb + r * CK + 8 * (8 * P + v));
                if (M > 1) __asm__("" : "+x"(w));
                for (int i = 0; i < M; i++)
                    sub[v % 2][i][r] = v < 2 ? _mm256_mul_ps(w, xv[i]) : _mm256_fmadd_ps(w, xv[i], sub[v % 2][i][r]);
            }
        }
        for (int j = 0; j < 2; j++)
            for (int r = 0; r < 2; r++) {
                const __m256 scale = _mm256_broadcast_ss(s + 32 * r + 2 * P + j);
                for (int i = 0; i < M; i++) a[i][r] = _mm256_fmadd_ps(scale, sub[j][i][r], a[i][r]);
            }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < 2; r++) acc[i * ROWS + r] = a[i][r];
}

static inline __attribute__((always_inline)) void factored_stored_item(int fmt, const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    float wb[ROWS * CK] __attribute__((aligned(32)));
    float s[ROWS][32];
    int off[CK / 8];
    for (int P = 0; P < 4; P++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 2; j++) off[8 * P + 2 * k + j] = k_offset(fmt, P, j, k);
    const int64_t lds = sums_stride(p->n);
    __m256 acc[MAX_M * ROWS];
    for (int64_t k = 0; k < p->m * ROWS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < p->n; c += CK) {
        chunk_scales(fmt, ROWS, row, c, s);
        for (int r = 0; r < ROWS; r++) {
            prefetch_chunk(p, row[r], c);
            const uint8_t* b = row[r] + c / QK_K * FORMATS[fmt].bytes;
            for (int P = 0; P < 4; P++)
                for (int k = 0; k < 4; k++)
                    for (int j = 0; j < 2; j++) _mm256_store_ps(wb + r * CK + 8 * (8 * P + 2 * k + j), k_codes(b, P, j, k));
        }
        for (int64_t i = 0; i < p->m; i++)
            for (int r = 0; r < ROWS; r++)
                acc[i * ROWS + r] = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 8), _mm256_loadu_ps(p->xs + i * lds + c / 32), acc[i * ROWS + r]);
        for (int h = 0; h < ROWS; h += 2)
            for (int64_t i = 0; i < p->m; i += 2) {
                const float* x = p->x + i * p->n + c;
                if (p->m - i >= 2) factored_tile(2, wb + h * CK, s[h], x, p->n, off, acc + i * ROWS + h);
                else factored_tile(1, wb + h * CK, s[h], x, p->n, off, acc + i * ROWS + h);
            }
    }
    finish_block_item(p, o0, rows, p->m, acc);
}

// Q6_K, factored the same way: a row's sum is Σ_g (d·sc_g)·(Σ_{v in g} q_v·x_v) − Σ_g (32·d·sc_g)·X_g over
// its groups g of 16 values, the codes q (0..63, q6k_codes' bytes) meeting x as they are: per chunk the
// offsets' two FNMADDs (groups 0-7, 8-15), then group by group Σ q·x of its two vectors (a multiply, an
// FMA) scaled in. Vector v of a chunk is values 8v .. 8v + 7 here (group v / 2).
static inline __attribute__((always_inline)) void q6k_rows(const int M, const int R, const Product* p,
                                                           const uint8_t* const* row, __m256* out) {
    const int bytes = FORMATS[Q6_K].bytes;
    const int64_t lds = sums_stride(p->n), o16 = sums16(p->n);
    __m256 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm256_setzero_ps();
    float s[ROWS][32];
    uint8_t buf[ROWS][128] __attribute__((aligned(32)));
    for (int64_t c = 0; c < p->n; c += CK) {
        chunk_scales(Q6_K, R, row, c, s);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < M; i++) {
                const float* X = p->xs + i * lds + o16 + c / 16;
                acc[r][i] = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 16), _mm256_loadu_ps(X), acc[r][i]);
                acc[r][i] = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 24), _mm256_loadu_ps(X + 8), acc[r][i]);
            }
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < R; r++) q6k_codes(row[r], c, h, buf[r]);
            for (int g = 8 * h; g < 8 * h + 8; g++) {
                const int at = 32 * ((g % 8) / 2) + 16 * (g % 2);  // buf: code 128h + 32t + l at 32t + l
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    prefetch_next(p, row[r], c / QK_K * bytes + g * bytes / 16);
                    const __m256 q0 = cvt8(widen8(buf[r] + at)), q1 = cvt8(widen8(buf[r] + at + 8));
                    const __m256 scale = _mm256_broadcast_ss(&s[r][g]);
#pragma GCC unroll 4
                    for (int i = 0; i < M; i++) {
                        const float* xv = p->x + i * p->n + c + 16 * g;
                        const __m256 sub = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xv + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(xv)));
                        acc[r][i] = _mm256_fmadd_ps(scale, sub, acc[r][i]);
                    }
                }
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

// More rows: a chunk's codes stored as floats in L1 (row r at wb + r·CK, in value order), then tiles of 2
// weight rows by M ≤ 2 activation rows, two groups at a time (8 chains of FMAs)
static inline __attribute__((always_inline)) void q6k_tile(const int M, const float* wb, const float* s, const float* x,
                                                           int64_t ldx, __m256* acc) {
    __m256 a[2][2];
    for (int i = 0; i < M; i++)
        for (int r = 0; r < 2; r++) a[i][r] = acc[i * ROWS + r];
    for (int G = 0; G < 16; G += 2) {
        __m256 sub[2][2][2];  // [group of the two][i][r]
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            const int j = v / 2;
            __m256 xv[2];
            for (int i = 0; i < M; i++) {
                xv[i] = _mm256_loadu_ps(x + i * ldx + 8 * (2 * G + v));
                __asm__("" : "+x"(xv[i]));
            }
            for (int r = 0; r < 2; r++) {
                __m256 w = _mm256_load_ps(wb + r * CK + 8 * (2 * G + v));
                if (M > 1) __asm__("" : "+x"(w));
                for (int i = 0; i < M; i++)
                    sub[j][i][r] = v % 2 ? _mm256_fmadd_ps(w, xv[i], sub[j][i][r]) : _mm256_mul_ps(w, xv[i]);
            }
        }
        for (int j = 0; j < 2; j++)
            for (int r = 0; r < 2; r++) {
                const __m256 scale = _mm256_broadcast_ss(s + 32 * r + G + j);
                for (int i = 0; i < M; i++) a[i][r] = _mm256_fmadd_ps(scale, sub[j][i][r], a[i][r]);
            }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < 2; r++) acc[i * ROWS + r] = a[i][r];
}

static inline __attribute__((always_inline)) void q6k_stored_item(const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    float wb[ROWS * CK] __attribute__((aligned(32)));
    float s[ROWS][32];
    const int64_t lds = sums_stride(p->n), o16 = sums16(p->n);
    __m256 acc[MAX_M * ROWS];
    for (int64_t k = 0; k < p->m * ROWS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < p->n; c += CK) {
        chunk_scales(Q6_K, ROWS, row, c, s);
        for (int r = 0; r < ROWS; r++) {
            prefetch_chunk(p, row[r], c);
            for (int h = 0; h < 2; h++) {
                uint8_t buf[128] __attribute__((aligned(32)));
                q6k_codes(row[r], c, h, buf);
                for (int t = 0; t < 4; t++)
                    for (int k = 0; k < 4; k++) _mm256_store_ps(wb + r * CK + 128 * h + 32 * t + 8 * k, cvt8(widen8(buf + 32 * t + 8 * k)));
            }
        }
        for (int64_t i = 0; i < p->m; i++)
            for (int r = 0; r < ROWS; r++) {
                const float* X = p->xs + i * lds + o16 + c / 16;
                __m256* a = acc + i * ROWS + r;
                *a = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 16), _mm256_loadu_ps(X), *a);
                *a = _mm256_fnmadd_ps(_mm256_loadu_ps(s[r] + 24), _mm256_loadu_ps(X + 8), *a);
            }
        for (int h = 0; h < ROWS; h += 2)
            for (int64_t i = 0; i < p->m; i += 2) {
                const float* x = p->x + i * p->n + c;
                if (p->m - i >= 2) q6k_tile(2, wb + h * CK, s[h], x, p->n, acc + i * ROWS + h);
                else q6k_tile(1, wb + h * CK, s[h], x, p->n, acc + i * ROWS + h);
            }
    }
    finish_block_item(p, o0, rows, p->m, acc);
}

// Q8_0, factored the same way (its weights are d·q: no offsets): per block, Σ q·x over its four vectors
// scaled in by d. 1.2x faster for one row; Q4_0, Q4_1 and Q5_0, whose offsets need a second FMA a block,
// measured no faster (Q4_1, SmolLM2's format) or slower for more rows, and keep decode_group.
static inline __attribute__((always_inline)) void q8_codes(const uint8_t* blk, int k, __m256* q) {
    *q = cvt8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * k))));
}

static inline __attribute__((always_inline)) void q8_rows(const int M, const int R, const Product* p, const uint8_t* const* row,
                                                          __m256* out) {
    __m256 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < p->n; c += CK) {
        const int blocks = (int)((p->n - c < CK ? p->n - c : CK) / 32);
        for (int64_t block = c / 32; block < c / 32 + blocks; block++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t* blk = row[r] + block * FORMATS[Q8_0].bytes;
                if (block == c / 32) prefetch_chunk(p, row[r], c);  // row by row: faster here than prefetch_next
                __m256 q[4];
                for (int k = 0; k < 4; k++) q8_codes(blk, k, q + k);
                const __m256 d = _mm256_set1_ps(half(blk));
#pragma GCC unroll 4
                for (int i = 0; i < M; i++) {
                    const float* x = p->x + i * p->n + 32 * block;
                    __m256 sub = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
                    for (int k = 1; k < 4; k++) sub = _mm256_fmadd_ps(q[k], _mm256_loadu_ps(x + 8 * k), sub);
                    acc[r][i] = _mm256_fmadd_ps(d, sub, acc[r][i]);
                }
            }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) out[i * ROWS + r] = acc[r][i];
}

// More rows: a chunk's codes stored as floats in L1 (row r at wb + r·CK), d at s[r][b]; tiles of 2 weight
// rows by M ≤ 2 activation rows over U = 2 blocks at once (8 chains of FMAs), or the chunk's odd last one
static inline __attribute__((always_inline)) void q8_tile(const int M, const int U, const float* wb, const float* s,
                                                          const float* x, int64_t n, int b, __m256* acc) {
    __m256 sub[2][2][2];  // [block][i][r]
#pragma GCC unroll 8
    for (int v = 0; v < 4 * U; v++) {
        const int j = v / 4, k = v % 4;
        __m256 xv[2];
        for (int i = 0; i < M; i++) {
            xv[i] = _mm256_loadu_ps(x + i * n + 32 * (b + j) + 8 * k);
            __asm__("" : "+x"(xv[i]));
        }
        for (int r = 0; r < 2; r++) {
            __m256 w = _mm256_load_ps(wb + r * CK + 32 * (b + j) + 8 * k);
            if (M > 1) __asm__("" : "+x"(w));
            for (int i = 0; i < M; i++) sub[j][i][r] = k ? _mm256_fmadd_ps(w, xv[i], sub[j][i][r]) : _mm256_mul_ps(w, xv[i]);
        }
    }
    for (int j = 0; j < U; j++)
        for (int i = 0; i < M; i++)
            for (int r = 0; r < 2; r++)
                acc[i * ROWS + r] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 32 * r + b + j), sub[j][i][r], acc[i * ROWS + r]);
}

static inline __attribute__((always_inline)) void q8_stored_item(const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    float wb[ROWS * CK] __attribute__((aligned(32)));
    float s[ROWS][32];
    __m256 acc[MAX_M * ROWS];
    for (int64_t k = 0; k < p->m * ROWS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < p->n; c += CK) {
        const int blocks = (int)((p->n - c < CK ? p->n - c : CK) / 32);
        for (int r = 0; r < ROWS; r++) {
            prefetch_chunk(p, row[r], c);
            for (int b = 0; b < blocks; b++) {
                const uint8_t* blk = row[r] + (c / 32 + b) * FORMATS[Q8_0].bytes;
                s[r][b] = half(blk);
                for (int k = 0; k < 4; k++) q8_codes(blk, k, (__m256*)(wb + r * CK + 32 * b + 8 * k));
            }
        }
        for (int h = 0; h < ROWS; h += 2)
            for (int64_t i = 0; i < p->m; i += 2) {
                const float* x = p->x + i * p->n + c;
                __m256* a = acc + i * ROWS + h;
                int b = 0;
                if (p->m - i >= 2) {
                    for (; b + 2 <= blocks; b += 2) q8_tile(2, 2, wb + h * CK, s[h], x, p->n, b, a);
                    if (b < blocks) q8_tile(2, 1, wb + h * CK, s[h], x, p->n, b, a);
                } else {
                    for (; b + 2 <= blocks; b += 2) q8_tile(1, 2, wb + h * CK, s[h], x, p->n, b, a);
                    if (b < blocks) q8_tile(1, 1, wb + h * CK, s[h], x, p->n, b, a);
                }
            }
    }
    finish_block_item(p, o0, rows, p->m, acc);
}

// The factored formats' M ≤ 4 rows: 8, 4 or 2 weight rows at a time, by the format's own loop
static inline __attribute__((always_inline)) void factored_item(int fmt, const int M, const Product* p, int64_t o0, int rows) {
    const uint8_t* row[ROWS];
    item_rows(p, o0, rows, row);
    __m256 acc[4 * ROWS];
    const int R = M == 1 ? 8 : M == 2 ? 4 : 2;
    for (int h = 0; h < ROWS; h += R) {
        if (fmt == Q6_K) q6k_rows(M, R, p, row + h, acc + h);
        else if (fmt == Q8_0) q8_rows(M, R, p, row + h, acc + h);
        else factored_rows(fmt, M, R, p, row + h, acc + h);
    }
    finish_block_item(p, o0, rows, M, acc);
}

static inline __attribute__((always_inline)) void fused_item(int fmt, const int M, const Product* p, int64_t o0, int rows) {
    if (fmt == Q4_K) {
        factored_item(fmt, M, p, o0, rows);
    } else if (fmt == Q6_K || fmt == Q8_0) {
        factored_item(fmt, M, p, o0, rows);
    } else {
        direct_fused_item(fmt, M, p, o0, rows);
    }
}

static inline __attribute__((always_inline)) void stored_item(int fmt, const Product* p, int64_t o0, int rows) {
    if (fmt == Q4_K) factored_stored_item(fmt, p, o0, rows);
    else if (fmt == Q6_K) q6k_stored_item(p, o0, rows);
    else if (fmt == Q8_0) q8_stored_item(p, o0, rows);
    else direct_stored_item(fmt, p, o0, rows);
}

// Dequantization with the same decoders, every vector put at its values' place
static void expand_row(int fmt, const uint8_t* row, int64_t n, float* y) {
    const int G = GROUP;
    float s[1][32];
    for (int64_t c = 0; c < n; c += CK) {
        const int groups = (int)((n - c < CK ? n - c : CK) / (8 * G));
        if (FORMATS[fmt].values == QK_K) chunk_scales(fmt, 1, &row, c, s);
        for (int g = 0; g < groups; g++) {
            __m256 w[4];
            decode_group(fmt, row, c, g, s[0], w);
            for (int v = 0; v < G; v++) _mm256_storeu_ps(y + c + vec_offset(fmt, G * g + v), w[v]);
        }
    }
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512VL__)) || (defined(__AVX2__) && defined(__FMA__))

#define DEFINE_BLOCK_ITEMS(NAME, FMT)                                                 \
    static void NAME(void* ctx, uint32_t begin, uint32_t end) {                       \
        const Product* p = ctx;                                                       \
        for (int64_t item = begin; item < end; item++) {                              \
            const int64_t o0 = item * ROWS;                                           \
            const int rows = p->out - o0 < ROWS ? (int)(p->out - o0) : ROWS;          \
            switch (p->m) {                                                           \
            case 1: fused_item(FMT, 1, p, o0, rows); break;                           \
            case 2: fused_item(FMT, 2, p, o0, rows); break;                           \
            case 3: fused_item(FMT, 3, p, o0, rows); break;                           \
            case 4: fused_item(FMT, 4, p, o0, rows); break;                           \
            default: stored_item(FMT, p, o0, rows);                                   \
            }                                                                         \
        }                                                                             \
    }

DEFINE_BLOCK_ITEMS(items_q8_0, Q8_0)
DEFINE_BLOCK_ITEMS(items_q4_0, Q4_0)
DEFINE_BLOCK_ITEMS(items_q4_1, Q4_1)
DEFINE_BLOCK_ITEMS(items_q5_0, Q5_0)
DEFINE_BLOCK_ITEMS(items_q4_k, Q4_K)
DEFINE_BLOCK_ITEMS(items_q5_k, Q5_K)
DEFINE_BLOCK_ITEMS(items_q6_k, Q6_K)

static PoolTask block_items(int fmt) {
    switch (fmt) {
    case Q8_0: return items_q8_0;
    case Q4_0: return items_q4_0;
    case Q4_1: return items_q4_1;
    case Q5_0: return items_q5_0;
    case Q4_K: return items_q4_k;
    case Q5_K: return items_q5_k;
    case Q6_K: return items_q6_k;
    default: return NULL;
    }
}

#else
static PoolTask block_items(int fmt) { (void)fmt; return NULL; }
static inline int in_lane_order(int fmt) { (void)fmt; return 0; }
static inline void to_lane_order(const float* x, float* xt, int64_t count) { (void)x, (void)xt, (void)count; }
static inline int wants_sums(int fmt) { (void)fmt; return 0; }
static inline int64_t sums_stride(int64_t n) { return n; }
static void x_sums(const float* x, int64_t m, int64_t n, float* xs) { (void)x, (void)m, (void)n, (void)xs; }
static void expand_row(int fmt, const uint8_t* row, int64_t n, float* y) { (void)fmt, (void)row, (void)n, (void)y; }
#endif

// Items a thread claims at a time: CHUNK, or for a long matrix (an LM head: 16k-32k items) a 16th of a
// thread's share, so that each thread streams longer runs of rows (a head from memory: 1.3-1.5x on SmolLM2's, Gemma 3's;
// a fused gate/up job, whose claims were CHUNK before: Qwen2.5-0.5B's exact one-sequence step 21.1-21.9 -> 19.8-20.3
// ms on a Zen 4 VM, 2 threads, alternated builds). An item's numbers do not depend on who computes it.
static inline uint32_t claim_size(uint32_t items, int threads) {
    const uint32_t share = items / (16 * (uint32_t)(threads > 1 ? threads : 1));
    return share > CHUNK ? share : CHUNK;
}

// x [m, n] in its decoders' lane order (to_lane_order) into xt: a prompt's rows spread over the pool,
// which waited for the calling thread otherwise (1,024 rows of 4,864 values: 20 MB, copied alone).
typedef struct {
    const float* x;
    float* xt;
    int64_t n;
} LaneOrder;

static void lane_order_rows(void* ctx, uint32_t begin, uint32_t end) {
    const LaneOrder* l = (const LaneOrder*)ctx;
    to_lane_order(l->x + begin * l->n, l->xt + begin * l->n, (int64_t)(end - begin) * l->n);
}

static void x_in_lane_order(const float* x, float* xt, int64_t m, int64_t n, int threads) {
    LaneOrder l = {x, xt, n};
    if (m < 64 || threads < 2)
        lane_order_rows(&l, 0, (uint32_t)m);
    else
        kvlab_pool_run(lane_order_rows, &l, (uint32_t)m, 16, threads);
}

// Activation rows a pass over the weights takes: each pass decodes every block once, for all its rows.
// With AVX-512, 128; 32 elsewhere. Qwen2.5-Coder-0.5B's 512-row prompt products on a Zen 4 VM, 2
// threads, alternated builds (2026-12-07; tiles() taking a tile's rows once for both halves of the
// item, so that the pass's sums are read once a span): against 64 rows before (at most 1,024 inputs),
// the Q5_0 gate 25.7 -> 24.5 ms, Q8_0 25.6 -> 24.5, a 896 × 896 Q5_0 matrix 4.91 -> 4.68; against 32
// (more inputs), the 896 × 4,864 down projections 3-5% less, and 2-4% less again at 128 rows than at
// 64 once the tiles ran over spans (stored_item). 256 rows took as long as 128.
static inline int64_t pass_rows(void) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    return MAX_M;
#else
    return MAX_M / 4;
#endif
}

// buffered_items' passes (float rows, expanded by the exact dequantizers), whose sums take twice a block
// path's stack a row: what every pass took before the block paths' 128 rows, with AVX-512 64 where a
// matrix has at most 1,024 inputs, else 32
static inline int64_t buffered_rows(int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    return n <= 1024 ? BUFFERED_M : BUFFERED_M / 2;
#else
    (void)n;
    return BUFFERED_M / 2;
#endif
}

// y[i, o] (row stride ldy) = sum_j x[i, j] · W[o, j]; W: `out` rows of format `fmt`, row o's blocks at
// w + o·ldw; x: [m, n] float32. Returns 0; −1 for an unknown format or n not a whole number of blocks;
// −2 when no memory was left for the activations in lane order.
int kvlab_quant_matmul(int fmt, const uint8_t* w, int64_t ldw, const float* x, float* y, int64_t m, int64_t n,
                       int64_t ldy, int64_t out, int threads) {
    if (fmt < 0 || fmt >= NUM_FORMATS || n % FORMATS[fmt].values || out / ROWS >= UINT32_MAX) return -1;
    if (fmt >= TILED) return kvlab_t16_matmul(fmt - TILED + Q8_0, w, x, y, m, n, ldy, out, threads);
    if (fmt >= INTERLEAVED) return kvlab_i8_matmul(fmt - INTERLEAVED + Q8_0, w, x, y, m, n, ldy, out, threads);
    PoolTask task = block_items(fmt);
    float* xt = NULL;
    float* xs = NULL;
    if (task && in_lane_order(fmt)) {
        if (!(xt = aligned_alloc(64, (m * n * sizeof(float) + 63) / 64 * 64))) return -2;  // whole-line loads
        x_in_lane_order(x, xt, m, n, threads);
        x = xt;
    }
    if (task && wants_sums(fmt)) {
        if (!(xs = malloc(m * sums_stride(n) * sizeof(float)))) return -2;
        x_sums(x, m, n, xs);
    }
    const int64_t rows = task ? pass_rows() : buffered_rows(n);
    for (int64_t i = 0; i < m; i += rows) {  // each pass reads the blocks once for up to `rows` rows
        Product p = {fmt, w, ldw, x + i * n, y + i * ldy, m - i < rows ? m - i : rows, n, ldy, out,
                     xs ? xs + i * sums_stride(n) : NULL};
        const uint32_t items = (uint32_t)((out + ROWS - 1) / ROWS);
        kvlab_pool_run(task ? task : buffered_items, &p, items, claim_size(items, threads), threads);
    }
    free(xt);
    free(xs);
    return 0;
}

// The parts of a fused matrix (q, k and v; gate and up) over the same x, as one job for the pool: one
// dispatch where a call per part makes one each (a decode step's small matrices spend as long in a
// dispatch as in their products). Part j (format fmt[j], out[j] rows at w[j], ldw[j] bytes a row)
// writes its columns of y after the parts before it; the numbers are kvlab_quant_matmul's, part by
// part. Parts in different families (interleaved and not), tiled ones or more than PARTS_M rows go part by part, except
// interleaved parts in bfloat16 on the tiles: one job and one rounding of x for all (q, k and v of a
// 512-token pass: three of each before).
int kvlab_quant_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* ldw, const int64_t* out,
                             const float* x, float* y, int64_t m, int64_t n, int64_t ldy, int threads) {
    int interleaved = 0, tiled = 0;
    for (int j = 0; j < num; j++) {
        if (fmt[j] < 0 || fmt[j] >= NUM_FORMATS || n % FORMATS[fmt[j]].values || out[j] / ROWS >= UINT32_MAX) return -1;
        interleaved += fmt[j] >= INTERLEAVED && fmt[j] < TILED;
        tiled += fmt[j] >= TILED;
    }
    if (num > 1 && num <= KVLAB_MAX_JOBS && (m <= PARTS_M || kvlab_i8_bf16_pass(m, n)) && interleaved == num) {
        int source[KVLAB_MAX_JOBS];
        for (int j = 0; j < num; j++) source[j] = fmt[j] - INTERLEAVED + Q8_0;
        return kvlab_i8_matmul_parts(num, source, w, out, x, y, m, n, ldy, threads);
    }
    if (num > 1 && num <= KVLAB_MAX_JOBS && tiled == num) {
        int source[KVLAB_MAX_JOBS];
        for (int j = 0; j < num; j++) source[j] = fmt[j] - TILED + Q8_0;
        return kvlab_t16_matmul_parts(num, source, w, out, x, y, m, n, ldy, threads);
    }
    if (num == 1 || num > KVLAB_MAX_JOBS || m > PARTS_M || interleaved || tiled) {
        int64_t column = 0;
        for (int j = 0; j < num; j++) {
            const int status = kvlab_quant_matmul(fmt[j], w[j], ldw[j], x, y + column, m, n, ldy, out[j], threads);
            if (status) return status;
            column += out[j];
        }
        return 0;
    }
    Product p[KVLAB_MAX_JOBS];
    PoolJobs jobs = {.num = num};
    float* xt = NULL;  // x in lane order, made once for the parts whose decoders want it
    float* xs = NULL;  // x's sums over sub-blocks, likewise
    int64_t column = 0;
    for (int j = 0; j < num; j++) {
        PoolTask task = block_items(fmt[j]);
        const float* xj = x;
        if (task && in_lane_order(fmt[j])) {
            if (!xt) {
                if (!(xt = aligned_alloc(64, (m * n * sizeof(float) + 63) / 64 * 64))) return free(xs), -2;
                x_in_lane_order(x, xt, m, n, threads);
            }
            xj = xt;
        }
        if (task && wants_sums(fmt[j]) && !xs) {
            if (!(xs = malloc(m * sums_stride(n) * sizeof(float)))) return free(xt), -2;
            x_sums(x, m, n, xs);
        }
        p[j] = (Product){fmt[j], w[j], ldw[j], xj, y + column, m, n, ldy, out[j], xs};
        jobs.task[j] = task ? task : buffered_items, jobs.ctx[j] = &p[j];
        jobs.first[j + 1] = jobs.first[j] + (uint32_t)((out[j] + ROWS - 1) / ROWS);
        column += out[j];
    }
    kvlab_pool_run_jobs(&jobs, claim_size(jobs.first[num], threads), threads);
    free(xt);
    free(xs);
    return 0;
}

// ---- dequantize: the blocks as float32 [rows, n] (row stride ldy), for prompt-sized products ----

typedef struct {
    int fmt;
    const uint8_t* w;
    int64_t ldw;
    float* y;
    int64_t ldy, rows, n;
} Expansion;

// `rows` rows of W from w (ldw bytes apart) as floats into y (ldy apart): the reference's values, bit for bit
static void expand_rows(int fmt, const uint8_t* w, int64_t ldw, int rows, int64_t n, float* y, int64_t ldy) {
    const Format* f = &FORMATS[fmt];
    if (block_items(fmt)) {
        for (int k = 0; k < rows; k++) expand_row(fmt, w + k * ldw, n, y + k * ldy);
    } else {
        f->dequant(w, ldw, rows, n / f->values, y, ldy);
    }
}

static void expand_items(void* ctx, uint32_t begin, uint32_t end) {  // item b: rows ROWS·b ..
    const Expansion e = *(const Expansion*)ctx;
    for (int64_t r = (int64_t)begin * ROWS; r < (int64_t)end * ROWS && r < e.rows; r += ROWS)
        expand_rows(e.fmt, e.w + r * e.ldw, e.ldw, e.rows - r < ROWS ? (int)(e.rows - r) : ROWS, e.n, e.y + r * e.ldy, e.ldy);
}

// y [rows, n] (row stride ldy) = the reference's values of W's blocks, bit for bit. Returns 0, or −1 as
// kvlab_quant_matmul.
int kvlab_quant_dequantize(int fmt, const uint8_t* w, int64_t ldw, float* y, int64_t ldy, int64_t rows, int64_t n,
                           int threads) {
    if (fmt < 0 || fmt >= NUM_FORMATS || !FORMATS[fmt].dequant || n % FORMATS[fmt].values || rows / ROWS >= UINT32_MAX)
        return -1;
    Expansion e = {fmt, w, ldw, y, ldy, rows, n};
    kvlab_pool_run(expand_items, &e, (uint32_t)((rows + ROWS - 1) / ROWS), CHUNK, threads);
    return 0;
}

// y [m, n] = rows ids[0 .. m − 1] of W [rows, n], dequantized as kvlab_quant_dequantize does them (the same
// bits): a token table's rows, on the caller's thread (the decode step's embedding, backends/cpu.py).
// Returns 0, −1 as kvlab_quant_matmul, or −2 for an id outside the table (nothing read).
int kvlab_quant_dequantize_rows(int fmt, const uint8_t* w, int64_t ldw, int64_t rows, const int64_t* ids, int64_t m,
                                float* y, int64_t n) {
    if (fmt < 0 || fmt >= NUM_FORMATS || !FORMATS[fmt].dequant || n % FORMATS[fmt].values) return -1;
    for (int64_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -2;
    for (int64_t i = 0; i < m; i++) expand_rows(fmt, w + ids[i] * ldw, ldw, 1, n, y + i * n, n);
    return 0;
}

// Format `fmt`'s rows interleaved for 8-bit activations: the bytes they take (`out` NULL), or written to
// out. Returns the bytes, or −1 for a format without an interleaved form or n not whole blocks.
int64_t kvlab_quant_interleave(int fmt, const uint8_t* w, int64_t ldw, int64_t rows, int64_t n, uint8_t* out) {
    if (fmt < Q8_0 || fmt > Q6_K || n % FORMATS[fmt].values) return -1;
    const int64_t bytes = kvlab_i8_bytes(fmt, rows, n);
    if (bytes < 0 || !out) return bytes;
    return kvlab_i8_repack(fmt, w, ldw, rows, n, FORMATS[fmt].values, FORMATS[fmt].bytes, out) ? -1 : bytes;
}

// A gated MLP's act(x · gateᵀ) · (x · upᵀ) [m, I] for gate and up in interleaved formats (fmt[0], fmt[1]):
// kvlab_i8_gated, in one bfloat16 pass where it takes it; −1 otherwise (the caller multiplies, then activates).
int kvlab_quant_gated(const int* fmt, const uint8_t* const* w, int64_t I, const float* x, float* y, int64_t m,
                      int64_t n, int act, int threads) {
    int source[2];
    for (int j = 0; j < 2; j++) {
        if (fmt[j] < INTERLEAVED || fmt[j] >= TILED) return -1;  // (the tiled forms: multiplied, then activated)
        source[j] = fmt[j] - INTERLEAVED + Q8_0;
    }
    return kvlab_i8_gated(source, w, I, x, y, m, n, I, act, threads);
}
