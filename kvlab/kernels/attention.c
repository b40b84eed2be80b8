// Attention of a decode step over the paged cache, straight from its stored codes (step.h's Step).

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "pool.h"
#include "step.h"

// ---- attention: one work item per (sequence, chunk of keys, kv heads) -----------------------
//
// A kv head's group of query heads share its keys and values: each cached row is decoded once and
// used by every query head of the item that reads it. Where the (sequence, chunk) pairs alone give each
// thread a few items, an item takes all the kv heads: the cache keeps a token's kv heads side by side,
// so the item reads each token's row whole, in order, and the prefetcher's lines are all used. Where
// they are too few (one sequence, a short context), an item takes one kv head's group of query heads,
// or a part of it (each head's numbers are its own, so any split gives the same bits). Per chunk:
// scores first (q · k · scale for each key), then each head's softmax over the chunk (relative to the
// chunk's largest score), then the weighted sum of the values. `merge` then combines the chunks of
// each head, exactly as one softmax over all keys.

typedef struct {
    const Layer* layer;
    const Step* step;
    const float* qkv;  // [B, q_row]: each row's H query heads first, rotated (RoPE; and Hadamard with `rotate_k`)
    int64_t q_row;     // floats from one row of qkv to the next: (H + 2 Hkv) · D in the decode step
    float* out;        // [B, H · D]
    float* scores;     // [B · H, max_keys]
    float* partial;    // [B, chunks, H, D + 2]: per chunk and head, its max score, sum of weights, Σ weight · v
    int64_t chunks;    // chunks per sequence (num_chunks(max_keys))
    int64_t parts;     // items per (sequence, chunk): 1 (every kv head), or kv heads × parts of each group
    int64_t per_part;  // query heads an item takes of a group (all of it with parts = 1)
} Attend;


// An item's kv heads g0 .. g1 − 1 and query heads h0 .. h1 − 1: of kv head g, those of its group among them
typedef struct {
    int64_t g0, g1, h0, h1;
} Heads;

static inline int64_t heads_lo(const Heads* r, int64_t g, int64_t group) { return g * group > r->h0 ? g * group : r->h0; }
static inline int64_t heads_hi(const Heads* r, int64_t g, int64_t group) {
    return (g + 1) * group < r->h1 ? (g + 1) * group : r->h1;
}

// the rows of kv heads g0 .. g1 − 1 of cache slot `slot`, on their way to L1
static inline void prefetch_heads(const KVStore* s, int64_t slot, int64_t Hkv, const Heads* r, int64_t D) {
    for (int64_t g = r->g0; g < r->g1; g++) prefetch_vector(s, slot * Hkv + g, D);
}

// Each of an item's query heads' weights over keys lo .. hi − 1 of its chunk (scores: head h's row at
// h · stride), relative to the chunk's largest score; into its partial: that score and the weights' sum,
// and (clear) zeros for the weighted sum of its values
static inline void chunk_weights(const Heads* r, int64_t group, float* scores, int64_t stride, float* partial,
                                 int64_t D, int64_t lo, int64_t hi, int clear) {
    for (int64_t g = r->g0; g < r->g1; g++)
        for (int64_t h = heads_lo(r, g, group); h < heads_hi(r, g, group); h++) {
            float* s = scores + h * stride;
            const float top = max_of(s, lo, hi);
            float* part = partial + h * (D + 2);
            part[1] = softmax_weights(s, lo, hi, top);
            part[0] = top;
            if (clear) memset(part + 2, 0, D * sizeof(float));
        }
}

// The cache slots of keys t .. t + 7, and the rows of the eight after PREFETCH_AHEAD more on their way
// (those before ahead_hi)
static inline void eight_slots(const KVStore* s, const int64_t* table, int64_t t, int64_t ahead_hi, int64_t bs,
                               int64_t Hkv, const Heads* r, int64_t D, int64_t* slots) {
    for (int j = 0; j < 8; j++) slots[j] = slot_of(table, t + j, bs);
    if (t + 8 + PREFETCH_AHEAD < ahead_hi)
        for (int j = 0; j < 8; j++) prefetch_heads(s, slot_of(table, t + 8 + PREFETCH_AHEAD + j, bs), Hkv, r, D);
}

