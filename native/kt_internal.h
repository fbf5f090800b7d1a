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

/* ---- The implementations: one table, best first (dispatch.c) ----
 * Which code runs on this CPU is decided in dispatch.c only: every kernel family takes its per-ISA functions from
 * the row kt_impl_get() returns. A row holds the id that KTCONVERT_FORCE_IMPL and `impl` arguments name, the
 * variant name (what `ktconvert env` shows), the KT_CPU_* features it needs, and one kernel table per family; each
 * table's type is completed by its family's source file. Several rows may share an id: the first supported one
 * runs (avx512 with VNNI before plain avx512). */
typedef struct kt_mse_kernels kt_mse_kernels;       /* amx_mse.c */
typedef struct kt_decode_kernels kt_decode_kernels; /* quant_decode.c */
typedef struct kt_gguf_kernels kt_gguf_kernels;     /* gguf_dequant.c */
typedef struct kt_rt_kernels kt_rt_kernels;         /* kt_runtime.h */
typedef struct kt_ctq_kernels kt_ctq_kernels;       /* ct_quant.c */

typedef struct {
    int id;                 /* KT_IMPL_SCALAR | KT_IMPL_AVX2 | KT_IMPL_AVX512 */
    const char *name;       /* "scalar" | "avx2" | "avx512": the name of the id */
    const char *variant;    /* e.g. "avx512-vnni": this row's kernels */
    int required;           /* KT_CPU_* bits that must all be usable */
    const kt_amx_kernels *amx;
    const kt_mse_kernels *mse;
    const kt_decode_kernels *decode;
    const kt_gguf_kernels *gguf;
    const kt_rt_kernels *runtime;
    const kt_ctq_kernels *ctq;
} kt_impl;

/* The row a call with `impl` runs: KT_IMPL_AUTO -> the choice made once per process (best supported, or
 * KTCONVERT_FORCE_IMPL); an id -> the best supported row of that id. NULL with *status = KT_E_IMPL (not supported
 * here) or KT_E_ARG (unknown id / name). */
const kt_impl *kt_impl_get(int impl, int *status);

/* Floating-point environment for one call, restored by kt_fpenv_leave:
 *   kt_fpenv_enter       round to nearest even + FTZ/DAZ on x86 (kt-kernel's mode; C99 fenv rounding elsewhere)
 *   kt_fpenv_enter_ieee  round to nearest even, no FTZ/DAZ (numpy's and torch's mode: subnormals kept) */
typedef struct {
    unsigned int saved;
} kt_fpenv;
void kt_fpenv_enter(kt_fpenv *env);
void kt_fpenv_enter_ieee(kt_fpenv *env);
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
