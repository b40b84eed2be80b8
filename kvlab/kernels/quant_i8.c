// Products with 8-bit activations (opt-in: `--activation-quant int8`): y[m, o] = sum_i x̂[m, i] · W[o, i].
//
// The exact products of quant.c turn every weight into a float32 and make one FMA per weight and
// activation row: at 16 rows a decode step is bound by those FMAs, not by the bytes it reads. Here
// each activation row is quantized per sub-block to int8 (x̂ = dx·q, dx = max|x| / 127, q rounded to
// the nearest integer), the weights' integer codes stay integers, and one VNNI instruction (vpdpbusd)
// makes 64 multiply-adds. The weights are exact: the result is the product of the exact W with x̂,
// float32 rounding aside. It is not the exact product of W and x — `kvlab quality` measures what the
// rounding of x costs — so it is a setting, never a default.
//
// Layout ("interleaved", the format names' "x16"): the matrix is repacked once, at load, into items of
// 16 output rows. Within an item, sub-block b (S values: 32, or 16 for Q6_K) of the 16 rows is one group:
// the 16 rows' codes, lane r of every 64-byte register holding 4 codes of row r. Every weight is
// scale·(code − off) + min with an unsigned code (0..255), so one vpdpbusd multiplies 4 codes of each of
// 16 rows with 4 codes of x broadcast to all lanes, and lane r ends as row r's sum: no horizontal sums.
// (Q6_K's codes are stored less their offset, signed, as the AMX tiles take them; the vpdpbusd roads add
// it back. Q8_0's stay unsigned: adding it back to every register cost its one-row products 10%.)
//
//   codes as 4-bit (Q4_0, Q4_1, Q4_K): register k (0..3) holds bytes 4k..4k+3 of each row's 16 bytes,
//   byte j = code j | code j + 16 << 4; as 5-bit (Q5_0, Q5_K): the same of their low 4 bits, then one
//   register more whose lane r has bit j set where row r's code j has its fifth (a decode step reads
//   0.69 bytes a Q5_0 weight, not the 1.06 of 8-bit codes); as 8-bit (Q8_0 + 128, Q6_K − 32 as signed
//   bytes): register k holds codes 4k..4k+3.
//
// The groups go in super-blocks of G: a head with the G groups' scales (and mins), then their codes, each
// part in whole 64-byte lines. The scales are kept as the source has them, not as float32 (which read a
// quarter more bytes per Q4_K weight): Q8_0, Q4_0, Q4_1, Q5_0 (G = 2) keep each group's float16 scale
// (and min); the K-quants (G = a 256-value block's groups) keep each group's 6- or 8-bit integer scale
// (and min) and the block's float d (and −dmin). A group's scale is then d·sc: a float16 times an integer
// under 256 is exact in float32, so the kernels multiply with the very floats a float32 copy would hold.
// The last super-block of a row may hold fewer than G groups.
//
// Per (item, row of x, group): isum = codes · q − off·sum(q) (integers, exact); then
// acc += float(isum) · (scale · dx) and, with mins, acc += min · (dx·sum(q)). The same operations in
// the same order whatever the number of rows and threads: a row's bits do not depend on its batch.
//
// Where the CPU has AMX tiles for bfloat16, passes of BF16_ROWS rows or more (prompts) take another road
// (bf16_runs_of_pairs): the weights decoded and rounded to bfloat16, the activations too, vLLM's numbers.
// There a row's bits do not depend on its batch either, but they are not the int8 rows' bits.
//
// The same layout (formats "<fmt>t16", `--activation-quant bf16x3`) is multiplied exactly on those tiles
// (kvlab_t16_matmul): the activations split into three bfloat16 parts, no rounding at all.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"  // the tiles' configuration, bfloat16 pairs
#include "pool.h"
#include "quant_i8.h"
#include "vec8.h"  // gated8: a gated MLP's activation, the bits gemv.c's gives

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DOT2 1  // AVX2: vpmaddubsw + vpmaddwd in place of one vpdpbusd
#endif

#define LANES 16  // output rows per item
#define MTILE 8   // activation rows per pass over an item's groups
#define WIDE_M 16 // ... and per pass over a 5-bit item's, its codes made once for all of them (item_rows)
#define CHUNK 4   // items claimed at a time at one activation row: fewer at more rows (claim_size)
// How far on a thread asks for the matrix, into L2, while its first pass over an item computes: the
// hardware's prefetch alone leaves the products waiting for memory. On an AMD EPYC (Zen 4) VM, 2
// threads, weights from memory: at 16 rows Qwen2.5-Coder-0.5B's Q5_0 gate 402-455 -> 281-286 us, its
// Q6_K down 479-573 -> 365-382, its Q8_0 LM head 9.8-10.1 ms (11.3 asking two items on into L1, for
// matrices over 16 MB only, as before) -> 8.0-8.1; at 2 and 8 rows the gate 182 -> 110 and 335 -> 170;
// at one row equal (Q5_0) or better (Q6_K 132-168 -> 118-122). 8 KB on into L1, or 32-64 KB into L2,
// were slower. (The old way had taken the Xeon's LM head at 8 rows 9.1 -> 5.7 ms; the new one was not
// measured there, where 16 rows and more go through the AMX tiles with AMX_AHEAD instead.)
#define AHEAD (16 << 10)

typedef struct {
    int S;        // values per sub-block (one group)
    int nibble;   // codes stored as 4-bit (1), or as 4-bit plus a plane of their fifth bits (2)
    int off;      // weight = scale·(code − off) + min; 0 wherever there is a min (CODE_OFF says the same)
    int has_min;  // a per-sub-block min
    int G;        // groups per super-block
    int kq;       // scales as int8 per group times a float per super-block (K-quants); else float16 per group
    int less_off; // 8-bit codes stored less off, as signed bytes (Q6_K: LESS_OFF)
} Layout;

// By quant.c's source format id (its enum): F32, F16, BF16 have no interleaved form
static const Layout LAYOUTS[] = {
    [KVLAB_Q8_0] = {32, 0, 128, 0, 2, 0}, [KVLAB_Q4_0] = {32, 1, 8, 0, 2, 0}, [KVLAB_Q4_1] = {32, 1, 0, 1, 2, 0},
    [KVLAB_Q5_0] = {32, 2, 16, 0, 2, 0},  [KVLAB_Q4_K] = {32, 1, 0, 1, 8, 1}, [KVLAB_Q5_K] = {32, 2, 0, 1, 8, 1},
    [KVLAB_Q6_K] = {16, 0, 32, 0, 16, 1, 1},
};

// A layout's off as a constant, from the kernels' constants (NIB: 4-bit codes, 2 with fifth bits; NW: code
// registers a group, 4 for Q6_K's 16 values; MIN): what the kernels' code for one layout adds or takes away
#define CODE_OFF(NIB, NW, MIN) ((MIN) ? 0 : (NIB) == 2 ? 16 : (NIB) ? 8 : (NW) == 4 ? 32 : 128)
// Stored less off, as signed bytes: Q6_K's 8-bit codes (Layout.less_off)
#define LESS_OFF(NIB, NW) (!(NIB) && (NW) == 4)

static int layout(int fmt, Layout* l) {
    if (fmt < KVLAB_Q8_0 || fmt > KVLAB_Q6_K) return -1;
    *l = LAYOUTS[fmt];
    const int nw = l->nibble ? 8 : l->S / 4;  // the kernels' NW
    // the kernels take off and less_off as constants from these macros: a layout they disagree with is refused
    if (l->off != CODE_OFF(l->nibble, nw, l->has_min) || l->less_off != LESS_OFF(l->nibble, nw)) return -1;
    return 0;
}

// One group's codes: 16 rows of S codes, as 4-bit (and a 64-byte plane of fifth bits) or 8-bit
static int64_t code_bytes(const Layout* l) { return LANES * (l->nibble ? l->S / 2 : l->S) + (l->nibble == 2 ? 64 : 0); }

// A super-block's head (G groups; MIN: with mins; KQ: K-quant). K-quants: sc int8 [G][16], (mins) m int8
// [G][16], d float [16], (mins) −dmin float [16]. The others: scales float16 [G][16], (mins) mins
// float16 [G][16]. Byte offsets, shared by the repacking and every kernel:
#define HEAD_BYTES(KQ, G, MIN) ((1 + (MIN)) * LANES * ((KQ) ? (G) + 4 : 2 * (G)))
#define SCALE_AT(KQ, gi) ((KQ) ? LANES * (gi) : 2 * LANES * (gi))  // group gi's 16 scales
#define MIN_AT(KQ, G, gi) SCALE_AT(KQ, (G) + (gi))                 // group gi's 16 mins
#define D_AT(G, MIN) (LANES * (G) * (1 + (MIN)))                   // (K-quants) 16 d, then 16 −dmin

static int64_t head_bytes(const Layout* l) { return HEAD_BYTES(l->kq, l->G, l->has_min); }

static int64_t super_bytes(const Layout* l) { return head_bytes(l) + l->G * code_bytes(l); }

static int64_t item_bytes(const Layout* l, int64_t groups) {
    const int64_t rest = groups % l->G;
    return groups / l->G * super_bytes(l) + (rest ? head_bytes(l) + rest * code_bytes(l) : 0);
}

static float f16(const uint8_t* p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

// ---- repacking: one source block → its sub-blocks' codes (0..255), scales and mins -------------

static void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {  // as quant.c's
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

// A source block taken apart: its values' codes, and its sub-blocks' scales and mins as the head keeps them
typedef struct {
    uint8_t codes[256];
    uint16_t half_scale, half_min;  // float16 bits: one sub-block (Q8_0, Q4_0, Q4_1, Q5_0)
    int8_t sc[16], mn[16];          // K-quants: each sub-block's integers …
    float d, neg_dmin;              // … and the block's factors
} Split;

static void split_block(int fmt, const uint8_t* p, Split* s) {
    memset(s, 0, sizeof *s);
    uint8_t* codes = s->codes;
    switch (fmt) {
    case KVLAB_Q8_0:
        memcpy(&s->half_scale, p, 2);
        for (int j = 0; j < 32; j++) codes[j] = (uint8_t)((int8_t)p[2 + j] + 128);
        return;
    case KVLAB_Q4_0:
    case KVLAB_Q4_1: {
        const uint8_t* q = p + (fmt == KVLAB_Q4_0 ? 2 : 4);
        memcpy(&s->half_scale, p, 2);
        if (fmt == KVLAB_Q4_1) memcpy(&s->half_min, p + 2, 2);
        for (int j = 0; j < 16; j++) codes[j] = q[j] & 15, codes[j + 16] = q[j] >> 4;
        return;
    }
    case KVLAB_Q5_0: {
        uint32_t qh;
        memcpy(&qh, p + 2, sizeof qh);
        memcpy(&s->half_scale, p, 2);
        for (int j = 0; j < 16; j++) {
            codes[j] = (p[6 + j] & 15) | ((qh >> j & 1) << 4);
            codes[j + 16] = (p[6 + j] >> 4) | ((qh >> (j + 16) & 1) << 4);
        }
        return;
    }
    case KVLAB_Q4_K:
    case KVLAB_Q5_K: {
        uint8_t sc[8], mn[8];
        s->d = f16(p), s->neg_dmin = -f16(p + 2);
        k_scales(p + 4, sc, mn);
        const uint8_t* q = p + (fmt == KVLAB_Q4_K ? 16 : 48);
        for (int g = 0; g < 8; g++) {
            s->sc[g] = (int8_t)sc[g], s->mn[g] = (int8_t)mn[g];  // 6-bit: 0..63
            for (int l = 0; l < 32; l++) {
                int c = g % 2 ? q[32 * (g / 2) + l] >> 4 : q[32 * (g / 2) + l] & 15;
                if (fmt == KVLAB_Q5_K) c |= (p[16 + l] >> g & 1) << 4;
                codes[32 * g + l] = (uint8_t)c;
            }
        }
        return;
    }
    default: {  // Q6_K: 16 groups of 16
        s->d = f16(p + 208);
        memcpy(s->sc, p + 192, 16);
        for (int h = 0; h < 2; h++)  // each half: 128 values from 64 bytes of ql and 32 of qh
            for (int l = 0; l < 32; l++) {
                const uint8_t *ql = p + 64 * h, hb = p[128 + 32 * h + l];
                codes[128 * h + l] = (ql[l] & 15) | ((hb & 3) << 4);
                codes[128 * h + l + 32] = (ql[l + 32] & 15) | (((hb >> 2) & 3) << 4);
                codes[128 * h + l + 64] = (ql[l] >> 4) | (((hb >> 4) & 3) << 4);
                codes[128 * h + l + 96] = (ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4);
            }
        return;
    }
    }
}

// Group b of an item: its super-block's head, and its place gi among that super-block's groups
static const uint8_t* group_head(const Layout* l, const uint8_t* item, int64_t b, int* gi) {
    *gi = (int)(b % l->G);
    return item + b / l->G * super_bytes(l);
}

// The head's parts: each group's scales (and mins) for 16 lanes, and (K-quants) the block's d and −dmin
static int64_t scale_at(const Layout* l, int gi) { return SCALE_AT(l->kq, gi); }
static int64_t min_at(const Layout* l, int gi) { return MIN_AT(l->kq, l->G, gi); }
static int64_t d_at(const Layout* l) { return D_AT(l->G, l->has_min); }

// Lane r's scale and min of group gi, as the vector kernels compute them: d·sc and −dmin·m (exact in
// float32), or the float16 as a float
static inline float lane_scale(const Layout* l, const uint8_t* head, int gi, int r, float* min) {
    if (!l->kq) {
        *min = l->has_min ? f16(head + min_at(l, gi) + 2 * r) : 0.0f;
        return f16(head + scale_at(l, gi) + 2 * r);
    }
    const float* d = (const float*)(head + d_at(l));
    *min = l->has_min ? (float)(int8_t)head[min_at(l, gi) + r] * d[LANES + r] : 0.0f;
    return (float)(int8_t)head[scale_at(l, gi) + r] * d[r];
}

int64_t kvlab_i8_bytes(int fmt, int64_t rows, int64_t n) {
    Layout l;
    if (layout(fmt, &l) || n % l.S) return -1;
    return (rows + LANES - 1) / LANES * item_bytes(&l, n / l.S);
}

// Repack `rows` rows of `fmt` blocks (row r at w + r·ldw, n values each) into out (kvlab_i8_bytes).
int kvlab_i8_repack(int fmt, const uint8_t* w, int64_t ldw, int64_t rows, int64_t n, int block_values,
                    int block_bytes, uint8_t* out) {
    Layout l;
    if (layout(fmt, &l) || n % block_values || block_values % l.S) return -1;
    const int64_t groups = n / l.S, ib = item_bytes(&l, groups), per_block = block_values / l.S;
    const int regs = l.nibble ? l.S / 8 : l.S / 4;  // a group's 64-byte code registers (past them: the plane)
    memset(out, 0, (rows + LANES - 1) / LANES * ib);  // missing rows: zero codes, scales, mins
    Split split;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t* item = out + r / LANES * ib;
        const int lane = (int)(r % LANES);
        for (int64_t b = 0; b < n / block_values; b++) {
            split_block(fmt, w + r * ldw + b * block_bytes, &split);
            for (int64_t s = 0; s < per_block; s++) {
                int gi;
                uint8_t* head = (uint8_t*)group_head(&l, item, b * per_block + s, &gi);
                uint8_t* g = head + head_bytes(&l) + gi * code_bytes(&l);
                const uint8_t* c = split.codes + s * l.S;
                for (int k = 0; k < regs; k++)  // register k, lane `lane`: 4 bytes
                    for (int t = 0; t < 4; t++) {
                        const int j = 4 * k + t;
                        g[64 * k + 4 * lane + t] = l.nibble ? (uint8_t)((c[j] & 15) | (c[j + 16] & 15) << 4) : (uint8_t)(c[j] - l.less_off * l.off);
                    }
                for (int j = 0; l.nibble == 2 && j < l.S; j++)  // the plane: lane's bit j, code j's fifth
                    g[64 * regs + 4 * lane + j / 8] |= (uint8_t)((c[j] >> 4 & 1) << (j % 8));
                if (!l.kq) {
                    memcpy(head + scale_at(&l, gi) + 2 * lane, &split.half_scale, 2);
                    if (l.has_min) memcpy(head + min_at(&l, gi) + 2 * lane, &split.half_min, 2);
                    continue;
                }
                head[scale_at(&l, gi) + lane] = (uint8_t)split.sc[s];
                if (l.has_min) head[min_at(&l, gi) + lane] = (uint8_t)split.mn[s];
                float* d = (float*)(head + d_at(&l));
                d[lane] = split.d;
                if (l.has_min) d[LANES + lane] = split.neg_dmin;
            }
        }
    }
    return 0;
}

// ---- the activations: int8 per sub-block ------------------------------------------------------

typedef struct {
    int32_t q[8];      // S int8 codes, 4 to a word (S ≤ 32)
    float dx;          // the sub-block's scale
    float dx_sum;      // dx · sum(q): the min's factor
    int32_t neg_off;   // −off · sum(q): where every integer sum starts
    int32_t pad[5];
} XBlock;  // 64 bytes: one line

// out[b·m + i]: sub-block b of row i (rows i0 .. i1 − 1 of m), the m rows of a sub-block side by side
// (the kernel reads them at fixed offsets from one address)
#if defined(VNNI)
#define SHUF4(a, b, imm) _mm512_castps_si512(_mm512_shuffle_f32x4(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm))
#define SHUFPS(a, b, imm) _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm))
#define UNPACK(LOHI, a, b) _mm512_castpd_si512(_mm512_unpack##LOHI##_pd(_mm512_castsi512_pd(a), _mm512_castsi512_pd(b)))

// v[0]'s lane j ← v[j]'s 16 lanes reduced by OP (max, or an integer sum): 16 reductions in 15 OPs and
// their shuffles, where a _mm512_reduce_* each takes about eight instructions
#define REDUCE16(OP, v)                                                                                    \
    do {                                                                                                   \
        for (int k = 0; k < 8; k++) /* lanes 0-7: v[2k]'s halves reduced, lanes 8-15: v[2k+1]'s */         \
            v[k] = OP(SHUF4(v[2 * k], v[2 * k + 1], 0x44), SHUF4(v[2 * k], v[2 * k + 1], 0xEE));          \
        for (int k = 0; k < 4; k++) /* quarter q: four lanes of v[4k+q] */                                 \
            v[k] = OP(SHUF4(v[2 * k], v[2 * k + 1], 0x88), SHUF4(v[2 * k], v[2 * k + 1], 0xDD));          \
        for (int k = 0; k < 2; k++) /* quarter q: two lanes of v[8k+q], two of v[8k+4+q] */                \
            v[k] = OP(UNPACK(lo, v[2 * k], v[2 * k + 1]), UNPACK(hi, v[2 * k], v[2 * k + 1]));            \
        v[0] = OP(SHUFPS(v[0], v[1], 0x88), SHUFPS(v[0], v[1], 0xDD)); /* lane 4q + p: v[4p + q] */        \
        v[0] = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v[0]); \
    } while (0)