// AHEAD: the rows of keys (and values) further on are asked for while these are read. Two compiled
// forms (attend_ahead, attend_in_cache), chosen per step in kvlab_decode_attention: in a step of several
// sequences and many keys, whose cache comes from memory, asking ahead pays (SmolLM2's shape, 30 layers,
// 2 threads: 16 sequences over 256 keys 13.4-13.8 -> 9.3-10.5 ms, 64 over 256 58.4 -> 43.2). Measured in
// whole decode steps (the products between layers push the cache out; SmolLM2 int8, float32 KV), the
// step with it took 0.96x at 16 sequences over 32 keys, 0.91-0.96x over 64, 0.85-0.93x over 128 and
// 0.92x at 4 over 256, and 1.02x at 4 over 64: so from 512 keys in all. One sequence was 8-13% slower
// with it over 64 keys, even over 512, and over 1,024 0.94-0.96x with float32 keys but 1.05x with
// 16-bit ones: one sequence keeps the form without it there (AHEAD_ONE).
static inline __attribute__((always_inline)) void attend(void* ctx, uint32_t begin, uint32_t end, const int AHEAD) {
    const Attend* a = ctx;
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = L->head_dim, H = L->heads, Hkv = L->kv_heads, group = H / Hkv;
    const int64_t qkv_row = a->q_row, bs = S->block_size, stride = S->max_keys;
    const float scale = L->qk_scale;
    float kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM], kbuf8[8 * MAX_HEAD_DIM];
    const int64_t split = a->parts > 1 ? a->parts / Hkv : 1;  // parts of a group
    for (uint32_t item = begin; item < end; item++) {
        const int64_t part = item % a->parts, seq_chunk = item / a->parts;
        const int64_t b = seq_chunk / a->chunks, c = seq_chunk % a->chunks, n = S->num_keys[b], first = S->first_key[b];
        Heads r = {0, Hkv, 0, H};  // every kv head and query head
        if (a->parts > 1) {  // kv head g, per_part query heads of its group from h0
            const int64_t g = part / split, h0 = g * group + part % split * a->per_part;
            r = (Heads){g, g + 1, h0, h0 + a->per_part};  // heads_hi stops at the group's end
        }
        const int64_t start = c * CHUNK_KEYS, hi = start + CHUNK_KEYS < n ? start + CHUNK_KEYS : n;
        if (start >= n || hi <= first) continue;  // past this sequence's keys, or before its window (merge skips it)
        const int64_t lo = start > first ? start : first;  // a window may begin inside the chunk
        const int64_t ahead_hi = AHEAD ? hi : 0;  // keys up to which rows are asked for ahead
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
                eight_slots(&S->k, table, t, ahead_hi, bs, Hkv, &r, D, slots);
                // the eight keys' value rows on their way to L2 while the keys are scored, so that the
                // values' pass over the chunk finds them there, not in memory
                for (int j = 0; ahead_hi && j < 8; j++)
                    for (int64_t g = r.g0; g < r.g1; g++) prefetch_vector_to(&S->v, slots[j] * Hkv + g, D, 1);
                for (int64_t g = r.g0; g < r.g1; g++) {
                    const float* k[8];
                    for (int j = 0; j < 8; j++) k[j] = decode_vector(&S->k, slots[j] * Hkv + g, D, kbuf8 + j * D);
                    for (int64_t h = heads_lo(&r, g, group); h < heads_hi(&r, g, group); h++)
                        store8(scores + h * stride + t, (D % 16 ? dot8(q + h * D, k, D) : dot8_wide(q + h * D, k, D)) * scale);
                }
            }
        for (; t < hi; t++) {
            const int64_t slot = slot_of(table, t, bs);
            if (t + PREFETCH_AHEAD < ahead_hi) prefetch_heads(&S->k, slot_of(table, t + PREFETCH_AHEAD, bs), Hkv, &r, D);
            for (int64_t g = r.g0; g < r.g1; g++) {
                const float* k = decode_vector(&S->k, slot * Hkv + g, D, kbuf);
                for (int64_t h = heads_lo(&r, g, group); h < heads_hi(&r, g, group); h++)
                    scores[h * stride + t] = dot(q + h * D, k, D) * scale;
            }
        }
        chunk_weights(&r, group, scores, stride, partial, D, lo, hi, 1);
        // the weighted sum of the values: every value decoded once, added to each head of its group;
        // eight values at a time (each head's output read and written once per eight), then one by one
        t = lo;
        if (D % 8 == 0)
            for (; t + 8 <= hi; t += 8) {
                int64_t slots[8];
                eight_slots(&S->v, table, t, ahead_hi, bs, Hkv, &r, D, slots);
                for (int64_t g = r.g0; g < r.g1; g++) {
                    const float* v[8];
                    for (int j = 0; j < 8; j++) v[j] = decode_vector(&S->v, slots[j] * Hkv + g, D, kbuf8 + j * D);
                    for (int64_t h = heads_lo(&r, g, group); h < heads_hi(&r, g, group); h++) {
                        const float* p = scores + h * stride + t;
                        float* o = partial + h * (D + 2) + 2;
                        int64_t i = 0;  // 16 lanes (AVX-512), then 8: the same operations per value either way
                        for (; WIDE && i + 16 <= D; i += 16) {
                            v16f acc = load16(o + i);
                            for (int j = 0; j < 8; j++) acc += p[j] * load16(v[j] + i);
                            store16(o + i, acc);
                        }
                        v8f pj[8];  // the weights broadcast once for the whole row, not once per 8 lanes
                        for (int j = 0; j < 8; j++) pj[j] = (v8f){p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j]};
                        for (; i + 8 <= D; i += 8) {
                            v8f acc = load8(o + i);
                            for (int j = 0; j < 8; j++) acc += pj[j] * load8(v[j] + i);
                            store8(o + i, acc);
                        }
                    }
                }
            }
        for (; t < hi; t++) {
            const int64_t slot = slot_of(table, t, bs);
            if (t + PREFETCH_AHEAD < ahead_hi) prefetch_heads(&S->v, slot_of(table, t + PREFETCH_AHEAD, bs), Hkv, &r, D);
            for (int64_t g = r.g0; g < r.g1; g++) {
                const float* v = decode_vector(&S->v, slot * Hkv + g, D, vbuf);
                for (int64_t h = heads_lo(&r, g, group); h < heads_hi(&r, g, group); h++)
                    axpy(partial + h * (D + 2) + 2, scores[h * stride + t], v, D);
            }
        }
    }
}

