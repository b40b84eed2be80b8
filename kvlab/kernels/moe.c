// The mixture-of-experts MLP of a decode step (step.h's Moe; kvlab/model/moe.py, its experts run by
// Experts.forward_by_expert, is the same computation in PyTorch, and the oracle).
//
// B rows (one new token per sequence) → router logits [B, E] → each row's top_k experts and weights
// (softmax over E then top-k, renormalised or not: Qwen, OLMoE; or top-k of the logits then softmax over
// them: gpt-oss). The rows are then grouped by expert: expert e's rows are gathered into one [n, hidden]
// matrix and multiplied by its gate/up and down matrices once — a chosen expert's blocks cross the memory
// bus once per step, whatever the number of rows that chose it, and an expert nobody chose is never read.
// Outputs are added into `out` expert by expert in ascending order, as the modules' index_add does; the
// shared expert (Qwen2-MoE), scaled by sigmoid(its gate), is added last.
//
// A prompt's experts (kvlab_moe_experts, below) take the same path for rows the modules routed: the
// Experts module's forward on a CPU (kernels/moe_prefill.py).

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "step.h"

// Floats of scratch kvlab_moe needs beyond `out` (the caller's [B, hidden] output goes first):
// logits [B, E], chosen weights [B, k] and ids [B, k] (as int32), the grouped order [B·k] (int32), the
// chosen experts and where their rows start [B·k + 1] (int32 each), and for every (row, slot) pair its
// gathered row [hidden], gate/up [2·max(I, I_shared)], activation [max(I, I_shared)] and output [hidden],
// the shared gate [B].
int64_t kvlab_moe_scratch_floats(const Moe* m, int64_t batch, int64_t hidden) {
    const int64_t width = m->expert_size > m->shared_size ? m->expert_size : m->shared_size;
    const int64_t pairs = batch * m->top_k;
    return batch * (hidden + m->num_experts + 1) + 3 * pairs + 2 * (pairs + 1) + pairs * (2 * hidden + 3 * width);
}

// Row b's experts and weights from its logits, as kvlab/model/moe.py's `route` chooses them
static void route(const Moe* m, const float* logits, float* weights, int32_t* ids) {
    const int64_t E = m->num_experts, k = m->top_k;
    float probs[E];
    if (m->routing == ROUTE_SOFTMAX_TOPK) {  // softmax over every expert first
        float top = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) top = logits[e] > top ? logits[e] : top;
        for (int64_t e = 0; e < E; e++) sum += probs[e] = expf(logits[e] - top);
        for (int64_t e = 0; e < E; e++) probs[e] /= sum;
    } else {
        memcpy(probs, logits, E * sizeof(float));
    }
    for (int64_t j = 0; j < k; j++) {  // the k largest, in decreasing order (the lower id first on a tie)
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = (int32_t)best;
        weights[j] = probs[best];
    }
    if (m->routing == ROUTE_TOPK_SOFTMAX) {  // softmax over the chosen logits
        const float top = weights[0];  // the largest
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(weights[j] - top);
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
    } else if (m->norm_topk_prob) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
    }
}

// Expert e's matrix: expert 0's parts moved by e · stride, its bias row e
static Linear expert_linear(const Linear* first, const int64_t* stride, const float* bias, int64_t e) {
    Linear l = *first;
    for (int p = 0; p < l.num_parts; p++) l.parts[p].w = (const uint8_t*)l.parts[p].w + e * stride[p];
    l.bias = bias ? bias + e * l.out : NULL;
    return l;
}

// act [n, I] from gate/up [n, 2I] (gate first): SiLU(gate)·up, or gpt-oss's clamped SwiGLU (one value at a time)
static void activate(const Moe* m, const float* gate_up, float* act, int64_t n, int64_t I, int32_t kind) {
    if (kind != EXPERT_CLAMPED_SWIGLU) {  // the dense MLP's own (gemv.c: 8 values at a time)
        kvlab_gated_act_f32(gate_up, act, n, I, ACT_SILU);
        return;
    }
    for (int64_t r = 0; r < n; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        float* a = act + r * I;
        const float limit = m->swiglu_limit, alpha = m->swiglu_alpha;
        for (int64_t i = 0; i < I; i++) {
            const float gi = g[i] > limit ? limit : g[i];
            const float ui = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
            a[i] = (ui + 1.0f) * (gi / (1.0f + expf(-gi * alpha)));
        }
    }
}

