// The interleaved layout for 8-bit activations (quant_i8.c), called by quant.c's products.
#pragma once
#include <stdint.h>

// quant.c's format ids (its FORMATS order) of the formats with an interleaved form
enum { KVLAB_Q8_0 = 3, KVLAB_Q4_0, KVLAB_Q4_1, KVLAB_Q5_0, KVLAB_Q4_K, KVLAB_Q5_K, KVLAB_Q6_K };

int64_t kvlab_i8_bytes(int fmt, int64_t rows, int64_t n);
int kvlab_i8_repack(int fmt, const uint8_t* w, int64_t ldw, int64_t rows, int64_t n, int block_values,
                    int block_bytes, uint8_t* out);
int kvlab_i8_matmul(int fmt, const uint8_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t ldy,
                    int64_t out, int threads);
int kvlab_i8_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* out, const float* x,
                          float* y, int64_t m, int64_t n, int64_t ldy, int threads);
// Exact products of interleaved matrices on AMX bfloat16 tiles (formats "<fmt>t16"); −1 where there are none
int kvlab_t16_matmul(int fmt, const uint8_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t ldy,
                     int64_t out, int threads);
int kvlab_t16_matmul_parts(int num, const int* fmt, const uint8_t* const* w, const int64_t* out, const float* x,
                           float* y, int64_t m, int64_t n, int64_t ldy, int threads);
// Whether this build and machine have them
int kvlab_t16_available(void);
// The rows from which a pass multiplies in bfloat16 on AMX tiles instead (0: never, on this machine)
int kvlab_i8_bf16_rows(void);
// Whether a pass of m rows over n inputs goes in bfloat16 on the tiles (kvlab_i8_matmul_parts: one job for all parts)
int kvlab_i8_bf16_pass(int64_t m, int64_t n);
// A gated MLP's act(x · gateᵀ) · (x · upᵀ) in one pass (bfloat16 tiles, vpdpbusd or AVX2); −1 where it is not
// (see quant_i8.c)
int kvlab_i8_gated(const int* fmt, const uint8_t* const* w, int64_t I, const float* x, float* y, int64_t m, int64_t n,
                   int64_t ldy, int act, int threads);
// The rows from which kvlab_i8_gated takes a pass (0: never, on this machine or build)
int kvlab_i8_gated_rows(void);