#if WIDE
// ---- rows read where they lie: every format of cache (AVX-512) -----------------------------------------
//
// `attend`'s numbers in its order, head by head and lane by lane (the same bits), D 64, 128 or 256, keys
// and values in one format: float rows widen exactly, 8- and 4-bit codes are decoded in registers to
// decode_vector's values (code × scale, rounded once). `attend` decodes every key's row
// into a buffer and reads it again for each query head of its group, its values' sums are loaded and
// stored every 8 keys, and each key's slot costs a division in each pass. Here the rows are widened
// in registers as they are loaded, each 16 values of a key loaded once for up to ROW_HEADS query heads;
// the values are summed kv head by kv head in registers across the whole chunk; and the chunk's slots
// come from its block table once, without a division per key. SmolLM2's shape (9 heads, 3 kv heads,
// D 64), 30 layers' caches, 2 threads, on an AMD EPYC Zen 5 VM (a C harness): bfloat16 rows, 16
// sequences over 80 keys 2.13 -> 0.77 ms, over 320 6.15 -> 3.80, 64 over 320 26.3 -> 15.5, one over
// 1,000 0.95 -> 0.51; float32 rows, which are read at about 33 GB/s either way, 1.63 -> 1.37, 7.16 ->
// 7.31, 30.1 -> 29.2, 1.71 -> 1.41. Asking for rows ahead (one kv head's row at a time, PREFETCH_AHEAD
// keys on) still paid: 16 over 320, bfloat16 5.1 against 8.6 ms without it, float32 7.5 against 8.1.
// The coded formats came later (an Intel Xeon VM, SmolLM2 int8, 2 threads, whole decode steps with the
// two forms alternated in one process): 16 sequences after 64-token prompts q8_0 23.6 -> 22.1 ms, fp8
// 28.9 -> 25.5, q4_0 27.0 -> 24.8; after 500, q8_0 48.3 -> 36.5, fp8 54.7 -> 38.0; one after 1,000,
// q8_0 10.8 -> 10.0, fp8 11.4 -> 10.0 (a contended hour: the products ran slow).
#define ROW_HEADS 3  // query heads whose scores share each loaded key (8 keys: 24 sums in registers)

