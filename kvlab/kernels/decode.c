// The decoder layers of a decode step, each in one C function and a run of them in one call: B sequences,
// one new token each, float32 activations, the KV cache in any of its storage formats (kvlab/kv/formats.py).
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
//
// The files: step.h (the structs, written once), kv_codec.h / kv_codec.c (the KV formats: reading
// inline, writing, the rotation), attention.c (attention over the stored codes), linear.c (a layer's
// products, part by part through their kernels), moe.c (a mixture-of-experts MLP), deltanet.c (a Gated
// DeltaNet mixer in attention's place: Qwen3.5, Qwen3-Next), and this one (the layer: norms, RoPE, the
// new K/V written, attention and its output gate, the MLP, the residuals).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "step.h"

// The activations' names (kvlab/config/layers.py's DenseMLP.activation), by id: Python asks for them
static const char* const ACT_NAMES[ACTIVATIONS] = {"silu", "gelu_pytorch_tanh"};

const char* kvlab_decode_activation(int id) { return id >= 0 && id < ACTIVATIONS ? ACT_NAMES[id] : 0; }

// The structs' sizes, for kernels/decode.py to check its own against at load
void kvlab_decode_struct_sizes(int64_t* out) {
    out[0] = sizeof(Part);
    out[1] = sizeof(Linear);
    out[2] = sizeof(Layer);
    out[3] = sizeof(KVStore);
    out[4] = sizeof(Step);
    out[5] = sizeof(Reduce);
    out[6] = sizeof(Moe);
    out[7] = sizeof(DeltaNet);
    out[8] = sizeof(Angles);
    out[9] = sizeof(KVView);
    out[10] = sizeof(LayerStep);
}

// Floats of scratch a step needs: qkv, attention output, a norm's output, gate/up, SiLU·up, the score
// rows of every (sequence, head), and each chunk's partial results (max, sum, D values) per head.
int64_t kvlab_decode_scratch_floats(int64_t batch, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t intermediate, int64_t max_keys) {
    int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    return batch * (qkv + heads * head_dim + hidden + 3 * intermediate) + batch * heads * max_keys +
           batch * num_chunks(max_keys) * heads * (head_dim + 2);
}

static inline void linear(const Linear* l, const float* x, float* y, int64_t m, int64_t ldy, int threads) {
    kvlab_decode_linear(l, x, y, m, ldy, threads);
}

// ---- the layer ----------------------------------------------------------------------------------

// A step's clock over a layer's parts (Step.phase_seconds; PHASE_*): each lap adds the time since the last
// to its part. Without phase_seconds it reads no clock.
typedef struct {
    double* seconds;
    struct timespec last;
} Clock;

static Clock start_clock(const Step* S) {
    Clock c = {S->phase_seconds, {0, 0}};
    if (c.seconds) clock_gettime(CLOCK_MONOTONIC, &c.last);
    return c;
}

static void lap(Clock* c, int phase) {
    if (!c->seconds) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    c->seconds[phase] += (double)(now.tv_sec - c->last.tv_sec) + 1e-9 * (double)(now.tv_nsec - c->last.tv_nsec);
    c->last = now;
}

// x += y [B, E], y normalised first where the layer normalises its outputs (Gemma's sandwich; in place)
static void add_residual(float* x, float* y, const float* out_norm, int64_t B, int64_t E, float eps) {
    if (out_norm) kvlab_rms_norm_f32(y, out_norm, y, B, E, eps);
    for (int64_t i = 0; i < B * E; i++) x[i] += y[i];
}

// y [n] summed over the ranks in place (a row-parallel product's partial sums); 0, or -1 when a rank did
// not arrive within the timeout
static int reduce(const Reduce* r, float* y, int64_t n) {
    if (!r) return 0;
    *r->calls += 1;
    return kvlab_shm_allreduce(r->segment, r->rank, r->world, r->capacity, y, n, *r->calls, r->timeout_s);
}

