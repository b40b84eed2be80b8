// A prompt pass's attention on the kernels' pool: two forms, one query at a time, and (AVX-512) a tile of
// queries at a time.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "pool.h"

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
    float* out;           // [B, H, T, D] at the strides os
    int64_t B, H, Hkv, T, L, D;
    int64_t qs[3], ks[3], vs[3], os[3], ms[2];  // strides (floats; bytes for the mask) of b, head, token / b, t
    float scale;
    int failed;  // a thread found no memory for its scores
} Prompt;

// the output row of query t of head h of sequence b
static inline float* out_row(const Prompt* p, int64_t b, int64_t h, int64_t t) {
    return p->out + b * p->os[0] + h * p->os[1] + t * p->os[2];
}

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
            float* o = out_row(p, b, h, t);
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
// queries), for every query head of the kv head's group, the (query, head) pairs CHUNK_PAIRS at a time.
// The keys go in chunks of up to CHUNK_KEYS, each block of 16 transposed once (16 keys a register, value
// by value), so that a pair's 16 scores are D FMAs of its query's values broadcast, with no horizontal
// sum: SCORED pairs share each loaded value, two blocks share each broadcast. A chunk's scores go into
// rows of S, then each row's softmax at once (one largest score, one sum), then the weighted values with
// PV pairs sharing each value row loaded, their sums in registers from the chunk's first key to its last.
// Between chunks a running softmax (FlashAttention's: the largest score so far, the sum of weights, the
// output rescaled when the largest grows) — a prompt that sees 256 keys or fewer never needs it. A pair
// takes every key up to its own position, in order, whatever else its tile holds: its numbers are its
// own, as above, but not the per-query form's (another order of sums).
//
// SmolLM2's shape (9 heads, 3 kv heads, D 64), 2 threads, an Intel Xeon VM, the two forms alternated: 8
// prompts of 64 tokens 0.78-1.05 ms a layer with 16-key blocks and the running softmax after each,
// 0.42-0.61 ms this way (Qwen2.5-Coder-0.5B's 14 and 2 heads: 1.10-1.26 -> 0.64-0.84; one 512-token prompt
// 2.8-4.3 -> 1.8-2.3); the 512-token prompt pass of a burst of 16 × 64 tokens (int8 activations, bfloat16
// KV) spent 22-26 ms of its 160-220 in this attention, now 14.
#define PROMPT_TILE 64
#define SCORED 8         // (query, head) pairs scored together: each loaded value of the keys serves 8 FMAs
#define CHUNK_KEYS 256   // keys whose scores a pair's row of S holds at once
#define CHUNK_PAIRS 24   // (query, head) pairs whose rows S holds

