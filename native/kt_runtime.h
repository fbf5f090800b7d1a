/* ktconvert verification runtime: the C ABI (loaded from Python with ctypes, see ktconvert/native/forward.py).
 *
 * Reads kt-kernel CPU expert weights in their on-disk form and computes with them in place: AMXINT4 / AMXINT8
 * blobs in the AMX tile order of kt-format.md 2.1 / 2.2 (never unpacked to row-major), BF16 rows in HF layout, and
 * RAWINT4's packed nibble rows with their BF16 group scales (decoded in registers, never to a float matrix).
 * Accumulation is fp32; activations are fp32 (no activation quantization, unlike kt-kernel's AMX forward), so the
 * result equals dequantize(blob, scale) @ x up to fp32 summation order.
 *
 * Implementations are chosen like every other kernel of the library (kt_native.h): impl = KT_IMPL_AUTO picks the
 * best supported one (KTCONVERT_FORCE_IMPL overrides), an explicit id runs that one or fails with KT_E_IMPL.
 * kt_impl_variant(impl) names the kernels that run: "scalar", "avx2", "avx512" (fp32 FMA) or "avx512-vnni" (exact
 * integer dot products, below; its BF16 and RAWINT4 kernels are the AVX-512 fp32 ones).
 * Results never depend on the thread count: each output row is summed by one thread in a fixed order.
 *
 * Weight types (wtype):
 *   KT_RT_INT4  blob uint8 [n*k/2] (N_BLOCK 128, 128-column tiles), scale float32 [n] = d, w = code * 16 * d;
 *               n % 32 == 0, k % 128 == 0.
 *   KT_RT_INT8  blob uint8 [n*k]   (N_BLOCK 64, 64-column tiles),   scale float32 [n] = d, w = code * d;
 *               n % 32 == 0, k % 64 == 0.
 *   KT_RT_BF16  uint16 [n, k] BF16 bits, row-major (HF nn.Linear orientation); scale ignored (may be NULL).
 *   KT_RT_RAWINT4  kt-kernel's RAWINT4 (kt-format.md 2.6: compressed-tensors pack-quantized symmetric INT4, read in
 *               place): w uint8 [n, k/2] (weight_packed's int32 words as little-endian bytes: byte j holds column 2j
 *               in its low nibble, 2j+1 in its high nibble, each stored as q + 8), scale uint16 [n, k/group] BF16
 *               bits (weight_scale); w = q * scale[c / group]. Only through the *_grouped calls (they carry the
 *               group size): k % group == 0, group % 8 == 0 (whole int32 words per group).
 *               The weights are q * fp32(scale), exact (kt-kernel converts the scales to fp32 too), not
 *               compressed-tensors' dequantization, which rounds each product to BF16.
 */
#ifndef KT_RUNTIME_H
#define KT_RUNTIME_H

#include <stdint.h>

#include "kt_native.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_RT_INT4 4
#define KT_RT_INT8 8
#define KT_RT_BF16 16
#define KT_RT_RAWINT4 41 /* 4-bit, group scales */

/* Status codes beyond kt_native.h's KT_E_*. */
#define KT_RT_E_NOMEM 33   /* malloc failed */
#define KT_RT_E_THREAD 34  /* pthread_create failed */

/* y[m, n] = x[m, k] @ W[n, k]^T (x, y row-major, contiguous). threads >= 1. */
KT_API int kt_rt_gemm(int wtype, const void *w, const float *scale, int64_t n, int64_t k, const float *x, int64_t m,
                      float *y, int impl, int threads);

/* One routed expert, all its NUMA parts, for m tokens.
 *   mats     6 * parts pointers; part t: [gate_w, gate_scale, up_w, up_scale, down_w, down_scale]
 *            gate/up part: [n = inter_part, k = hidden]; down part: [n = hidden, k = inter_part]
 *   out[i, :] += coef[i] * sum_t down_t( silu(gate_t . x_i) * (up_t . x_i) )      (t summed in order 0..parts-1)
 */
KT_API int kt_rt_expert_forward(int wtype, int64_t hidden, int64_t inter_part, int parts, const void *const *mats,
                                const float *x, int64_t m, const float *coef, float *out, int impl, int threads);

/* Routed-expert MoE of one layer over a table of experts [expert_lo, expert_lo + n_table).
 *   table        n_table * parts * 6 pointers, expert-major, each expert laid out as for kt_rt_expert_forward;
 *                an expert whose gate_w of part 0 is NULL is not loaded in this call and is skipped, as are
 *                ids outside the table's range (run a layer a few experts at a time into the same out).
 *   topk_ids     int64 [m, topk]; topk_weights float32 [m, topk]
 *   out          float32 [m, hidden]; out[i] += w_ij * expert_{id_ij}(x_i), experts in increasing id order.
 */
KT_API int kt_rt_moe_forward(int wtype, int64_t hidden, int64_t inter_part, int parts, int64_t expert_lo,
                             int64_t n_table, const void *const *table, const float *x, int64_t m,
                             const int64_t *topk_ids, const float *topk_weights, int64_t topk, float *out, int impl,
                             int threads);

/* The calls above with the weight type's group size: group 0 for KT_RT_INT4 / INT8 / BF16 (then each is exactly
 * its call above), group > 0 for KT_RT_RAWINT4, whose scale is uint16 BF16 bits.
 * Forward of RAWINT4: part t's six pointers are views into the whole matrices, split as kt-kernel splits them in
 * memory (TP_MOE<AMX_K2_MOE_TP>::load_weights): gate/up at row t*inter_part (rows of hidden/2 bytes and
 * hidden/group scales, as stored), down at column t*inter_part of row 0 (rows strided by the whole matrix:
 * parts*inter_part/2 bytes and parts*inter_part/group scales). Needs hidden % group == 0 and
 * inter_part % group == 0 (whole groups per NUMA part), else KT_E_SHAPE. */