// 16 values of a stored row from value i, as floats: decode_vector's values (kv_codec.h), the same IEEE
// operations on 16 lanes. sc: the row's scales (q8_0, q4_0: D / 32 fp16; fp8_e4m3: one float32), unread
// for the 16- and 32-bit formats, whose rows widen exactly
static inline __attribute__((always_inline)) v16f row16(const void* row, const void* sc, int64_t i, const int FMT) {
    if (FMT == KV_F32) return load16((const float*)row + i);
    if (FMT == KV_Q8_0) {
        const __m128i codes = _mm_loadu_si128((const __m128i*)((const int8_t*)row + i));
        return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)) * (float)((const _Float16*)sc)[i / QK];
    }
    if (FMT == KV_Q4_0) {  // values 0-15 of a block in its 16 bytes' low nibbles, 16-31 in their high ones
        const __m128i bytes = _mm_loadu_si128((const __m128i*)((const uint8_t*)row + i / QK * (QK / 2)));
        const __m128i q = _mm_and_si128(i % QK ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
        return ((v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)) - 8.0f) * (float)((const _Float16*)sc)[i / QK];
    }
    if (FMT == KV_FP8) {  // fp8x8_over_256's fp16 bits, 16 at a time, times 256 · scale
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)((const uint8_t*)row + i)));
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
        const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
        return (v16f)_mm512_cvtph_ps(_mm256_or_si256(sign, rest)) * (*(const float*)sc * 256.0f);
    }
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i));
    if (FMT == KV_BF16) return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return (v16f)_mm512_cvtph_ps(h);
}

// Where vector `vec`'s scales are (row16's sc): NULL for the formats without any
static inline __attribute__((always_inline)) const void* row_scales(const KVStore* s, int64_t vec, int64_t D,
                                                                    const int FMT) {
    if (FMT == KV_Q8_0 || FMT == KV_Q4_0) return (const _Float16*)s->scales + vec * (D / QK);
    if (FMT == KV_FP8) return (const float*)s->scales + vec;
    return NULL;
}

// The scores of NH query heads (q: the first's, D apart) with 8 keys (rows): dot8_wide's operations for
// each head, into s (the first head's scores at the first key; heads `stride` apart), times scale
static inline __attribute__((always_inline)) void row_scores(const float* q, int64_t D, const char* const rows[8],
                                                             const void* const sc[8], float scale, float* s,
                                                             int64_t stride, const int NH, const int FMT) {
    v16f acc[ROW_HEADS][8];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < 8; j++) acc[h][j] = (v16f){0};
    for (int64_t i = 0; i < D; i += 16) {
        v16f x[ROW_HEADS];
        for (int h = 0; h < NH; h++) x[h] = load16(q + h * D + i);
        for (int j = 0; j < 8; j++) {
            const v16f k = row16(rows[j], sc[j], i, FMT);
            for (int h = 0; h < NH; h++) acc[h][j] += x[h] * k;
        }
    }
    for (int h = 0; h < NH; h++) store8(s + h * stride, sums8_wide(acc[h]) * scale);
}

