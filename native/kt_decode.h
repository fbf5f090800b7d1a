/* ktconvert native library: decoders of quantized HF inputs to BF16 bits (native/quant_decode.c).
 *
 * Every function is bit-identical to its numpy reference in ktconvert/quant/ (fp8.dequant_block,
 * ct_int4.unpack_int32 + ct_int4.dequant, mxfp4.dequant): the same float32 operations in the same order
 * (-ffp-contract=off), run with MXCSR = round-to-nearest-even and no FTZ/DAZ (numpy's mode, so subnormal products
 * match); the caller's MXCSR is restored. BF16 rounding is RNE with NaN kept quiet ((bits >> 16) | 0x0040), as
 * ktconvert.quant.bf16.f32_to_bf16_bits.
 *
 * Common arguments:
 *   impl        KT_IMPL_AUTO (KTCONVERT_FORCE_IMPL honoured) or an explicit id of kt_native.h; KT_E_IMPL if the CPU
 *               lacks it (nothing written).
 *   product_f16 0: product rounded once, float32 -> BF16. 1: the float32 product is first rounded to float16 and
 *               back (compressed-tensors multiplies in the scale's dtype when scales are F16), then to BF16.
 *   out         uint16 [n, k] BF16 bits, row-major; only rows [row_begin, row_end) are written, so threads can share
 *               one output; the bytes never depend on how rows are split.
 * Status: KT_OK, KT_E_ARG (NULL pointer, bad row range, bits not 2/4/8), KT_E_SHAPE (sizes <= 0, strides or group
 * out of range), KT_E_IMPL. All functions are thread-safe on disjoint outputs.
 */
#ifndef KT_DECODE_H
#define KT_DECODE_H

#include <stdint.h>

#include "kt_native.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Block-scaled FP8 e4m3fn -> BF16 (fp8.dequant_block).
 * codes  uint8 [n, k]; scale float32 [ceil(n/bn), ceil(k/bk)] row-major (edge blocks may be partial).
 * out[r, c] = RNE_bf16(e4m3(codes[r, c]) * scale[r / bn, c / bk]); codes 0x7F / 0xFF (NaN) give 0x7FC0 (numpy's
 * table NaN) whatever the scale. With a NaN scale too, numpy returns either operand's NaN depending on its inner
 * loop, so there only "a NaN" is common to both; everywhere else the bits are equal. */
KT_API int kt_fp8_block_dequant_bf16(const uint8_t *codes, int64_t n, int64_t k, const float *scale, int64_t bn,
                                     int64_t bk, int product_f16, int impl, uint16_t *out, int64_t row_begin,
                                     int64_t row_end);

/* compressed-tensors pack-quantized words -> signed values (ct_int4.unpack_int32).
 * packed int32 [rows, words] with words = ceil(k * bits / 32); value j of a word sits in bits [j*bits, j*bits+bits)
 * as q + 2^(bits-1). out int8 [rows, k]. */
KT_API int kt_ct_unpack(const int32_t *packed, int64_t rows, int64_t words, int64_t k, int bits, int8_t *out);

/* Grouped integer weights -> BF16 (ct_int4.dequant): out[r, c] = RNE_bf16((q[r, c] - zp) * s) with
 * s = scale[r * scale_stride + c / group] and zp = zero_point[r * zp_stride + c / group] (0 when zero_point is
 * NULL); the difference and product in float32. Group strategy: stride k/group; channel: stride 1, group k;
 * tensor: stride 0, group k. q int8 [n, k]. */
KT_API int kt_ct_dequant_bf16(const int8_t *q, int64_t n, int64_t k, const float *scale, int64_t scale_stride,
                              const int8_t *zero_point, int64_t zp_stride, int64_t group, int product_f16, int impl,
                              uint16_t *out, int64_t row_begin, int64_t row_end);

/* kt_ct_unpack + kt_ct_dequant_bf16 in one pass (no int8 [n, k] intermediate): packed int32 [n, ceil(k*bits/32)]. */
KT_API int kt_ct_packed_dequant_bf16(const int32_t *packed, int64_t n, int64_t k, int bits, const float *scale,
                                     int64_t scale_stride, const int8_t *zero_point, int64_t zp_stride, int64_t group,
                                     int product_f16, int impl, uint16_t *out, int64_t row_begin, int64_t row_end);

/* MXFP4 -> BF16 (mxfp4.dequant): blocks uint8 [n, groups, 16] (byte j: value 2j low nibble, 2j+1 high nibble),
 * scales uint8 [n, groups] E8M0; out [n, groups * 32] = RNE_bf16(e2m1(nibble) * 2^(e - 127)), e = 0 the subnormal
 * 2^-127, e = 255 NaN (0x7FC0); overflow gives +-Inf. */
KT_API int kt_mxfp4_dequant_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t n, int64_t groups, int impl,
                                 uint16_t *out, int64_t row_begin, int64_t row_end);

#ifdef __cplusplus
}
#endif

#endif /* KT_DECODE_H */
