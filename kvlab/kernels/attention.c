// Attention of a decode step over the paged cache, straight from its stored codes (step.h's Step).

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "step.h"
#include "pool.h"

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
    const float* qkv;  // [B, (H + 2 Hkv) · D], q and k rotated (RoPE; and Hadamard with `rotate_k`)
    float* out;        // [B, H · D]
    float* scores;     // [B · H, max_keys]
    float* partial;    // [B, chunks, H, D + 2]: per chunk and head, its max score, sum of weights, Σ weight · v
    int64_t chunks;    // chunks per sequence (num_chunks(max_keys))
    int64_t parts;     // items per (sequence, chunk): 1 (every kv head), or kv heads × parts of each group
    int64_t per_part;  // query heads an item takes of a group (all of it with parts = 1)
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

static inline __attribute__((always_inline)) v8f dot8_wide(const float* q, const float* const k[8], int64_t D) {
    v8f half[8];
#if WIDE
    v16f acc[8] = {{0}};
    for (int64_t i = 0; i < D; i += 16) {
        const v16f x = load16(q + i);
        for (int r = 0; r < 8; r++) acc[r] += x * load16(k[r] + i);
    }
    for (int r = 0; r < 8; r++)
        half[r] = __builtin_shufflevector(acc[r], acc[r], 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(acc[r], acc[r], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    for (int r0 = 0; r0 < 8; r0 += 4) {
        v8f lo[4] = {{0}}, hi[4] = {{0}};
        for (int64_t i = 0; i < D; i += 16) {
            const v8f xl = load8(q + i), xh = load8(q + i + 8);
            for (int r = 0; r < 4; r++) lo[r] += xl * load8(k[r0 + r] + i), hi[r] += xh * load8(k[r0 + r] + i + 8);
        }
        for (int r = 0; r < 4; r++) half[r0 + r] = lo[r] + hi[r];
    }
#endif
    return sums8(half);
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
    const int64_t qkv_row = (H + 2 * Hkv) * D, bs = S->block_size, stride = S->max_keys;
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
// ---- rows read where they lie: float32, bfloat16 and float16 caches (AVX-512) --------------------------
//
// `attend`'s numbers in its order, head by head and lane by lane (the same bits), for the formats whose
// rows are a float's bits or widen to them exactly, D 64, 128 or 256. `attend` decodes every key's row
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
#define ROW_HEADS 3  // query heads whose scores share each loaded key (8 keys: 24 sums in registers)

// 16 values of a stored row from value i, as floats: exact in all three formats
static inline __attribute__((always_inline)) v16f row16(const void* row, int64_t i, const int FMT) {
    if (FMT == KV_F32) return load16((const float*)row + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i));
    if (FMT == KV_BF16) return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return (v16f)_mm512_cvtph_ps(h);
}

// The scores of NH query heads (q: the first's, D apart) with 8 keys (rows): dot8_wide's operations for
// each head, into s (the first head's scores at the first key; heads `stride` apart), times scale
static inline __attribute__((always_inline)) void row_scores(const float* q, int64_t D, const char* const rows[8],
                                                             float scale, float* s, int64_t stride, const int NH,
                                                             const int FMT) {
    v16f acc[ROW_HEADS][8];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < 8; j++) acc[h][j] = (v16f){0};
    for (int64_t i = 0; i < D; i += 16) {
        v16f x[ROW_HEADS];
        for (int h = 0; h < NH; h++) x[h] = load16(q + h * D + i);
        for (int j = 0; j < 8; j++) {
            const v16f k = row16(rows[j], i, FMT);
            for (int h = 0; h < NH; h++) acc[h][j] += x[h] * k;
        }
    }
    for (int h = 0; h < NH; h++) {
        v8f half[8];
        for (int j = 0; j < 8; j++)
            half[j] = __builtin_shufflevector(acc[h][j], acc[h][j], 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(acc[h][j], acc[h][j], 8, 9, 10, 11, 12, 13, 14, 15);
        store8(s + h * stride, sums8(half) * scale);
    }
}

// Σ_t p_t · v_t over keys lo .. hi − 1 of kv head g for NH query heads (weights p: the first head's row,
// heads `stride` apart), D = 16·DV, into o (the first head's sum; heads D + 2 apart): one FMA per key and
// lane in key order from 0, as attend's groups of 8 and its one-at-a-time tail make them
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
        if (AHEAD && t + PREFETCH_AHEAD < hi) prefetch_vector(s, vecs[t + PREFETCH_AHEAD - lo] + g, D);
        for (int i = 0; i < DV; i++) {
            const v16f v = row16(row, 16 * i, FMT);
            for (int h = 0; h < NH; h++) acc[h][i] += p[h * stride + t] * v;
        }
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
        const int64_t n = h1 - h < 16 / DV ? h1 - h : 16 / DV;
        float* o = partial + h * (D + 2) + 2;
        const float* p = scores + h * stride;
        if (n >= 4 && DV == 4) row_values(p, stride, v, vecs, lo, hi, g, o, 4, 4, FMT, AHEAD);
        else if (n == 3 && DV == 4) row_values(p, stride, v, vecs, lo, hi, g, o, 3, 4, FMT, AHEAD);
        else if (n >= 2 && DV <= 8) row_values(p, stride, v, vecs, lo, hi, g, o, 2, DV, FMT, AHEAD);
        else row_values(p, stride, v, vecs, lo, hi, g, o, 1, DV, FMT, AHEAD);
        h += DV == 4 ? (n >= 4 ? 4 : n >= 3 ? 3 : n >= 2 ? 2 : 1) : DV == 8 ? (n >= 2 ? 2 : 1) : 1;
    }
}

