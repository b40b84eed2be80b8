// Gated DeltaNet's decode step (kvlab/model/deltanet.py): B sequences, one token each, their states updated
// in place in the state pool. Float32 throughout, as the modules compute it.
//
// Per sequence b (state slot slots[b]) and channel c of the conv input x = mixed[b] [C]:
//     y_c = silu(Σ_j<K−1 conv_state[c][j]·w[c][j] + x_c·w[c][K−1]);   conv_state[c] ← (conv_state[c][1:], x_c)
// y splits into q, k [Hk·Dk] and v [H·Dv]; q and k are l2-normalised per key head (eps 1e-6), q scaled by
// 1/√Dk. Value head h reads key head h / (H/Hk) (grouped), or h mod Hk (`tiled`: llama.cpp's qwen35 order):
//     S ← e^{g} S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq                     S: [Dk, Dv], row-major
// A work item is one (sequence, value head): items never share a state, so any split gives the same bits.
// The conv and the norms run first, per sequence, on the calling thread.
//
// Two entries: `kvlab_deltanet_decode_f32` (the recurrence alone, for the modules' decode rows) and
// `kvlab_deltanet_mixer` (the whole mixer as one layer of the C decode step, decode.c: in_proj, the gates
// β = sigmoid(b) and g = −exp(A_log)·softplus(a + dt_bias), the recurrence, the gated norm, out_proj).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "step.h"

typedef struct {
    const float* qkv;    // [B, C] (row stride ldx) after the conv and the norms (q scaled)
    int64_t ldx;
    const float* g;      // [B, H] log decay
    const float* beta;   // [B, H]
    float* ssm;          // [slots, H, Dk, Dv]
    const int64_t* slots;
    float* out;          // [B, H, Dv]
    int64_t C, H, Hk, Dk, Dv;
    int tiled;
} DeltaJob;

static float silu(float x) { return x / (1.0f + expf(-x)); }

