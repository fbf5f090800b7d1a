/* ktconvert native library: dequantization of ggml (GGUF) block formats.
 *
 * Results are bit-identical to gguf-py 0.19 `gguf.quants.dequantize`: every element is computed in float32 with
 * the same operations in the same order as gguf-py's numpy code (no FMA contraction: the library is built with
 * -ffp-contract=off), and the call runs with MXCSR = round-to-nearest-even, no FTZ/DAZ (as numpy does), so
 * subnormal results (MXFP4 with tiny exponents) match too. The caller's floating-point mode is restored.
 *
 * ggml type ids are those of ggml.h / gguf.constants.GGMLQuantizationType (F32 0, F16 1, Q4_0 2, ... MXFP4 39).
 * Implementations (impl: KT_IMPL_AUTO / SCALAR / AVX2 / AVX512 of kt_native.h, resolved with kt_resolve_impl):
 * one portable C body per type, compiled once plainly (scalar) and once per ISA target; all give equal bits.
 */
#ifndef KT_GGUF_H
#define KT_GGUF_H

#include <stdint.h>

#include "kt_native.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per block and bytes per block of ggml type `type` when it is dequantized natively; 0 otherwise. */
KT_API int64_t kt_gguf_block_elems(int type);
KT_API int64_t kt_gguf_block_bytes(int type);

/* Dequantize `nblocks` consecutive blocks of type `type` at `src` into float32 `dst`
 * (nblocks * kt_gguf_block_elems(type) values). Returns KT_OK, KT_E_ARG (unsupported type, NULL pointer,
 * nblocks < 0) or KT_E_IMPL (impl not supported here). Thread-safe on disjoint outputs. */
KT_API int kt_gguf_dequant_f32(int type, int impl, const uint8_t *src, int64_t nblocks, float *dst);

/* The same values rounded to BF16 bits: round-to-nearest-even, NaN kept quiet (bits >> 16 | 0x0040), exactly
 * ktconvert.quant.bf16.f32_to_bf16_bits of the float32 result. */
KT_API int kt_gguf_dequant_bf16(int type, int impl, const uint8_t *src, int64_t nblocks, uint16_t *dst);

#ifdef __cplusplus
}
#endif

#endif /* KT_GGUF_H */