static inline __m512 exp16(__m512 x) {  // exp8 on both halves: 0 below NEGLIGIBLE (and for -inf)
    const v8f lo = exp8((v8f)_mm512_castps512_ps256(x)), hi = exp8((v8f)_mm512_extractf32x8_ps(x, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512((__m256)lo), (__m256)hi, 1);
}

typedef struct {
    float m, l;  // the largest score so far, the sum of weights relative to it
} Running;

// What a running softmax's output so far keeps when its largest score goes from `old` to `top`
static inline float running_keep(float old, float top) {
    return old == -INFINITY ? 0.0f : old == top ? 1.0f : expf(old - top);
}

// Which of 16 keys a query may look at: the first `left` of them (all from 16), and of those, with a mask
// (bytes from m, NULL: none), those whose byte is nonzero
static inline __mmask16 keys16(const uint8_t* m, int64_t left) {
    __mmask16 allowed = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    if (m) {
        uint8_t bytes[16] = {0};
        memcpy(bytes, m, left >= 16 ? 16 : (size_t)left);
        allowed &= _mm_test_epi8_mask(_mm_loadu_si128((const __m128i*)bytes), _mm_set1_epi8((char)0xFF));
    }
    return allowed;
}

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

// Keys j0 .. j0 + 16·blocks − 1 (at most CHUNK_KEYS; the last block's rows past n zeros) into kt: block by
// block, [D][16], value d of the block's 16 keys
static inline __attribute__((always_inline)) void transposed_keys(float* kt, const float* K, int64_t kstride, int64_t j0,
                                                                  int64_t n, int64_t D) {
    for (int64_t b0 = 0; b0 < n; b0 += 16) {
        float* kb = kt + b0 * D;
        const int nk = n - b0 < 16 ? (int)(n - b0) : 16;
        if (nk == 16) {
            for (int64_t c0 = 0; c0 < D; c0 += 16) {
                __m512 r[16];
                for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(K + (j0 + b0 + k) * kstride + c0);
                transpose16(r);
                for (int c = 0; c < 16; c++) _mm512_store_ps(kb + (c0 + c) * 16, r[c]);
            }
        } else {
            for (int64_t d = 0; d < D; d++)
                for (int r = 0; r < 16; r++) kb[d * 16 + r] = r < nk ? K[(j0 + b0 + r) * kstride + d] : 0.0f;
        }
    }
}

// n pairs (1 .. 6) of weight rows w (stride CHUNK_KEYS, zeros past each pair's keys) times the value rows
// 0 .. keys − 1: o[k] = (first ? 0 : o[k] · keep[k]) + the sums, then · inv[k] where last
static inline __attribute__((always_inline)) void pair_values(float* const* o, const float* w, const float* keep,
                                                              const float* inv, const float* V, int64_t vstride,
                                                              int64_t keys, int first, int last, const int n,
                                                              const int DV) {
    __m512 acc[6][16];  // n · DV of them used: 24, 24 or 16 registers
    for (int k = 0; k < n; k++)
        for (int i = 0; i < DV; i++) acc[k][i] = _mm512_setzero_ps();
    // the pairs' weights of key j broadcast first, then each vector of its values loaded once for all of
    // them: held in registers (GCC had folded a load of the values into every FMA, 3 pairs × 8 vectors a
    // key at D = 128; a 1,024-token prompt's attention with 12 heads of 128 ran 19.4 -> 18.1 ms on a Zen 4
    // VM, 2 threads; D = 64 and 256 as before)
    for (int64_t j = 0; j < keys; j++) {
        __m512 b[6];
        for (int k = 0; k < n; k++) {
            b[k] = _mm512_set1_ps(w[k * CHUNK_KEYS + j]);
            __asm__("" : "+v"(b[k]));
        }
        for (int i = 0; i < DV; i++) {
            __m512 vi = _mm512_loadu_ps(V + j * vstride + 16 * i);
            __asm__("" : "+v"(vi));
            for (int k = 0; k < n; k++) acc[k][i] = _mm512_fmadd_ps(b[k], vi, acc[k][i]);
        }
    }
    for (int k = 0; k < n; k++)
        for (int i = 0; i < DV; i++) {
            __m512 sum = acc[k][i];
            if (!first) sum = _mm512_fmadd_ps(_mm512_loadu_ps(o[k] + 16 * i), _mm512_set1_ps(keep[k]), sum);
            if (last) sum = _mm512_mul_ps(sum, _mm512_set1_ps(inv[k]));
            _mm512_storeu_ps(o[k] + 16 * i, sum);
        }
}

static inline __attribute__((always_inline)) void prompt_tile(const Prompt* p, uint32_t item, float* kt, float* S,
                                                              Running* run, const int DV) {
    const int64_t D = 16 * DV, L = p->L, T = p->T, tiles = (T + PROMPT_TILE - 1) / PROMPT_TILE;
    const int64_t group = p->H / p->Hkv, tile = item % tiles, g = item / tiles % p->Hkv, b = item / tiles / p->Hkv;
    const int64_t t0 = tile * PROMPT_TILE, t1 = t0 + PROMPT_TILE < T ? t0 + PROMPT_TILE : T, h0 = g * group;
    const float* K = p->k + b * p->ks[0] + g * p->ks[1];
    const float* V = p->v + b * p->vs[0] + g * p->vs[1];
    const int64_t rows = (t1 - t0) * group;  // (query, head) pairs: pair i is query t0 + i / group, head h0 + i % group
    const int64_t nmax = t1 - 1 + L - T + 1 < L ? t1 - 1 + L - T + 1 : L;  // keys the tile's last query sees
    const __m512 scale = _mm512_set1_ps(p->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < rows; i++) run[i] = (Running){-INFINITY, 0.0f};
    for (int64_t c0 = 0; c0 < nmax; c0 += CHUNK_KEYS) {
        const int64_t cn = nmax - c0 < CHUNK_KEYS ? nmax - c0 : CHUNK_KEYS;
        const int first = c0 == 0, last = c0 + cn == nmax;
        transposed_keys(kt, K, p->ks[2], c0, cn, D);
        for (int64_t r0 = 0; r0 < rows; r0 += CHUNK_PAIRS) {
            const int np = rows - r0 < CHUNK_PAIRS ? (int)(rows - r0) : CHUNK_PAIRS;
            int64_t seen[CHUNK_PAIRS];  // the chunk's keys a pair may see: up to its query's position
            int64_t blocks = 0;         // blocks of 16 keys the most-seeing of them sees
            for (int k = 0; k < np; k++) {
                const int64_t t = t0 + (r0 + k) / group, n = (t + L - T + 1 < L ? t + L - T + 1 : L) - c0;
                seen[k] = n < 0 ? 0 : n < cn ? n : cn;
                blocks = (seen[k] + 15) / 16 > blocks ? (seen[k] + 15) / 16 : blocks;
            }
            // the scores, SCORED pairs at a time against two blocks, masked, into S's rows
            for (int64_t j0 = 0; j0 < blocks * 16; j0 += 32) {
                const float* kb = kt + j0 * D;
                const int two = j0 + 16 < blocks * 16;
                for (int k0 = 0; k0 < np;) {
                    int pair[SCORED], n = 0;
                    for (; k0 < np && n < SCORED; k0++)
                        if (j0 < seen[k0]) pair[n++] = k0;
                    if (!n) break;
                    const float* qr[SCORED];
                    for (int k = 0; k < SCORED; k++) {
                        const int64_t i = r0 + pair[k < n ? k : 0], t = t0 + i / group, h = h0 + i % group;
                        qr[k] = p->q + b * p->qs[0] + h * p->qs[1] + t * p->qs[2];
                    }
                    __m512 s[2][SCORED];
                    for (int k = 0; k < SCORED; k++) s[0][k] = s[1][k] = _mm512_setzero_ps();
                    if (two)
                        for (int64_t d = 0; d < D; d++) {
                            const __m512 k0d = _mm512_load_ps(kb + d * 16), k1d = _mm512_load_ps(kb + (D + d) * 16);
                            for (int k = 0; k < SCORED; k++) {
                                const __m512 qd = _mm512_set1_ps(qr[k][d]);
                                s[0][k] = _mm512_fmadd_ps(qd, k0d, s[0][k]), s[1][k] = _mm512_fmadd_ps(qd, k1d, s[1][k]);
                            }
                        }
                    else
                        for (int64_t d = 0; d < D; d++) {
                            const __m512 kd = _mm512_load_ps(kb + d * 16);
                            for (int k = 0; k < SCORED; k++) s[0][k] = _mm512_fmadd_ps(_mm512_set1_ps(qr[k][d]), kd, s[0][k]);
                        }
                    for (int k = 0; k < n; k++)
                        for (int half = 0; half <= two; half++) {
                            const int64_t j = j0 + 16 * half, over = seen[pair[k]] - 1 - j;  // its last key, in the block
                            if (over < 0) continue;  // a block past the pair's keys: zeros below
                            const int64_t t = t0 + (r0 + pair[k]) / group;
                            const __mmask16 allowed =
                                keys16(p->mask ? p->mask + b * p->ms[0] + t * p->ms[1] + c0 + j : NULL, over + 1);
                            _mm512_storeu_ps(S + pair[k] * CHUNK_KEYS + j,
                                             _mm512_mask_mov_ps(minus_inf, allowed, _mm512_mul_ps(s[half][k], scale)));
                        }
                }
            }
            // each row's softmax: the largest score so far, the weights e^(s − m) in place (zeros up to the
            // chunk's last block where the row sees none), what the output so far keeps (e^(m_old − m)),
            // and at the last chunk the reciprocal of the sum (0: no key to look at, zeros out)
            float keep[CHUNK_PAIRS], inv[CHUNK_PAIRS];
            for (int k = 0; k < np; k++) {
                float* row = S + k * CHUNK_KEYS;
                Running* r = run + r0 + k;
                const int64_t nb = (seen[k] + 15) / 16;
                __m512 top = minus_inf, sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < nb; j++) top = _mm512_max_ps(top, _mm512_loadu_ps(row + 16 * j));
                const float chunk_top = nb ? _mm512_reduce_max_ps(top) : -INFINITY;
                const float m = chunk_top > r->m ? chunk_top : r->m;
                if (m == -INFINITY) {
                    for (int64_t j = 0; j < nb; j++) _mm512_storeu_ps(row + 16 * j, sum);
                } else {
                    for (int64_t j = 0; j < nb; j++) {
                        const __m512 w = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * j), _mm512_set1_ps(m)));
                        _mm512_storeu_ps(row + 16 * j, w);
                        sum = _mm512_add_ps(sum, w);
                    }
                }
                for (int64_t j = nb; j < blocks; j++) _mm512_storeu_ps(row + 16 * j, _mm512_setzero_ps());
                keep[k] = running_keep(r->m, m);
                r->l = r->l * keep[k] + _mm512_reduce_add_ps(sum);
                r->m = m;
                inv[k] = r->l > 0.0f ? 1.0f / r->l : 0.0f;
            }
            // the weighted values, PV pairs at a time over the keys the most-seeing of them sees
            const int PV = DV == 4 ? 6 : DV == 8 ? 3 : 1;
            for (int k0 = 0; k0 < np; k0 += PV) {
                const int n = np - k0 < PV ? np - k0 : PV;
                float* o[6];
                int64_t keys = 0;
                for (int k = 0; k < n; k++) {
                    const int64_t i = r0 + k0 + k;
                    o[k] = out_row(p, b, h0 + i % group, t0 + i / group);
                    keys = seen[k0 + k] > keys ? seen[k0 + k] : keys;
                }
                const float* w = S + k0 * CHUNK_KEYS;
                const float* Vc = V + c0 * p->vs[2];
                if (DV == 4 && n == 6) pair_values(o, w, keep + k0, inv + k0, Vc, p->vs[2], keys, first, last, 6, 4);
                else if (DV == 8 && n == 3) pair_values(o, w, keep + k0, inv + k0, Vc, p->vs[2], keys, first, last, 3, 8);
                else
                    for (int k = 0; k < n; k++)
                        pair_values(o + k, w + k * CHUNK_KEYS, keep + k0 + k, inv + k0 + k, Vc, p->vs[2], keys, first,
                                    last, 1, DV);
            }
        }
    }
}

