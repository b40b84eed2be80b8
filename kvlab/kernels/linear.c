// A layer's products in the decode step: each part of a (fused) matrix through its own kernel — gemv.c
// for float matrices, quant.c for GGUF blocks (and their int8-activation form), mxfp4.c for MXFP4 —
// into its columns of y, then the bias. decode.c's dense layers and moe.c's experts both call it.

#include <stdint.h>

#include "step.h"

static int blocks_only(const Linear* l) {
    for (int p = 0; p < l->num_parts; p++)
        if (l->parts[p].kind != BLOCKS) return 0;
    return 1;
}

static void add_bias(const Linear* l, float* y, int64_t m, int64_t ldy) {
    if (l->bias)  // the blocks' products, then the bias: one rounding, as PackedLinear adds it
        for (int64_t i = 0; i < m; i++)
            for (int64_t o = 0; o < l->out; o++) y[i * ldy + o] += l->bias[o];
}

// y [m, l->out] (row stride ldy) = x [m, l->in] · Wᵀ + bias, part by part into its columns
void kvlab_decode_linear(const Linear* l, const float* x, float* y, int64_t m, int64_t ldy, int threads) {
    if (l->num_parts > 1 && blocks_only(l)) {  // q, k and v (gate and up) as one dispatch
        int fmt[MAX_PARTS];
        const uint8_t* w[MAX_PARTS];
        int64_t ldw[MAX_PARTS], rows[MAX_PARTS];
        for (int p = 0; p < l->num_parts; p++)
            fmt[p] = l->parts[p].fmt, w[p] = l->parts[p].w, ldw[p] = l->parts[p].ldw, rows[p] = l->parts[p].rows;
        kvlab_quant_matmul_parts(l->num_parts, fmt, w, ldw, rows, x, y, m, l->in, ldy, threads);
        add_bias(l, y, m, ldy);
        return;
    }
    int64_t column = 0;
    for (int p = 0; p < l->num_parts; p++) {
        const Part* part = &l->parts[p];
        if (part->kind == BLOCKS) {
            kvlab_quant_matmul(part->fmt, part->w, part->ldw, x, y + column, m, l->in, ldy, part->rows, threads);
        } else if (part->kind == MXFP4_BLOCKS) {
            kvlab_mxfp4_matmul(part->w, part->ldw, x, l->in, y + column, ldy, m, part->rows, l->in, threads);
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
    add_bias(l, y, m, ldy);
}