static inline __attribute__((always_inline)) void attend_rows(void* ctx, uint32_t begin, uint32_t end, const int AHEAD,
                                                              const int FMT, const int DV) {
    const Attend* a = ctx;
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = 16 * DV, H = L->heads, Hkv = L->kv_heads, group = H / Hkv, cb = code_bytes(FMT, D);
    const int64_t qkv_row = (H + 2 * Hkv) * D, bs = S->block_size, stride = S->max_keys;
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
        // scores, kv head by kv head: eight keys at a time, then one by one (attend's dot, on the row as floats)
        const char* K = S->k.codes;
        for (int64_t g = r.g0; g < r.g1; g++) {
            const int64_t h0 = heads_lo(&r, g, group), h1 = heads_hi(&r, g, group);
            int64_t t = lo;
            for (; t + 8 <= hi; t += 8) {
                const char* rows[8];
                for (int j = 0; j < 8; j++) rows[j] = K + (vecs[t - lo + j] + g) * cb;
                if (AHEAD)
                    for (int j = 0; j < 8; j++) {
                        if (t + 8 + PREFETCH_AHEAD + j < hi) prefetch_vector(&S->k, vecs[t + 8 + PREFETCH_AHEAD + j - lo] + g, D);
                        prefetch_vector_to(&S->v, vecs[t - lo + j] + g, D, 1);  // on to L2 for the values' pass
                    }
                for (int64_t h = h0; h < h1;) {
                    float* s = scores + h * stride + t;
                    const float* qh = q + h * D;
                    if (h1 - h >= 3) row_scores(qh, D, rows, scale, s, stride, 3, FMT), h += 3;
                    else if (h1 - h == 2) row_scores(qh, D, rows, scale, s, stride, 2, FMT), h += 2;
                    else row_scores(qh, D, rows, scale, s, stride, 1, FMT), h += 1;
                }
            }
            for (; t < hi; t++) {
                const char* row = K + (vecs[t - lo] + g) * cb;
                for (int64_t i = 0; i < D; i += 16) store16(kbuf + i, row16(row, i, FMT));
                for (int64_t h = h0; h < h1; h++) scores[h * stride + t] = dot(q + h * D, kbuf, D) * scale;
            }
        }
        chunk_weights(&r, group, scores, stride, partial, D, lo, hi, 0);  // the sums of values: row_values's
        for (int64_t g = r.g0; g < r.g1; g++)
            row_values_heads(a, scores, partial, vecs, lo, hi, g, heads_lo(&r, g, group), heads_hi(&r, g, group), DV, FMT,
                             AHEAD);  // fmt: skip
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

static int rows_allowed = 1;  // kvlab_attention_rows: off, every step goes through attend (the tests' reference)

// The form of attend_rows for this step, or NULL where attend takes it (another format or head size,
// keys and values in different formats)
static PoolTask rows_form(const Layer* L, const Step* S, int ahead) {
    static const PoolTask forms[3][2][3] = {
        {{rows_f32_64, rows_f32_128, rows_f32_256}, {rows_f32_64_ahead, rows_f32_128_ahead, rows_f32_256_ahead}},
        {{rows_bf16_64, rows_bf16_128, rows_bf16_256}, {rows_bf16_64_ahead, rows_bf16_128_ahead, rows_bf16_256_ahead}},
        {{rows_f16_64, rows_f16_128, rows_f16_256}, {rows_f16_64_ahead, rows_f16_128_ahead, rows_f16_256_ahead}}};
    const int f = S->k.fmt == KV_F32 ? 0 : S->k.fmt == KV_BF16 ? 1 : S->k.fmt == KV_F16 ? 2 : -1;
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

void kvlab_decode_attention(const Layer* L, const Step* S, const float* qkv, float* out, float* scores, float* partial,
                            int threads) {
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
    Attend a = {L, S, qkv, out, scores, partial, chunks, parts, per_part};
    const int ahead = (S->batch > 1 || AHEAD_ONE) && S->batch * S->max_keys >= AHEAD_KEYS;
    const PoolTask rows = rows_form(L, S, ahead);
    kvlab_pool_run(rows ? rows : ahead ? attend_ahead : attend_in_cache, &a, (uint32_t)(pairs * parts), 1, threads);
    merge(&a);
}

// ---- a prompt's attention: T new queries per sequence over its L keys (the modules' passes) ------------
//
// What PyTorch's scaled_dot_product_attention computes for the model's prompt passes (kernels/gemv.py's
// prompt_attention), on the kernels' pool rather than on PyTorch's OpenMP threads: its CPU kernel took
// ~1.2 ms a layer for 8 sequences of 64 tokens (SmolLM2's 9 heads), and its threads spun on the cores
// between the pool's products. One work item per (sequence, query head, QUERY_TILE queries); each query
// alone: its scores over the keys its causal position allows (and the mask, where there is one), their
// softmax from the largest, the weighted sum of the values. A query's numbers depend on nothing but its
// own row, its keys and values: the same bits in any batch, at any thread count.
#define QUERY_TILE 32

typedef struct {
    const float *q, *k, *v;
    const uint8_t* mask;  // [b, t, L] bool, True where a query may look (b and t at their strides), or NULL
    float* out;           // [B, H, T, D]
    int64_t B, H, Hkv, T, L, D;
    int64_t qs[3], ks[3], vs[3], ms[2];  // strides (floats; bytes for the mask) of b, head, token / b, t
    float scale;
    int failed;  // a thread found no memory for its scores
} Prompt;

// o [D] (zeros) += Σ_j w[j] · v_j over keys j < n (row j at V + j · stride), the sums in registers: two
// sets, even and odd keys, added at the end (one set waited on its own FMAs; o summed in memory key after
// key waited on its stores: 45% of the kernel's time on one store). NV vectors of VW lanes make a row.
#if defined(__AVX512F__)
typedef v16f vrow;
#define VW 16
#else
typedef v8f vrow;
#define VW 8
#endif
static inline vrow load_row(const float* p) {
    vrow v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) void weighted_rows(float* o, const float* w, const float* V, int64_t stride,
                                                                int64_t n, const int NV) {
    vrow a[16], b[16];
    for (int i = 0; i < NV; i++) a[i] = b[i] = (vrow){0};
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        const float* v0 = V + j * stride;
        const float* v1 = v0 + stride;
        for (int i = 0; i < NV; i++) a[i] += w[j] * load_row(v0 + i * VW), b[i] += w[j + 1] * load_row(v1 + i * VW);
    }
    if (j < n)
        for (int i = 0; i < NV; i++) a[i] += w[j] * load_row(V + j * stride + i * VW);
    for (int i = 0; i < NV; i++) {
        const vrow sum = a[i] + b[i];
        memcpy(o + i * VW, &sum, sizeof sum);
    }
}

static void weighted_values(float* o, const float* w, const float* V, int64_t stride, int64_t n, int64_t D) {
    if (D == 4 * VW) weighted_rows(o, w, V, stride, n, 4);
    else if (D == 8 * VW) weighted_rows(o, w, V, stride, n, 8);
    else if (D == 16 * VW) weighted_rows(o, w, V, stride, n, 16);
    else
        for (int64_t j = 0; j < n; j++) axpy(o, w[j], V + j * stride, D);
}

static void prompt_items(void* ctx, uint32_t begin, uint32_t end) {
    const Prompt* p = ctx;
    const int64_t D = p->D, L = p->L, T = p->T, tiles = (T + QUERY_TILE - 1) / QUERY_TILE, group = p->H / p->Hkv;
    float* s = malloc((size_t)(L + 8) * sizeof(float));
    if (!s) {
        ((Prompt*)ctx)->failed = 1;
        return;
    }
    for (uint32_t item = begin; item < end; item++) {
        const int64_t tile = item % tiles, h = item / tiles % p->H, b = item / tiles / p->H, g = h / group;
        const float* K = p->k + b * p->ks[0] + g * p->ks[1];
        const float* V = p->v + b * p->vs[0] + g * p->vs[1];
        const int64_t t1 = (tile + 1) * QUERY_TILE < T ? (tile + 1) * QUERY_TILE : T;
        for (int64_t t = tile * QUERY_TILE; t < t1; t++) {
            const float* q = p->q + b * p->qs[0] + h * p->qs[1] + t * p->qs[2];
            const uint8_t* m = p->mask ? p->mask + b * p->ms[0] + t * p->ms[1] : NULL;
            float* o = p->out + ((b * p->H + h) * T + t) * D;
            // keys 0 .. n − 1: the masks are causal (no query sees a key after its own position)
            const int64_t n = t + L - T + 1 < L ? t + L - T + 1 : L;
            int64_t j = 0;
            if (D % 8 == 0)
                for (; j + 8 <= n; j += 8) {
                    const float* keys[8];
                    for (int r = 0; r < 8; r++) keys[r] = K + (j + r) * p->ks[2];
                    store8(s + j, (D % 16 ? dot8(q, keys, D) : dot8_wide(q, keys, D)) * p->scale);
                }
            for (; j < n; j++) s[j] = dot(q, K + j * p->ks[2], D) * p->scale;
            if (m)
                for (j = 0; j < n; j++) s[j] = m[j] ? s[j] : -INFINITY;
            const float top = max_of(s, 0, n);
            memset(o, 0, D * sizeof(float));
            if (top == -INFINITY) continue;  // no key to look at: zeros (SDPA would give NaN)
            const float sum = softmax_weights(s, 0, n, top);
            weighted_values(o, s, V, p->vs[2], n, D);
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
    }
    free(s);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// The same attention a tile at a time (AVX-512): one work item per (sequence, kv head, PROMPT_TILE
// queries), for every query head of the kv head's group. The keys go 16 at a time: the block's rows
// transposed once (16 keys a register, value by value), so that a query's 16 scores are D FMAs of its
// values broadcast, with no horizontal sum, four queries sharing each load; then the block's weights
// into a running softmax (its largest score so far, the sum of weights, the weighted sum rescaled when
// the largest grows: FlashAttention's) and the values added in registers. A query takes every block up
// to its own position, in order, whatever else its tile holds: its numbers are its own, as above, but
// not the per-query form's (another order of sums). SmolLM2's shape (9 heads, 3 kv heads, D 64), one
// prompt of 1,024 tokens, 2 threads, on the Zen 5 VM: 6.6-7.3 ms a layer against the per-query form's 11.0
// and PyTorch's SDPA's 10.3-11.3 (8 prompts of 64: 0.33-0.38 ms against 0.94 and 0.55-0.64); its whole
// 1,024-token prompt pass (int8 activations, bfloat16 KV) 752 -> 603 ms against SDPA.
#define PROMPT_TILE 64
#define SCORED 8  // (query, head) pairs scored together: each loaded value of the keys serves 8 FMAs

static inline __m512 exp16(__m512 x) {  // exp8 on both halves: 0 below NEGLIGIBLE (and for -inf)
    const v8f lo = exp8((v8f)_mm512_castps512_ps256(x)), hi = exp8((v8f)_mm512_extractf32x8_ps(x, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512((__m256)lo), (__m256)hi, 1);
}

typedef struct {
    float m, l;  // the largest score so far, the sum of weights relative to it
} Running;

// r[k] (row k of a 16 x 16 block) -> r[c] (column c): pairs of rows interleaved, then fours within each
// 128-bit lane, then the lanes themselves (64 shuffles, not 256 scalar loads and stores)
static inline __attribute__((always_inline)) void transpose16(__m512* r) {
    __m512 t[16], u[16];
    for (int m = 0; m < 16; m += 2) t[m] = _mm512_unpacklo_ps(r[m], r[m + 1]), t[m + 1] = _mm512_unpackhi_ps(r[m], r[m + 1]);
    for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: column 4L + k of rows i .. i + 3
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
        const __m512 w0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), w1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        const __m512 w2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), w3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_f32x4(w0, w2, 0x88), r[4 + k] = _mm512_shuffle_f32x4(w1, w3, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(w0, w2, 0xDD), r[12 + k] = _mm512_shuffle_f32x4(w1, w3, 0xDD);
    }
}

// o [16·DV] (with running r) += the block's weights w [16] (scores s, -inf where not allowed) times its
// value rows: the running softmax's step for one query head
static inline __attribute__((always_inline)) void block_values(float* o, Running* r, __m512 s, const float* V,
                                                               int64_t vstride, int nk, const int DV) {
    const float top = _mm512_reduce_max_ps(s);
    if (top == -INFINITY) return;  // no key of the block for this query
    const float m = top > r->m ? top : r->m;
    const __m512 w = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m)));
    __m512 acc[16];
    if (m > r->m && r->m != -INFINITY) {  // the sums so far, rescaled to the new largest score
        const float c = expf(r->m - m);
        r->l *= c;
        for (int i = 0; i < DV; i++) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * i), _mm512_set1_ps(c));
    } else {
        for (int i = 0; i < DV; i++) acc[i] = _mm512_loadu_ps(o + 16 * i);
    }
    r->m = m;
    r->l += _mm512_reduce_add_ps(w);
    float wj[16];
    _mm512_storeu_ps(wj, w);
    __m512 odd[16];  // odd keys' sums apart: two chains of FMAs per register of o, not one
    for (int i = 0; i < DV; i++) odd[i] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 2 <= nk; j += 2) {
        const __m512 b0 = _mm512_set1_ps(wj[j]), b1 = _mm512_set1_ps(wj[j + 1]);
        for (int i = 0; i < DV; i++) {
            acc[i] = _mm512_fmadd_ps(b0, _mm512_loadu_ps(V + j * vstride + 16 * i), acc[i]);
            odd[i] = _mm512_fmadd_ps(b1, _mm512_loadu_ps(V + (j + 1) * vstride + 16 * i), odd[i]);
        }
    }
    if (j < nk)
        for (int i = 0; i < DV; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(wj[j]), _mm512_loadu_ps(V + j * vstride + 16 * i), acc[i]);
    for (int i = 0; i < DV; i++) _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(acc[i], odd[i]));
}