// The attention of a layer: normed [B, E] (the normalised input) in, the o product's output [B, E] written
// over it. q/k/v, their norms, RoPE, the new K/V into the cache, attention, the output gate, o.
static void attention(const Layer* L, const Step* S, float* normed, int threads, Clock* clock) {
    const int64_t B = S->batch, E = L->hidden, D = L->head_dim, H = L->heads, Hkv = L->kv_heads;
    const int64_t qkv_row = (H + 2 * Hkv) * D;
    float* qkv = S->scratch;
    float* attn = qkv + B * qkv_row;
    float* scores = attn + B * H * D + B * E + B * 3 * L->intermediate;  // after the norm's and the MLP's rows
    float* partial = scores + B * H * S->max_keys;

    linear(&L->qkv, normed, qkv, B, qkv_row, threads);
    if (L->gate.num_parts) linear(&L->gate, normed, S->mixer_scratch, B, H * D, threads);  // before o overwrites
    lap(clock, PHASE_PRODUCTS);
    if (L->q_norm) {  // each head of q and of k normalised over its D values (OLMoE: all heads at once)
        const int64_t qn = L->qk_norm_whole ? 1 : H, kn = L->qk_norm_whole ? 1 : Hkv;
        for (int64_t b = 0; b < B; b++) {
            float* row = qkv + b * qkv_row;
            kvlab_rms_norm_f32(row, L->q_norm, row, qn, H * D / qn, L->eps);
            kvlab_rms_norm_f32(row + H * D, L->k_norm, row + H * D, kn, Hkv * D / kn, L->eps);
        }
    }
    if (L->rotary_dim == D)  // q heads, then k heads, per token
        kvlab_rope_f32(qkv, S->cos, S->signed_sin, B, H + Hkv, D, qkv_row);
    else  // partial rotary: each head's first rotary_dim channels (the tables are that wide)
        for (int64_t h = 0; h < H + Hkv; h++) kvlab_rope_f32(qkv + h * D, S->cos, S->signed_sin, B, 1, L->rotary_dim, qkv_row);
    for (int64_t b = 0; b < B; b++) {  // into the Hadamard basis the cache stores: q and k, v
        float* row = qkv + b * qkv_row;
        if (S->rotate_k) kvlab_hadamard_f32(row, H + Hkv, D);
        if (S->rotate_v) kvlab_hadamard_f32(row + (H + Hkv) * D, Hkv, D);
    }
    for (int64_t b = 0; b < B; b++) {  // the new token's K and V into its slot, in the cache's formats
        const float* row = qkv + b * qkv_row;
        for (int64_t g = 0; g < Hkv; g++) {
            kvlab_kv_encode_vector(&S->k, row + (H + g) * D, S->slots[b] * Hkv + g, D);
            kvlab_kv_encode_vector(&S->v, row + (H + Hkv + g) * D, S->slots[b] * Hkv + g, D);
        }
    }
    kvlab_decode_attention(L, S, qkv, attn, scores, partial, threads);
    if (L->gate.num_parts)  // Qwen3.5: each channel of the heads' outputs times sigmoid(its gate)
        for (int64_t i = 0; i < B * H * D; i++) attn[i] *= 1.0f / (1.0f + expf(-S->mixer_scratch[i]));
    lap(clock, PHASE_MIXER);
    linear(&L->o, attn, normed, B, E, threads);
    lap(clock, PHASE_PRODUCTS);
}

