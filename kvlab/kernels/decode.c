// One decoder layer of a decode step in one call: B sequences, one new token each, float32.
//
// A decode step of a small model is a few hundred small operations; run one by one from Python each
// costs microseconds of dispatch, which with 4-bit weights is more than the products themselves take.
// Here a layer is: RMSNorm, the fused q/k/v product (+ bias), per-head q/k RMSNorm (Qwen3), the
// rotation, the new K and V written into the paged cache through their slots, attention over every
// cached key of each sequence (read through its block table), the o product and the residual, then
// RMSNorm, the fused gate/up product, SiLU(gate)·up, the down product and the residual.
//
// The products are the library's own kernels (gemv.c for float matrices, quant.c for block formats,
// on the pool), so they give the same bits as the layer-by-layer path; RMSNorm and the rotation too
// (the same C functions). Attention and SiLU are computed here in float32: the same values as
// PyTorch's up to the order of sums and the exp implementation.
//
// Layout of the paged cache (kv/paged.py): k[block, offset, kv_head, d], v alike; token p of a
// sequence is in block table[p / block_size] at offset p % block_size.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

// the library's other kernels (gemv.c, quant.c)
void kvlab_gemv_f32(const float* w, const float* x, const float* bias, float* y, int64_t m, int64_t n, int64_t out,
                    int threads);
void kvlab_gemv_bf16(const uint16_t* w, const float* x, const float* bias, float* y, int64_t m, int64_t n,
                     int64_t out, int threads);
void kvlab_gemv_f16(const _Float16* w, const float* x, const float* bias, float* y, int64_t m, int64_t n,
                    int64_t out, int threads);
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

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const float *attn_norm, *mlp_norm;  // [hidden]
    const float *q_norm, *k_norm;       // [head_dim], or NULL
    Linear qkv, o, gate_up, down;
} Layer;

typedef struct {
    int64_t batch;                       // B sequences, one new token each
    const float *cos, *signed_sin;       // [B, head_dim]: each token's rotation (kvlab/model/rope.py)
    float *k_cache, *v_cache;            // this layer's [num_blocks, block_size, kv_heads, head_dim]
    int64_t block_size;
    const int64_t* slots;                // [B]: where each new token's K/V goes
    const int64_t* block_tables;         // [B, table_stride]
    int64_t table_stride;
    const int64_t* num_keys;             // [B]: keys each sequence sees, its new token included
    int64_t max_keys;
    float* scratch;                      // kvlab_decode_scratch_floats(...) floats
} Step;

// Floats of scratch a step needs: qkv, attention output, a norm's output, gate/up, SiLU·up, and the
// score rows of every (sequence, kv head).
int64_t kvlab_decode_scratch_floats(int64_t batch, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t intermediate, int64_t max_keys) {
    int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    return batch * (qkv + heads * head_dim + hidden + 3 * intermediate) + batch * heads * max_keys;
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

// ---- attention: one work item per (sequence, kv head), its query heads together ----------------

typedef struct {
    const Layer* layer;
    const Step* step;
    const float* qkv;  // [B, (H + 2 Hkv) · D], q and k rotated
    float* out;        // [B, H · D]
    float* scores;     // [B · H, max_keys]
} Attend;

static void attend_items(void* ctx, uint32_t begin, uint32_t end) {
    const Attend* a = ctx;
    const Layer* L = a->layer;
    const Step* S = a->step;
    const int64_t D = L->head_dim, H = L->heads, Hkv = L->kv_heads, group = H / Hkv;
    const int64_t qkv_row = (H + 2 * Hkv) * D, bs = S->block_size;
    const float scale = 1.0f / sqrtf((float)D);
    for (uint32_t item = begin; item < end; item++) {
        const int64_t b = item / Hkv, g = item % Hkv, n = S->num_keys[b];
        const int64_t* table = S->block_tables + b * S->table_stride;
        for (int64_t j = 0; j < group; j++) {
            const int64_t h = g * group + j;
            const float* q = a->qkv + b * qkv_row + h * D;
            float* s = a->scores + (b * H + h) * S->max_keys;
            float top = -INFINITY;
            for (int64_t t = 0; t < n; t++) {
                const float* k = S->k_cache + ((table[t / bs] * bs + t % bs) * Hkv + g) * D;
                float dot = 0.0f;
                for (int64_t i = 0; i < D; i++) dot += q[i] * k[i];
                s[t] = dot * scale;
                top = s[t] > top ? s[t] : top;
            }
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                s[t] = expf(s[t] - top);
                sum += s[t];
            }
            float* o = a->out + b * H * D + h * D;
            memset(o, 0, D * sizeof(float));
            for (int64_t t = 0; t < n; t++) {
                const float* v = S->v_cache + ((table[t / bs] * bs + t % bs) * Hkv + g) * D;
                const float p = s[t] / sum;
                for (int64_t i = 0; i < D; i++) o[i] += p * v[i];
            }
        }
    }
}

// ---- the layer ----------------------------------------------------------------------------------

// x [B, hidden] float32, updated in place: x + attention(x), then + MLP(that).
void kvlab_decode_layer(const Layer* L, const Step* S, float* x, int threads) {
    const int64_t B = S->batch, E = L->hidden, D = L->head_dim, H = L->heads, Hkv = L->kv_heads;
    const int64_t I = L->intermediate, qkv_row = (H + 2 * Hkv) * D;
    float* qkv = S->scratch;
    float* attn = qkv + B * qkv_row;
    float* normed = attn + B * H * D;
    float* gate_up = normed + B * E;
    float* act = gate_up + B * 2 * I;
    float* scores = act + B * I;

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
    for (int64_t b = 0; b < B; b++) {  // the new token's K and V into its slot
        const float* row = qkv + b * qkv_row;
        memcpy(S->k_cache + S->slots[b] * Hkv * D, row + H * D, Hkv * D * sizeof(float));
        memcpy(S->v_cache + S->slots[b] * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(float));
    }
    Attend a = {L, S, qkv, attn, scores};
    kvlab_pool_run(attend_items, &a, (uint32_t)(B * Hkv), 1, threads);
    linear(&L->o, attn, normed, B, E, threads);
    for (int64_t i = 0; i < B * E; i++) x[i] += normed[i];

    kvlab_rms_norm_f32(x, L->mlp_norm, normed, B, E, L->eps);
    linear(&L->gate_up, normed, gate_up, B, 2 * I, threads);
    for (int64_t b = 0; b < B; b++) {
        const float *g = gate_up + b * 2 * I, *u = g + I;
        float* out = act + b * I;
        for (int64_t i = 0; i < I; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    linear(&L->down, act, normed, B, E, threads);
    for (int64_t i = 0; i < B * E; i++) x[i] += normed[i];
}