static inline __m512i max_bits(__m512i a, __m512i b) {
    return _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
}

// A sub-block's |values| lane by lane (S = 16 · halves values at v): its largest is the lanes' largest
static inline __m512 magnitudes(const float* v, int halves) {
    __m512 amax = _mm512_setzero_ps();
    for (int h = 0; h < halves; h++) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(v + 16 * h)));
    return amax;
}

// A sub-block's codes round(v · id), clamped to ±127, into q's 32 bytes (the second 16 zero where S = 16);
// returns their sums lane by lane
static inline __m512i codes_of(const float* v, int halves, __m512 id, int32_t* q) {
    __m512i sum = _mm512_setzero_si512();
    __m128i codes[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
    for (int h = 0; h < halves; h++) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * h), id));
        c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        sum = _mm512_add_epi32(sum, c);
        codes[h] = _mm512_cvtepi32_epi8(c);
    }
    _mm256_storeu_si256((__m256i*)q, _mm256_set_m128i(codes[1], codes[0]));
    return sum;
}

// Sixteen sub-blocks of a row (S = 32 or 16 values each; block g at o[g · stride]) at a time: their
// largest magnitudes, the reciprocals and the codes' sums, each a vector of 16, not 16 reductions and
// divisions. The same numbers as one sub-block at a time (quantize_range): max and integer sums are
// exact in any order, and the divisions and products are the same IEEE operations.
static void quantize_sixteen(const float* v, int S, int off, XBlock* o, int64_t stride) {
    const int halves = S / 16;
    __m512i red[16];
    for (int g = 0; g < 16; g++) red[g] = _mm512_castps_si512(magnitudes(v + g * S, halves));
    REDUCE16(max_bits, red);
    const __m512 top = _mm512_castsi512_ps(red[0]);
    const __mmask16 positive = _mm512_cmp_ps_mask(top, _mm512_setzero_ps(), _CMP_GT_OQ);
    float ids[16];
    _mm512_storeu_ps(ids, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), top));
    for (int g = 0; g < 16; g++) red[g] = codes_of(v + g * S, halves, _mm512_set1_ps(ids[g]), o[g * stride].q);
    REDUCE16(_mm512_add_epi32, red);
    const __m512 dx = _mm512_div_ps(top, _mm512_set1_ps(127.0f));
    int32_t dxs[16], dx_sums[16], neg_offs[16];  // the floats' bits
    _mm512_storeu_si512(dxs, _mm512_castps_si512(dx));
    _mm512_storeu_si512(dx_sums, _mm512_castps_si512(_mm512_mul_ps(dx, _mm512_cvtepi32_ps(red[0]))));
    _mm512_storeu_si512(neg_offs, _mm512_mullo_epi32(_mm512_set1_epi32(-off), red[0]));
    for (int g = 0; g < 16; g++)  // dx, dx_sum, neg_off and the pad's zeros: the line's second half
        _mm256_storeu_si256((__m256i*)&o[g * stride].dx, _mm256_setr_epi32(dxs[g], dx_sums[g], neg_offs[g], 0, 0, 0, 0, 0));
}
#endif

static void quantize_range(const float* x, int64_t m, int64_t n, const Layout* l, XBlock* out, int64_t i0, int64_t i1) {
    const int64_t groups = n / l->S;
#if defined(VNNI)
    // the same numbers as the loop below: max is exact in any order, one rounding per product, and
    // vcvtps2dq rounds to nearest even as nearbyintf does
    const int halves = l->S / 16;
    for (int64_t i = i0; i < i1; i++) {
        int64_t b = 0;
        for (; b + 16 <= groups; b += 16) quantize_sixteen(x + i * n + b * l->S, l->S, l->off, out + b * m + i, m);
        for (; b < groups; b++) {
            const float* v = x + i * n + b * l->S;
            XBlock* o = out + b * m + i;
            const float top = _mm512_reduce_max_ps(magnitudes(v, halves));
            memset(o, 0, sizeof *o);
            const int32_t total = _mm512_reduce_add_epi32(codes_of(v, halves, _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f), o->q));
            o->dx = top / 127.0f;
            o->dx_sum = o->dx * (float)total;
            o->neg_off = -l->off * total;
        }
    }
    return;
#elif defined(DOT2)
    // the loop's numbers, 8 values at a time (as the VNNI build's: max exact in any order, one rounding
    // per product, vcvtps2dq rounding to nearest even)
    const int parts = l->S / 8;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int64_t i = i0; i < i1; i++)
        for (int64_t b = 0; b < groups; b++) {
            const float* v = x + i * n + b * l->S;
            XBlock* o = out + b * m + i;
            __m256 a[4], amax = _mm256_setzero_ps();
            for (int h = 0; h < parts; h++)  // (|v|, amax): a NaN leaves amax as it was, as the loop's test
                a[h] = _mm256_loadu_ps(v + 8 * h), amax = _mm256_max_ps(_mm256_and_ps(a[h], magnitude), amax);
            __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
            const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
            const __m256 id = _mm256_set1_ps(top > 0 ? 127.0f / top : 0.0f);
            __m256i sum = _mm256_setzero_si256(), q[4] = {sum, sum, sum, sum};
            memset(o, 0, sizeof *o);
            for (int h = 0; h < parts; h++) {
                q[h] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a[h], id)), hi), lo);
                sum = _mm256_add_epi32(sum, q[h]);
            }
            for (int h = 0; h < parts; h += 2) {  // 16 codes in order: int32 → int16 → int8
                const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[h], q[h + 1]), 0xD8);
                _mm_storeu_si128((__m128i*)(o->q + 2 * h),
                                 _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
            o->dx = top / 127.0f;
            o->dx_sum = o->dx * (float)total;
            o->neg_off = -l->off * total;
        }
    return;
#endif
    for (int64_t i = i0; i < i1; i++)
        for (int64_t b = 0; b < groups; b++) {
            const float* v = x + i * n + b * l->S;
            XBlock* o = out + b * m + i;
            float amax = 0;
            for (int j = 0; j < l->S; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            const float id = amax > 0 ? 127.0f / amax : 0.0f;
            int8_t q[32] = {0};
            int32_t sum = 0;
            for (int j = 0; j < l->S; j++) {
                float r = nearbyintf(v[j] * id);
                q[j] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
                sum += q[j];
            }
            memcpy(o->q, q, sizeof o->q);
            o->dx = amax / 127.0f;
            o->dx_sum = o->dx * (float)sum;
            o->neg_off = -l->off * sum;
            memset(o->pad, 0, sizeof o->pad);
        }
}

// A prompt's rows are quantized by every thread, QUANT_ROWS at a time: on the caller alone they took
// ~4% of a burst of 16 SmolLM2 prompts while the other core waited. A decode step's rows too, split
// evenly over the threads, where they are QUANT_SHARED values or more (Qwen2.5-Coder-0.5B's 16 rows into
// its down projection: 4,864 values each, ~25 us on the caller); fewer stay on the caller, for whom the
// pool's hand-over would cost more than it saves. Each row's blocks are its own: the same bits either way.
#define QUANT_ROWS 16
#define QUANT_SHARED 32768

typedef struct {
    const float* x;
    int64_t m, n;
    const Layout* l;
    XBlock* out;
    int64_t rows;  // a work item's
} Quantize;

static void quantize_items(void* ctx, uint32_t begin, uint32_t end) {
    const Quantize* q = ctx;
    const int64_t i1 = (int64_t)end * q->rows;
    quantize_range(q->x, q->m, q->n, q->l, q->out, (int64_t)begin * q->rows, i1 < q->m ? i1 : q->m);
}

static void quantize_rows(const float* x, int64_t m, int64_t n, const Layout* l, XBlock* out, int threads) {
    if (threads < 2 || m < 2 || (m < 4 * QUANT_ROWS && m * n < QUANT_SHARED)) {
        quantize_range(x, m, n, l, out, 0, m);
        return;
    }
    Quantize q = {x, m, n, l, out, m < 4 * QUANT_ROWS ? (m + threads - 1) / threads : QUANT_ROWS};
    kvlab_pool_run(quantize_items, &q, (uint32_t)((m + q.rows - 1) / q.rows), 1, threads);
}

// ---- the product ------------------------------------------------------------------------------

typedef struct {
    Layout l;
    const uint8_t* w;
    const XBlock* xq;  // [m, groups]
    float* y;
    int64_t m, groups, ldy, out;
    int amx;        // 16 rows at a time on AMX tiles (where built, granted and m ≥ 16)
    int64_t begin, end;  // the rows this pass computes (of the m the activations hold)
} Product;

typedef struct {  // a gated MLP's gate and up over the same rows, as one pass (kvlab_i8_gated)
    Product gate, up;
    int act;
} GatedPass;

#if defined(VNNI) || defined(DOT2)
// A gated pass's two parts, their item sizes, and for a 5-bit one read by `from` rows or more a buffer for
// its codes split once per item (else NULL: split per block)
static void gated_parts(const GatedPass* q, int64_t from, const Product* part[2], int64_t ib[2], uint8_t* whole[2]) {
    part[0] = &q->gate, part[1] = &q->up;
    for (int j = 0; j < 2; j++) {
        ib[j] = item_bytes(&part[j]->l, part[j]->groups);
        const int split = part[j]->l.nibble == 2 && part[j]->end - part[j]->begin >= from;
        whole[j] = split ? aligned_alloc(64, part[j]->groups * 512) : NULL;
    }
}
#endif

// A kernel's layout as constants (NIB: 4-bit codes; NW: code registers per group, 4 or 8; MIN; KQ: integer
// scales), so that finding group b is shifts and adds: its super-block, its place there, its codes.
#define GROUPS_PER_SUPER(NIB, NW, KQ) ((KQ) ? (!(NIB) && (NW) == 4 ? 16 : 8) : 2)
#define CODE_BYTES(NIB, NW) (64 * ((NIB) ? (NW) / 2 : (NW)) + ((NIB) == 2 ? 64 : 0))