static void prompt_tiles(void* ctx, uint32_t begin, uint32_t end) {
    const Prompt* p = ctx;
    float* kt = aligned_alloc(64, (size_t)p->D * CHUNK_KEYS * sizeof(float));
    float* S = aligned_alloc(64, (size_t)CHUNK_PAIRS * CHUNK_KEYS * sizeof(float));
    Running* run = malloc((size_t)PROMPT_TILE * (p->H / p->Hkv) * sizeof(Running));
    if (!kt || !S || !run) {
        ((Prompt*)ctx)->failed = 1;
    } else {
        for (uint32_t item = begin; item < end; item++) {
            if (p->D == 64) prompt_tile(p, item, kt, S, run, 4);
            else if (p->D == 128) prompt_tile(p, item, kt, S, run, 8);
            else prompt_tile(p, item, kt, S, run, 16);
        }
    }
    free(kt);
    free(S);
    free(run);
}
#define PROMPT_TILES 1
#endif

#if defined(PROMPT_TILES) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "amx.h"
// ---- the same attention on bfloat16 tiles: --activation-quant int8's prompt passes --------------------
//
// Where that setting's products go in bfloat16 (passes of quant_i8.c's BF16_ROWS rows or more, vLLM's
// numbers), its prompt attention may too: q, k, v and the softmax's weights rounded to bfloat16, every
// product summed in float32 by TDPBF16PS, the softmax itself in float32. One work item per (sequence, kv
// head, 32 (query, head) pairs), the pairs as in prompt_tiles. Up to BF16_ATTN_CHUNK keys in two passes,
// no running softmax: the scores of the item's 32 rows against every key any of them sees (tiles 0-3 for
// two row tiles by two blocks of 16 keys), then each row's softmax in place, its weights rounded into a row
// of P, then P · V (tiles 0-3 for two row tiles by 32 values of D); more keys, chunk after chunk of that
// many, the output rescaled between them. The keys and values are laid out as the
// tiles' B operand once a pass, a pool job of their own before the items' (laid out per work item, one
// item a claim: SmolLM2's heads on 2 threads, 4 x 256 tokens 2.0 ms a layer, 1 x 1,024 5.2; this way 1.3
// and 3.7, where the float32 form takes 2.4-2.8 and 8.0-13.3). A row's numbers depend on its own query,
// keys and values only: keys past the ones it sees weigh exactly 0, and the rows past a pass's last
// (zeros) are never written.
#define BF16_ATTN_CHUNK 4096  // keys a work item's scores hold at once (512 KB, in L2); more: a running softmax

