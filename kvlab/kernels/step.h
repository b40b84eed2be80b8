// The decode step's shared description (decode.c, attention.c): a layer as the modules describe it
// (kvlab/backends/cpu.py fills these structs; kernels/decode.py declares the same fields and checks
// their sizes against kvlab_decode_struct_sizes at load), the step's per-pass inputs, and the other
// kernels of the library the step calls.

#ifndef KVLAB_STEP_H
#define KVLAB_STEP_H

#include <stdint.h>

#include "kv_codec.h"

// the library's other kernels (gemv.c, quant.c, kvlab/parallel/allreduce.c)
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
int kvlab_quant_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* ldw, const int64_t* out,
                             const float* x, float* y, int64_t m, int64_t n, int64_t ldy, int threads);
int kvlab_mxfp4_matmul(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, float* y, int64_t ldy,
                       int64_t rows_x, int64_t out_features, int64_t in_features, int threads);
void kvlab_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);
void kvlab_gated_act_f32(const float* gate_up, float* y, int64_t rows, int64_t I, int act);
void kvlab_gated_act_rows(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* y,
                          int64_t rows, int64_t I, int act, int threads);
void kvlab_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out, int threads);
void kvlab_rope_f32(float* x, const float* cos, const float* signed_sin, int64_t tokens, int64_t heads, int64_t d,
                    int64_t token_stride);

#define MAX_PARTS 4

// One matrix of a linear layer: a float matrix (kind FLOAT_*, one part, row-major [rows, n]) or the
// blocks of a GGUF format (kind BLOCKS, `fmt` a quant.c id, `ldw` bytes per row; kind MXFP4_BLOCKS:
// mxfp4.c's format, gpt-oss's experts).
enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2, BLOCKS = 3, MXFP4_BLOCKS = 4 };

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

// A mixture of experts (kvlab/model/moe.py) as the layer's MLP: the router picks top_k of E experts per
// row, each chosen expert multiplies all the rows that chose it at once (its matrices read once per step),
// the weighted outputs summed expert by expert in ascending order (the modules' order); plus a shared
// expert behind its sigmoid gate. Expert e's matrices are expert 0's parts moved by e · stride bytes.
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1 };  // MoE.routing
enum { EXPERT_SILU = 0, EXPERT_CLAMPED_SWIGLU = 1 };      // MoE.activation

typedef struct {
    int64_t num_experts, top_k, expert_size, shared_size;
    int32_t routing, norm_topk_prob, activation;
    float swiglu_limit, swiglu_alpha;
    Linear router;                               // [E, hidden] (+ bias)
    Linear gate_up, down;                        // expert 0's: gate_up [2I, hidden], down [hidden, I]; no bias
    int64_t gate_up_stride[MAX_PARTS], down_stride[MAX_PARTS];  // bytes from one expert's part to the next's
    const float *gate_up_bias, *down_bias;       // [E, 2I], [E, hidden], or NULL
    Linear shared_gate_up, shared_down, shared_gate;  // the shared expert (shared_size > 0); its gate [1, hidden] or none
} Moe;

// A Gated DeltaNet mixer (kvlab/model/deltanet.py) in a layer's place of attention: in_proj gives each row
// the conv input [C = 2·Hk·Dk + H·Dv] (q, k, v), the output gate z [H·Dv], b [H] and a [H]; the conv runs
// over the sequence's last K − 1 inputs (its conv state), then the delta rule on its [H, Dk, Dv] state
// (both in the state pool, at the step's state slots); each head's output is RMS-normalised, times silu(z),
// and out_proj maps it back to the hidden size. `tiled`: value head h reads key head h mod Hk (llama.cpp's
// qwen35 order), else h / (H / Hk).
typedef struct {
    int64_t key_heads, value_heads, key_dim, value_dim, conv_kernel;
    int32_t tiled;
    float norm_eps;
    Linear in_proj, out;       // in_proj: [C + H·Dv + 2H, hidden] in the parts (conv, z, b, a); out: [hidden, H·Dv]
    const float* conv_weight;  // [C, K]
    const float *A_log, *dt_bias, *norm;  // [H], [H], [Dv]
} DeltaNet;

// Floats of mixer scratch (Step.mixer_scratch) a DeltaNet layer needs for a step of B rows (deltanet.c)
int64_t kvlab_deltanet_scratch_floats(const DeltaNet* d, int64_t batch);

// Floats of scratch the MoE MLP of a step of B rows needs (moe.c)
int64_t kvlab_moe_scratch_floats(const Moe* m, int64_t batch, int64_t hidden);
// out [B, hidden] = the mixture of experts of x [B, hidden]; scratch: kvlab_moe_scratch_floats floats
void kvlab_moe(const Moe* m, const float* x, float* out, int64_t B, int64_t hidden, float* scratch, int threads);
// A prompt's routed experts (rows already routed: ids, weights [N, k]; router and shared expert unused):
// out [N, hidden] = Σ weight · expert(x); scratch: kvlab_moe_experts_scratch_floats floats (moe.c)
int64_t kvlab_moe_experts_scratch_floats(const Moe* m, int64_t rows, int64_t hidden, int threads);
void kvlab_moe_experts(const Moe* m, const float* x, const float* weights, const int64_t* ids, float* out, int64_t N,
                       int64_t hidden, float* scratch, int threads);
