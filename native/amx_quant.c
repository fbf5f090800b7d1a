/* AMXINT4 / AMXINT8 driver: shape checks, per-row scales, the N-block / K-block / panel / tile walk
 * (kt-format.md 2.0-2.2). The per-tile work is done by the ISA kernels of the implementation dispatch.c picks. */
#include <float.h>

#include "kt_internal.h"

KT_API int64_t kt_amx_nblock_rows(int bits) { return bits == 4 ? 128 : bits == 8 ? 64 : 0; }

KT_API int64_t kt_amx_nblocks(int64_t n, int bits) {
    int64_t rows = kt_amx_nblock_rows(bits);
    return (rows > 0 && n > 0) ? (n + rows - 1) / rows : 0;
}

KT_API int kt_amx_check_shape(int64_t n, int64_t k, int bits) {
    if (bits != 4 && bits != 8) return KT_E_ARG;
    int64_t k_multiple = bits == 4 ? KT_INT4_TILE_COLS : KT_INT8_TILE_COLS;
    if (n <= 0 || k <= 0 || n % KT_N_STEP != 0 || k % k_multiple != 0) return KT_E_SHAPE;
    if (n > INT64_MAX / k) return KT_E_SHAPE;
    return KT_OK;
}

/* d and 1/d of one row from its largest |x| as BF16 bits (< 0x7f80). */
static void row_scale(uint16_t amax_bits, int bits, float *d_out, float *inv_out) {
    float amax = amax_bits >= 0x0080 ? kt_bf16_to_f32(amax_bits) : 0.0f; /* subnormal amax reads as 0 */
    float d = bits == 4 ? (float)((double)amax / 112.0) : amax * (1.0f / 127.0f);
    if (!(d >= FLT_MIN)) d = 0.0f; /* a subnormal scale is stored as 0, with all codes 0 */
    *d_out = d;
    *inv_out = d != 0.0f ? 1.0f / d : 0.0f;
}

/* Scales of rows [r0, r0 + rows) (rows `ld` elements apart); returns the first row holding NaN/Inf, or -1. */
static int64_t block_scales(const kt_amx_kernels *kern, const uint16_t *w, int64_t k, int64_t ld, int bits,
                            int64_t r0, int64_t rows, float *scales, float *inv) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t amax_bits = kern->row_amax_bits(w + (r0 + r) * ld, k);
        if (amax_bits >= 0x7f80) return r0 + r;
        row_scale(amax_bits, bits, &scales[r0 + r], &inv[r]);
    }
    return -1;
}

/* Tiles of one N-block of `nbs` rows starting at row nb0 (layout of kt-format.md 2.1 / 2.2). */
static void block_tiles(const kt_amx_kernels *kern, const uint16_t *w, int64_t k, int64_t ld, int bits,
                        int64_t nb0, int64_t nbs, const float *inv, uint8_t *blob) {
    int64_t tile_cols = bits == 4 ? KT_INT4_TILE_COLS : KT_INT8_TILE_COLS;
    int shift = bits == 4 ? 1 : 0; /* element offset -> byte offset */
    for (int64_t kb0 = 0; kb0 < k; kb0 += KT_K_BLOCK) {
        int64_t kbs = k - kb0 < KT_K_BLOCK ? k - kb0 : KT_K_BLOCK;
        for (int64_t s0 = 0; s0 < nbs; s0 += KT_N_STEP) {
            const uint16_t *panel = w + (nb0 + s0) * ld + kb0;
            for (int64_t t0 = 0; t0 < kbs; t0 += tile_cols) {
                uint8_t *tile = blob + ((nb0 * k + kb0 * nbs + s0 * kbs + t0 * KT_N_STEP) >> shift);
                if (bits == 4) kern->tile_int4(panel + t0, ld, inv + s0, tile);
                else kern->tile_int8(panel + t0, ld, inv + s0, tile);
            }
        }
    }
}

static int quantize_blocks(const kt_amx_kernels *kern, const uint16_t *w, int64_t n, int64_t k, int64_t ld,
                           int bits, uint8_t *blob, float *scales, int64_t nb_begin, int64_t nb_end,
                           int64_t *err_row) {
    float inv[128];
    int64_t nb_rows = kt_amx_nblock_rows(bits);
    for (int64_t nb = nb_begin; nb < nb_end; nb++) {
        int64_t nb0 = nb * nb_rows;
        int64_t nbs = n - nb0 < nb_rows ? n - nb0 : nb_rows;
        int64_t bad = block_scales(kern, w, k, ld, bits, nb0, nbs, scales, inv);
        if (bad >= 0) {
            if (err_row) *err_row = bad;
            return KT_E_NONFINITE;
        }
        block_tiles(kern, w, k, ld, bits, nb0, nbs, inv, blob);
    }
    return KT_OK;
}

KT_API int kt_amx_quantize(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int impl, uint8_t *blob,
                           float *scales, int64_t nblock_begin, int64_t nblock_end, int64_t *err_row) {
    return kt_amx_quantize_rows(w_bf16, n, k, k, bits, impl, blob, scales, nblock_begin, nblock_end, err_row);
}

KT_API int kt_amx_quantize_rows(const uint16_t *w_bf16, int64_t n, int64_t k, int64_t ld, int bits, int impl,
                                uint8_t *blob, float *scales, int64_t nblock_begin, int64_t nblock_end,
                                int64_t *err_row) {
    int status = kt_amx_check_shape(n, k, bits);
    if (status != KT_OK) return status;
    if (!w_bf16 || !blob || !scales || ld < k || n > INT64_MAX / ld) return KT_E_ARG;
    if (nblock_begin < 0 || nblock_begin > nblock_end || nblock_end > kt_amx_nblocks(n, bits)) return KT_E_ARG;
    const kt_impl *chosen = kt_impl_get(impl, &status);
    if (!chosen) return status;
    kt_fpenv env;
    kt_fpenv_enter(&env);
    status = quantize_blocks(chosen->amx, w_bf16, n, k, ld, bits, blob, scales, nblock_begin, nblock_end, err_row);
    kt_fpenv_leave(&env);
    return status;
}