int kvlab_t16_available(void);

typedef struct {
    const Prompt* p;
    uint16_t *kt, *vt;  // each (sequence, kv head)'s keys and values as B tiles of 1 KB, n · D values each
    int64_t n;          // keys laid out a (sequence, kv head): L rounded up to 32, zeros past L
} Bf16Attention;

// Keys 32j .. 32j + 31 (zeros past L) of sequence b's kv head g, work item (b, g, j), as the tiles' B
// operand: kt tile (block i of 16 keys, values 32s .. 32s + 31) row r holds values 32s + 2r and 32s + 2r + 1
// of the block's 16 keys; vt tile (keys 32j .. 32j + 31, values 16c .. 16c + 15) row r keys 32j + 2r, + 1
static void bf16_lay_out(void* ctx, uint32_t begin, uint32_t end) {
    const Bf16Attention* a = ctx;
    const Prompt* p = a->p;
    const int64_t D = p->D, L = p->L, steps = a->n / 32;
    for (uint32_t item = begin; item < end; item++) {
        const int64_t j = item % steps, g = item / steps % p->Hkv, b = item / steps / p->Hkv;
        const float* K = p->k + b * p->ks[0] + g * p->ks[1];
        const float* V = p->v + b * p->vs[0] + g * p->vs[1];
        uint16_t *kt = a->kt + (b * p->Hkv + g) * a->n * D, *vt = a->vt + (b * p->Hkv + g) * a->n * D;
        for (int64_t i = 2 * j; i < 2 * j + 2; i++)
            for (int64_t s = 0; s < D / 32; s++) {
                __m512 r[16];
                for (int k = 0; k < 16; k++) {
                    const int64_t key = 16 * i + k;
                    const float* row = K + key * p->ks[2] + 32 * s;
                    r[k] = key < L ? (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row))
                                   : _mm512_setzero_ps();
                }
                transpose16(r);  // lane k of r[c]: values 2c, 2c + 1 of key k
                uint16_t* tile = kt + (i * (D / 32) + s) * 512;
                for (int c = 0; c < 16; c++) _mm512_store_ps(tile + 32 * c, r[c]);
            }
        for (int64_t c = 0; c < D / 16; c++) {
            uint16_t* tile = vt + (j * (D / 16) + c) * 512;
            for (int r = 0; r < 16; r++) {
                const int64_t key = 32 * j + 2 * r;
                const __m512 lo = key < L ? _mm512_loadu_ps(V + key * p->vs[2] + 16 * c) : _mm512_setzero_ps();
                const __m512 hi = key + 1 < L ? _mm512_loadu_ps(V + (key + 1) * p->vs[2] + 16 * c) : _mm512_setzero_ps();
                _mm512_store_si512(tile + 32 * r, bf16_pairs(lo, hi));
            }
        }
    }
}