KT_API int kt_rt_gemm_grouped(int wtype, int64_t group, const void *w, const void *scale, int64_t n, int64_t k,
                              const float *x, int64_t m, float *y, int impl, int threads);
KT_API int kt_rt_expert_forward_grouped(int wtype, int64_t group, int64_t hidden, int64_t inter_part, int parts,
                                        const void *const *mats, const float *x, int64_t m, const float *coef,
                                        float *out, int impl, int threads);
KT_API int kt_rt_moe_forward_grouped(int wtype, int64_t group, int64_t hidden, int64_t inter_part, int parts,
                                     int64_t expert_lo, int64_t n_table, const void *const *table, const float *x,
                                     int64_t m, const int64_t *topk_ids, const float *topk_weights, int64_t topk,
                                     float *out, int impl, int threads);

#ifdef KT_RUNTIME_INTERNAL
/* ---- internal: per-ISA kernels (runtime_kernels_*.c), selected by runtime_driver.c ----
 * panel:  one 32-row panel over ntiles consecutive 2048-byte tiles of one K-block;
 *         acc[t * ldacc + r] += sum_c code[r][c] * x[t * ldx + c] for r < 32, t < m (x points at the K-block start).
 * rows:   y[t * ldy + r] = sum_c bf16(w[r * k + c]) * x[t * k + c] for r < rows, t < m.
 * rawint4: y[t * ldy + r] = sum_g bf16(scale[r * lds + g]) * (sum_{c in group g} q(r, c) * x[t * k + c]) for
 *          r < rows, t < m; q(r, c) = nibble c % 2 of byte w[r * ldw + c / 2], minus 8. Inner sums per group in
 *          fp32, then the groups in order; group % 8 == 0. A row's sum never depends on rows or m (thread split).
 */
typedef void (*kt_rt_panel_fn)(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx, int64_t m,
                               float *acc, int64_t ldacc);
typedef void (*kt_rt_rows_fn)(const uint16_t *w, int64_t rows, int64_t k, const float *x, int64_t m, float *y,
                              int64_t ldy);
typedef void (*kt_rt_rawint4_fn)(const uint8_t *w, int64_t ldw, const uint16_t *scale, int64_t lds, int64_t rows,
                                 int64_t k, int64_t group, const float *x, int64_t m, float *y, int64_t ldy);
/* Activations as exact integers for the VNNI kernels: token t's x[c] ~= X[c] * 2^exp[t], X an int32 rounded to
 * nearest even with |X| <= 2^KT_RT_XBITS (so each x keeps >= 31 bits relative to max|x|: finer than fp32 for every
 * x within 2^-7 of the max), written as KT_RT_XDIGITS balanced base-256 digits: X = sum_i digit_i * 256^i,
 * digit_i int8 in [-128, 127]. (Three digits, 23 bits, were measured: 12x the fp32 kernels' error on activations
 * with 1e4 outliers, and no speed gain once the weights are prefetched.)
 *   digits  int8 [m][KT_RT_XDIGITS][k]: digit i of token t at digits + (t * KT_RT_XDIGITS + i) * k
 *   ksum    int64 [m][nkb]: sum of X over K-block kb (3584 columns)
 *   pow2    double [m]: 2^exp[t] (0 for an all-zero token)
 * A kernel computes S = sum_c code[c] * X[c] exactly in integers (vpdpbusd on the tile's VNNI dwords, weights
 * biased to unsigned by +128, the bias removed with ksum) and adds fp32(S * pow2) to acc. */
#define KT_RT_XDIGITS 4
#define KT_RT_XBITS 30
typedef struct {
    const int8_t *digits;
    const int64_t *ksum;
    const double *pow2;
    int64_t k, nkb;
} kt_rt_xq;
typedef void (*kt_rt_qpanel_fn)(const uint8_t *panel, int64_t ntiles, const kt_rt_xq *xq, int64_t kb, int64_t m,
                                float *acc, int64_t ldacc);

/* One implementation's kernels (a row of dispatch.c's table points at one): the integer panels when set, else the
 * fp32 panels. */
struct kt_rt_kernels {
    kt_rt_panel_fn int4_panel;
    kt_rt_panel_fn int8_panel;
    kt_rt_rows_fn bf16_rows;
    kt_rt_qpanel_fn int4_qpanel; /* NULL: the fp32 panels are used */
    kt_rt_qpanel_fn int8_qpanel;
    kt_rt_rawint4_fn rawint4_rows; /* fp32 in every row (the VNNI row runs the AVX-512 one) */
};
typedef struct kt_rt_kernels kt_rt_kernels;

extern const kt_rt_kernels kt_rt_kernels_scalar;
extern const kt_rt_kernels kt_rt_kernels_avx2;
extern const kt_rt_kernels kt_rt_kernels_avx512;
extern const kt_rt_kernels kt_rt_kernels_avx512vnni;
void kt_rt_bf16_rows_avx512(const uint16_t *w, int64_t rows, int64_t k, const float *x, int64_t m, float *y,
                            int64_t ldy); /* shared by the avx512 and avx512-vnni kernels */
void kt_rt_rawint4_rows_avx512(const uint8_t *w, int64_t ldw, const uint16_t *scale, int64_t lds, int64_t rows,
                               int64_t k, int64_t group, const float *x, int64_t m, float *y, int64_t ldy);
#endif

#ifdef __cplusplus
}
#endif

#endif /* KT_RUNTIME_H */