// Σ_t p_t · v_t over keys lo .. hi − 1 of kv head g for NH query heads (weights p: the first head's row,
// heads `stride` apart), D = 16·DV, into o (the first head's sum; heads D + 2 apart): one FMA per key and
// lane in key order from 0, as attend's groups of 8 and its one-at-a-time tail make them. bfloat16 rows
// are widened 32 values a load: the even ones' bits shifted up, the odd ones' masked (one instruction
// per 16 values, where a widening load and a shift took two), their sums apart and interleaved at the
// end; each value's own sum is the same sequence of FMAs, so the same bits. With sums8_wide for the
// scores, on an Intel Xeon VM (Emerald Rapids, 2 vCPUs; a C harness, SmolLM2's shape, bfloat16 rows in
// L2, the fastest of 15 × 20 calls, three runs alternated with the old code): one thread, 16 sequences
// over 256 keys 240 -> 224 us a layer, over 96 83 -> 76, one over 1,024 43 -> 37; two threads, 64 over
// 320 907 -> 842; float32 rows unchanged.
static inline __attribute__((always_inline)) void row_values(const float* p, int64_t stride, const KVStore* s,
                                                             const int64_t* vecs, int64_t lo, int64_t hi, int64_t g,
                                                             float* o, const int NH, const int DV, const int FMT,
                                                             const int AHEAD) {
    const int64_t D = 16 * DV, cb = code_bytes(FMT, D);
    const char* codes = s->codes;
    v16f acc[4][16];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < DV; i++) acc[h][i] = (v16f){0};
    for (int64_t t = lo; t < hi; t++) {
        const char* row = codes + (vecs[t - lo] + g) * cb;
        const void* sc = row_scales(s, vecs[t - lo] + g, D, FMT);
        if (AHEAD && t + PREFETCH_AHEAD < hi) prefetch_vector(s, vecs[t + PREFETCH_AHEAD - lo] + g, D);
        if (FMT == KV_BF16) {  // acc[h][i] (i even): values 16i, 16i + 2, ...; acc[h][i + 1]: 16i + 1, 16i + 3, ...
            for (int i = 0; i < DV; i += 2) {
                const __m512i w = _mm512_loadu_si512((const void*)(row + 32 * i));
                const v16f even = (v16f)_mm512_slli_epi32(w, 16);
                const v16f odd = (v16f)_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u));
                for (int h = 0; h < NH; h++) acc[h][i] += p[h * stride + t] * even, acc[h][i + 1] += p[h * stride + t] * odd;
            }
        } else {
            for (int i = 0; i < DV; i++) {
                const v16f v = row16(row, sc, 16 * i, FMT);
                for (int h = 0; h < NH; h++) acc[h][i] += p[h * stride + t] * v;
            }
        }
    }
    if (FMT == KV_BF16) {  // the even and odd values' sums interleaved back into order
        const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < DV; i += 2) {
                const __m512 e = (__m512)acc[h][i], d = (__m512)acc[h][i + 1];
                store16(o + h * (D + 2) + 16 * i, (v16f)_mm512_permutex2var_ps(e, first, d));
                store16(o + h * (D + 2) + 16 * (i + 1), (v16f)_mm512_permutex2var_ps(e, second, d));
            }
        return;
    }
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < DV; i++) store16(o + h * (D + 2) + 16 * i, acc[h][i]);
}

// row_values for query heads h0 .. h1 − 1 of kv head g, as many at a time as 16 registers of sums hold
static inline __attribute__((always_inline)) void row_values_heads(const Attend* a, float* scores, float* partial,
                                                                   const int64_t* vecs, int64_t lo, int64_t hi,
                                                                   int64_t g, int64_t h0, int64_t h1, const int DV,
                                                                   const int FMT, const int AHEAD) {
    const int64_t stride = a->step->max_keys, D = 16 * DV;
    const KVStore* v = &a->step->v;
    for (int64_t h = h0; h < h1;) {
        const int64_t n = h1 - h < 16 / DV ? h1 - h : 16 / DV;  // 1 to 4 heads (D 64), 1 or 2 (128), 1 (256)
        float* o = partial + h * (D + 2) + 2;
        const float* p = scores + h * stride;
        if (n == 4) row_values(p, stride, v, vecs, lo, hi, g, o, 4, 4, FMT, AHEAD);
        else if (n == 3) row_values(p, stride, v, vecs, lo, hi, g, o, 3, 4, FMT, AHEAD);
        else if (n == 2) row_values(p, stride, v, vecs, lo, hi, g, o, 2, DV, FMT, AHEAD);
        else row_values(p, stride, v, vecs, lo, hi, g, o, 1, DV, FMT, AHEAD);
        h += n;
    }
}