// y [m, l->out] (row stride ldy) = x [m, l->in] · Wᵀ + bias (decode.c), part by part into its columns
void kvlab_decode_linear(const Linear* l, const float* x, float* y, int64_t m, int64_t ldy, int threads);


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
    const float *q_norm, *k_norm;               // [head_dim] (or the whole projections' with qk_norm_whole), or NULL
    Linear qkv, o, gate_up, down;
    const Reduce* reduce;                       // a tensor-parallel rank: o's and down's sums over ranks; or NULL
    int32_t qk_norm_whole;                      // q and k normalised over all their heads at once (OLMoE)
    const float* sinks;                         // [heads]: a learned sink logit per head in the softmax (gpt-oss), or NULL
    const Moe* moe;                             // the MLP is this mixture of experts (gate_up, down unused), or NULL
    Linear gate;                                // a sigmoid gate on the attention's output [H·D, hidden] (Qwen3.5), or no parts
    int64_t rotary_dim;                         // RoPE on each head's first rotary_dim channels (partial rotary)
    const DeltaNet* deltanet;                   // the mixer is this Gated DeltaNet (the attention fields unused), or NULL
} Layer;

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
    float* moe_scratch;                  // the largest kvlab_moe_scratch_floats of the model's layers, or NULL
    float *conv_state, *ssm_state;       // a DeltaNet layer's states in the pool: [slots, C, K − 1], [slots, H, Dk, Dv]
    const int64_t* state_slots;          // [B]: each sequence's slot in them
    float* mixer_scratch;                // the attention gate's [B, H·D], or a DeltaNet's (kvlab_deltanet_scratch_floats)
    double* phase_seconds;               // [PHASES]: each part's wall time added here (decode.c), or NULL: none timed
} Step;

// A run of layers in one call (kvlab_decode_layers): what differs from layer to layer is in its LayerStep,
// the step's fields set from it before the layer runs: its K/V storage, its rotary table's angles and its
// KV group's view (indices into the step's tables, −1 for a DeltaNet layer, which has neither) or a
// DeltaNet's states.
typedef struct {
    const float *cos, *signed_sin;  // [B, rotary dim]: one rotary table's angles at the step's positions
} Angles;

typedef struct {  // one KV group's tables as a layer with one window reads them (Step's fields of the same names)
    const int64_t *slots, *block_tables;
    int64_t table_stride;
    const int64_t *num_keys, *first_key;
} KVView;

typedef struct {
    const Layer* layer;
    KVStore k, v;
    int32_t angles, view;            // indices into the step's Angles and KVView tables, or −1
    float *conv_state, *ssm_state;   // a DeltaNet layer's states, or NULL
} LayerStep;

// The parts of a layer a step can time (Step.phase_seconds): its matrix products (a mixture's experts
// too), its mixer (attention with RoPE and the new K/V's writes, or a Gated DeltaNet with its own products), the rest (norms,
// residuals, the gated activation, all-reduces). kvlab/backends/cpu.py names them in this order.
enum { PHASE_PRODUCTS = 0, PHASE_MIXER = 1, PHASE_OTHER = 2, PHASES = 3 };

// A Gated DeltaNet's decode step (deltanet.c): x [B, hidden] the normalised input, overwritten with the
// mixer's output; the layer's conv and delta-rule states updated in place. 0, or -1 for sizes out of range.
int kvlab_deltanet_mixer(const DeltaNet* d, const Step* S, float* x, int64_t hidden, int threads);

// Attention splits each sequence's keys into chunks of CHUNK_KEYS (a fixed size, so that no value
// depends on the thread count): one work item per (sequence, chunk), every head at once. Each item
// leaves, per query head, its chunk's largest score, sum of weights and weighted sum of values; the
// chunks are then merged (flash-decoding). At one sequence and a long context that keeps every thread
// busy, whatever the number of kv heads, and each item reads whole blocks of the cache in order.
#define CHUNK_KEYS 128

static inline int64_t num_chunks(int64_t max_keys) { return (max_keys + CHUNK_KEYS - 1) / CHUNK_KEYS; }

// Attention of a decode step (attention.c): q (after RoPE) against every key each sequence's window
// shows, out [B, H·D] the heads' outputs; scores and partial are scratch (kvlab_decode_scratch_floats)
void kvlab_decode_attention(const Layer* L, const Step* S, const float* qkv, float* out, float* scores, float* partial,
                            int threads);
// The same for B one-token rows outside the decode step (attention.c): q's rows q_row floats apart, their
// K/V already stored; scratch: kvlab_paged_attention_scratch_floats(B, H, D, max_keys) floats
int64_t kvlab_paged_attention_scratch_floats(int64_t batch, int64_t heads, int64_t head_dim, int64_t max_keys);
void kvlab_paged_attention(const Layer* L, const Step* S, const float* q, int64_t q_row, float* out, float* scratch,
                           int threads);

#endif