// x [B, hidden] float32, updated in place: x + mixer(x) (attention, or a Gated DeltaNet), then + MLP(that).
// Returns 0, -1 when another tensor-parallel rank did not reach an all-reduce (x is then not to be used),
// or -2 when a DeltaNet's sizes are out of the C step's range.
int kvlab_decode_layer(const Layer* L, const Step* S, float* x, int threads) {
    const int64_t B = S->batch, E = L->hidden, D = L->head_dim, H = L->heads, Hkv = L->kv_heads;
    const int64_t I = L->intermediate, qkv_row = (H + 2 * Hkv) * D;
    float* normed = S->scratch + B * qkv_row + B * H * D;
    float* gate_up = normed + B * E;
    float* act = gate_up + B * 2 * I;

    Clock clock = start_clock(S);
    kvlab_rms_norm_f32(x, L->attn_norm, normed, B, E, L->eps);
    lap(&clock, PHASE_OTHER);
    if (L->deltanet) {
        if (kvlab_deltanet_mixer(L->deltanet, S, normed, E, threads)) return -2;
        lap(&clock, PHASE_MIXER);
    } else {
        attention(L, S, normed, threads, &clock);
    }
    if (reduce(L->reduce, normed, B * E)) return -1;
    add_residual(x, normed, L->attn_out_norm, B, E, L->eps);

    kvlab_rms_norm_f32(x, L->mlp_norm, normed, B, E, L->eps);
    lap(&clock, PHASE_OTHER);
    if (L->moe) {  // a mixture of experts (moe.c): its output [B, E] first in the step's MoE scratch
        float* out = S->moe_scratch;
        kvlab_moe(L->moe, normed, out, B, E, out + B * E, threads);
        lap(&clock, PHASE_PRODUCTS);
        if (reduce(L->reduce, out, B * E)) return -1;  // a shard's experts: their sum over the ranks
        add_residual(x, out, L->mlp_out_norm, B, E, L->eps);
        lap(&clock, PHASE_OTHER);
        return 0;
    }
    linear(&L->gate_up, normed, gate_up, B, 2 * I, threads);
    lap(&clock, PHASE_PRODUCTS);
    // the modules' decode-sized passes call it too; the rows on the pool (Qwen2.5-Coder-0.5B's 16 × 4,864
    // on the caller alone: 34 us a layer while the other core waited)
    kvlab_gated_act_rows(gate_up, 2 * I, gate_up + I, 2 * I, act, B, I, L->activation, threads);
    lap(&clock, PHASE_OTHER);
    linear(&L->down, act, normed, B, E, threads);
    lap(&clock, PHASE_PRODUCTS);
    if (reduce(L->reduce, normed, B * E)) return -1;
    add_residual(x, normed, L->mlp_out_norm, B, E, L->eps);
    lap(&clock, PHASE_OTHER);
    return 0;
}

// Layers 0 .. num − 1 of `layers` in order, each with the step's per-layer fields set from its LayerStep:
// one call for a step's layers, not one per layer with its fields set from Python (SmolLM2, int8, one
// sequence: the Python of a step's forward 0.56-0.72 -> 0.50-0.63 ms). Returns 0, or the failing layer's
// status with *failed its index.
int kvlab_decode_layers(const LayerStep* layers, int64_t num, const Angles* angles, const KVView* views, Step* S, float* x,
                        int threads, int64_t* failed) {
    for (int64_t i = 0; i < num; i++) {
        const LayerStep* e = &layers[i];
        if (e->angles >= 0) S->cos = angles[e->angles].cos, S->signed_sin = angles[e->angles].signed_sin;
        if (e->view >= 0) {
            const KVView* v = &views[e->view];
            S->slots = v->slots, S->block_tables = v->block_tables, S->table_stride = v->table_stride;
            S->num_keys = v->num_keys, S->first_key = v->first_key;
        }
        S->k = e->k, S->v = e->v;
        S->conv_state = e->conv_state, S->ssm_state = e->ssm_state;
        const int status = kvlab_decode_layer(e->layer, S, x, threads);
        if (status) {
            *failed = i;
            return status;
        }
    }
    return 0;
}

// The step's end: rows index[0 .. S − 1] of x [B, hidden] normalised (RMSNorm with the weights w and eps,
// kvlab_rms_norm_f32: the final norm module's bits) into normed [S, hidden], then the LM head's product
// of them into logits [S, head->out] (its kernels, the module's bits). One call after the layers': the
// index, the norm and the head as modules were each a PyTorch dispatch, run just after the layers had
// streamed the weights through the caches. On the AMD EPYC Zen 4 VM, 2 threads, bfloat16 KV, the two
// alternated 7 times in one process: SmolLM2's head 1.32 -> 1.10 ms a step (int8 activations, one
// sequence; its step 0.95x), exact 1.22 -> 1.04 (0.95x), 16 sequences 1.91 -> 1.71 (0.97x); Qwen2.5-
// Coder-0.5B's one-sequence step 0.98x (int8), 0.99x (exact).
// Returns 0, or −1 for an index outside x's B rows (nothing written).
int kvlab_decode_head(const Linear* head, const float* norm_w, float eps, const float* x, int64_t B, int64_t hidden,
                      const int64_t* index, int64_t S, float* normed, float* logits, int threads) {
    for (int64_t s = 0; s < S; s++)
        if (index[s] < 0 || index[s] >= B) return -1;
    for (int64_t s = 0; s < S; s++) kvlab_rms_norm_f32(x + index[s] * hidden, norm_w, normed + s * hidden, 1, hidden, eps);
    linear(head, normed, logits, S, head->out, threads);
    return 0;
}
