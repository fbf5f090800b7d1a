/* Verification runtime, portable reference kernels (no ISA flags). Tile walk as in kt-format.md 2.1 / 2.2:
 * a 2048-byte tile is two 1024-byte halves (panel rows 0-15, 16-31); half byte (q*64 + i*4 + b) holds
 * row i, tile column 4q+b (INT8: the whole byte; INT4: low nibble, and column 4q+b+64 in the high nibble).
 */
#define KT_RUNTIME_INTERNAL
#include "kt_runtime.h"

#include <string.h>

#include "kt_internal.h"

static void int4_panel_scalar(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx, int64_t m,
                              float *acc, int64_t ldacc)
{
    for (int64_t t = 0; t < m; t++) {
        float sum[32];
        memset(sum, 0, sizeof sum);
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const float *xc = x + t * ldx + tile * 128;
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 16; q++)
                    for (int i = 0; i < 16; i++)
                        for (int b = 0; b < 4; b++) {
                            uint8_t byte = tp[h * 1024 + q * 64 + i * 4 + b];
                            int lo = (int)(int8_t)(uint8_t)(byte << 4) >> 4;
                            int hi = (int)(int8_t)byte >> 4;
                            sum[h * 16 + i] += (float)lo * xc[4 * q + b] + (float)hi * xc[4 * q + b + 64];
                        }
        }
        for (int r = 0; r < 32; r++) acc[t * ldacc + r] += sum[r];
    }
}

static void int8_panel_scalar(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx, int64_t m,
                              float *acc, int64_t ldacc)
{
    for (int64_t t = 0; t < m; t++) {
        float sum[32];
        memset(sum, 0, sizeof sum);
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const float *xc = x + t * ldx + tile * 64;
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 16; q++)
                    for (int i = 0; i < 16; i++)
                        for (int b = 0; b < 4; b++)
                            sum[h * 16 + i] += (float)(int8_t)tp[h * 1024 + q * 64 + i * 4 + b] * xc[4 * q + b];
        }
        for (int r = 0; r < 32; r++) acc[t * ldacc + r] += sum[r];
    }
}

static void bf16_rows_scalar(const uint16_t *w, int64_t rows, int64_t k, const float *x, int64_t m, float *y,
                             int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < m; t++) {
            float sum = 0.0f;
            for (int64_t c = 0; c < k; c++) sum += kt_bf16_to_f32(w[r * k + c]) * x[t * k + c];
            y[t * ldy + r] = sum;
        }
}

/* RAWINT4 (kt-format.md 2.6): byte c/2 of a row holds column c in its low nibble (c even) or high nibble (c odd),
 * stored q + 8. Each group's sum in column order, then scaled and added in group order. */
static void rawint4_rows_scalar(const uint8_t *w, int64_t ldw, const uint16_t *scale, int64_t lds, int64_t rows,
                                int64_t k, int64_t group, const float *x, int64_t m, float *y, int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * ldw;
        const uint16_t *srow = scale + r * lds;
        for (int64_t t = 0; t < m; t++) {
            const float *xt = x + t * k;
            float total = 0.0f;
            for (int64_t g0 = 0; g0 < k; g0 += group) {
                float sum = 0.0f;
                for (int64_t c = g0; c < g0 + group; c += 2) {
                    const uint8_t byte = row[c / 2];
                    sum += (float)((int)(byte & 0x0F) - 8) * xt[c];
                    sum += (float)((int)(byte >> 4) - 8) * xt[c + 1];
                }
                total += kt_bf16_to_f32(srow[g0 / group]) * sum;
            }
            y[t * ldy + r] = total;
        }
    }
}

const kt_rt_kernels kt_rt_kernels_scalar = {int4_panel_scalar, int8_panel_scalar, bf16_rows_scalar, 0, 0,
                                            rawint4_rows_scalar};