static inline __attribute__((always_inline)) void attend_rows(void* ctx, uint32_t begin, uint32_t end, const int AHEAD,
                                                              const int FMT, const int DV) {
    const Attend* a = ctx;
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = 16 * DV, H = L->heads, Hkv = L->kv_heads, group = H / Hkv, cb = code_bytes(FMT, D);
    const int64_t qkv_row = a->q_row, bs = S->block_size, stride = S->max_keys;
    const float scale = L->qk_scale;
    const int64_t split = a->parts > 1 ? a->parts / Hkv : 1;
    float kbuf[MAX_HEAD_DIM];
    int64_t vecs[CHUNK_KEYS];  // each key's first vector in the cache (its slot · Hkv)
    for (uint32_t item = begin; item < end; item++) {
        const int64_t part = item % a->parts, seq_chunk = item / a->parts;
        const int64_t b = seq_chunk / a->chunks, c = seq_chunk % a->chunks, n = S->num_keys[b], first = S->first_key[b];
        Heads r = {0, Hkv, 0, H};
        if (a->parts > 1) {
            const int64_t g = part / split, h0 = g * group + part % split * a->per_part;
            r = (Heads){g, g + 1, h0, h0 + a->per_part};
        }
        const int64_t start = c * CHUNK_KEYS, hi = start + CHUNK_KEYS < n ? start + CHUNK_KEYS : n;
        if (start >= n || hi <= first) continue;
        const int64_t lo = start > first ? start : first;
        const int64_t* table = S->block_tables + b * S->table_stride;
        const float* q = a->qkv + b * qkv_row;
        float* scores = a->scores + b * H * stride;
        float* partial = a->partial + (b * a->chunks + c) * H * (D + 2);
        for (int64_t t = lo, blk = lo / bs, at = lo % bs; t < hi; t++) {  // through the table, block by block
            vecs[t - lo] = (table[blk] * bs + at) * Hkv;
            if (++at == bs) at = 0, blk++;
        }
        // kv head by kv head: its scores, eight keys at a time, then one by one (attend's dot, on the row as
        // floats); its query heads' weights; the sums of its values, while the next kv head's keys come to
        // L2. Each head's numbers are the same operations as when every head's scores came first; the
        // scores' pass no longer fetches both a head's keys and its values from memory while the values'
        // pass fetches nothing. On the AMD EPYC Zen 4 VM (a C harness, bfloat16 rows, 2 threads, the kv
        // heads' order alternated 8 times): SmolLM2's shape, 30 layers, 16 sequences over 470 keys 10.36 ->
        // 8.88 ms (0.99x without the prefetch), over 100 0.81x, 64 over 300 0.80x; Qwen2.5-0.5B's (14 heads,
        // 2 kv heads, 24 layers) 16 over 470 0.93x, over 100 1.00x, one over 1,000 0.85x.
        const char* K = S->k.codes;
        for (int64_t g = r.g0; g < r.g1; g++) {
            const int64_t h0 = heads_lo(&r, g, group), h1 = heads_hi(&r, g, group);
            int64_t t = lo;
            for (; t + 8 <= hi; t += 8) {
                const char* rows[8];
                const void* sc[8];
                for (int j = 0; j < 8; j++)
                    rows[j] = K + (vecs[t - lo + j] + g) * cb, sc[j] = row_scales(&S->k, vecs[t - lo + j] + g, D, FMT);
                if (AHEAD)
                    for (int j = 0; j < 8; j++) {
                        if (t + 8 + PREFETCH_AHEAD + j < hi) prefetch_vector(&S->k, vecs[t + 8 + PREFETCH_AHEAD + j - lo] + g, D);
                        prefetch_vector_to(&S->v, vecs[t - lo + j] + g, D, 1);  // on to L2 for the values' pass
                    }
                for (int64_t h = h0; h < h1;) {
                    float* s = scores + h * stride + t;
                    const float* qh = q + h * D;
                    if (h1 - h >= 3) row_scores(qh, D, rows, sc, scale, s, stride, 3, FMT), h += 3;
                    else if (h1 - h == 2) row_scores(qh, D, rows, sc, scale, s, stride, 2, FMT), h += 2;
                    else row_scores(qh, D, rows, sc, scale, s, stride, 1, FMT), h += 1;
                }
            }
            for (; t < hi; t++) {
                const char* row = K + (vecs[t - lo] + g) * cb;
                const void* sc = row_scales(&S->k, vecs[t - lo] + g, D, FMT);
                for (int64_t i = 0; i < D; i += 16) store16(kbuf + i, row16(row, sc, i, FMT));
                for (int64_t h = h0; h < h1; h++) scores[h * stride + t] = dot(q + h * D, kbuf, D) * scale;
            }
            const Heads rg = {g, g + 1, h0, h1};
            chunk_weights(&rg, group, scores, stride, partial, D, lo, hi, 0);  // the sums of values: row_values's
            if (AHEAD && g + 1 < r.g1)  // the next kv head's keys on their way to L2 while these values are summed
                for (int64_t t = lo; t < hi; t++) prefetch_vector_to(&S->k, vecs[t - lo] + g + 1, D, 1);
            row_values_heads(a, scores, partial, vecs, lo, hi, g, h0, h1, DV, FMT, AHEAD);
        }
    }
}