static void l2norm(float* x, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = scale / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

static void delta_items(void* ctx, uint32_t begin, uint32_t end) {
    const DeltaJob* j = (const DeltaJob*)ctx;
    int64_t r = j->H / j->Hk;
    float kv[1024];  // Dv ≤ 1024 (checked by the caller)
    for (uint32_t item = begin; item < end; item++) {
        int64_t b = item / j->H, h = item % j->H;
        int64_t kh = j->tiled ? h % j->Hk : h / r;
        const float* row = j->qkv + b * j->ldx;
        const float* q = row + kh * j->Dk;
        const float* k = row + j->Hk * j->Dk + kh * j->Dk;
        const float* v = row + 2 * j->Hk * j->Dk + h * j->Dv;
        float* S = j->ssm + (j->slots[b] * j->H + h) * j->Dk * j->Dv;
        float decay = expf(j->g[b * j->H + h]), beta = j->beta[b * j->H + h];
        float* o = j->out + (b * j->H + h) * j->Dv;
        memset(kv, 0, sizeof(float) * j->Dv);
        for (int64_t a = 0; a < j->Dk; a++) {
            float* s = S + a * j->Dv;
            float ka = k[a];
            for (int64_t c = 0; c < j->Dv; c++) {
                s[c] *= decay;
                kv[c] += s[c] * ka;
            }
        }
        for (int64_t c = 0; c < j->Dv; c++) kv[c] = (v[c] - kv[c]) * beta;  // δ
        memset(o, 0, sizeof(float) * j->Dv);
        for (int64_t a = 0; a < j->Dk; a++) {
            float* s = S + a * j->Dv;
            float ka = k[a], qa = q[a];
            for (int64_t c = 0; c < j->Dv; c++) {
                s[c] += ka * kv[c];
                o[c] += s[c] * qa;
            }
        }
    }
}

// The conv, the norms and the recurrence of B rows: mixed [B, C] at row stride ldx (its conv input
// overwritten with the normalised conv output), w [C, K], conv [slots, C, K−1], ssm [slots, H, Dk, Dv]
// → out [B, H, Dv]. Returns 0, or −1 when a size is out of range.
static int recurrence(float* mixed, int64_t ldx, const float* g, const float* beta, const float* w, float* conv,
                      float* ssm, const int64_t* slots, float* out, int64_t B, int64_t C, int64_t K, int64_t H,
                      int64_t Hk, int64_t Dk, int64_t Dv, int tiled, int threads) {
    if (Dv > 1024 || K < 1 || Hk < 1 || H % Hk) return -1;
    for (int64_t b = 0; b < B; b++) {
        float* x = mixed + b * ldx;
        float* state = conv + slots[b] * C * (K - 1);
        for (int64_t c = 0; c < C; c++) {
            float* s = state + c * (K - 1);
            const float* wc = w + c * K;
            float acc = x[c] * wc[K - 1];
            for (int64_t t = 0; t < K - 1; t++) acc += s[t] * wc[t];
            if (K > 1) {
                memmove(s, s + 1, sizeof(float) * (K - 2));
                s[K - 2] = x[c];
            }
            x[c] = silu(acc);
        }
        for (int64_t kh = 0; kh < Hk; kh++) {
            l2norm(x + kh * Dk, Dk, 1.0f / sqrtf((float)Dk));
            l2norm(x + Hk * Dk + kh * Dk, Dk, 1.0f);
        }
    }
    DeltaJob job = {mixed, ldx, g, beta, ssm, slots, out, C, H, Hk, Dk, Dv, tiled};
    kvlab_pool_run(delta_items, &job, (uint32_t)(B * H), 1, threads);
    return 0;
}

// mixed [B, C] (overwritten with the normalised conv output), w [C, K], conv [slots, C, K−1], ssm [slots, H, Dk, Dv]
// → out [B, H, Dv]. Returns 0, or −1 when a size is out of range.
int kvlab_deltanet_decode_f32(float* mixed, const float* g, const float* beta, const float* w, float* conv, float* ssm,
                              const int64_t* slots, float* out, int64_t B, int64_t C, int64_t K, int64_t H,
                              int64_t Hk, int64_t Dk, int64_t Dv, int tiled, int threads) {
    return recurrence(mixed, C, g, beta, w, conv, ssm, slots, out, B, C, K, H, Hk, Dk, Dv, tiled, threads);
}

// ---- the whole mixer, as a layer of the decode step ---------------------------------------------

static inline int64_t conv_channels(const DeltaNet* d) {
    return 2 * d->key_heads * d->key_dim + d->value_heads * d->value_dim;
}

// in_proj's outputs of a row: the conv input, z, b, a
static inline int64_t projected(const DeltaNet* d) { return conv_channels(d) + d->value_heads * (d->value_dim + 2); }

int64_t kvlab_deltanet_scratch_floats(const DeltaNet* d, int64_t batch) {
    const int64_t H = d->value_heads;
    return batch * (projected(d) + 2 * H + H * d->value_dim);  // in_proj's outputs, g and β, the heads' outputs
}

// PyTorch's softplus (beta 1, threshold 20): x itself above the threshold
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

int kvlab_deltanet_mixer(const DeltaNet* d, const Step* S, float* x, int64_t hidden, int threads) {
    const int64_t B = S->batch, H = d->value_heads, Dv = d->value_dim, C = conv_channels(d), P = projected(d);
    float* proj = S->mixer_scratch;  // [B, P]: conv input | z | b | a
    float* g = proj + B * P;         // [B, H]
    float* beta = g + B * H;         // [B, H]
    float* o = beta + B * H;         // [B, H, Dv]
    kvlab_decode_linear(&d->in_proj, x, proj, B, P, threads);
    for (int64_t b = 0; b < B; b++) {
        const float *bs = proj + b * P + C + H * Dv, *as = bs + H;
        for (int64_t h = 0; h < H; h++) {
            beta[b * H + h] = 1.0f / (1.0f + expf(-bs[h]));
            g[b * H + h] = -expf(d->A_log[h]) * softplus(as[h] + d->dt_bias[h]);
        }
    }
    if (recurrence(proj, P, g, beta, d->conv_weight, S->conv_state, S->ssm_state, S->state_slots, o, B, C,
                   d->conv_kernel, H, d->key_heads, d->key_dim, Dv, d->tiled, threads))
        return -1;
    kvlab_rms_norm_f32(o, d->norm, o, B * H, Dv, d->norm_eps);  // each head over its Dv values
    for (int64_t b = 0; b < B; b++) {  // times silu(z)
        const float* z = proj + b * P + C;
        float* ob = o + b * H * Dv;
        for (int64_t i = 0; i < H * Dv; i++) ob[i] *= silu(z[i]);
    }
    kvlab_decode_linear(&d->out, o, x, B, hidden, threads);
    return 0;
}
