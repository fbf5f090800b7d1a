/* Internal declarations shared by the native/ sources (not part of the ABI). */
#ifndef KT_INTERNAL_H
#define KT_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kt_native.h"

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#define KT_X86 1
#endif

/* kt-format.md 2.1 / 2.2 constants. */
#define KT_N_STEP 32         /* rows per panel */
#define KT_K_BLOCK 3584      /* columns per K-block (the last one may be shorter) */
#define KT_TILE_BYTES 2048   /* one tile: two transposed 16x16-dword halves */
#define KT_INT4_TILE_COLS 128
#define KT_INT8_TILE_COLS 64

/* Per-ISA kernels of the AMX quantizer. Every implementation must give identical results.
 *   row_amax_bits: max over the row of (bits & 0x7fff): the |x| of the largest magnitude as BF16 bits
 *                  (0x7f80 or more means Inf/NaN; below 0x0080 means zero or subnormal).
 *   tile_int4:     32 rows x 128 columns of BF16 (row stride `stride` elements) -> one 2048-byte INT4 tile.
 *   tile_int8:     32 rows x 64 columns -> one 2048-byte INT8 tile.
 *   inv:           the 32 per-row reciprocals 1/d (0 for d == 0). */
typedef struct {
    uint16_t (*row_amax_bits)(const uint16_t *row, int64_t k);
    void (*tile_int4)(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile);
    void (*tile_int8)(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile);
} kt_amx_kernels;

extern const kt_amx_kernels kt_amx_kernels_scalar;
#ifdef KT_X86
extern const kt_amx_kernels kt_amx_kernels_avx2;
extern const kt_amx_kernels kt_amx_kernels_avx512;
#endif

/* Floating-point environment for one call (see kt_native.h): set RNE (+FTZ/DAZ on x86), restore afterwards. */
typedef struct {
    unsigned int saved;
} kt_fpenv;
void kt_fpenv_enter(kt_fpenv *env);
void kt_fpenv_leave(const kt_fpenv *env);

/* Bit-level float helpers shared by every kernel file. */
static inline float kt_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t kt_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float kt_bf16_to_f32(uint16_t b) { return kt_f32_from_bits((uint32_t)b << 16); }

/* float32 -> BF16 bits, round-to-nearest-even; NaN -> (bits >> 16) | 0x0040 (quiet, top payload kept), exactly as
 * ktconvert/quant/bf16.py. Branch-free so loops over it vectorize. */
static inline uint16_t kt_f32_to_bf16(float x) {
    const uint32_t u = kt_f32_bits(x);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    const uint16_t quiet = (uint16_t)((u >> 16) | 0x0040u);
    return (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}

#endif /* KT_INTERNAL_H */