#if defined(VNNI)
// M activation rows against one item's groups. NIB, NW (code registers per group: 4 or 8) and MIN are
// the layout's, as constants, so that everything stays in registers: M sums of NW vpdpbusd each, the
// M interleaved so that no sum waits on its own last instruction.
static inline __m512 int8_times16(const uint8_t* sc, const float* d) {  // 16 int8 as floats, times d lane by lane
    const __m128i q = _mm_loadu_si128((const __m128i*)sc);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_loadu_ps(d));
}

// Code register k (codes 4k .. 4k + 3 of each lane's row, their low 4 bits) with their fifth bits from a
// 5-bit layout's plane (lane r's bit j: code j's fifth): the plane's byte k/2 copied to the lane's four
// bytes, each tested for its own bit, and 16 added where it is set. SIGNED: code − 16 instead, the same
// two instructions (16 taken away where the bit is clear).
static inline __m512i with_fifth_bits(__m512i w, __m512i plane, int k, const int SIGNED) {
    const __m512i at = _mm512_add_epi8(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0), _mm512_set1_epi8((char)(k / 2)));
    const __m512i bits = _mm512_shuffle_epi8(plane, at), bit = _mm512_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201);
    if (SIGNED) return _mm512_mask_sub_epi8(w, _mm512_testn_epi8_mask(bits, bit), w, _mm512_set1_epi8(16));
    return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(bits, bit), w, _mm512_set1_epi8(16));
}

// A 4-bit group's codes at g as bytes (NIB 2: with their fifth bits from the plane after them): w[k], lane
// r holds codes 4k .. 4k + 3 of row r, the low halves (codes 0..15) in w[0..3], the high ones in w[4..7].
// OFF (the layout's code offset, as a constant): a nonzero one is taken away, the codes signed (the AMX
// road's, which then has no offset to add to its sums); 0 leaves them as they are.
static inline __attribute__((always_inline)) void nibble_codes(const uint8_t* g, const int NIB, const int OFF, __m512i* w) {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_loadu_si512(g + 64 * k);
        w[k] = _mm512_and_si512(v, low4), w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if (NIB == 2)  // OFF is 16 here (Q5_0) or 0 (Q5_K)
        for (int k = 0; k < 8; k++) w[k] = with_fifth_bits(w[k], _mm512_loadu_si512(g + 256), k, OFF != 0);
    else if (OFF)
        for (int k = 0; k < 8; k++) w[k] = _mm512_sub_epi8(w[k], _mm512_set1_epi8((char)OFF));
}

// Group gi's 16 lanes' scales (and mins, else zeros) from its super-block's head: lane_scale's numbers
static inline __attribute__((always_inline)) __m512 group_scales(const uint8_t* head, int gi, const int G, const int MIN,
                                                                 const int KQ, __m512* min) {
    *min = _mm512_setzero_ps();
    if (!KQ) {
        if (MIN) *min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(head + MIN_AT(KQ, G, gi))));
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(head + SCALE_AT(KQ, gi))));
    }
    const float* d = (const float*)(head + D_AT(G, MIN));
    if (MIN) *min = int8_times16(head + MIN_AT(KQ, G, gi), d + LANES);
    return int8_times16(head + SCALE_AT(KQ, gi), d);
}

// A group's 4-bit codes (NIB 2: with their fifth bits) as nibble_codes makes them, stored: rows 0-3 the
// low halves (codes 0..15), rows 4-7 the high ones (16..31), less the layout's offset OFF (0: unsigned)
static inline __attribute__((always_inline)) void split_group(const uint8_t* codes, uint8_t* out, const int NIB,
                                                              const int OFF) {
    __m512i w[8];
    nibble_codes(codes, NIB, OFF, w);
    for (int k = 0; k < 8; k++) _mm512_store_si512(out + 64 * k, w[k]);
}

// Every group of a 4-bit item split (split_group) into out, 512 bytes a group: once for an item that many
// blocks of rows read, rather than per block. SIGNED: less the layout's offset (the AMX tiles' codes);
// else unsigned, as item_rows splits them.
static void split_codes(const Layout* l, const uint8_t* item, int64_t groups, uint8_t* out, const int SIGNED) {
    const int G = GROUPS_PER_SUPER(1, 8, l->kq), HB = (int)head_bytes(l), CB = (int)code_bytes(l);
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t* g = item + b / G * (HB + G * CB) + HB + (b % G) * CB;
        if (!SIGNED && l->nibble == 2) split_group(g, out + b * 512, 2, 0);
        else if (!SIGNED) split_group(g, out + b * 512, 1, 0);
        else if (l->nibble == 2 && l->has_min) split_group(g, out + b * 512, 2, CODE_OFF(2, 8, 1));
        else if (l->nibble == 2) split_group(g, out + b * 512, 2, CODE_OFF(2, 8, 0));
        else if (l->has_min) split_group(g, out + b * 512, 1, CODE_OFF(1, 8, 1));
        else split_group(g, out + b * 512, 1, CODE_OFF(1, 8, 0));
    }
}

// Rows from which a 4-bit item's codes are split once for all of them (split_codes): on the AMX tiles, and
// for vpdpbusd's blocks of MTILE rows where the codes are 5-bit. For vpdpbusd, on a Zen 4 core, one thread, 512
// rows: Qwen2.5-Coder-0.5B's Q5_0 gate (4,864 x 896) 15.4-15.6 -> 14.1-14.2 ms; the same at 16 rows, and
// at 896 x 4864 (its 76 KB of split codes in L2). 4-bit codes split per block are cheaper than their
// loads: SmolLM2's Q4_1 gate/up and Qwen's Q4_K down 2-3% and 5-10% slower split once, 7% at 16 rows.
// From 16 to 31 rows a 5-bit item goes WIDE_M rows a pass, its codes made once in registers and its
// accumulators in L1 (item_rows): Qwen2.5-Coder-0.5B's Q5_0 gate/up at 16 rows 0.491 -> 0.458 ms, its
// decode step 33.4 -> 32.4 ms (alternated builds, Zen 4, 2 threads); at 32 and 64 rows splitting once
// stays 5-8% faster. 4-bit and 8-bit items: 1-7% slower that way (Q8_0's LM head 6.9 -> 7.3 ms).
#define SPLIT_ONCE 32

static inline __attribute__((always_inline)) void item_rows(const Product* p, const uint8_t* item, int64_t i0,
                                                            const int M, const int NIB, const int NW, const int MIN,
                                                            const int KQ, const uint8_t* whole, __m512* acc) {
    const int G = GROUPS_PER_SUPER(NIB, NW, KQ), HB = HEAD_BYTES(KQ, G, MIN), CB = CODE_BYTES(NIB, NW);
    // MTILE rows or fewer: their accumulators in registers (GCC stored acc's every update, as acc might
    // alias the loads); WIDE_M rows: in acc, as the registers hold their 16 sums and the codes
    __m512 in_registers[MTILE], *a = M > MTILE ? acc : in_registers;
    for (int i = 0; i < M; i++) a[i] = _mm512_setzero_ps();
    const int64_t ib = p->groups / G * (HB + G * CB) + (p->groups % G ? HB + p->groups % G * CB : 0);
    for (int64_t b = 0; b < p->groups; b++) {
        const int gi = (int)(b % G);
        const uint8_t* head = item + b / G * (HB + G * CB);
        const uint8_t* g = head + HB + gi * CB;
        const XBlock* xs = p->xq + b * p->m + i0;
        if (i0 == p->begin)  // the bytes AHEAD on, into L2, spread over this item's groups
            for (int64_t line = b * ib / p->groups / 64 * 64; line < (b + 1) * ib / p->groups; line += 64)
                _mm_prefetch((const char*)item + AHEAD + line, _MM_HINT_T1);
        __m512i w[8];
        if (NIB && whole) {  // split once for all the item's rows (split_codes)
            for (int k = 0; k < 8; k++) w[k] = _mm512_load_si512(whole + b * 512 + 64 * k);
        } else if (NIB) {
            nibble_codes(g, NIB, 0, w);
        } else {
            for (int k = 0; k < NW; k++) w[k] = _mm512_loadu_si512(g + 64 * k);
            if (LESS_OFF(NIB, NW))  // unsigned again
                for (int k = 0; k < NW; k++) w[k] = _mm512_add_epi8(w[k], _mm512_set1_epi8((char)CODE_OFF(NIB, NW, MIN)));
        }
        __m512i s[WIDE_M];
        for (int i = 0; i < M; i++) s[i] = _mm512_set1_epi32(xs[i].neg_off);
#pragma GCC unroll 8
        for (int k = 0; k < NW; k++)
#pragma GCC unroll 16
            for (int i = 0; i < M; i++) s[i] = _mm512_dpbusd_epi32(s[i], w[k], _mm512_set1_epi32(xs[i].q[k]));
        __m512 min;
        const __m512 scale = group_scales(head, gi, G, MIN, KQ, &min);
#pragma GCC unroll 16
        for (int i = 0; i < M; i++) {
            const XBlock* x = xs + i;
            a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(scale, _mm512_set1_ps(x->dx)), a[i]);
            if (MIN) a[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(x->dx_sum), a[i]);
        }
    }
    if (M <= MTILE)
        for (int i = 0; i < M; i++) acc[i] = a[i];
}

#define LAYOUT_ROWS(M)                                                                                          \
    static void rows_##M(const Product* p, const uint8_t* item, int64_t i0, const uint8_t* whole, __m512* acc) { \
        const Layout* l = &p->l;                                                                                \
        if (l->nibble == 2 && l->kq) item_rows(p, item, i0, M, 2, 8, 1, 1, whole, acc);                         \
        else if (l->nibble == 2) item_rows(p, item, i0, M, 2, 8, 0, 0, whole, acc);                             \
        else if (l->nibble && l->kq) item_rows(p, item, i0, M, 1, 8, 1, 1, whole, acc);                         \
        else if (l->nibble && l->has_min) item_rows(p, item, i0, M, 1, 8, 1, 0, whole, acc);                    \
        else if (l->nibble) item_rows(p, item, i0, M, 1, 8, 0, 0, whole, acc);                                  \
        else if (l->S == 16) item_rows(p, item, i0, M, 0, 4, 0, 1, NULL, acc);                                  \
        else if (l->has_min) item_rows(p, item, i0, M, 0, 8, 1, 1, NULL, acc);                                  \
        else item_rows(p, item, i0, M, 0, 8, 0, 0, NULL, acc);                                                  \
    }
