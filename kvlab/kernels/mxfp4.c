// MXFP4 blocks (gpt-oss's experts; GGML type MXFP4): dequantization and the product with a few rows.
//
// A block is 32 weights in 17 bytes: an E8M0 exponent e, then 16 bytes of FP4 (E2M1) codes, byte j holding
// weight j in its low nibble and weight j + 16 in its high one. Like ggml, the codes are kept doubled
// (MXFP4_VALUES) and the scale halved: w = 2^(e − 128) · value[q], the float32 product of two exact
// numbers, so the dequantization is bit for bit kvlab/quant/formats.py's and the gguf package's.
//
// kvlab_mxfp4_matmul reads each block once for all the rows of x (a decode step's B rows, or the rows that
// chose one expert), so a weight row's bytes cross the memory bus once per call whatever the number of
// rows. Output rows are the pool's work items (4 at a time); each is summed in one fixed order, so the
// result does not depend on the thread count.

#include <stdint.h>
#include <string.h>

#include "pool.h"

#define MXFP4_VALUES_PER_BLOCK 32
#define MXFP4_BLOCK_BYTES 17
#define MXFP4_MAX_ROWS 64  // rows of x one call multiplies (the thread policy's kernel rows are 32)
#define ROWS_PER_ITEM 4

typedef float v8 __attribute__((vector_size(32)));

static const float VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float half_scale(uint8_t e) {  // 2^(e − 128), from its bits as ggml builds it
    uint32_t bits = e < 2 ? (uint32_t)0x00200000 << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline void decode_block(const uint8_t* b, float* w) {  // 32 weights of one block
    const float d = half_scale(b[0]);
    for (int j = 0; j < 16; j++) {
        w[j] = d * VALUES[b[1 + j] & 0x0F];
        w[j + 16] = d * VALUES[b[1 + j] >> 4];
    }
}

typedef struct {
    const uint8_t* w;
    int64_t ldw;  // bytes per weight row
    const float* x;
    int64_t ldx;
    float* y;
    int64_t ldy;
    int64_t rows_x, out_features, blocks;
    float* out;  // dequantize: the float32 rows
    int64_t ldo;
} Job;

static void matmul_items(void* ctx, uint32_t begin, uint32_t end) {
    const Job* job = ctx;
    const int64_t R = job->rows_x;
    v8 acc[MXFP4_MAX_ROWS][4];
    float w[MXFP4_VALUES_PER_BLOCK] __attribute__((aligned(32)));
    for (int64_t o = (int64_t)begin * ROWS_PER_ITEM; o < (int64_t)end * ROWS_PER_ITEM && o < job->out_features; o++) {
        const uint8_t* row = job->w + o * job->ldw;
        memset(acc, 0, sizeof(v8) * 4 * R);
        for (int64_t b = 0; b < job->blocks; b++) {
            decode_block(row + b * MXFP4_BLOCK_BYTES, w);
            v8 wv[4];
            memcpy(wv, w, sizeof wv);
            for (int64_t r = 0; r < R; r++) {
                const float* xr = job->x + r * job->ldx + b * MXFP4_VALUES_PER_BLOCK;
                for (int q = 0; q < 4; q++) {
                    v8 xv;
                    memcpy(&xv, xr + 8 * q, sizeof xv);
                    acc[r][q] += wv[q] * xv;
                }
            }
        }
        for (int64_t r = 0; r < R; r++) {
            v8 s = (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]);
            float total = 0.0f;
            for (int l = 0; l < 8; l++) total += s[l];
            job->y[r * job->ldy + o] = total;
        }
    }
}

static void dequantize_items(void* ctx, uint32_t begin, uint32_t end) {
    const Job* job = ctx;
    for (int64_t o = (int64_t)begin * ROWS_PER_ITEM; o < (int64_t)end * ROWS_PER_ITEM && o < job->out_features; o++)
        for (int64_t b = 0; b < job->blocks; b++)
            decode_block(job->w + o * job->ldw + b * MXFP4_BLOCK_BYTES,
                         job->out + o * job->ldo + b * MXFP4_VALUES_PER_BLOCK);
}

static uint32_t num_items(int64_t out_features) {
    return (uint32_t)((out_features + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM);
}

// The block format's facts, for the Python side's handshake: values and bytes per block.
void kvlab_mxfp4_block(int* values, int* bytes) {
    *values = MXFP4_VALUES_PER_BLOCK;
    *bytes = MXFP4_BLOCK_BYTES;
}

// out [rows, in_features] float32 (row stride ldo) = the MXFP4 rows w (row stride ldw bytes), dequantized.
// Returns 0, or -1 when in_features is not a whole number of blocks.
int kvlab_mxfp4_dequantize(const uint8_t* w, int64_t ldw, float* out, int64_t ldo, int64_t rows,
                           int64_t in_features, int threads) {
    if (in_features % MXFP4_VALUES_PER_BLOCK || rows < 0) return -1;
    Job job = {.w = w, .ldw = ldw, .out = out, .ldo = ldo, .out_features = rows,
               .blocks = in_features / MXFP4_VALUES_PER_BLOCK};
    if (rows) kvlab_pool_run(dequantize_items, &job, num_items(rows), 4, threads);
    return 0;
}

// y [rows_x, out_features] (row stride ldy) = x [rows_x, in_features] (row stride ldx) · Wᵀ, W the MXFP4
// matrix [out_features, in_features] (row stride ldw bytes). Returns 0, or -1 for a shape it does not take.
int kvlab_mxfp4_matmul(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, float* y, int64_t ldy,
                       int64_t rows_x, int64_t out_features, int64_t in_features, int threads) {
    if (in_features % MXFP4_VALUES_PER_BLOCK || rows_x < 0 || rows_x > MXFP4_MAX_ROWS) return -1;
    Job job = {.w = w, .ldw = ldw, .x = x, .ldx = ldx, .y = y, .ldy = ldy, .rows_x = rows_x,
               .out_features = out_features, .blocks = in_features / MXFP4_VALUES_PER_BLOCK};
    if (rows_x && out_features) kvlab_pool_run(matmul_items, &job, num_items(out_features), 4, threads);
    return 0;
}