// Tiles 0-3 = rows 0-15 and 16-31 of A (bfloat16, `width` a row: tiles 4, 5) times B0 and B1 (tiles 6, 7),
// summed over `steps` steps of 32 values of A's rows, B0's and B1's tiles `b_step` values apart
static inline void tiles_2x2(const uint16_t* a, int64_t width, const uint16_t* b0, const uint16_t* b1, int64_t b_step,
                             int64_t steps) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, a + 32 * s, width * 2);
        _tile_loadd(5, a + 16 * width + 32 * s, width * 2);
        _tile_loadd(6, b0 + s * b_step, 64);
        _tile_loadd(7, b1 + s * b_step, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// Work item (b, g, block): the block's 32 (query, head) pairs of sequence b's kv head g, BF16_ATTN_CHUNK keys
// at a time: a row's largest score so far and its weights' sum (run), its output so far in acc
// [32, D], rescaled when a later chunk holds a larger score (FlashAttention's running softmax)
static void bf16_attention_item(const Bf16Attention* a, uint32_t item, uint16_t* qb, float* S, uint16_t* pb,
                                float* acc) {
    const Prompt* p = a->p;
    const int64_t D = p->D, L = p->L, T = p->T, group = p->H / p->Hkv, blocks = (T * group + 31) / 32;
    const int64_t blk = item % blocks, g = item / blocks % p->Hkv, b = item / blocks / p->Hkv, r0 = 32 * blk;
    const int64_t rows = T * group - r0 < 32 ? T * group - r0 : 32;  // (query, head) pair i: row r0 + i
    const uint16_t *kt = a->kt + (b * p->Hkv + g) * a->n * D, *vt = a->vt + (b * p->Hkv + g) * a->n * D;
    int64_t seen[32] = {0}, most = 0;  // keys each row's query sees (causal: up to its own position)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t t = (r0 + i) / group;
        seen[i] = t + L - T + 1 < L ? t + L - T + 1 : L;
        most = seen[i] > most ? seen[i] : most;
    }
    const int64_t n = (most + 31) / 32 * 32;  // keys through the tiles: whole pairs of 16-key blocks
    for (int64_t i = 0; i < 32; i++)            // the queries as bfloat16 rows (zeros past the pass's last)
        for (int64_t d = 0; d < D; d += 32) {
            __m512i v = _mm512_setzero_si512();
            if (i < rows) {
                const float* q = p->q + b * p->qs[0] + (g * group + (r0 + i) % group) * p->qs[1] + (r0 + i) / group * p->qs[2] + d;
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
            }
            _mm512_store_si512(qb + i * D + d, v);
        }
    Running run[32];
    for (int i = 0; i < 32; i++) run[i] = (Running){-INFINITY, 0.0f};
    const __m512 scale = _mm512_set1_ps(p->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t c0 = 0; c0 < n; c0 += BF16_ATTN_CHUNK) {
        const int64_t nc = n - c0 < BF16_ATTN_CHUNK ? n - c0 : BF16_ATTN_CHUNK;  // a multiple of 32
        // S [32, nc]: rows 0-15 and 16-31 against blocks of 16 keys j, j + 1, over D 32 values a step
        for (int64_t j = 0; j < nc / 16; j += 2) {
            const int64_t at = c0 / 16 + j;
            tiles_2x2(qb, D, kt + at * (D / 32) * 512, kt + (at + 1) * (D / 32) * 512, 512, D / 32);
            _tile_stored(0, S + 16 * j, nc * 4);
            _tile_stored(1, S + 16 * j + 16, nc * 4);
            _tile_stored(2, S + 16 * nc + 16 * j, nc * 4);
            _tile_stored(3, S + 16 * nc + 16 * j + 16, nc * 4);
        }
        // each row's softmax over the chunk: scaled, masked, its weights e^(s − top so far) rounded into P
        // (zeros past its keys); keep: what its output so far keeps (e^(old top − new top))
        float keep[32];
        for (int64_t i = 0; i < 32; i++) {
            float* s = S + i * nc;
            uint16_t* w = pb + i * nc;
            const int64_t keys = seen[i] - c0 < 0 ? 0 : seen[i] - c0 < nc ? seen[i] - c0 : nc;
            const uint8_t* m = p->mask && keys ? p->mask + b * p->ms[0] + (r0 + i) / group * p->ms[1] + c0 : NULL;
            __m512 top = minus_inf;
            for (int64_t j = 0; j < keys; j += 16) {
                const __mmask16 allowed = keys16(m ? m + j : NULL, keys - j);
                const __m512 v = _mm512_mask_mov_ps(minus_inf, allowed, _mm512_mul_ps(_mm512_loadu_ps(s + j), scale));
                _mm512_storeu_ps(s + j, v);
                top = _mm512_max_ps(top, v);
            }
            const float chunk_top = keys ? _mm512_reduce_max_ps(top) : -INFINITY;
            const float most_score = chunk_top > run[i].m ? chunk_top : run[i].m;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nc; j += 32) {
                __m512 e[2];
                for (int h = 0; h < 2; h++) {
                    const int64_t left = keys - j - 16 * h;  // of the row's keys, from this vector's first
                    e[h] = _mm512_setzero_ps();
                    if (most_score != -INFINITY && left > 0) {
                        const __mmask16 in = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                        e[h] = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16 * h), _mm512_set1_ps(most_score))));
                        sum = _mm512_add_ps(sum, e[h]);
                    }
                }
                _mm512_store_si512(w + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
            }
            keep[i] = running_keep(run[i].m, most_score);
            run[i] = (Running){most_score, run[i].l * keep[i] + _mm512_reduce_add_ps(sum)};
        }
        // the chunk's P · V, 32 values of D at a time: rows 0-15 and 16-31 over its keys, 32 a step
        const uint16_t* vc = vt + c0 / 32 * (D / 16) * 512;
        float o[32 * 32] __attribute__((aligned(64)));
        for (int64_t c = 0; c < D / 16; c += 2) {
            tiles_2x2(pb, nc, vc + c * 512, vc + (c + 1) * 512, (D / 16) * 512, nc / 32);
            _tile_stored(0, o, 128);
            _tile_stored(1, o + 16, 128);
            _tile_stored(2, o + 16 * 32, 128);
            _tile_stored(3, o + 16 * 32 + 16, 128);
            for (int64_t i = 0; i < rows; i++)
                for (int h = 0; h < 2; h++) {
                    float* r = acc + i * D + 16 * (c + h);
                    const __m512 part = _mm512_load_ps(o + 32 * i + 16 * h);
                    _mm512_store_ps(r, c0 ? _mm512_fmadd_ps(_mm512_load_ps(r), _mm512_set1_ps(keep[i]), part) : part);
                }
        }
    }
    for (int64_t i = 0; i < rows; i++) {  // no key to look at: zeros, as the other forms
        const __m512 f = _mm512_set1_ps(run[i].l > 0.0f ? 1.0f / run[i].l : 0.0f);
        float* out = out_row(p, b, g * group + (r0 + i) % group, (r0 + i) / group);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_load_ps(acc + i * D + d), f));
    }
}

