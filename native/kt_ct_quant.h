/* ktconvert native library: compressed-tensors pack-quantized RTN of BF16 weights (native/ct_quant.c), the routed
 * experts of the GPU checkpoint (W4A16 / W8A16).
 *
 * Byte-identical to compressed-tensors 0.19 (llmcompressor model_free_ptq) on BF16 weights: calculate_qparams of
 * the group's min/max (symmetric), quantize and pack_to_int32; the numpy reference is
 * ktconvert.quant.ct_int4.quantize_sym_groups + pack_int32. Per group of `group` consecutive columns of a row:
 *   amax  = max |x| (BF16, exact in float32; subnormals kept)
 *   s     = RNE_bf16(float32(amax / D)), D = 7.5 (bits 4) or 127.5 (bits 8); s == 0 -> 2^-7 (BF16 eps)
 *   q     = rint_even(clamp(RNE_bf16(float32(x / s)), -2^(bits-1), 2^(bits-1) - 1))
 * torch computes BF16 arithmetic in float32 and rounds each result to BF16, hence the two roundings. The call runs
 * with MXCSR = round-to-nearest-even and no FTZ/DAZ (torch's and numpy's mode); the caller's mode is restored.
 *
 * w_bf16  uint16 [n, k] BF16 bits, row-major (HF [out_features, in_features]).
 * bits    4 or 8. group: columns per scale, k % group == 0 (group == k: channel-wise), group * bits % 8 == 0, and
 *         k * bits % 32 == 0 (whole int32 words per row).
 * packed  int32 [n, k * bits / 32]: 32 / bits values per word, value j in bits [j*bits, j*bits + bits), stored
 *         q + 2^(bits-1) (little-endian: the bytes are the values' offset codes, low nibble first for bits 4).
 * scale   uint16 [n, k / group] BF16 bits of s.
 * Only rows [row_begin, row_end) are written (threads share one output). err_row may be NULL; on KT_E_NONFINITE
 * it receives the first row holding NaN/Inf (compressed-tensors would write garbage codes there).
 * Status: KT_OK, KT_E_ARG (NULL pointer, bits, row range), KT_E_SHAPE (sizes, group), KT_E_NONFINITE, KT_E_IMPL.
 */
#ifndef KT_CT_QUANT_H
#define KT_CT_QUANT_H

#include <stdint.h>

#include "kt_native.h"

#ifdef __cplusplus
extern "C" {
#endif

KT_API int kt_ct_rtn_quantize(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int64_t group, int impl,
                              int32_t *packed, uint16_t *scale, int64_t row_begin, int64_t row_end,
                              int64_t *err_row);

#ifdef __cplusplus
}
#endif

#endif /* KT_CT_QUANT_H */
