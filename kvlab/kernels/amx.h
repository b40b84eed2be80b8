// What the kernels' AMX tile code shares (quant_i8.c's products, prompt_attention.c's bfloat16 form): the
// tile configuration and the bfloat16 pairs the B operand of TDPBF16PS holds. Built where the compiler
// targets AMX tiles on Linux; the OS's leave to use them is asked once (quant_i8.c's kvlab_t16_available).
#ifndef KVLAB_AMX_H
#define KVLAB_AMX_H

#if defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void tiles_load(const TileConfig* c) {
    __asm__ volatile("" : : "r"(c) : "memory");  // GCC otherwise drops the stores the load reads
    _tile_loadconfig(c);
}

// Every tile 16 rows of 64 bytes: 16 x 16 float32 sums, 16 x 32 bfloat16 operands
static inline void tiles_square(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    tiles_load(&c);
}

#if defined(__AVX512BF16__)
// (lo[r], hi[r]) as bfloat16 in 32-bit lane r: two consecutive values of K of output column r, the pair
// a row of TDPBF16PS's B operand holds
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif
#endif
#endif