LAYOUT_ROWS(1)
LAYOUT_ROWS(2)
LAYOUT_ROWS(3)
LAYOUT_ROWS(4)
LAYOUT_ROWS(5)
LAYOUT_ROWS(6)
LAYOUT_ROWS(7)
LAYOUT_ROWS(8)
static void (*const ROWS_OF[MTILE])(const Product*, const uint8_t*, int64_t, const uint8_t*, __m512*) = {
    rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

// WIDE_M rows of a 5-bit item (Q5_K, Q5_0), its codes made in registers (no split copy): the only
// layouts that pass is for (see SPLIT_ONCE)
static void wide_rows(const Product* p, const uint8_t* item, int64_t i0, __m512* acc) {
    if (p->l.kq) item_rows(p, item, i0, WIDE_M, 2, 8, 1, 1, NULL, acc);
    else item_rows(p, item, i0, WIDE_M, 2, 8, 0, 0, NULL, acc);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
// Intel AMX: one TDPBSUD multiplies a 16-row tile of activations (signed) by a group's codes (unsigned)
// into 16 × 16 int32 sums, the very integers the vpdpbusd above make (exact in any order), in the time
// of a few of them. The group's codes are already a tile's rows: register k, lane r ↔ tile row k, row r's
// 4 bytes (4-bit codes are split into two 8-bit rows first); the activations' XBlocks are a tile's rows,
// 64 bytes apart. The sums go out to L1 and take item_rows' float operations in its order: the same
// bits as a row alone through item_rows. 16 rows at a time; fewer go the VNNI way.
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define AMX_M 16  // activation rows per tile
#define AMX_GROUPS 4  // groups in flight: their sums in tiles 0-3; activations in 4, 5; codes in 6, 7
// The tiles' loads wait for memory in line, so an item's first 16 rows ask for the codes 4 KB on
// (Qwen2.5-Coder-0.5B's products at 16 rows, a decode step's: 50.2 -> 43.4 ms; 8 or 16 KB on, or into
// L1: 47-50)
#define AMX_AHEAD 4096

static int amx_granted = -1;  // -1: not asked yet; the OS's leave to use the tiles' 8 KB of state

static int amx_available(void) {
    if (amx_granted < 0)  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the process's threads, once
        amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
}

static void amx_configure(const Layout* l) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_M, c.colsb[t] = 64;
    c.colsb[4] = c.colsb[5] = (uint16_t)l->S;         // a sub-block of activations a row
    c.rows[6] = c.rows[7] = (uint8_t)(l->S / 4);      // a group's code registers
    tiles_load(&c);
}

// Tile T (0-3) gets a group's sums: activations into tile A, codes (64 bytes a row) into B. SIGNED: the
// codes less their offset (4-bit ones from split_group, Q6_K's as stored), so that the sums are the
// integers the vpdpbusd roads make from −off·sum(q) with nothing added; else Q8_0's, 0..255
#define AMX_PRODUCT(T, A, B, xs, codes, SIGNED)                \
    do {                                                       \
        _tile_zero(T);                                         \
        _tile_loadd(A, (const void*)(xs), sizeof(XBlock));     \
        _tile_loadd(B, (const void*)(codes), 64);              \
        if (SIGNED) _tile_dpbssd(T, A, B);                     \
        else _tile_dpbsud(T, A, B);                            \
    } while (0)
#define AMX_SIGNED(NIB, NW) ((NIB) || LESS_OFF(NIB, NW))

// Groups b0 .. b0 + 3 (those there are) of an item through the tiles, their sums into tiles 0-3
static inline __attribute__((always_inline)) void amx_sums(const Product* p, const uint8_t* item, int64_t i0,
                                                           int64_t b0, const int NIB, const int NW, const int MIN, const int G, const int HB,
                                                           const int CB, uint8_t (*split)[8 * 64],
                                                           const uint8_t* whole) {
    const int nb = p->groups - b0 < AMX_GROUPS ? (int)(p->groups - b0) : AMX_GROUPS;
    const uint8_t* codes[AMX_GROUPS];
    for (int j = 0; j < nb; j++) {
        const int64_t b = b0 + j;
        codes[j] = item + b / G * (HB + G * CB) + HB + (b % G) * CB;
        if (i0 == p->begin)  // into L2, the lines AMX_AHEAD bytes on (into the next item near an item's end)
            for (int line = 0; line < CB; line += 64) _mm_prefetch((const char*)codes[j] + AMX_AHEAD + line, _MM_HINT_T1);
        if (NIB && whole) {  // the item's codes, split once for all its rows (split_codes)
            codes[j] = whole + b * 8 * 64;
        } else if (NIB) {
            split_group(codes[j], split[j], NIB, CODE_OFF(NIB, 8, MIN));
            codes[j] = split[j];
        }
    }
    const XBlock* xs = p->xq + b0 * p->m + i0;
    AMX_PRODUCT(0, 4, 6, xs, codes[0], AMX_SIGNED(NIB, NW));
    if (nb > 1) AMX_PRODUCT(1, 5, 7, xs + p->m, codes[1], AMX_SIGNED(NIB, NW));
    if (nb > 2) AMX_PRODUCT(2, 4, 6, xs + 2 * p->m, codes[2], AMX_SIGNED(NIB, NW));
    if (nb > 3) AMX_PRODUCT(3, 5, 7, xs + 3 * p->m, codes[3], AMX_SIGNED(NIB, NW));
}

// The sums of amx_sums' nb groups out of tiles 0-3
static inline __attribute__((always_inline)) void amx_store(int nb, int32_t (*sums)[AMX_M * LANES]) {
    _tile_stored(0, sums[0], 64);
    if (nb > 1) _tile_stored(1, sums[1], 64);
    if (nb > 2) _tile_stored(2, sums[2], 64);
    if (nb > 3) _tile_stored(3, sums[3], 64);
}

static inline __attribute__((always_inline)) void amx_rows(const Product* p, const uint8_t* item, int64_t i0,
                                                           const int NIB, const int NW, const int MIN,
                                                           const int KQ, const uint8_t* whole, __m512* acc) {
    const int G = GROUPS_PER_SUPER(NIB, NW, KQ), HB = HEAD_BYTES(KQ, G, MIN), CB = CODE_BYTES(NIB, NW);
    // two sets, so that the tiles make the next groups' sums while this set's are scaled
    int32_t sums[2][AMX_GROUPS][AMX_M * LANES] __attribute__((aligned(64)));
    uint8_t split[2][AMX_GROUPS][8 * 64] __attribute__((aligned(64)));  // 4-bit codes as 8-bit tile rows
    __m512 a[AMX_M];  // in registers: acc is memory the tiles' stores could alias
    for (int i = 0; i < AMX_M; i++) a[i] = _mm512_setzero_ps();
    amx_sums(p, item, i0, 0, NIB, NW, MIN, G, HB, CB, split[0], whole);
    amx_store(p->groups < AMX_GROUPS ? (int)p->groups : AMX_GROUPS, sums[0]);
    for (int64_t b0 = 0, set = 0; b0 < p->groups; b0 += AMX_GROUPS, set ^= 1) {
        // the next set's products, then this set's scaling, then the next set's stores (stores before
        // the scaling left less of it overlapping the products: with split_codes, SmolLM2's 512-row
        // products on one thread, gate/up 4.91 -> 4.45 ms, q/k/v 1.68 -> 1.58, o 0.96 -> 0.91, down
        // unchanged; the scaling and the tiles' work alone take about half each)
        const int64_t next = b0 + AMX_GROUPS;
        if (next < p->groups) amx_sums(p, item, i0, next, NIB, NW, MIN, G, HB, CB, split[set ^ 1], whole);
        const int nb = p->groups - b0 < AMX_GROUPS ? (int)(p->groups - b0) : AMX_GROUPS;
        for (int j = 0; j < nb; j++) {
            const int64_t b = b0 + j;
            const int gi = (int)(b % G);
            const uint8_t* head = item + b / G * (HB + G * CB);
            const XBlock* x = p->xq + b * p->m + i0;
            const int32_t* sj = sums[set][j];
            __m512 min;
            const __m512 scale = group_scales(head, gi, G, MIN, KQ, &min);
#pragma GCC unroll 16
            for (int i = 0; i < AMX_M; i++) {
                // nothing to add where the codes have no offset (MIN) or went in less it (at 16 rows on
                // one thread, SmolLM2's Q4_1 gate and up 160 -> 150 us, Qwen2.5-Coder-0.5B's Q5_0 ones
                // 690-700 -> 632-650 us, its Q6_K down projection 585-600 -> 556-563 us)
                const __m512i sum = _mm512_load_si512(sj + LANES * i);
                const __m512i s = MIN || AMX_SIGNED(NIB, NW) ? sum : _mm512_add_epi32(sum, _mm512_set1_epi32(x[i].neg_off));
                a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(x[i].dx)), a[i]);
                if (MIN) a[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(x[i].dx_sum), a[i]);
            }
        }
        if (next < p->groups) amx_store(p->groups - next < AMX_GROUPS ? (int)(p->groups - next) : AMX_GROUPS, sums[set ^ 1]);
    }
    for (int i = 0; i < AMX_M; i++) acc[i] = a[i];
}

static void amx_item(const Product* p, const uint8_t* item, int64_t i0, const uint8_t* whole, __m512* acc) {
    const Layout* l = &p->l;
    if (l->nibble == 2 && l->kq) amx_rows(p, item, i0, 2, 8, 1, 1, whole, acc);
    else if (l->nibble == 2) amx_rows(p, item, i0, 2, 8, 0, 0, whole, acc);
    else if (l->nibble && l->kq) amx_rows(p, item, i0, 1, 8, 1, 1, whole, acc);
    else if (l->nibble && l->has_min) amx_rows(p, item, i0, 1, 8, 1, 0, whole, acc);
    else if (l->nibble) amx_rows(p, item, i0, 1, 8, 0, 0, whole, acc);
    else if (l->S == 16) amx_rows(p, item, i0, 0, 4, 0, 1, NULL, acc);
    else if (l->has_min) amx_rows(p, item, i0, 0, 8, 1, 1, NULL, acc);
    else amx_rows(p, item, i0, 0, 8, 0, 0, NULL, acc);
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Passes of BF16_ROWS rows or more (a prompt's; a decode step of that many sequences) in bfloat16 on the
// tiles, vLLM's numbers on a CPU: each item's weights decoded once a pass (scale·(code − off) + min, as
// float32, then rounded to bfloat16) into a panel the tiles read as their B operand, the activations
// rounded to bfloat16 once, and one TDPBF16PS per 32 values of K for a 16 × 16 block of outputs, summed in
// float32 in the tile across the whole of K. No group's sums leave the tiles to be scaled, which bounds
// the int8 tiles above (a store, load, convert and multiply-add per row and group). The rounding differs:
// a value's bfloat16 is within 2^-9 of it, where an int8 sub-block's code is within max|x|/254. A row's
// result depends only on its own activations, as on every path here, but it is not the int8 rows' result.
#define BF16 1
// From BF16_ROWS rows a pass decodes its weights to bfloat16: SmolLM2's products on 2 threads, int8 tiles
// against these, at 32 rows 0.39 against 0.41 ms (q/k/v, o, gate/up, down), at 64 0.73 against 0.56, at
// 96 1.23 against 0.77; at 512 rows on one thread, gate/up 4.45 against 2.20 ms
#define BF16_ROWS 64
// Values of K a 32-row block of activations goes through the tiles at a time: 16 KB of it, in L1 for
// every pair of a run (Qwen2.5-Coder-0.5B's 512-token pass on 2 threads, 322 -> 302 ms; 128: 307-313,
// 384: 322-331; SmolLM2's 576-wide blocks fit whole and gain nothing)
#define BF16_K_CHUNK 256

// An item's weights as bfloat16 pairs: panel row p (64 bytes) holds values 2p and 2p + 1 of K for its 16
// output rows; group b fills rows b·S/2 onwards
static void panel_of(const Layout* l, const uint8_t* item, int64_t groups, uint32_t* panel) {
    const int64_t HB = head_bytes(l), CB = code_bytes(l);
    const __m512i byte = _mm512_set1_epi32(255);
    for (int64_t b = 0; b < groups; b++) {
        int gi;
        const uint8_t* head = group_head(l, item, b, &gi);
        const uint8_t* g = head + HB + gi * CB;
        __m512 min;
        const __m512 scale = group_scales(head, gi, l->G, l->has_min, l->kq, &min);
        const __m512 bias = _mm512_fnmadd_ps(_mm512_set1_ps((float)l->off), scale, min);  // min − off·scale
        __m512i w[8];  // register k, lane r: codes 4k .. 4k + 3 of row r, a byte each
        const int regs = l->nibble ? 8 : l->S / 4;
        if (l->nibble) nibble_codes(g, l->nibble, 0, w);
        else  // (Q6_K's: unsigned again)
            for (int k = 0; k < regs; k++) w[k] = _mm512_add_epi8(_mm512_loadu_si512(g + 64 * k), _mm512_set1_epi8((char)(l->less_off * l->off)));
        __m512 v[32];  // value j of the group, lane r: output row r's
        for (int k = 0; k < regs; k++)
            for (int t = 0; t < 4; t++) v[4 * k + t] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[k], 8 * t), byte));
        uint32_t* rows = panel + b * (l->S / 2) * LANES;
        for (int q = 0; q < l->S / 2; q++)
            _mm512_store_si512(rows + LANES * q, bf16_pairs(_mm512_fmadd_ps(v[2 * q], scale, bias),
                                                            _mm512_fmadd_ps(v[2 * q + 1], scale, bias)));
    }
}

typedef struct {
    Layout l;
    const uint8_t* w;
    const uint16_t* xb;  // the activations as bfloat16 [rows, n], rows m rounded up to 32 (zeros past m)
    float* y;
    int64_t m, n, groups, ldy, out;
    int64_t per;  // pairs of items a work item takes (pairs_per_run)
    int* failed;  // set when a thread found no memory for its panels
    // a gated MLP (kvlab_i8_gated): w the gate's matrix, w2 (layout l2) the up's, out = I; pair q is item q
    // of each, and y gets act(gate) · up (gated8, act an ACT_* id). w2 NULL: pair q is items 2q, 2q + 1 of w
    const uint8_t* w2;
    Layout l2;
    int act;
} Bf16Product;

// Pairs of items a product has: (items + 1) / 2 of one matrix, or a gated MLP's I / 16 (gate's and up's)
static int64_t bf16_pairs_of(const Bf16Product* p) {
    const int64_t items = (p->out + LANES - 1) / LANES;
    return p->w2 ? items : (items + 1) / 2;
}

// act(gate) · up of 32 rows of a pair's sums (gate's 16 outputs, then up's, in each row of 32) into y
static void bf16_gated_rows(const Bf16Product* p, const float* sums, int64_t i0, int64_t q) {
    for (int64_t i = i0; i < p->m && i < i0 + 32; i++)
        for (int h = 0; h < 2; h++)
            store8(p->y + i * p->ldy + q * LANES + 8 * h,
                   gated8(load8(sums + (i - i0) * 32 + 8 * h), load8(sums + (i - i0) * 32 + LANES + 8 * h), p->act));
}