static void bf16_attention_items(void* ctx, uint32_t begin, uint32_t end) {
    const Bf16Attention* a = ctx;
    const int64_t D = a->p->D, n = a->n < BF16_ATTN_CHUNK ? a->n : BF16_ATTN_CHUNK;
    uint16_t* qb = aligned_alloc(64, 32 * D * 2);
    float* S = aligned_alloc(64, 32 * n * sizeof(float));
    uint16_t* pb = aligned_alloc(64, 32 * n * 2);
    float* acc = aligned_alloc(64, 32 * D * sizeof(float));
    if (qb && S && pb && acc) {
        tiles_square();
        for (uint32_t item = begin; item < end; item++) bf16_attention_item(a, item, qb, S, pb, acc);
        _tile_release();
    } else {
        __atomic_store_n(&((Prompt*)a->p)->failed, 1, __ATOMIC_RELAXED);
    }
    free(qb), free(S), free(pb), free(acc);
}

// The pass on bfloat16 tiles: its keys and values laid out, then its blocks of 32 (query, head) pairs,
// several a claim (each claim allocates its scores); -1 without memory
static int bf16_attention(Prompt* p, int threads) {
    const int64_t n = (p->L + 31) / 32 * 32, pairs = p->B * p->Hkv;
    Bf16Attention a = {p, aligned_alloc(64, pairs * n * p->D * 2), aligned_alloc(64, pairs * n * p->D * 2), n};
    if (a.kt && a.vt) {
        kvlab_pool_run(bf16_lay_out, &a, (uint32_t)(pairs * (n / 32)), 1, threads);
        const int64_t items = pairs * ((p->T * (p->H / p->Hkv) + 31) / 32);
        const int64_t chunk = items / (8 * (threads > 1 ? threads : 1));
        kvlab_pool_run(bf16_attention_items, &a, (uint32_t)items, (uint32_t)(chunk > 1 ? chunk : 1), threads);
    } else {
        p->failed = 1;
    }
    free(a.kt), free(a.vt);
    return p->failed ? -1 : 0;
}
#define PROMPT_BF16 1
#endif