// One expert's n rows, each pair's input row order[r] / top_k of x: gathered, gate/up, the activation, down into y
static void expert_rows(const Moe* m, int64_t e, const float* x, const int32_t* order, int64_t n, int64_t H,
                        float* rows, float* gate_up, float* act, float* y) {
    const int64_t I = m->expert_size, k = m->top_k;
    for (int64_t r = 0; r < n; r++) memcpy(rows + r * H, x + (order[r] / k) * H, H * sizeof(float));
    const Linear gu = expert_linear(&m->gate_up, m->gate_up_stride, m->gate_up_bias, e);
    const Linear dn = expert_linear(&m->down, m->down_stride, m->down_bias, e);
    kvlab_decode_linear(&gu, rows, gate_up, n, 2 * I, 1);
    activate(m, gate_up, act, n, I, m->activation);
    kvlab_decode_linear(&dn, act, y, n, H, 1);
}

// The chosen experts of a step, each with its rows: expert[j]'s (row, slot) pairs are order[start[j] ..
// start[j + 1]), and its working rows sit at the same offsets of rows / gate_up / act / y.
typedef struct {
    const Moe* m;
    const float* x;  // [B, hidden]
    int64_t hidden, width;
    const int32_t *order, *expert, *start;
    float *rows, *gate_up, *act, *y;
} Chosen;

// Experts [begin, end) of the chosen, each on this thread alone: gather its rows, gate/up, activation,
// down. An expert's numbers do not depend on the thread or on the other experts (the products' rows
// never do), so the step's result is the same on any number of threads and for any batch.
static void expert_items(void* ctx, uint32_t begin, uint32_t end) {
    const Chosen* c = ctx;
    const Moe* m = c->m;
    const int64_t H = c->hidden;
    for (uint32_t j = begin; j < end; j++) {
        const int64_t s = c->start[j], n = c->start[j + 1] - s;
        float *rows = c->rows + s * H, *gate_up = c->gate_up + s * 2 * c->width, *act = c->act + s * c->width;
        expert_rows(m, c->expert[j], c->x, c->order + s, n, H, rows, gate_up, act, c->y + s * H);
    }
}

void kvlab_moe(const Moe* m, const float* x, float* out, int64_t B, int64_t hidden, float* scratch, int threads) {
    const int64_t E = m->num_experts, k = m->top_k, I = m->expert_size, pairs = B * m->top_k;
    const int64_t width = I > m->shared_size ? I : m->shared_size;
    float* logits = scratch;
    float* weights = logits + B * E;
    int32_t* ids = (int32_t*)(weights + pairs);
    int32_t* order = ids + pairs;
    int32_t* expert = order + pairs;
    int32_t* start = expert + pairs + 1;
    float* rows = (float*)(start + pairs + 1);
    float* gate_up = rows + pairs * hidden;
    float* act = gate_up + pairs * 2 * width;
    float* y = act + pairs * width;
    float* gate = y + pairs * hidden;

    kvlab_decode_linear(&m->router, x, logits, B, E, threads);
    for (int64_t b = 0; b < B; b++) route(m, logits + b * E, weights + b * k, ids + b * k);
    int64_t n = 0, chosen = 0;  // the (row, slot) pairs grouped by expert, ascending, each in row order
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = n;
        for (int64_t i = 0; i < pairs; i++)
            if (ids[i] == e) order[n++] = (int32_t)i;
        if (n > first) expert[chosen] = (int32_t)e, start[chosen++] = (int32_t)first;  // an unchosen one: never read
    }
    start[chosen] = (int32_t)n;
    // one job for the step: each thread takes whole experts (no barrier between an expert's products)
    Chosen c = {m, x, hidden, width, order, expert, start, rows, gate_up, act, y};
    kvlab_pool_run(expert_items, &c, (uint32_t)chosen, 1, threads);
    memset(out, 0, B * hidden * sizeof(float));
    for (int64_t j = 0; j < n; j++) {  // added expert by expert in ascending order, as the modules' index_add
        float* o = out + (order[j] / k) * hidden;
        const float w = weights[order[j]];
        for (int64_t col = 0; col < hidden; col++) o[col] += y[j * hidden + col] * w;
    }
    if (!m->shared_size) return;
    const int64_t Is = m->shared_size;
    kvlab_decode_linear(&m->shared_gate_up, x, gate_up, B, 2 * Is, threads);
    activate(m, gate_up, act, B, Is, EXPERT_SILU);
    kvlab_decode_linear(&m->shared_down, act, y, B, hidden, threads);
    if (m->shared_gate.num_parts) kvlab_decode_linear(&m->shared_gate, x, gate, B, 1, threads);
    for (int64_t b = 0; b < B; b++) {
        const float g = m->shared_gate.num_parts ? 1.0f / (1.0f + expf(-gate[b])) : 1.0f;
        for (int64_t c = 0; c < hidden; c++) out[b * hidden + c] += g * y[b * hidden + c];
    }
}