// The tiles hold 32 rows × 32 outputs of sums (0-3), two 16-row blocks of activations (4, 5) and two
// items' panels (6, 7): a pair of items at a time. A work item is a run of `per` pairs: their panels
// decoded first, then each 32-row block of activations, read once, serves every pair of the run (one
// pair a work item read all the activations again for each: Qwen2.5's 4,864-wide down projection at 512
// rows, 5 MB a pass). A block goes BF16_K_CHUNK values of K at a time through every pair, so that its
// chunk stays in L1 from pair to pair and only the panels come from L2; each pair's sums wait in memory
// from chunk to chunk (the same additions in the same order). A gated MLP's pair is a gate item and the
// up item of the same outputs, so its 32 rows' activations leave the tiles at once (the same sums as the
// two parts' own products)
static void bf16_runs_of_pairs(void* ctx, uint32_t begin, uint32_t end) {
    const Bf16Product* p = ctx;
    const int64_t n = p->n, ib = item_bytes(&p->l, p->groups), items = (p->out + LANES - 1) / LANES;
    const int64_t pairs = bf16_pairs_of(p);
    uint32_t* panels = aligned_alloc(64, p->per * 2 * n * 32);  // 2·per items, n/2 rows of 64 bytes each
    float* parts = aligned_alloc(64, p->per * 32 * 32 * sizeof(float));
    float sums[32 * 32] __attribute__((aligned(64)));
    if (!panels || !parts) {
        __atomic_store_n(p->failed, 1, __ATOMIC_RELAXED);
        free(panels);
        free(parts);
        return;
    }
    tiles_square();
    for (int64_t run = begin; run < end; run++) {
        const int64_t q0 = p->per * run, q1 = q0 + p->per < pairs ? q0 + p->per : pairs;
        for (int64_t q = q0; q < q1; q++) {
            uint32_t* panel = panels + (q - q0) * 2 * n * 8;  // the pair's two items', n * 8 words each
            if (p->w2) {
                panel_of(&p->l, p->w + q * ib, p->groups, panel);
                const int64_t groups2 = n / p->l2.S;  // up's groups (a K-quant's sub-blocks may be of 16)
                panel_of(&p->l2, p->w2 + q * item_bytes(&p->l2, groups2), groups2, panel + n * 8);
            } else {
                for (int64_t it = 2 * q; it < 2 * q + 2 && it < items; it++)
                    panel_of(&p->l, p->w + it * ib, p->groups, panel + (it - 2 * q) * n * 8);
            }
        }
        for (int64_t i0 = 0; i0 < p->m; i0 += 32)
            for (int64_t kc = 0; kc < n; kc += BF16_K_CHUNK) {
                const uint16_t* x0 = p->xb + i0 * n;
                const int64_t kend = kc + BF16_K_CHUNK < n ? kc + BF16_K_CHUNK : n;
                for (int64_t q = q0; q < q1; q++) {
                    const int64_t it = 2 * q;  // (one matrix's pairs: its first item)
                    const int two = p->w2 || it + 1 < items;
                    const uint32_t* panel = panels + (q - q0) * 2 * n * 8;
                    float* part = parts + (q - q0) * 32 * 32;  // the pair's sums between chunks
                    if (kc == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, part, 128);
                        _tile_loadd(2, part + 16 * 32, 128);
                        if (two) {
                            _tile_loadd(1, part + 16, 128);
                            _tile_loadd(3, part + 16 * 32 + 16, 128);
                        }
                    }
                    for (int64_t k = kc; k < kend; k += 32) {  // 32 values of K: 16 panel rows
                        _tile_loadd(4, x0 + k, n * 2);
                        _tile_loadd(5, x0 + 16 * n + k, n * 2);
                        _tile_loadd(6, panel + k * 8, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) {
                            _tile_loadd(7, panel + n * 8 + k * 8, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    float* to = kend < n ? part : sums;
                    _tile_stored(0, to, 128);
                    _tile_stored(2, to + 16 * 32, 128);
                    if (two) {
                        _tile_stored(1, to + 16, 128);
                        _tile_stored(3, to + 16 * 32 + 16, 128);
                    }
                    if (kend < n) continue;
                    if (p->w2) {
                        bf16_gated_rows(p, sums, i0, q);
                        continue;
                    }
                    const int64_t o0 = it * LANES, width = p->out - o0 < 32 ? p->out - o0 : 32;
                    const __mmask16 lo = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
                    const __mmask16 hi = width >= 32 ? 0xFFFF : width <= 16 ? 0 : (__mmask16)((1u << (width - 16)) - 1);
                    for (int64_t i = i0; i < p->m && i < i0 + 32; i++) {
                        _mm512_mask_storeu_ps(p->y + i * p->ldy + o0, lo, _mm512_load_ps(sums + (i - i0) * 32));
                        if (hi) _mm512_mask_storeu_ps(p->y + i * p->ldy + o0 + 16, hi, _mm512_load_ps(sums + (i - i0) * 32 + 16));
                    }
                }
            }
    }
    _tile_release();
    free(panels);
    free(parts);
}

// Pairs a work item takes: up to 4, their panels within about 1 MB (a core's L2 holds them and a block
// of activations), and at least 4 work items a thread
static int64_t pairs_per_run(int64_t pairs, int64_t n, int threads) {
    int64_t per = pairs / (4 * (threads > 1 ? threads : 1));
    const int64_t fit = (1 << 20) / (n * 64);
    per = per < fit ? per : fit;
    return per < 1 ? 1 : per > 4 ? 4 : per;
}

typedef struct {
    const float* x;
    uint16_t* xb;
    int64_t m, n;
} Bf16Rows;

static void bf16_rows(void* ctx, uint32_t begin, uint32_t end) {  // rows begin .. end − 1 rounded (zeros past m)
    const Bf16Rows* r = ctx;
    for (int64_t i = begin; i < end; i++) {
        uint16_t* out = r->xb + i * r->n;
        for (int64_t k = 0; k < r->n; k += 16) {
            const __m512 v = i < r->m ? _mm512_loadu_ps(r->x + i * r->n + k) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i*)(out + k), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

// x [m, n] as bfloat16, m rounded up to 32 rows; NULL when there is no memory for it
static uint16_t* bf16_activations(const float* x, int64_t m, int64_t n, int threads) {
    const int64_t rows = (m + 31) / 32 * 32;
    uint16_t* xb = aligned_alloc(64, rows * n * 2);
    if (!xb) return NULL;
    Bf16Rows r = {x, xb, m, n};
    kvlab_pool_run(bf16_rows, &r, (uint32_t)rows, 16, threads);
    return xb;
}

// ---- exact products on bfloat16 tiles -------------------------------------------------------------
// Every code of these layouts is an integer of at most 8 bits: exact in bfloat16. A float32 activation is
// exactly hi + mid + lo, three bfloat16 (its 24 bits of significand, 8 at a time). So C += hi·codes,
// C += mid·codes, C += lo·codes through the tiles (one C tile, three TDPBF16PS) sums exact products in
// float32: a group's Σ code·x within float32's rounding of its sums, then y += scale·C (+ min·Σx). A C row
// is one activation row's, in the same order at any number of rows: a row's bits do not depend on its batch.
#define XT_M 16  // activation rows a pass

typedef struct {
    Layout l;
    const uint8_t* w;
    const uint16_t* xa;  // [passes][groups][3 parts][XT_M rows][S] bfloat16, zeros past m
    const float* xs;     // [passes][groups][XT_M] each row's Σx over the group
    float* y;
    int64_t m, groups, ldy, out;
    int* failed;  // set when a thread found no memory for its panel
} ExactProduct;

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// Row i's three parts and sums into the pass layout
typedef struct {
    const float* x;
    uint16_t* xa;
    float* xs;
    int64_t m, n, S, groups;
} ExactRows;

static void exact_split_rows(void* ctx, uint32_t begin, uint32_t end) {
    const ExactRows* e = ctx;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
    for (int64_t i = begin; i < end; i++) {
        const int64_t pass = i / XT_M, r = i % XT_M;
        for (int64_t b = 0; b < e->groups; b++) {
            uint16_t* to = e->xa + ((pass * e->groups + b) * 3 * XT_M + r) * e->S;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k = 0; k < e->S; k += 16) {
                const __mmask16 keep = e->S - k >= 16 ? 0xFFFF : (__mmask16)((1u << (e->S - k)) - 1);
                const __m512 v = i < e->m ? _mm512_maskz_loadu_ps(keep, e->x + i * e->n + b * e->S + k) : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, v);
                const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
                const __m512 r1 = _mm512_sub_ps(v, hi);
                const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
                const __m512 lo = _mm512_sub_ps(r1, mid);  // at most 8 bits of significand left: exact
                const __m512 parts[3] = {hi, mid, lo};
                for (int t = 0; t < 3; t++)
                    _mm256_mask_storeu_epi16(to + t * XT_M * e->S + k, keep,
                                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(parts[t]), 16)));
            }
            e->xs[(pass * e->groups + b) * XT_M + r] = _mm512_reduce_add_ps(sum);
        }
    }
}

// bfloat16 of v (an integer of at most 8 bits) for every 5-bit index: unsigned codes, or signed (two's
// complement in 5 bits)
static inline __m512i code_table5(const int SIGNED) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = (uint16_t)(f32_bits((float)(SIGNED && i >= 16 ? i - 32 : i)) >> 16);
    return _mm512_loadu_si512(t);
}

// A group's codes as the tiles' B operand: row j (64 bytes) holds codes 2j, 2j + 1 of each of the 16
// outputs as bfloat16 pairs
static inline __attribute__((always_inline)) void exact_codes(const uint8_t* g, const int NIB, const int NW,
                                                               const int MIN, uint32_t* out) {
    const __m512i even = _mm512_set4_epi32(0x0D0D0C0C, 0x09090808, 0x05050404, 0x01010000);
    const __m512i odd = _mm512_add_epi8(even, _mm512_set1_epi8(2));
    __m512i w[8];
    if (NIB) {
        nibble_codes(g, NIB, CODE_OFF(NIB, 8, MIN), w);
        const __m512i table = code_table5(!MIN);
        for (int k = 0; k < 8; k++) {
            // bytes 4r, 4r + 1 of lane r doubled into words: the table reads an index's low 5 bits
            const __m512i e = _mm512_shuffle_epi8(w[k], even), o = _mm512_shuffle_epi8(w[k], odd);
            _mm512_store_si512(out + 32 * k, _mm512_permutexvar_epi16(e, table));
            _mm512_store_si512(out + 32 * k + 16, _mm512_permutexvar_epi16(o, table));
        }
    } else if (NW == 4) {  // Q6_K: codes less 32, signed bytes, 6 bits
        uint16_t t[64];
        for (int i = 0; i < 64; i++) t[i] = (uint16_t)(f32_bits((float)(i >= 32 ? i - 64 : i)) >> 16);
        const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 32);
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_loadu_si512(g + 64 * k);
            const __m512i e = _mm512_shuffle_epi8(v, even), o = _mm512_shuffle_epi8(v, odd);
            _mm512_store_si512(out + 32 * k, _mm512_permutex2var_epi16(t0, e, t1));
            _mm512_store_si512(out + 32 * k + 16, _mm512_permutex2var_epi16(t0, o, t1));
        }
    } else {  // Q8_0: codes + 128, unsigned bytes: as floats, whose bfloat16 is their top half
        const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
        for (int k = 0; k < 8; k++) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(g + 64 * k), _mm512_set1_epi8((char)0x80));
            __m512i f[4];
            for (int t = 0; t < 4; t++)  // code 4k + t of each lane, as float32 bits
                f[t] = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24)));
            _mm512_store_si512(out + 32 * k, _mm512_ternarylogic_epi32(f[1], top, _mm512_srli_epi32(f[0], 16), 0xE2));
            _mm512_store_si512(out + 32 * k + 16, _mm512_ternarylogic_epi32(f[3], top, _mm512_srli_epi32(f[2], 16), 0xE2));
        }
    }
}

// The tiles for sub-blocks of S values and passes of `rows` rows: sums in 0 and 1 (two groups in flight,
// or two items), the activations' hi, mid and lo parts in 2-4, two groups' codes (or two items') in 5 and 6
static void exact_configure(int S, int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    for (int t = 2; t < 5; t++) c.colsb[t] = (uint16_t)(2 * S);  // A: a group of activations a row
    c.rows[5] = c.rows[6] = (uint8_t)(S / 2);                   // B: a group's codes as bfloat16 pairs
    tiles_load(&c);
}

// Group b's three products into C tile T (B in tile U); A parts at x (stride 2S bytes)
#define EXACT_GROUP(T, U, x, codes, S)                                    \
    do {                                                                  \
        _tile_zero(T);                                                    \
        _tile_loadd(U, (const void*)(codes), 64);                         \
        _tile_loadd(2, (const void*)(x), 2 * (S));                        \
        _tile_dpbf16ps(T, 2, U);                                          \
        _tile_loadd(3, (const void*)((x) + XT_M * (S)), 2 * (S));         \
        _tile_dpbf16ps(T, 3, U);                                          \
        _tile_loadd(4, (const void*)((x) + 2 * XT_M * (S)), 2 * (S));     \
        _tile_dpbf16ps(T, 4, U);                                          \
    } while (0)

// One item's products for a pass of up to XT_M rows: group b's products (its codes made the turn before),
// then group b + 1's codes while the tiles work, then group b − 1's sums out of the tiles and scaled. The
// codes go into the item's panel (8·S words a group) on its first pass, and later passes (a prompt's) read
// them back.
static inline __attribute__((always_inline)) void exact_rows(const ExactProduct* p, const uint8_t* item, int64_t pass,
                                                             int rows, uint32_t* panel, const int NIB, const int NW,
                                                             const int MIN, const int KQ, __m512* acc) {
    const int G = GROUPS_PER_SUPER(NIB, NW, KQ), HB = HEAD_BYTES(KQ, G, MIN), CB = CODE_BYTES(NIB, NW);
    const int S = NIB ? 32 : NW * 4;
    float sums[2][XT_M * LANES] __attribute__((aligned(64)));
    __m512 a[XT_M];
    for (int i = 0; i < XT_M; i++) a[i] = _mm512_setzero_ps();
    const uint16_t* xa = p->xa + pass * p->groups * 3 * XT_M * S;
    const float* xs = p->xs + pass * p->groups * XT_M;
#define GROUP_CODES(b) (item + (b) / G * (HB + G * CB) + HB + ((b) % G) * CB)
    if (pass == 0) exact_codes(GROUP_CODES(0), NIB, NW, MIN, panel);
    for (int64_t b = 0; b <= p->groups; b++) {
        if (b < p->groups) {
            if (b & 1) EXACT_GROUP(1, 6, xa + b * 3 * XT_M * S, panel + b * 8 * S, S);
            else EXACT_GROUP(0, 5, xa + b * 3 * XT_M * S, panel + b * 8 * S, S);
        }
        if (b + 1 < p->groups && pass == 0) {
            const uint8_t* g = GROUP_CODES(b + 1);
            for (int line = 0; line < CB; line += 64) _mm_prefetch((const char*)g + AMX_AHEAD + line, _MM_HINT_T1);
            exact_codes(g, NIB, NW, MIN, panel + (b + 1) * 8 * S);
        }
        if (b == 0) continue;
        const int64_t c = b - 1;  // the group before: its sums out of the tiles, then scaled
        if (c & 1) _tile_stored(1, sums[1], 64);
        else _tile_stored(0, sums[0], 64);
        const uint8_t* head = item + c / G * (HB + G * CB);
        __m512 min;
        const __m512 scale = group_scales(head, (int)(c % G), G, MIN, KQ, &min);
        const float* s = sums[c & 1];
#pragma GCC unroll 16
        for (int i = 0; i < XT_M; i++) {
            if (i >= rows) break;
            a[i] = _mm512_fmadd_ps(_mm512_load_ps(s + LANES * i), scale, a[i]);
            if (MIN) a[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(xs[c * XT_M + i]), a[i]);
        }
    }
#undef GROUP_CODES
    for (int i = 0; i < XT_M; i++) acc[i] = a[i];
}

static void exact_item(const ExactProduct* p, const uint8_t* item, int64_t pass, int rows, uint32_t* panel, __m512* acc) {
    const Layout* l = &p->l;
    if (l->nibble == 2 && l->kq) exact_rows(p, item, pass, rows, panel, 2, 8, 1, 1, acc);
    else if (l->nibble == 2) exact_rows(p, item, pass, rows, panel, 2, 8, 0, 0, acc);
    else if (l->nibble && l->kq) exact_rows(p, item, pass, rows, panel, 1, 8, 1, 1, acc);
    else if (l->nibble && l->has_min) exact_rows(p, item, pass, rows, panel, 1, 8, 1, 0, acc);
    else if (l->nibble) exact_rows(p, item, pass, rows, panel, 1, 8, 0, 0, acc);
    else if (l->S == 16) exact_rows(p, item, pass, rows, panel, 0, 4, 0, 1, acc);
    else exact_rows(p, item, pass, rows, panel, 0, 8, 0, 0, acc);
}


