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

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

typedef struct {
    const float* qkv;    // [B, C] after the conv and the norms (q scaled)
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
        const float* row = j->qkv + b * j->C;
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

// mixed [B, C] (overwritten with the normalised conv output), w [C, K], conv [slots, C, K−1], ssm [slots, H, Dk, Dv]
// → out [B, H, Dv]. Returns 0, or −1 when a size is out of range.
int kvlab_deltanet_decode_f32(float* mixed, const float* g, const float* beta, const float* w, float* conv, float* ssm,
                              const int64_t* slots, float* out, int64_t B, int64_t C, int64_t K, int64_t H,
                              int64_t Hk, int64_t Dk, int64_t Dv, int tiled, int threads) {
    if (Dv > 1024 || K < 1 || Hk < 1 || H % Hk) return -1;
    for (int64_t b = 0; b < B; b++) {
        float* x = mixed + b * C;
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
    DeltaJob job = {mixed, g, beta, ssm, slots, out, C, H, Hk, Dk, Dv, tiled};
    kvlab_pool_run(delta_items, &job, (uint32_t)(B * H), 1, threads);
    return 0;
}