#define ROWS_FORM(NAME, AHEAD, FMT, DV) \
    static void NAME(void* ctx, uint32_t begin, uint32_t end) { attend_rows(ctx, begin, end, AHEAD, FMT, DV); }
#define ROWS_FORMS(FMT, TAG)                            \
    ROWS_FORM(rows_##TAG##_64, 0, FMT, 4)               \
    ROWS_FORM(rows_##TAG##_128, 0, FMT, 8)              \
    ROWS_FORM(rows_##TAG##_256, 0, FMT, 16)             \
    ROWS_FORM(rows_##TAG##_64_ahead, 1, FMT, 4)         \
    ROWS_FORM(rows_##TAG##_128_ahead, 1, FMT, 8)        \
    ROWS_FORM(rows_##TAG##_256_ahead, 1, FMT, 16)
ROWS_FORMS(KV_F32, f32)
ROWS_FORMS(KV_BF16, bf16)
ROWS_FORMS(KV_F16, f16)
ROWS_FORMS(KV_Q8_0, q8_0)
ROWS_FORMS(KV_Q4_0, q4_0)
ROWS_FORMS(KV_FP8, fp8)

static int rows_allowed = 1;  // kvlab_attention_rows: off, every step goes through attend (the tests' reference)

// The form of attend_rows for this step, or NULL where attend takes it (another format or head size,
// keys and values in different formats)
static PoolTask rows_form(const Layer* L, const Step* S, int ahead) {
#define FORMS_OF(TAG) \
    {{rows_##TAG##_64, rows_##TAG##_128, rows_##TAG##_256}, {rows_##TAG##_64_ahead, rows_##TAG##_128_ahead, rows_##TAG##_256_ahead}}
    static const PoolTask forms[KV_FORMATS][2][3] = {
        [KV_F32] = FORMS_OF(f32),   [KV_Q8_0] = FORMS_OF(q8_0), [KV_Q4_0] = FORMS_OF(q4_0),
        [KV_FP8] = FORMS_OF(fp8),   [KV_BF16] = FORMS_OF(bf16), [KV_F16] = FORMS_OF(f16)};
#undef FORMS_OF
    const int f = S->k.fmt >= 0 && S->k.fmt < KV_FORMATS ? S->k.fmt : -1;
    const int64_t D = L->head_dim;
    const int d = D == 64 ? 0 : D == 128 ? 1 : D == 256 ? 2 : -1;
    if (!rows_allowed || f < 0 || d < 0 || S->v.fmt != S->k.fmt || L->heads % L->kv_heads) return NULL;
    return forms[f][ahead][d];
}

int kvlab_attention_rows(int on) {
    const int was = rows_allowed;
    rows_allowed = on;
    return was;
}
#else
static PoolTask rows_form(const Layer* L, const Step* S, int ahead) { return NULL; }

int kvlab_attention_rows(int on) { return -1; }  // no such form in this build
#endif

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
            const float sink = L->sinks ? L->sinks[h] : -INFINITY;  // gpt-oss: one more logit, its value 0
            float top = sink, sum = 0.0f;
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
            if (L->sinks) sum += expf(sink - top);
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
            if (S->rotate_v) kvlab_kv_hadamard(o, D);
        }
    }
}

static void attend_ahead(void* ctx, uint32_t begin, uint32_t end) { attend(ctx, begin, end, 1); }
static void attend_in_cache(void* ctx, uint32_t begin, uint32_t end) { attend(ctx, begin, end, 0); }

#define AHEAD_KEYS 512  // a step's sequences × keys from which it asks for rows ahead (attend)
// One sequence asks ahead as well where a vector holds 8 floats (AVX2): on an AMD EPYC Zen 3 VM, 2 threads,
// a one-sequence SmolLM2 step (int8) after 520 keys 9.1-9.5 -> 7.8-8.8 ms, after 600 9.4-10.5 -> 8.5-8.9,
// after 1,500 10.0-11.4 -> 9.7-10.2; Qwen2.5-Coder-0.5B's after 1,500 26.8-28.5 -> 25.6-27.0; exact
// SmolLM2 after 960 equal. (On the AVX-512 machine of the rule above, one sequence was slower with it.)
#if defined(__AVX512F__)
#define AHEAD_ONE 0
#else
#define AHEAD_ONE 1
#endif

static void attention_of(const Layer* L, const Step* S, const float* qkv, int64_t q_row, float* out, float* scores,
                         float* partial, int threads) {
    const int64_t chunks = num_chunks(S->max_keys), group = L->heads / L->kv_heads, pairs = S->batch * chunks;
    // every kv head in one item where the (sequence, chunk) pairs give each thread a few; else each kv
    // head's group of query heads split until the items give every thread two, or one head each
    int64_t parts = 1, per_part = group;
    if (pairs < 4 * threads) {
        int64_t split = 1;
        while (split < group && pairs * L->kv_heads * split < 2 * threads) split++;
        per_part = (group + split - 1) / split;
        split = (group + per_part - 1) / per_part;  // no part left empty
        parts = L->kv_heads * split;
    }
    Attend a = {L, S, qkv, q_row, out, scores, partial, chunks, parts, per_part};
    const int ahead = (S->batch > 1 || AHEAD_ONE) && S->batch * S->max_keys >= AHEAD_KEYS;
    const PoolTask rows = rows_form(L, S, ahead);
    kvlab_pool_run(rows ? rows : ahead ? attend_ahead : attend_in_cache, &a, (uint32_t)(pairs * parts), 1, threads);
    merge(&a);
}

void kvlab_decode_attention(const Layer* L, const Step* S, const float* qkv, float* out, float* scores, float* partial,
                            int threads) {
    attention_of(L, S, qkv, (L->heads + 2 * L->kv_heads) * L->head_dim, out, scores, partial, threads);
}

int64_t kvlab_paged_attention_scratch_floats(int64_t batch, int64_t heads, int64_t head_dim, int64_t max_keys) {
    return batch * heads * (head_dim + max_keys + num_chunks(max_keys) * (head_dim + 2));
}

// The same attention for B one-token rows outside the decode step: a mixed pass's decode rows (the
// modules' path, kvlab/kv/paged.py), whose new keys and values are already in the cache. q: each row's H
// query heads after RoPE, q_row floats apart; out [B, H · D]; scratch: kvlab_paged_attention_scratch_floats.
// Where the cache stores keys rotated, q is rotated into that basis first (in the scratch), as the step does.
void kvlab_paged_attention(const Layer* L, const Step* S, const float* q, int64_t q_row, float* out, float* scratch,
                           int threads) {
    const int64_t B = S->batch, H = L->heads, D = L->head_dim;
    float* rotated = scratch;
    float* scores = rotated + B * H * D;
    float* partial = scores + B * H * S->max_keys;
    if (S->rotate_k) {
        for (int64_t b = 0; b < B; b++) {
            memcpy(rotated + b * H * D, q + b * q_row, H * D * sizeof(float));
            kvlab_hadamard_f32(rotated + b * H * D, H, D);
        }
        q = rotated;
        q_row = H * D;
    }
    attention_of(L, S, q, q_row, out, scores, partial, threads);
}