// Up to XT_PAIR rows: two items at a time, their chains alternating on the tiles and each group's three
// parts of the activations loaded once for both (one item at a time, a decode step's one row left the tiles
// waiting on one chain: SmolLM2's Q4_1 products at one row, one thread, 41 -> 31 ns per 16 × 32 weights).
// Up to XT_M rows too where the sub-blocks are of 32 (PR = XT_M): at 16 rows the three parts are 3 KB a
// group, from L2, against the codes' 1 KB, and a pair halves them; the 32 sums then outnumber the
// registers and some wait in L1. On an Intel Xeon VM (2 threads, bfloat16 KV, 16-sequence decode steps,
// alternated in one process): Qwen2.5-Coder-0.5B 96.6 -> 86.1 and 83.5 -> 75.2 ms, SmolLM2 24.7 -> 23.6
// and 24.7 -> 24.6. Q6_K's sub-blocks of 16 lost (2 threads, 16 rows: 136 -> 150 ns a group).
#define XT_PAIR 8
// How far on the pairs ask for the matrix, into L2 (SmolLM2's 30 layers at one row, 2 threads: 4 KB on
// 7.87 ms, 32 KB 6.38, against the exact blocks' 6.91; later, with its LM head, 8, 32 and 128 KB alike)
#define XT_AHEAD (32 << 10)
static inline __attribute__((always_inline)) void exact_rows2(const ExactProduct* p, const uint8_t* item0,
                                                              const uint8_t* item1, int rows, const int NIB,
                                                              const int NW, const int MIN, const int KQ,
                                                              const int PR, __m512* acc0, __m512* acc1) {
    const int G = GROUPS_PER_SUPER(NIB, NW, KQ), HB = HEAD_BYTES(KQ, G, MIN), CB = CODE_BYTES(NIB, NW);
    const int S = NIB ? 32 : NW * 4;
    uint32_t codes[2][2][16 * LANES] __attribute__((aligned(64)));  // [turn][item]
    float sums[2][XT_M * LANES] __attribute__((aligned(64)));
    __m512 a[2][XT_M];
    for (int i = 0; i < PR; i++) a[0][i] = a[1][i] = _mm512_setzero_ps();
    const uint8_t* items[2] = {item0, item1};
#define PAIR_CODES(j, b) (items[j] + (b) / G * (HB + G * CB) + HB + ((b) % G) * CB)
    for (int j = 0; j < 2; j++) exact_codes(PAIR_CODES(j, 0), NIB, NW, MIN, codes[0][j]);
    for (int64_t b = 0; b < p->groups; b++) {  // group b's products, b + 1's codes, b's sums scaled
        const uint16_t* x = p->xa + b * 3 * XT_M * S;
        const int u = b & 1;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(5, codes[u][0], 64);
        _tile_loadd(6, codes[u][1], 64);
        _tile_loadd(2, x, 2 * S);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(1, 2, 6);
        _tile_loadd(3, x + XT_M * S, 2 * S);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 3, 6);
        _tile_loadd(4, x + 2 * XT_M * S, 2 * S);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (b + 1 < p->groups)
            for (int j = 0; j < 2; j++) {
                const uint8_t* g = PAIR_CODES(j, b + 1);
                for (int line = 0; line < CB; line += 64) _mm_prefetch((const char*)g + XT_AHEAD + line, _MM_HINT_T1);
                exact_codes(g, NIB, NW, MIN, codes[u ^ 1][j]);
            }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        for (int j = 0; j < 2; j++) {
            const uint8_t* head = items[j] + b / G * (HB + G * CB);
            __m512 min;
            const __m512 scale = group_scales(head, (int)(b % G), G, MIN, KQ, &min);
#pragma GCC unroll 16
            for (int i = 0; i < PR; i++) {
                if (i >= rows) break;
                a[j][i] = _mm512_fmadd_ps(_mm512_load_ps(sums[j] + LANES * i), scale, a[j][i]);
                if (MIN) a[j][i] = _mm512_fmadd_ps(min, _mm512_set1_ps(p->xs[b * XT_M + i]), a[j][i]);
            }
        }
    }
#undef PAIR_CODES
    for (int i = 0; i < PR; i++) acc0[i] = a[0][i], acc1[i] = a[1][i];
}

#define EXACT_ITEM2(NAME, PR)                                                                                  \
    static void NAME(const ExactProduct* p, const uint8_t* item0, const uint8_t* item1, int rows, __m512* acc0, \
                     __m512* acc1) {                                                                           \
        const Layout* l = &p->l;                                                                               \
        if (l->nibble == 2 && l->kq) exact_rows2(p, item0, item1, rows, 2, 8, 1, 1, PR, acc0, acc1);          \
        else if (l->nibble == 2) exact_rows2(p, item0, item1, rows, 2, 8, 0, 0, PR, acc0, acc1);              \
        else if (l->nibble && l->kq) exact_rows2(p, item0, item1, rows, 1, 8, 1, 1, PR, acc0, acc1);          \
        else if (l->nibble && l->has_min) exact_rows2(p, item0, item1, rows, 1, 8, 1, 0, PR, acc0, acc1);     \
        else if (l->nibble) exact_rows2(p, item0, item1, rows, 1, 8, 0, 0, PR, acc0, acc1);                   \
        else if (l->S == 16) exact_rows2(p, item0, item1, rows, 0, 4, 0, 1, PR, acc0, acc1);                  \
        else exact_rows2(p, item0, item1, rows, 0, 8, 0, 0, PR, acc0, acc1);                                  \
    }
EXACT_ITEM2(exact_item2, XT_PAIR)
EXACT_ITEM2(exact_item2_16, XT_M)
static void exact_items(void* ctx, uint32_t begin, uint32_t end) {
    const ExactProduct* p = ctx;
    const int64_t ib = item_bytes(&p->l, p->groups), passes = (p->m + XT_M - 1) / XT_M;
    const int rows = p->m < XT_M ? (int)p->m : XT_M;
    exact_configure(p->l.S, rows);
    int64_t it = begin;
    const int pair = p->m <= XT_PAIR || (p->m <= XT_M && p->l.S == 32);
    for (; pair && it + 1 < end; it += 2) {  // two whole items
        __m512 acc[2][XT_M];
        if (p->m <= XT_PAIR) exact_item2(p, p->w + it * ib, p->w + (it + 1) * ib, rows, acc[0], acc[1]);
        else exact_item2_16(p, p->w + it * ib, p->w + (it + 1) * ib, rows, acc[0], acc[1]);
        for (int j = 0; j < 2; j++) {
            const int64_t o0 = (it + j) * LANES;
            const __mmask16 keep = p->out - o0 >= LANES ? 0xFFFF : (__mmask16)((1u << (p->out - o0)) - 1);
            for (int64_t i = 0; i < p->m; i++) _mm512_mask_storeu_ps(p->y + i * p->ldy + o0, keep, acc[j][i]);
        }
    }
    uint32_t* panel = it < end ? aligned_alloc(64, p->groups * 16 * 64) : NULL;  // an item's codes, 1 KB a group
    if (it < end && !panel) {
        __atomic_store_n(p->failed, 1, __ATOMIC_RELAXED);
        it = end;
    }
    for (; it < end; it++) {
        const int64_t o0 = it * LANES;
        const __mmask16 keep = p->out - o0 >= LANES ? 0xFFFF : (__mmask16)((1u << (p->out - o0)) - 1);
        for (int64_t pass = 0; pass < passes; pass++) {
            __m512 acc[XT_M];
            exact_item(p, p->w + it * ib, pass, rows, panel, acc);
            for (int64_t i = pass * XT_M; i < p->m && i < (pass + 1) * XT_M; i++)
                _mm512_mask_storeu_ps(p->y + i * p->ldy + o0, keep, acc[i - pass * XT_M]);
        }
    }
    free(panel);
    _tile_release();
}

static uint32_t claim_size(int64_t m, uint32_t items, int threads);

// x's parts for the sub-blocks of layout l (xa, xs: NULL where no memory was left), split by every thread
// for a prompt
static void exact_split(const Layout* l, const float* x, int64_t m, int64_t n, int threads, uint16_t** xa, float** xs) {
    const int64_t groups = n / l->S, passes = (m + XT_M - 1) / XT_M;
    *xa = aligned_alloc(64, passes * groups * 3 * XT_M * l->S * 2);
    *xs = aligned_alloc(64, passes * groups * XT_M * sizeof(float));
    if (!*xa || !*xs) {
        free(*xa), free(*xs);
        *xa = NULL, *xs = NULL;
        return;
    }
    ExactRows e = {x, *xa, *xs, m, n, l->S, groups};
    // fewer than XT_M rows: the tiles are configured for m rows and read no others; else a last pass's
    // rows past m are zeros
    const uint32_t rows = (uint32_t)(m < XT_M ? m : passes * XT_M);
    if (m * n >= 32768) kvlab_pool_run(exact_split_rows, &e, rows, 4, threads);
    else exact_split_rows(&e, 0, rows);
}

// kvlab_t16_matmul_parts' work where the tiles are there: x split once for the parts of each sub-block
// size, then every part's items as one pool job
static int exact_parts(int num, const Layout* l, const uint8_t* const* w, const int64_t* out, const float* x, float* y,
                       int64_t m, int64_t n, int64_t ldy, int threads) {
    ExactProduct p[KVLAB_MAX_JOBS];
    uint16_t* xa[2] = {NULL, NULL};  // sub-blocks of 32, of 16
    float* xs[2] = {NULL, NULL};
    PoolJobs jobs = {.num = num};
    int status = 0, failed = 0;
    int64_t column = 0;
    for (int j = 0; j < num; j++) {
        const int s = l[j].S == 16;
        if (!xa[s]) exact_split(&l[j], x, m, n, threads, &xa[s], &xs[s]);
        if (!xa[s]) {
            status = -2;
            break;
        }
        p[j] = (ExactProduct){l[j], w[j], xa[s], xs[s], y + column, m, n / l[j].S, ldy, out[j], &failed};
        jobs.task[j] = exact_items, jobs.ctx[j] = &p[j];
        jobs.first[j + 1] = jobs.first[j] + (uint32_t)((out[j] + LANES - 1) / LANES);
        column += out[j];
    }
    if (!status) kvlab_pool_run_jobs(&jobs, claim_size(m < XT_M ? XT_M : m, jobs.first[num], threads), threads);
    for (int s = 0; s < 2; s++) free(xa[s]), free(xs[s]);
    return status ? status : failed ? -2 : 0;
}
#endif
#endif

static void items(void* ctx, uint32_t begin, uint32_t end) {
    const Product* p = ctx;
    const int64_t ib = item_bytes(&p->l, p->groups);
    int amx = 0;
#if defined(AMX)
    if ((amx = p->amx)) amx_configure(&p->l);  // a thread's own tiles, set for this call's format
#endif
    // a 4-bit item's codes split once for all its rows: signed for the tiles, unsigned for vpdpbusd (only
    // 5-bit ones there: see SPLIT_ONCE)
    const int split = (amx ? p->l.nibble : p->l.nibble == 2) && p->end - p->begin >= SPLIT_ONCE;
    uint8_t* whole = split ? aligned_alloc(64, p->groups * 512) : NULL;
    for (int64_t it = begin; it < end; it++) {
        const int64_t o0 = it * LANES;
        const __mmask16 keep = p->out - o0 >= LANES ? 0xFFFF : (__mmask16)((1u << (p->out - o0)) - 1);
        int64_t i = p->begin;
        if (whole) split_codes(&p->l, p->w + it * ib, p->groups, whole, amx);
#if defined(AMX)
        for (; amx && p->end - i >= AMX_M; i += AMX_M) {
            __m512 acc[AMX_M];
            amx_item(p, p->w + it * ib, i, whole, acc);
            for (int k = 0; k < AMX_M; k++) _mm512_mask_storeu_ps(p->y + (i + k) * p->ldy + o0, keep, acc[k]);
        }
#endif
        for (; !whole && p->l.nibble == 2 && p->end - i >= WIDE_M; i += WIDE_M) {
            __m512 acc[WIDE_M];
            wide_rows(p, p->w + it * ib, i, acc);
            for (int k = 0; k < WIDE_M; k++) _mm512_mask_storeu_ps(p->y + (i + k) * p->ldy + o0, keep, acc[k]);
        }
        for (; i < p->end; i += MTILE) {
            __m512 acc[MTILE];
            const int M = p->end - i < MTILE ? (int)(p->end - i) : MTILE;
            ROWS_OF[M - 1](p, p->w + it * ib, i, amx ? NULL : whole, acc);
            for (int k = 0; k < M; k++) _mm512_mask_storeu_ps(p->y + (i + k) * p->ldy + o0, keep, acc[k]);
        }
    }
#if defined(AMX)
    if (amx) _tile_release();
#endif
    free(whole);
}

// A gated MLP's pass on vpdpbusd: work item `it` is gate's item and up's item of the same 16 outputs,
// MTILE rows at a time through both (the rows' own sums, as items() makes them), and only act(gate) · up
// leaves the registers (gated8, 8 lanes at a time, as gated_act takes a row). The two products wrote gate
// and up out and gated_act read them back: for Qwen2.5-Coder-0.5B's 512-row prompt passes, 20 MB a
// layer each way. The same bits as those products and gated_act.
static void gated_items(void* ctx, uint32_t begin, uint32_t end) {
    const GatedPass* q = ctx;
    const Product* part[2];
    int64_t ib[2];
    uint8_t* whole[2];
    gated_parts(q, SPLIT_ONCE, part, ib, whole);
    for (int64_t it = begin; it < end; it++) {
        const int64_t o0 = it * LANES;
        for (int j = 0; j < 2; j++)
            if (whole[j]) split_codes(&part[j]->l, part[j]->w + it * ib[j], part[j]->groups, whole[j], 0);
        for (int64_t i = q->gate.begin; i < q->gate.end; i += MTILE) {
            __m512 acc[2][MTILE];
            const int M = q->gate.end - i < MTILE ? (int)(q->gate.end - i) : MTILE;
            for (int j = 0; j < 2; j++) ROWS_OF[M - 1](part[j], part[j]->w + it * ib[j], i, whole[j], acc[j]);
            for (int k = 0; k < M; k++) {
                float g[LANES], u[LANES];
                _mm512_storeu_ps(g, acc[0][k]), _mm512_storeu_ps(u, acc[1][k]);
                for (int h = 0; h < LANES; h += 8)
                    store8(q->gate.y + (i + k) * q->gate.ldy + o0 + h, gated8(load8(g + h), load8(u + h), q->act));
            }
        }
    }
    free(whole[0]), free(whole[1]);
}
#elif defined(DOT2)
// AVX2 has no vpdpbusd: vpmaddubsw multiplies codes by x in pairs into 16-bit sums, which add up in 16
// bits while no sum can overflow (K16 of them: 8 for 4-bit codes, 4 for 5-bit, 2 for 6-bit), and
// vpmaddwd by ones widens them into the 32-bit lanes. Q8_0's codes (q + 128) would overflow a pair, so
// they are multiplied as the signed q (|q| against x with q's sign: llama.cpp's trick), which is the
// same integer sum without the −128·sum(x) it starts from. An item's 16 rows are two halves of 8 lanes;
// the integers are exact and the float operations per lane are the fallback's below, in its order: the
// same bits. The bound on an AMD Zen 3 core: vpmaddubsw alone issues 2 a cycle, but with the vpaddw each
// needs only 1.25 (they share pipes), so 40 multiply-adds a cycle at most; a loop of just those (codes
// masked, x broadcast) ran 34-38, these passes 24-25 at 16 rows (1,024 x 1,024 Q4_1, one thread, in cache):
// the group's scaling (vpmaddwd, conversion, scale · dx, the FMAs with the min) is most of the rest.
#define MT2 4  // activation rows per pass over a half item: 4 of int16 sums, int32 sums and accumulators
// From SPLIT_HALVES rows a call splits each 5-bit item's codes once (split_halves) for its passes of MT2 rows,
// instead of placing the fifth bits in every pass (seven operations a register). On an AMD EPYC Zen 3 VM,
// one thread, a 1,024 x 1,024 matrix in cache: Q5_0 at 16 rows 294 -> 239 us, at 8 147 -> 134; Q5_K at 16
// 316 -> 265. 4-bit codes gain nothing split once (Q4_1 at 16 rows 244 -> 247 us, at 8 122 -> 134).
#define SPLIT_HALVES 8

