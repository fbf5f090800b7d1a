/* AMXINT4 / AMXINT8 kernels, portable C: the reference the ISA versions must match byte for byte.
 * Built with no ISA flags. Relies on the round-to-nearest-even mode kt_fpenv_enter sets for the call (x * inv and
 * the rounding to an integer); zero and subnormal inputs are flushed explicitly. */
#include "kt_internal.h"

static uint16_t amax_bits_scalar(const uint16_t *row, int64_t k) {
    uint16_t m = 0;
    for (int64_t i = 0; i < k; i++) {
        uint16_t a = (uint16_t)(row[i] & 0x7fff);
        m = a > m ? a : m;
    }
    return m;
}

/* saturate_int8(round_half_even(y)) for a finite y. Adding and subtracting 1.5 * 2^23 rounds to an integer in
 * the current rounding mode, which kt_fpenv_enter set to nearest-even; |y| is clamped first so the trick is exact. */
static inline int sat_rne_i8(float y) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    y = y < 128.0f ? y : 128.0f; /* written as min / max so the loop vectorizes without branches */
    y = y > -129.0f ? y : -129.0f;
    float r = (y + magic) - magic;
    r = r < 127.0f ? r : 127.0f;
    r = r > -128.0f ? r : -128.0f;
    return (int)r;
}

/* First rounding of `cols` consecutive BF16: sat(rne(x * inv)), 0 for zero and subnormal inputs (DAZ). */
static void codes_row(const uint16_t *row, int cols, float inv, int8_t *out) {
    for (int c = 0; c < cols; c++) {
        float x = (row[c] & 0x7f80) ? kt_bf16_to_f32(row[c]) : 0.0f;
        out[c] = (int8_t)sat_rne_i8(x * inv);
    }
}

/* INT4 second rounding: sign(q) * floor((|q| + 8) / 16). */
static inline int round_4bit(int q) {
    int m = ((q < 0 ? -q : q) + 8) >> 4;
    return q < 0 ? -m : m;
}

/* Store the 16 dwords (64 bytes) of panel row rr into its tile half: dword q goes to line q, column rr % 16
 * (kt-format.md 2.1/2.2: byte = (rr/16)*1024 + (c/4)*64 + (rr%16)*4 + c%4). */
static void store_row(const uint8_t line[64], int rr, uint8_t *tile) {
    uint8_t *dst = tile + (rr >> 4) * 1024 + (rr & 15) * 4;
    for (int q = 0; q < 16; q++) memcpy(dst + q * 64, line + q * 4, 4);
}

static void tile_int8_scalar(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    int8_t codes[KT_INT8_TILE_COLS];
    for (int rr = 0; rr < KT_N_STEP; rr++) {
        codes_row(src + rr * stride, KT_INT8_TILE_COLS, inv[rr], codes);
        store_row((const uint8_t *)codes, rr, tile);
    }
}

static void tile_int4_scalar(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    int8_t codes[KT_INT4_TILE_COLS];
    uint8_t line[64];
    for (int rr = 0; rr < KT_N_STEP; rr++) {
        codes_row(src + rr * stride, KT_INT4_TILE_COLS, inv[rr], codes);
        for (int j = 0; j < 64; j++) /* tile column j in the low nibble, j + 64 in the high nibble */
            line[j] = (uint8_t)((round_4bit(codes[j]) & 0xf) | ((round_4bit(codes[j + 64]) & 0xf) << 4));
        store_row(line, rr, tile);
    }
}

const kt_amx_kernels kt_amx_kernels_scalar = {amax_bits_scalar, tile_int4_scalar, tile_int8_scalar};