// ---- a prompt's experts ---------------------------------------------------------------------------
// A prompt chunk's N rows, already routed (weights and ids [N, k] from kvlab/model/moe.py's `route`, any
// of its routings): the Experts module's forward in one call. Its per-expert loop from Python cost a pool
// dispatch and a few PyTorch ops per expert and matrix, and those ops woke PyTorch's OpenMP workers, which
// then spun on the cores the pool's threads needed. Here the rows are grouped by expert, each expert's rows
// cut into tiles of TILE_ROWS (quant.c's rows per pass over the blocks: the blocks are decoded once per
// tile), and the tiles of every chosen expert are one job for the pool: gather, gate/up, activation, down,
// each tile on one thread. A row's numbers do not depend on the rows beside it (quant.c's kernels), so the
// tiling, the threads and N change no bit. Then each row sums its experts' weighted outputs in ascending
// expert order, each product rounded before it is added, as the module's index_add does. Rows go through in
// rounds of as many as the pairs' outputs of ROUND_FLOATS floats allow (1,024 rows of Qwen3-30B-A3B's: at
// 8 of 128 experts, about 64 rows per expert), so that the scratch stays bounded.

#define TILE_ROWS 32            // rows per tile: quant.c's MAX_M, one pass over the expert's blocks
#define ROUND_FLOATS (1 << 24)  // the (row, slot) pairs' outputs of one round: 64 MiB
#define MAX_SLOTS 64            // threads, each with its own tile buffers

// The ints of one round's grouping: order and where [pairs], each tile's expert and first pair [tiles + 1]
static int64_t grouping_ints(const Moe* m, int64_t rows) {
    const int64_t pairs = rows * m->top_k, tiles = pairs / TILE_ROWS + m->num_experts;
    return 2 * pairs + 2 * (tiles + 1) + m->num_experts + 1;
}

static int64_t work_floats(const Moe* m, int64_t hidden) {  // one thread's tile: rows, gate/up, activation
    return TILE_ROWS * (hidden + 3 * m->expert_size);
}

static int64_t round_rows(const Moe* m, int64_t hidden) {  // rows per round of grouping and summing
    const int64_t rows = ROUND_FLOATS / (m->top_k * hidden);
    return rows > 1 ? rows : 1;
}

// Floats of scratch kvlab_moe_experts needs for `rows` rows (taken round_rows at a time): the grouping (as
// int32), every pair's output [pairs, hidden], and one tile's buffers per thread.
int64_t kvlab_moe_experts_scratch_floats(const Moe* m, int64_t rows, int64_t hidden, int threads) {
    rows = rows < round_rows(m, hidden) ? rows : round_rows(m, hidden);
    threads = threads < 1 ? 1 : threads > MAX_SLOTS ? MAX_SLOTS : threads;
    return grouping_ints(m, rows) + rows * m->top_k * hidden + threads * work_floats(m, hidden);
}

// One round's tiles: tile t computes pairs first[t] .. first[t + 1] of `order` (all of expert[t]'s, or
// TILE_ROWS of them), writing each pair's output at its place in y.
typedef struct {
    const Moe* m;
    const float* x;  // [rows, hidden]
    int64_t hidden;
    const int32_t *order, *expert, *first;
    float* y;                // [pairs, hidden]
    float* work;             // `slots` tile buffers of work_floats each
    _Atomic uint64_t taken;  // the buffers in use, one bit each
} Tiles;

// A free tile buffer: at most `threads` tasks of a job run at once (the caller and its helpers), and
// there are as many buffers.
static int take_slot(Tiles* t) {
    for (;;) {
        uint64_t taken = atomic_load_explicit(&t->taken, memory_order_relaxed);
        const int s = __builtin_ctzll(~taken);
        if (atomic_compare_exchange_weak_explicit(&t->taken, &taken, taken | (uint64_t)1 << s, memory_order_acquire,
                                                  memory_order_relaxed))
            return s;
    }
}