static inline __m256 int8_times8(const uint8_t* sc, const float* d) {  // 8 int8 as floats, times d lane by lane
    const __m128i q = _mm_loadl_epi64((const __m128i*)sc);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(d));
}

// with_fifth_bits for a half item's 8 lanes
static inline __m256i with_fifth_bits8(__m256i w, __m256i plane, int k) {
    const __m256i at = _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808,
                                                         0x0C0C0C0C), _mm256_set1_epi8((char)(k / 2)));  // fmt: skip
    const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(plane, at), _mm256_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201));
    return _mm256_or_si256(w, _mm256_slli_epi16(_mm256_min_epu8(bits, _mm256_set1_epi8(1)), 4));  // 16 where set
}

// Code register k of half h of a 4-bit group g (NIB 2: with its fifth bits): lane r's 4 codes as bytes
static inline __attribute__((always_inline)) __m256i half_codes(const uint8_t* g, int k, int h, const int NIB) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(g + 64 * (k % 4) + 32 * h));
    const __m256i w = _mm256_and_si256(k < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
    return NIB == 2 ? with_fifth_bits8(w, _mm256_loadu_si256((const __m256i*)(g + 256 + 32 * h)), k) : w;
}

static inline __attribute__((always_inline)) void half_rows(const Product* p, const uint8_t* item, int64_t i0,
                                                            const int M, const int H, int h0, const int NIB,
                                                            const int NW, const int MIN, const int KQ,
                                                            const int SIGNED, const int K16, const uint8_t* whole,
                                                            __m256* acc) {
    const int G = GROUPS_PER_SUPER(NIB, NW, KQ), HB = HEAD_BYTES(KQ, G, MIN), CB = CODE_BYTES(NIB, NW);
    const int U = M * H;  // (half, row) pairs: pair u is row u % M of half h0 + u / M
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 a[MT2];  // in registers: acc is memory the code loads could alias
    for (int u = 0; u < U; u++) a[u] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p->groups; b++) {
        const int gi = (int)(b % G);
        const uint8_t* head = item + b / G * (HB + G * CB);
        const uint8_t* g = head + HB + gi * CB;
        const XBlock* xs = p->xq + b * p->m + i0;
        __m256i s[MT2], s16[MT2];
        // one code register (per half) at a time against the M rows: the sums, not 8 code registers, stay live
#pragma GCC unroll 8
        for (int k = 0; k < NW; k++) {
            __m256i w[2], wabs[2];
            for (int hh = 0; hh < H; hh++) {
                const int h = h0 + hh;
                if (NIB && whole) {  // split once for all the item's rows (split_halves)
                    w[hh] = _mm256_load_si256((const __m256i*)(whole + b * 512 + 64 * k + 32 * h));
                } else if (NIB) {
                    w[hh] = half_codes(g, k, h, NIB);
                } else {
                    w[hh] = _mm256_loadu_si256((const __m256i*)(g + 64 * k + 32 * h));
                    if (SIGNED) w[hh] = _mm256_xor_si256(w[hh], flip);  // the code − 128: Q8_0's own q
                    if (LESS_OFF(NIB, NW))  // Q6_K's, unsigned again
                        w[hh] = _mm256_add_epi8(w[hh], _mm256_set1_epi8((char)CODE_OFF(NIB, NW, MIN)));
                }
                wabs[hh] = SIGNED ? _mm256_abs_epi8(w[hh]) : w[hh];
            }
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) {
                const int i = u % M, hh = u / M;
                const __m256i xv = _mm256_set1_epi32(xs[i].q[k]);
                const __m256i prod = SIGNED ? _mm256_maddubs_epi16(wabs[hh], _mm256_sign_epi8(xv, w[hh]))
                                            : _mm256_maddubs_epi16(w[hh], xv);
                s16[u] = k % K16 ? _mm256_add_epi16(s16[u], prod) : prod;
                if (k % K16 == K16 - 1 || k == NW - 1) {  // the 16-bit sums into 32 bits, from −off·sum(q)
                    const __m256i part = _mm256_madd_epi16(s16[u], ones);  // with a min, −off·sum(q) is 0: not added
                    s[u] = k >= K16 ? _mm256_add_epi32(s[u], part)
                           : SIGNED || MIN ? part : _mm256_add_epi32(_mm256_set1_epi32(xs[i].neg_off), part);
                }
            }
            // in this order: GCC would otherwise hoist every load and product above the sums and spill them;
            // the 32-bit sums too (it kept each part apart, spilled them and added them late). A barrier to
            // memory as well cost 5-10% on a Zen 3 core (the loads of the next register waited for it).
            for (int u = 0; u < U; u++) __asm__ volatile("" : "+x"(s16[u]));
            if (k % K16 == K16 - 1 || k == NW - 1)
                for (int u = 0; u < U; u++) __asm__ volatile("" : "+x"(s[u]));
        }
        for (int hh = 0; hh < H; hh++) {
            const int h = h0 + hh;
            __m256 scale, min = _mm256_setzero_ps();  // the half's 8 scales (and mins): lane_scale's numbers
            if (KQ) {
                const float* d = (const float*)(head + D_AT(G, MIN)) + 8 * h;
                scale = int8_times8(head + SCALE_AT(KQ, gi) + 8 * h, d);
                if (MIN) min = int8_times8(head + MIN_AT(KQ, G, gi) + 8 * h, d + LANES);
            } else {
                scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(head + SCALE_AT(KQ, gi) + 16 * h)));
                if (MIN) min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(head + MIN_AT(KQ, G, gi) + 16 * h)));
            }
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const int u = hh * M + i;
                a[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[u]), _mm256_mul_ps(scale, _mm256_set1_ps(xs[i].dx)), a[u]);
                if (MIN) a[u] = _mm256_fmadd_ps(min, _mm256_set1_ps(xs[i].dx_sum), a[u]);
            }
        }
    }
    for (int u = 0; u < U; u++) acc[u] = a[u];
}

// M rows against H halves from h0 (rows 8h .. 8h + 7 of the item); acc[hh·M + i]: row i, half h0 + hh. The
// layout's constants as literals, so that everything stays in registers; 5-bit codes split once (whole) or
// not (NULL) in two compiled forms, so that neither carries the other's branch.
#define HALF_ROWS(NAME, M, H)                                                                                 \
    static void NAME(const Product* p, const uint8_t* item, int64_t i0, int h0, const uint8_t* whole,         \
                     __m256* acc) {                                                                           \
        const Layout* l = &p->l;                                                                              \
        if (l->nibble == 2 && l->kq && whole) half_rows(p, item, i0, M, H, h0, 2, 8, 1, 1, 0, 4, whole, acc); \
        else if (l->nibble == 2 && l->kq) half_rows(p, item, i0, M, H, h0, 2, 8, 1, 1, 0, 4, NULL, acc);      \
        else if (l->nibble == 2 && whole) half_rows(p, item, i0, M, H, h0, 2, 8, 0, 0, 0, 4, whole, acc);     \
        else if (l->nibble == 2) half_rows(p, item, i0, M, H, h0, 2, 8, 0, 0, 0, 4, NULL, acc);               \
        else if (l->nibble && l->kq) half_rows(p, item, i0, M, H, h0, 1, 8, 1, 1, 0, 8, NULL, acc);           \
        else if (l->nibble && l->has_min) half_rows(p, item, i0, M, H, h0, 1, 8, 1, 0, 0, 8, NULL, acc);      \
        else if (l->nibble) half_rows(p, item, i0, M, H, h0, 1, 8, 0, 0, 0, 8, NULL, acc);                    \
        else if (l->S == 16) half_rows(p, item, i0, M, H, h0, 0, 4, 0, 1, 0, 2, NULL, acc);                   \
        else if (l->off == 128) half_rows(p, item, i0, M, H, h0, 0, 8, 0, 0, 1, 1, NULL, acc);                \
        else if (l->has_min) half_rows(p, item, i0, M, H, h0, 0, 8, 1, 1, 0, 4, NULL, acc);                   \
        else half_rows(p, item, i0, M, H, h0, 0, 8, 0, 0, 0, 4, NULL, acc);                                   \
    }
HALF_ROWS(half_rows_1, 1, 1)
HALF_ROWS(half_rows_2, 2, 1)
HALF_ROWS(half_rows_3, 3, 1)
HALF_ROWS(half_rows_4, 4, 1)
HALF_ROWS(both_halves_1, 1, 2)
HALF_ROWS(both_halves_2, 2, 2)
typedef void (*HalfRows)(const Product*, const uint8_t*, int64_t, int, const uint8_t*, __m256*);
static const HalfRows HALF_ROWS_OF[MT2] = {half_rows_1, half_rows_2, half_rows_3, half_rows_4};
// Up to 2 rows, both halves in one pass: each line of codes is used whole when it arrives, so that the
// one-row products of a decode step stream from memory without a second pass over every item.
static const HalfRows BOTH_HALVES_OF[2] = {both_halves_1, both_halves_2};

// Every group of a 5-bit item, its codes as half_rows makes them (half_codes), into out: 512 bytes a group,
// register k of half h at 64k + 32h. Once for an item that SPLIT_HALVES rows or more read.
static void split_halves(const Layout* l, const uint8_t* item, int64_t groups, uint8_t* out) {
    const int G = GROUPS_PER_SUPER(1, 8, l->kq), HB = (int)head_bytes(l), CB = (int)code_bytes(l);
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t* g = item + b / G * (HB + G * CB) + HB + (b % G) * CB;
        for (int k = 0; k < 8; k++)
            for (int h = 0; h < 2; h++) _mm256_store_si256((__m256i*)(out + b * 512 + 64 * k + 32 * h), half_codes(g, k, h, 2));
    }
}

static void items(void* ctx, uint32_t begin, uint32_t end) {
    const Product* p = ctx;
    const int64_t ib = item_bytes(&p->l, p->groups);
    const int split = p->l.nibble == 2 && p->end - p->begin >= SPLIT_HALVES;  // 5-bit codes only (SPLIT_HALVES)
    uint8_t* whole = split ? aligned_alloc(64, p->groups * 512) : NULL;
    for (int64_t it = begin; it < end; it++) {
        const int64_t o0 = it * LANES;
        const int rows = p->out - o0 >= LANES ? LANES : (int)(p->out - o0);
        if (whole) split_halves(&p->l, p->w + it * ib, p->groups, whole);
        for (int64_t i = p->begin; i < p->end; i += MT2) {
            const int M = p->end - i < MT2 ? (int)(p->end - i) : MT2, H = M <= 2 && rows > 8 ? 2 : 1;
            for (int h0 = 0; h0 < 2 && 8 * h0 < rows; h0 += H) {
                __m256 acc[MT2];
                (H == 2 ? BOTH_HALVES_OF : HALF_ROWS_OF)[M - 1](p, p->w + it * ib, i, h0, whole, acc);
                for (int u = 0; u < M * H; u++) {
                    const int h = h0 + u / M;
                    float* y = p->y + (i + u % M) * p->ldy + o0 + 8 * h;
                    if (rows >= 8 * h + 8) {
                        _mm256_storeu_ps(y, acc[u]);
                        continue;
                    }
                    float lanes[8];  // the matrix's last item: only its rows
                    _mm256_storeu_ps(lanes, acc[u]);
                    for (int r = 0; r < rows - 8 * h; r++) y[r] = lanes[r];
                }
            }
        }
    }
    free(whole);
}

// A gated MLP's pass (the VNNI road's gated_items): gate's and up's items of the same 16 outputs, MT2 rows
// and one half at a time through both, only act(gate) · up stored
static void gated_items(void* ctx, uint32_t begin, uint32_t end) {
    const GatedPass* q = ctx;
    const Product* part[2];
    int64_t ib[2];
    uint8_t* whole[2];
    gated_parts(q, SPLIT_HALVES, part, ib, whole);
    for (int64_t it = begin; it < end; it++) {
        const int64_t o0 = it * LANES;
        for (int j = 0; j < 2; j++)
            if (whole[j]) split_halves(&part[j]->l, part[j]->w + it * ib[j], part[j]->groups, whole[j]);
        for (int64_t i = q->gate.begin; i < q->gate.end; i += MT2) {
            const int M = q->gate.end - i < MT2 ? (int)(q->gate.end - i) : MT2;
            for (int h = 0; h < 2; h++) {
                __m256 acc[2][MT2];
                for (int j = 0; j < 2; j++) HALF_ROWS_OF[M - 1](part[j], part[j]->w + it * ib[j], i, h, whole[j], acc[j]);
                for (int k = 0; k < M; k++)
                    store8(q->gate.y + (i + k) * q->gate.ldy + o0 + 8 * h, gated8((v8f)acc[0][k], (v8f)acc[1][k], q->act));
            }
        }
    }
    free(whole[0]), free(whole[1]);
}
#else
// Any machine: the same integers, and the same float operations per lane in the same order.
static void items(void* ctx, uint32_t begin, uint32_t end) {
    const Product* p = ctx;
    const int nib = p->l.nibble, words = (nib ? p->l.S / 2 : p->l.S) / 4;
    const int64_t ib = item_bytes(&p->l, p->groups), hb = head_bytes(&p->l), cb = code_bytes(&p->l);
    for (int64_t it = begin; it < end; it++) {
        const int64_t o0 = it * LANES;
        const int rows = p->out - o0 >= LANES ? LANES : (int)(p->out - o0);
        for (int64_t i = p->begin; i < p->end; i++)
            for (int r = 0; r < rows; r++) {
                float acc = 0;
                for (int64_t b = 0; b < p->groups; b++) {
                    int gi;
                    const uint8_t* head = group_head(&p->l, p->w + it * ib, b, &gi);
                    const uint8_t* g = head + hb + gi * cb;
                    const XBlock* x = p->xq + b * p->m + i;
                    const int8_t* xq = (const int8_t*)x->q;
                    uint32_t plane = 0;  // 5-bit codes: bit j, code j's fifth
                    if (nib == 2) memcpy(&plane, g + 256 + 4 * r, sizeof plane);
                    int32_t isum = 0;
                    for (int k = 0; k < words; k++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t c = g[64 * k + 4 * r + t];
                            const int j = 4 * k + t;
                            if (nib)
                                isum += ((c & 15) | (plane >> j & 1) << 4) * xq[j] +
                                        ((c >> 4) | (plane >> (16 + j) & 1) << 4) * xq[16 + j];
                            else isum += (p->l.less_off ? (int8_t)c + p->l.off : c) * xq[j];  // (unsigned again)
                        }
                    float min;
                    const float scale = lane_scale(&p->l, head, gi, r, &min);
                    acc = fmaf((float)(isum + x->neg_off), scale * x->dx, acc);
                    if (p->l.has_min) acc = fmaf(min, x->dx_sum, acc);
                }
                p->y[i * p->ldy + o0 + r] = acc;
            }
    }
}
#endif