static inline __attribute__((always_inline)) void prompt_tile(const Prompt* p, uint32_t item, float* kt, Running* run,
                                                              const int DV) {
    const int64_t D = 16 * DV, L = p->L, T = p->T, tiles = (T + PROMPT_TILE - 1) / PROMPT_TILE;
    const int64_t group = p->H / p->Hkv, tile = item % tiles, g = item / tiles % p->Hkv, b = item / tiles / p->Hkv;
    const int64_t t0 = tile * PROMPT_TILE, t1 = t0 + PROMPT_TILE < T ? t0 + PROMPT_TILE : T, h0 = g * group;
    const float* K = p->k + b * p->ks[0] + g * p->ks[1];
    const float* V = p->v + b * p->vs[0] + g * p->vs[1];
    const int64_t rows = (t1 - t0) * group;  // (query, head) pairs: pair i is query t0 + i / group, head h0 + i % group
    for (int64_t i = 0; i < rows; i++) {
        run[i] = (Running){-INFINITY, 0.0f};
        memset(p->out + ((b * p->H + h0 + i % group) * T + t0 + i / group) * D, 0, D * sizeof(float));
    }
    const int64_t nmax = t1 - 1 + L - T + 1 < L ? t1 - 1 + L - T + 1 : L;  // keys the tile's last query sees
    const __m512 scale = _mm512_set1_ps(p->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < nmax; j0 += 16) {
        const int nk = nmax - j0 < 16 ? (int)(nmax - j0) : 16;
        if (nk == 16) {  // kt [D][16]: value d of the block's keys
            for (int64_t c0 = 0; c0 < D; c0 += 16) {
                __m512 r[16];
                for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(K + (j0 + k) * p->ks[2] + c0);
                transpose16(r);
                for (int c = 0; c < 16; c++) _mm512_store_ps(kt + (c0 + c) * 16, r[c]);
            }
        } else {
            for (int64_t d = 0; d < D; d++)
                for (int r = 0; r < 16; r++) kt[d * 16 + r] = r < nk ? K[(j0 + r) * p->ks[2] + d] : 0.0f;
        }
        for (int64_t i = 0; i < rows;) {
            // up to SCORED (query, head) pairs whose queries see this block, their scores together
            int64_t pair[SCORED];
            int n = 0;
            for (; i < rows && n < SCORED; i++) {
                const int64_t t = t0 + i / group;
                if (j0 <= t + L - T) pair[n++] = i;
            }
            if (!n) break;
            const float* qr[SCORED];
            for (int k = 0; k < SCORED; k++) {
                const int64_t i2 = pair[k < n ? k : 0], t = t0 + i2 / group, h = h0 + i2 % group;
                qr[k] = p->q + b * p->qs[0] + h * p->qs[1] + t * p->qs[2];
            }
            __m512 s[SCORED];
            for (int k = 0; k < SCORED; k++) s[k] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m512 kd = _mm512_load_ps(kt + d * 16);
                for (int k = 0; k < SCORED; k++) s[k] = _mm512_fmadd_ps(_mm512_set1_ps(qr[k][d]), kd, s[k]);
            }
            for (int k = 0; k < n; k++) {
                const int64_t t = t0 + pair[k] / group, h = h0 + pair[k] % group, last = t + L - T - j0;
                __mmask16 allowed = last >= 15 ? 0xFFFF : (__mmask16)((1u << (last + 1)) - 1);
                allowed &= nk == 16 ? 0xFFFF : (__mmask16)((1u << nk) - 1);
                if (p->mask) {
                    const uint8_t* m = p->mask + b * p->ms[0] + t * p->ms[1] + j0;
                    uint8_t bytes[16] = {0};
                    memcpy(bytes, m, nk);
                    allowed &= _mm_test_epi8_mask(_mm_loadu_si128((const __m128i*)bytes), _mm_set1_epi8((char)0xFF));
                }
                const __m512 sc = _mm512_mask_mov_ps(minus_inf, allowed, _mm512_mul_ps(s[k], scale));
                block_values(p->out + ((b * p->H + h) * T + t) * D, run + pair[k], sc, V + j0 * p->vs[2], p->vs[2], nk, DV);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        float* o = p->out + ((b * p->H + h0 + i % group) * T + t0 + i / group) * D;
        const float inv = run[i].l > 0.0f ? 1.0f / run[i].l : 0.0f;  // no key to look at: zeros
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

static void prompt_tiles(void* ctx, uint32_t begin, uint32_t end) {
    const Prompt* p = ctx;
    float* kt = aligned_alloc(64, (size_t)p->D * 16 * sizeof(float));
    Running* run = malloc((size_t)PROMPT_TILE * (p->H / p->Hkv) * sizeof(Running));
    if (!kt || !run) {
        ((Prompt*)ctx)->failed = 1;
    } else {
        for (uint32_t item = begin; item < end; item++) {
            if (p->D == 64) prompt_tile(p, item, kt, run, 4);
            else if (p->D == 128) prompt_tile(p, item, kt, run, 8);
            else prompt_tile(p, item, kt, run, 16);
        }
    }
    free(kt);
    free(run);
}
#define PROMPT_TILES 1
#endif

// out [B, H, T, D] (contiguous) = softmax(q · kᵀ · scale) · v per query head, q
// [B, H, T, D], k and v [B, Hkv, L, D] (each the last dimension contiguous, the rest at the strides given,
// in floats), the T queries the sequences' last: query t at position L − T + t sees keys up to its own,
// and of those only where mask [b, t, key] (bytes, at strides ms; NULL: no mask) is nonzero. 0, or -1
// where there was no memory for the scores (out then incomplete).
int kvlab_prompt_attention(const float* q, const int64_t* qs, const float* k, const int64_t* ks, const float* v,
                            const int64_t* vs, const uint8_t* mask, const int64_t* ms, float* out, int64_t B, int64_t H,
                            int64_t Hkv, int64_t T, int64_t L, int64_t D, float scale, int threads) {
    Prompt p = {q, k, v, mask, out, B, H, Hkv, T, L, D, {qs[0], qs[1], qs[2]}, {ks[0], ks[1], ks[2]},
                {vs[0], vs[1], vs[2]}, {mask ? ms[0] : 0, mask ? ms[1] : 0}, scale, 0};
#if defined(PROMPT_TILES)
    if (D == 64 || D == 128 || D == 256) {
        kvlab_pool_run(prompt_tiles, &p, (uint32_t)(B * Hkv * ((T + PROMPT_TILE - 1) / PROMPT_TILE)), 1, threads);
        return p.failed ? -1 : 0;
    }
#endif
    const int64_t items = B * H * ((T + QUERY_TILE - 1) / QUERY_TILE);
    kvlab_pool_run(prompt_items, &p, (uint32_t)items, 1, threads);
    return p.failed ? -1 : 0;
}