static void tile_items(void* ctx, uint32_t begin, uint32_t end) {
    Tiles* t = ctx;
    const Moe* m = t->m;
    const int64_t H = t->hidden, I = m->expert_size;
    const int s = take_slot(t);
    float* rows = t->work + s * work_floats(m, H);
    float* gate_up = rows + TILE_ROWS * H;
    float* act = gate_up + TILE_ROWS * 2 * I;
    for (uint32_t j = begin; j < end; j++) {
        const int64_t p = t->first[j], n = t->first[j + 1] - p;
        expert_rows(m, t->expert[j], t->x, t->order + p, n, H, rows, gate_up, act, t->y + p * H);
    }
    atomic_fetch_and_explicit(&t->taken, ~((uint64_t)1 << s), memory_order_release);
}

// Rows [begin, end) of a round: out[row] = Σ weight · y over the row's slots in ascending expert order
typedef struct {
    const Moe* m;
    const float* weights;  // [rows, k]
    const int64_t* ids;    // [rows, k]
    const int32_t* where;  // [pairs]: each pair's place in the grouped order
    const float* y;        // [pairs, hidden]
    float* out;            // [rows, hidden]
    int64_t hidden;
} Sums;

__attribute__((optimize("fp-contract=off")))  // product, then sum: the module's rounding, not an FMA's
static void sum_items(void* ctx, uint32_t begin, uint32_t end) {
    const Sums* s = ctx;
    const int64_t H = s->hidden, k = s->m->top_k;
    for (int64_t row = begin; row < end; row++) {
        int32_t slot[k];  // the row's slots by ascending expert id (its k experts are distinct)
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j;
            for (; i > 0 && s->ids[row * k + slot[i - 1]] > s->ids[row * k + j]; i--) slot[i] = slot[i - 1];
            slot[i] = (int32_t)j;
        }
        float* o = s->out + row * H;
        memset(o, 0, H * sizeof(float));
        for (int64_t j = 0; j < k; j++) {
            const int64_t pair = row * k + slot[j];
            const float w = s->weights[pair], *y = s->y + s->where[pair] * H;
            for (int64_t c = 0; c < H; c++) {
                const float product = y[c] * w;
                o[c] += product;
            }
        }
    }
}

// out [N, hidden] = Σ over each row's k experts (ids [N, k], weights [N, k]) of weight · expert(x row),
// x [N, hidden]; scratch: kvlab_moe_experts_scratch_floats(m, N, hidden, threads) floats.
void kvlab_moe_experts(const Moe* m, const float* x, const float* weights, const int64_t* ids, float* out, int64_t N,
                       int64_t hidden, float* scratch, int threads) {
    const int64_t E = m->num_experts, k = m->top_k, per_round = round_rows(m, hidden);
    threads = threads < 1 ? 1 : threads > MAX_SLOTS ? MAX_SLOTS : threads;
    for (int64_t r0 = 0; r0 < N; r0 += per_round) {
        const int64_t rows = N - r0 < per_round ? N - r0 : per_round, pairs = rows * k;
        const int64_t* round_ids = ids + r0 * k;
        int32_t* order = (int32_t*)scratch;
        int32_t* where = order + pairs;
        int32_t* expert = where + pairs;
        int32_t* first = expert + pairs / TILE_ROWS + E + 1;
        int32_t* start = first + pairs / TILE_ROWS + E + 1;  // [E + 1]: where each expert's pairs begin
        float* y = scratch + grouping_ints(m, rows);

        // counting sort of the pairs by expert, stable: each expert's pairs in row order
        memset(start, 0, (E + 1) * sizeof(int32_t));
        for (int64_t i = 0; i < pairs; i++) start[round_ids[i] + 1]++;
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        for (int64_t i = 0; i < pairs; i++) where[i] = start[round_ids[i]]++, order[where[i]] = (int32_t)i;
        int64_t tiles = 0, p = 0;  // start[e] is now where expert e's pairs end, and the next one's begin
        for (int64_t e = 0; e < E; e++)
            for (; p < start[e]; p = p + TILE_ROWS < start[e] ? p + TILE_ROWS : start[e])
                expert[tiles] = (int32_t)e, first[tiles++] = (int32_t)p;
        first[tiles] = (int32_t)pairs;

        Tiles job = {m, x + r0 * hidden, hidden, order, expert, first, y, y + pairs * hidden, 0};
        kvlab_pool_run(tile_items, &job, (uint32_t)tiles, 1, threads);
        Sums sums = {m, weights + r0 * k, round_ids, where, y, out + r0 * hidden, hidden};
        kvlab_pool_run(sum_items, &sums, (uint32_t)rows, 16, threads);
    }
}