// Whether the rows go 16 at a time on AMX tiles: built for them, the OS's leave, and 16 rows or more
static int tiles_for(int64_t m) {
#if defined(AMX)
    return m >= AMX_M && amx_available();
#else
    (void)m;
    return 0;
#endif
}

// Whether a pass goes in bfloat16 on the tiles: built for them, the OS's leave, a prompt's rows, and K in
// whole 32s (every format's rows are)
static int bf16_for(int64_t m, int64_t n) {
#if defined(BF16)
    return m >= BF16_ROWS && n % 32 == 0 && amx_available();
#else
    (void)m, (void)n;
    return 0;
#endif
}

int kvlab_i8_bf16_pass(int64_t m, int64_t n) { return bf16_for(m, n); }

// The rows from which a gated MLP's gate, up and activation go as one pass on vpdpbusd or AVX2
// (kvlab_i8_gated): a prompt's, whose gate and up (20 MB a layer each for Qwen2.5-Coder-0.5B at 512 rows)
// would be written out and read back; a decode step's MLP is the decode backend's, its 16 rows' sums in
// cache anyway
#define GATED_ROWS 64

int kvlab_i8_bf16_rows(void) {
#if defined(BF16)
    return amx_available() ? BF16_ROWS : 0;
#else
    return 0;
#endif
}

// Rows a pass over the matrix takes: a prompt's activations (64 bytes a sub-block and row) in passes
// that stay in L2 (about 768 KB) while every item reads them, rather than each item streaming them all
// from L3 (Qwen2.5's 4,864-wide down projection at 512 rows: 5 MB a pass). A multiple of 16 rows.
static int64_t pass_rows(int64_t m, int64_t groups) {
    const int64_t fit = (768 << 10) / (groups * (int64_t)sizeof(XBlock)) / 16 * 16;
    return fit < 16 ? 16 : fit > m ? m : fit;
}

// Items a thread claims at a time. Up to 15 rows and for prompts: CHUNK one-row items' work, so that
// at more rows, where an item costs m times as much, the last claims do not leave one thread computing
// while the other waits. A decode step's batch of 16-64 rows: half a thread's share, so that each
// thread streams long runs of the matrix. Claimed one by one, neighbouring items alternated between
// the cores, and each core's prefetching (the hardware's, and AMX_AHEAD into the next item) fetched
// the other's items too: SmolLM2's products at 16 rows took 12.5 -> 8.0 ms a step, Qwen2.5-Coder-0.5B's
// 40.7 -> 35.4, SmolLM2's at 64 rows 33.1 -> 30.1 (2 threads, weights from memory). At 4-8 rows and
// for prompts it did not pay. Below 16 rows a long matrix (more than 16 · threads · CHUNK items: an LM
// head, Qwen2.5's gate and up) is claimed in runs of a 16th of a thread's share, as quant.c's exact
// products are: on a Zen 4 VM, 2 threads, one row, Qwen2.5's 151,936-row Q8_0 head 5.0-5.5 -> 4.7-4.9 ms
// and a Q5_0 one 3.9-4.1 -> 3.1-3.2 ms (alternated builds), its whole int8 step 15.9-17.4 -> 14.1-14.9 ms.
// An item's numbers do not depend on who computes it.
#define RUNS_FROM 16  // the rows from which ...
#define RUNS_TO 64    // ... to which items are claimed in runs
static uint32_t claim_size(int64_t m, uint32_t items, int threads) {
    if (m >= RUNS_FROM && m <= RUNS_TO) {
        const uint32_t run = items / (2 * (uint32_t)(threads > 1 ? threads : 1));
        return run > 1 ? run : 1;
    }
    const uint32_t chunk = m >= CHUNK ? 1 : (uint32_t)(CHUNK / m);
    const uint32_t share = items / (16 * (uint32_t)(threads > 1 ? threads : 1));  // a long matrix's runs
    return m < RUNS_FROM && share > chunk ? share : chunk;
}

// y[i, o] (row stride ldy), i < m, o < out: x [m, n] float32 quantized per sub-block, times the
// interleaved matrix w (kvlab_i8_repack). Returns 0; −1 for a format without an interleaved form or n
// not whole sub-blocks; −2 when no memory was left for the quantized activations.
int kvlab_i8_matmul(int fmt, const uint8_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t ldy,
                    int64_t out, int threads) {
    Layout l;
    if (layout(fmt, &l) || n % l.S || (out + LANES - 1) / LANES >= UINT32_MAX) return -1;
    const int64_t groups = n / l.S;
    if (bf16_for(m, n)) {
        const int fmts[1] = {fmt};
        const uint8_t* ws[1] = {w};
        const int64_t outs[1] = {out};
        return kvlab_i8_matmul_parts(1, fmts, ws, outs, x, y, m, n, ldy, threads);
    }
    XBlock* xq = aligned_alloc(64, m * groups * sizeof(XBlock));
    if (!xq) return -2;
    quantize_rows(x, m, n, &l, xq, threads);
    const int64_t step = pass_rows(m, groups);
    for (int64_t i = 0; i < m; i += step) {
        Product p = {l, w, xq, y, m, groups, ldy, out, tiles_for(m), i,
                     m - i < step ? m : i + step};
        const uint32_t num_items = (uint32_t)((out + LANES - 1) / LANES);
        kvlab_pool_run(items, &p, num_items, claim_size(m, num_items, threads), threads);
    }
    free(xq);
    return 0;
}

// y[i, o] (row stride ldy), i < m, o < out: x [m, n] float32 times the interleaved matrix w, exactly (the
// bfloat16 tiles' road above: within float32's rounding of the reference, a row's bits its own). Returns
// 0; −1 where this build or machine has no bfloat16 tiles, for a format without an interleaved form or n
// not whole sub-blocks; −2 when no memory was left for the activations' parts.
int kvlab_t16_matmul(int fmt, const uint8_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t ldy,
                     int64_t out, int threads) {
    return kvlab_t16_matmul_parts(1, &fmt, &w, &out, x, y, m, n, ldy, threads);
}

// The parts of a fused matrix (q, k and v; gate and up) over the same x, exactly on the tiles: one
// split of x (per sub-block size) and one pool job for them all; part j (format fmt[j], out[j] rows at
// w[j]) writes the columns after the parts before it. Returns as kvlab_t16_matmul.
int kvlab_t16_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* out, const float* x,
                           float* y, int64_t m, int64_t n, int64_t ldy, int threads) {
    Layout l[KVLAB_MAX_JOBS];
    if (num < 1 || num > KVLAB_MAX_JOBS) return -1;
    for (int j = 0; j < num; j++)
        if (layout(fmt[j], &l[j]) || n % l[j].S || (out[j] + LANES - 1) / LANES >= UINT32_MAX) return -1;
#if defined(BF16)
    if (amx_available()) return exact_parts(num, l, w, out, x, y, m, n, ldy, threads);
#endif
    (void)w, (void)x, (void)y, (void)m, (void)ldy, (void)threads;
    return -1;
}

int kvlab_t16_available(void) {
#if defined(BF16)
    return amx_available();
#else
    return 0;
#endif
}

// The parts of a fused matrix (q, k and v; gate and up) over the same x as one pool job: part j
// (format fmt[j], out[j] rows at w[j]) writes the columns after the parts before it. x is quantized
// once for all the parts that quantize it alike (the same sub-block size and code offset). Returns as
// kvlab_i8_matmul.
int kvlab_i8_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* out, const float* x,
                          float* y, int64_t m, int64_t n, int64_t ldy, int threads) {
    Layout l[KVLAB_MAX_JOBS];
    XBlock* xq[KVLAB_MAX_JOBS] = {0};
    Product p[KVLAB_MAX_JOBS];
    PoolJobs jobs = {.num = num};
    int status = 0;
    if (num > KVLAB_MAX_JOBS) return -1;
    for (int j = 0; j < num; j++)
        if (layout(fmt[j], &l[j]) || n % l[j].S || (out[j] + LANES - 1) / LANES >= UINT32_MAX) return -1;
#if defined(BF16)
    if (bf16_for(m, n)) {
        uint16_t* xb = bf16_activations(x, m, n, threads);
        if (!xb) return -2;
        Bf16Product b[KVLAB_MAX_JOBS];
        int failed = 0;
        int64_t column = 0;
        for (int j = 0; j < num; j++) {
            const int64_t pairs = (out[j] + 2 * LANES - 1) / (2 * LANES), per = pairs_per_run(pairs, n, threads);
            b[j] = (Bf16Product){l[j], w[j], xb, y + column, m, n, n / l[j].S, ldy, out[j], per, &failed};
            jobs.task[j] = bf16_runs_of_pairs, jobs.ctx[j] = &b[j];
            jobs.first[j + 1] = jobs.first[j] + (uint32_t)((pairs + per - 1) / per);
            column += out[j];
        }
        kvlab_pool_run_jobs(&jobs, 1, threads);
        free(xb);
        return failed ? -2 : 0;
    }
#endif
    int64_t column = 0;
    for (int j = 0; j < num; j++) {
        const int64_t groups = n / l[j].S;
        const XBlock* shared = NULL;
        for (int i = 0; i < j && !shared; i++)
            if (l[i].S == l[j].S && l[i].off == l[j].off) shared = p[i].xq;
        if (!shared) {
            if (!(xq[j] = aligned_alloc(64, m * groups * sizeof(XBlock)))) {
                status = -2;
                break;
            }
            quantize_rows(x, m, n, &l[j], xq[j], threads);
            shared = xq[j];
        }
        p[j] = (Product){l[j], w[j], shared, y + column, m, groups, ldy, out[j], tiles_for(m), 0, m};
        jobs.task[j] = items, jobs.ctx[j] = &p[j];
        jobs.first[j + 1] = jobs.first[j] + (uint32_t)((out[j] + LANES - 1) / LANES);
        column += out[j];
    }
    if (!status) kvlab_pool_run_jobs(&jobs, claim_size(m, jobs.first[num], threads), threads);
    for (int j = 0; j < num; j++) free(xq[j]);
    return status;
}

// A gated MLP's activations y [m, I] (row stride ldy) = act(x · gateᵀ) · (x · upᵀ), gate and up interleaved
// matrices of I rows each (formats fmt[0], fmt[1]; act an ACT_* id), in one pass: of bfloat16 tiles where
// the pass is theirs (bf16_for), else of vpdpbusd or AVX2 (gated_items) from GATED_ROWS rows. Each pair
// of items is a gate item and the up item of the same 16 outputs, so the activation is taken as the sums
// leave the tiles or registers (gated8), where two products write gate and up out for gated_act to read back
// (Qwen2.5-Coder-0.5B's 512-row passes: 20 MB a layer each way). The same bits as those products and
// gated_act. Returns 0; −1 where the pass is neither's (fewer rows than kvlab_i8_gated_rows(), the int8
// tiles'), I is not whole items or a format has no interleaved form (the caller multiplies, then
// activates); −2 without memory.
int kvlab_i8_gated(const int* fmt, const uint8_t* const* w, int64_t I, const float* x, float* y, int64_t m, int64_t n,
                   int64_t ldy, int act, int threads) {
    Layout l[2];
    const int least = kvlab_i8_gated_rows();
    if (!least || m < least || I % LANES || act < 0 || act >= ACTIVATIONS || I / LANES >= UINT32_MAX) return -1;
    for (int j = 0; j < 2; j++)
        if (layout(fmt[j], &l[j]) || n % l[j].S) return -1;
#if defined(BF16)
    if (bf16_for(m, n)) {
        uint16_t* xb = bf16_activations(x, m, n, threads);
        if (!xb) return -2;
        int failed = 0;
        const int64_t pairs = I / LANES, per = pairs_per_run(pairs, n, threads);
        Bf16Product b = {l[0], w[0], xb, y, m, n, n / l[0].S, ldy, I, per, &failed, w[1], l[1], act};
        kvlab_pool_run(bf16_runs_of_pairs, &b, (uint32_t)((pairs + per - 1) / per), 1, threads);
        free(xb);
        return failed ? -2 : 0;
    }
#endif
#if defined(VNNI) || defined(DOT2)
    if (tiles_for(m)) return -1;  // the two products' rows on the int8 tiles
    // x quantized as the two products quantize it: once where gate's and up's sub-blocks agree
    const int64_t groups[2] = {n / l[0].S, n / l[1].S};
    const int shared = l[0].S == l[1].S && l[0].off == l[1].off;
    XBlock* xq[2] = {aligned_alloc(64, m * groups[0] * sizeof(XBlock)),
                     shared ? NULL : aligned_alloc(64, m * groups[1] * sizeof(XBlock))};
    if (!xq[0] || (!shared && !xq[1])) {
        free(xq[0]), free(xq[1]);
        return -2;
    }
    for (int j = 0; j < 2 - shared; j++) quantize_rows(x, m, n, &l[j], xq[j], threads);
    const uint32_t pairs = (uint32_t)(I / LANES);
    GatedPass g = {{l[0], w[0], xq[0], y, m, groups[0], ldy, I, 0, 0, m},
                   {l[1], w[1], shared ? xq[0] : xq[1], NULL, m, groups[1], ldy, I, 0, 0, m}, act};
    kvlab_pool_run(gated_items, &g, pairs, claim_size(m, pairs, threads), threads);
    free(xq[0]), free(xq[1]);
    return 0;
#else
    (void)w, (void)x, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

int kvlab_i8_gated_rows(void) {
#if defined(BF16)
    if (amx_available()) return BF16_ROWS;
#endif
#if defined(VNNI) || defined(DOT2)
    return tiles_for(GATED_ROWS) ? 0 : GATED_ROWS;  // the int8 tiles' passes: left to the two products
#else
    return 0;
#endif
}