// out [B, H, T, D] = softmax(q · kᵀ · scale) · v per query head, q [B, H, T, D], k and v [B, Hkv, L, D]
// (each, out too, the last dimension contiguous, the rest at the strides given, in floats; the caller lays
// out out [B, T, H, D], a token's heads side by side as the output projection reads them), the T queries
// the sequences' last: query t at position L − T + t sees keys up to its own, and of those only where
// mask [b, t, key] (bytes, at strides ms; NULL: no mask) is nonzero. bf16: in bfloat16 on AMX tiles
// (bf16_attention) where they are built and granted and D is a multiple of 32 up to 256; else in float32.
// 0, or -1 where there was no memory for the scores (out then incomplete).
int kvlab_prompt_attention(const float* q, const int64_t* qs, const float* k, const int64_t* ks, const float* v,
                            const int64_t* vs, const uint8_t* mask, const int64_t* ms, float* out, const int64_t* os,
                            int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t L, int64_t D, float scale, int bf16,
                            int threads) {
    Prompt p = {q, k, v, mask, out, B, H, Hkv, T, L, D, {qs[0], qs[1], qs[2]}, {ks[0], ks[1], ks[2]},
                {vs[0], vs[1], vs[2]}, {os[0], os[1], os[2]}, {mask ? ms[0] : 0, mask ? ms[1] : 0}, scale, 0};
#if defined(PROMPT_BF16)
    if (bf16 && D % 32 == 0 && D <= 256 && kvlab_t16_available()) return bf16_attention(&p, threads);
#endif
    (void)bf16;
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
