/* Decoders of quantized HF inputs (FP8 block, compressed-tensors pack-quantized, MXFP4) to BF16 bits; the contract
 * is in kt_decode.h. The scalar functions are the reference: per element the same float32 operations, in the same
 * order, as the numpy code in ktconvert/quant/. The AVX2 / AVX-512 functions do the same operations 8 / 16 lanes
 * at a time; IEEE multiply/subtract are exact-rounded at any vector width and nothing is fused
 * (-ffp-contract=off), so every implementation gives the same bits.
 *
 * Element decodes (exact, no rounding):
 *   e4m3fn  code c: the float32 whose bits are (c & 0x7F) << 20 -- exponent field eeee, mantissa mmm at the top --
 *           times 2^120 rebiases 127 -> 7, subnormals (eeee = 0) included; the sign bit is or-ed in afterwards.
 *           0x7F / 0xFF are NaN (numpy's table holds +NaN 0x7FC00000 for both).
 *   E2M1    16-entry table; E8M0 e -> 2^(e-127) as float32 bits (e = 0: subnormal 0x00400000; 255: 0x7FC00000).
 * float16 rounding (product_f16): the value numpy's float32 -> float16 -> float32 round trip gives, either with
 * F16C's vcvtps2ph (RNE) or in plain C (f16_round).
 */
#include <stdlib.h>
#include <string.h>

#include "kt_decode.h"
#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>
#endif

#define KT_INLINE static inline __attribute__((always_inline))
#define BF16_TABLE_NAN 0x7FC0u /* RNE_bf16 of numpy's NaN table entries (+NaN 0x7FC00000: e4m3 0x7F/0xFF, E8M0 255) */


/* ---------------------------------------------------------------- scalar element operations (the reference) */


/* float32 -> the float32 value of its RNE float16 rounding (numpy astype(float16).astype(float32)). NaN passes
 * through: float16 keeps the top 10 payload bits and BF16 reads only the top 7, so the BF16 result is the same. */
KT_INLINE float f16_round(float x) {
    const uint32_t u = kt_f32_bits(x), a = u & 0x7fffffffu, sign = u & 0x80000000u;
    if (a > 0x7f800000u) return x;
    if (a >= 0x477ff000u) return kt_f32_from_bits(sign | 0x7f800000u);   /* |x| >= 65520 rounds to Inf */
    if (a < 0x38800000u) {                                        /* below 2^-14: float16 subnormal, step 2^-24 */
        const float steps = (kt_f32_from_bits(a) * 0x1p24f + 0x1p23f) - 0x1p23f;   /* RNE to an integer (< 2^10) */
        return kt_f32_from_bits(sign | kt_f32_bits(steps * 0x1p-24f));
    }
    return kt_f32_from_bits(sign | ((a + 0xfffu + ((a >> 13) & 1u)) & ~0x1fffu));   /* 10 mantissa bits, RNE */
}

KT_INLINE float e4m3_value(uint8_t c) {
    return kt_f32_from_bits(kt_f32_bits(kt_f32_from_bits((uint32_t)(c & 0x7f) << 20) * 0x1p120f) | ((uint32_t)(c & 0x80) << 24));
}

KT_INLINE float e8m0_value(uint8_t e) {
    return kt_f32_from_bits(e == 255 ? 0x7fc00000u : e == 0 ? 0x00400000u : (uint32_t)e << 23);
}

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* ---------------------------------------------------------------- kernels: one run sharing one scale */

/* fp8 run: len codes of one row inside one (bn x bk) block, scale s. */
typedef void (*fp8_run_fn)(const uint8_t *codes, int64_t len, float s, int f16, uint16_t *out);
/* ct run: len values of one row inside one group: RNE_bf16((q - zp) * s). */
typedef void (*ct_run_fn)(const int8_t *q, int64_t len, float zp, float s, int f16, uint16_t *out);
/* mxfp4 row: groups blocks of 16 bytes + groups E8M0 scales -> groups * 32 BF16. */
typedef void (*mx_row_fn)(const uint8_t *blocks, const uint8_t *scales, int64_t groups, uint16_t *out);

static void fp8_run_scalar(const uint8_t *codes, int64_t len, float s, int f16, uint16_t *out) {
    for (int64_t i = 0; i < len; i++) {
        float p = e4m3_value(codes[i]) * s;
        if (f16) p = f16_round(p);
        out[i] = (codes[i] & 0x7f) == 0x7f ? (uint16_t)BF16_TABLE_NAN : kt_f32_to_bf16(p);
    }
}

static void ct_run_scalar(const int8_t *q, int64_t len, float zp, float s, int f16, uint16_t *out) {
    for (int64_t i = 0; i < len; i++) {
        float p = ((float)q[i] - zp) * s;
        if (f16) p = f16_round(p);
        out[i] = kt_f32_to_bf16(p);
    }
}

/* The 16 BF16 values e2m1[i] * 2^(e-127) of one block (numpy: one float32 multiply each, then RNE). A NaN scale
 * (e = 255) gives numpy's +NaN for every entry; it is written out because the compiler may compute the negative
 * half of the table as -(E2M1[i-8] * s), which flips the sign of a NaN. */
KT_INLINE void mx_table(uint8_t e, uint16_t *table) {
    const float s = e8m0_value(e);
    for (int i = 0; i < 16; i++) table[i] = e == 255 ? (uint16_t)BF16_TABLE_NAN : kt_f32_to_bf16(E2M1[i] * s);
}

static void mx_row_scalar(const uint8_t *blocks, const uint8_t *scales, int64_t groups, uint16_t *out) {
    for (int64_t g = 0; g < groups; g++) {
        uint16_t table[16];
        mx_table(scales[g], table);
        const uint8_t *b = blocks + g * 16;
        for (int j = 0; j < 16; j++) {
            out[g * 32 + 2 * j] = table[b[j] & 15];
            out[g * 32 + 2 * j + 1] = table[b[j] >> 4];
        }
    }
}

/* ---------------------------------------------------------------- unpacking (SSE2 nibbles on x86, all ISAs) */

static void unpack_row(const int32_t *words, int64_t k, int bits, int8_t *out) {
    const int per_word = 32 / bits, half = 1 << (bits - 1);
    const uint32_t mask = (1u << bits) - 1u;
    int64_t c = 0;
#if defined(KT_X86)
    if (bits == 4) {      /* little-endian: byte i holds values 2i (low nibble) and 2i+1 (high nibble) */
        const uint8_t *bytes = (const uint8_t *)words;
        const __m128i m15 = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        for (; c + 32 <= k; c += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(bytes + c / 2));
            const __m128i lo = _mm_and_si128(b, m15), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m15);
            _mm_storeu_si128((__m128i *)(out + c), _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight));
            _mm_storeu_si128((__m128i *)(out + c + 16), _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight));
        }
    } else if (bits == 8) {
        const uint8_t *bytes = (const uint8_t *)words;
        for (; c < k; c++) out[c] = (int8_t)(bytes[c] ^ 0x80u);
    }
#endif
    for (; c < k; c++) {
        const uint32_t u = (uint32_t)words[c / per_word];
        out[c] = (int8_t)((int)((u >> ((c % per_word) * bits)) & mask) - half);
    }
}

/* ---------------------------------------------------------------- AVX2 / AVX-512 */

#ifdef KT_X86
#define KT_ATTR_AVX2 __attribute__((target("avx2,f16c")))
#define KT_ATTR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* bf16_rne on 8 / 16 lanes; the BF16 bits stay in the low half of each 32-bit lane. */
KT_ATTR_AVX2 KT_INLINE __m256i bf16_lanes_avx2(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), top = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}

KT_ATTR_AVX512 KT_INLINE __m512i bf16_lanes_avx512(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), top = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, top, _mm512_set1_epi32(0x40));
}

#define KT_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Two 8-lane BF16 results -> 16 uint16 in order (packus works per 128-bit lane; the permute restores order). */
KT_ATTR_AVX2 KT_INLINE void store16_avx2(uint16_t *out, __m256i lo, __m256i hi) {
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}

/* e4m3 codes (zero-extended to 32-bit lanes) -> float32 values, as e4m3_value. */
KT_ATTR_AVX2 KT_INLINE __m256 e4m3_avx2(__m256i code) {
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7f)), 20);
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

/* fp8: one product of 8 lanes -> BF16 lanes (NaN codes -> 0x7FC0). */
KT_ATTR_AVX2 KT_INLINE __m256i fp8_lanes_avx2(__m256i code, __m256 s, int f16) {
    __m256 p = _mm256_mul_ps(e4m3_avx2(code), s);
    if (f16) p = _mm256_cvtph_ps(_mm256_cvtps_ph(p, KT_F16_RNE));
    const __m256i is_nan = _mm256_cmpeq_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7f)), _mm256_set1_epi32(0x7f));
    return _mm256_blendv_epi8(bf16_lanes_avx2(p), _mm256_set1_epi32(BF16_TABLE_NAN), is_nan);
}

KT_ATTR_AVX2 static void fp8_run_avx2(const uint8_t *codes, int64_t len, float s, int f16, uint16_t *out) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m128i c = _mm_loadu_si128((const __m128i *)(codes + i));
        store16_avx2(out + i, fp8_lanes_avx2(_mm256_cvtepu8_epi32(c), vs, f16),
                     fp8_lanes_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)), vs, f16));
    }
    fp8_run_scalar(codes + i, len - i, s, f16, out + i);
}

KT_ATTR_AVX2 KT_INLINE __m256i ct_lanes_avx2(__m128i q8, __m256 zp, __m256 s, int f16) {
    __m256 p = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), zp), s);
    if (f16) p = _mm256_cvtph_ps(_mm256_cvtps_ph(p, KT_F16_RNE));
    return bf16_lanes_avx2(p);
}

KT_ATTR_AVX2 static void ct_run_avx2(const int8_t *q, int64_t len, float zp, float s, int f16, uint16_t *out) {
    const __m256 vz = _mm256_set1_ps(zp), vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m128i c = _mm_loadu_si128((const __m128i *)(q + i));
        store16_avx2(out + i, ct_lanes_avx2(c, vz, vs, f16), ct_lanes_avx2(_mm_srli_si128(c, 8), vz, vs, f16));
    }
    ct_run_scalar(q + i, len - i, zp, s, f16, out + i);
}

/* mxfp4 with SSSE3 byte shuffles: the 16 BF16 table entries split into low and high bytes, looked up by nibble. */
KT_ATTR_AVX2 static void mx_row_avx2(const uint8_t *blocks, const uint8_t *scales, int64_t groups, uint16_t *out) {
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        uint16_t table[16];
        uint8_t lo_bytes[16], hi_bytes[16];
        mx_table(scales[g], table);
        for (int i = 0; i < 16; i++) {
            lo_bytes[i] = (uint8_t)table[i];
            hi_bytes[i] = (uint8_t)(table[i] >> 8);
        }
        const __m128i tl = _mm_loadu_si128((const __m128i *)lo_bytes), th = _mm_loadu_si128((const __m128i *)hi_bytes);
        const __m128i b = _mm_loadu_si128((const __m128i *)(blocks + g * 16));
        const __m128i lo = _mm_and_si128(b, m15), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m15);
        const __m128i idx[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};   /* values 0..15, 16..31 */
        for (int h = 0; h < 2; h++) {
            const __m128i l = _mm_shuffle_epi8(tl, idx[h]), t = _mm_shuffle_epi8(th, idx[h]);
            _mm_storeu_si128((__m128i *)(out + g * 32 + h * 16), _mm_unpacklo_epi8(l, t));
            _mm_storeu_si128((__m128i *)(out + g * 32 + h * 16 + 8), _mm_unpackhi_epi8(l, t));
        }
    }
}

KT_ATTR_AVX512 static void fp8_run_avx512(const uint8_t *codes, int64_t len, float s, int f16, uint16_t *out) {
    const __m512 vs = _mm512_set1_ps(s), rebias = _mm512_set1_ps(0x1p120f);
    const __m512i m7f = _mm512_set1_epi32(0x7f), m80 = _mm512_set1_epi32(0x80), nan = _mm512_set1_epi32(BF16_TABLE_NAN);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m512i mag = _mm512_and_si512(code, m7f);
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), rebias);
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(code, m80), 24);
        __m512 p = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)), vs);
        if (f16) p = _mm512_cvtph_ps(_mm512_cvtps_ph(p, KT_F16_RNE));
        const __m512i b = _mm512_mask_mov_epi32(bf16_lanes_avx512(p), _mm512_cmpeq_epi32_mask(mag, m7f), nan);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(b));
    }
    fp8_run_scalar(codes + i, len - i, s, f16, out + i);
}

KT_ATTR_AVX512 static void ct_run_avx512(const int8_t *q, int64_t len, float zp, float s, int f16, uint16_t *out) {
    const __m512 vz = _mm512_set1_ps(zp), vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i)));
        __m512 p = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v), vz), vs);
        if (f16) p = _mm512_cvtph_ps(_mm512_cvtps_ph(p, KT_F16_RNE));
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(bf16_lanes_avx512(p)));
    }
    ct_run_scalar(q + i, len - i, zp, s, f16, out + i);
}

/* mxfp4: the block's table is one 16-lane multiply; the 32 outputs are one 16-bit permute by nibble. */
KT_ATTR_AVX512 static void mx_row_avx512(const uint8_t *blocks, const uint8_t *scales, int64_t groups, uint16_t *out) {
    const __m512 e2m1 = _mm512_loadu_ps(E2M1);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 t = _mm512_mul_ps(e2m1, _mm512_set1_ps(e8m0_value(scales[g])));
        const __m512i table = scales[g] == 255 ? _mm512_set1_epi16((short)BF16_TABLE_NAN)
                                               : _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_lanes_avx512(t)));
        const __m128i b = _mm_loadu_si128((const __m128i *)(blocks + g * 16));
        const __m128i lo = _mm_and_si128(b, m15), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m15);
        const __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
        _mm512_storeu_si512((void *)(out + g * 32), _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), table));
    }
}
#endif

/* ---------------------------------------------------------------- dispatch */

struct kt_decode_kernels {
    fp8_run_fn fp8;
    ct_run_fn ct;
    mx_row_fn mx;
};

/* Referenced by dispatch.c's table of implementations. The AVX2 row requires F16C (float16 products). */
const kt_decode_kernels kt_decode_kernels_scalar = {fp8_run_scalar, ct_run_scalar, mx_row_scalar};
#ifdef KT_X86
const kt_decode_kernels kt_decode_kernels_avx2 = {fp8_run_avx2, ct_run_avx2, mx_row_avx2};
const kt_decode_kernels kt_decode_kernels_avx512 = {fp8_run_avx512, ct_run_avx512, mx_row_avx512};
#endif

/* The kernels a call with `impl` runs, or NULL with *status set. */
static const kt_decode_kernels *kernels_for(int impl, int *status) {
    const kt_impl *chosen = kt_impl_get(impl, status);
    return chosen ? chosen->decode : NULL;
}

static int bad_rows(int64_t n, int64_t row_begin, int64_t row_end) {
    return row_begin < 0 || row_end < row_begin || row_end > n;
}

/* ---------------------------------------------------------------- public functions */

KT_API int kt_fp8_block_dequant_bf16(const uint8_t *codes, int64_t n, int64_t k, const float *scale, int64_t bn,
                                     int64_t bk, int product_f16, int impl, uint16_t *out, int64_t row_begin,
                                     int64_t row_end) {
    if (!codes || !scale || !out || bad_rows(n, row_begin, row_end)) return KT_E_ARG;
    if (n <= 0 || k <= 0 || bn <= 0 || bk <= 0) return KT_E_SHAPE;
    int status;
    const kt_decode_kernels *kern = kernels_for(impl, &status);
    if (!kern) return status;
    const int64_t kb = (k + bk - 1) / bk;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = row_begin; r < row_end; r++) {
        const float *srow = scale + (r / bn) * kb;
        for (int64_t b = 0; b < kb; b++) {
            const int64_t c0 = b * bk, len = k - c0 < bk ? k - c0 : bk;
            kern->fp8(codes + r * k + c0, len, srow[b], product_f16, out + r * k + c0);
        }
    }
    kt_fpenv_leave(&env);
    return KT_OK;
}

KT_API int kt_ct_unpack(const int32_t *packed, int64_t rows, int64_t words, int64_t k, int bits, int8_t *out) {
    if (!packed || !out || (bits != 2 && bits != 4 && bits != 8)) return KT_E_ARG;
    if (rows < 0 || k <= 0 || words != (k * bits + 31) / 32) return KT_E_SHAPE;
    for (int64_t r = 0; r < rows; r++) unpack_row(packed + r * words, k, bits, out + r * k);
    return KT_OK;
}

static int ct_args_bad(int64_t n, int64_t k, const float *scale, int64_t scale_stride, int64_t zp_stride,
                       int64_t group, const uint16_t *out, int64_t row_begin, int64_t row_end) {
    if (!scale || !out || bad_rows(n, row_begin, row_end)) return KT_E_ARG;
    if (n <= 0 || k <= 0 || group <= 0 || scale_stride < 0 || zp_stride < 0) return KT_E_SHAPE;
    return KT_OK;
}

/* One row of values through the group runs. */
KT_INLINE void ct_row(const kt_decode_kernels *kern, const int8_t *q, int64_t k, const float *srow, const int8_t *zrow,
                      int64_t group, int f16, uint16_t *out) {
    for (int64_t g = 0, c0 = 0; c0 < k; g++, c0 += group) {
        const int64_t len = k - c0 < group ? k - c0 : group;
        kern->ct(q + c0, len, zrow ? (float)zrow[g] : 0.0f, srow[g], f16, out + c0);
    }
}

KT_API int kt_ct_dequant_bf16(const int8_t *q, int64_t n, int64_t k, const float *scale, int64_t scale_stride,
                              const int8_t *zero_point, int64_t zp_stride, int64_t group, int product_f16, int impl,
                              uint16_t *out, int64_t row_begin, int64_t row_end) {
    int status = q ? ct_args_bad(n, k, scale, scale_stride, zp_stride, group, out, row_begin, row_end) : KT_E_ARG;
    if (status != KT_OK) return status;
    const kt_decode_kernels *kern = kernels_for(impl, &status);
    if (!kern) return status;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = row_begin; r < row_end; r++)
        ct_row(kern, q + r * k, k, scale + r * scale_stride, zero_point ? zero_point + r * zp_stride : NULL, group,
               product_f16, out + r * k);
    kt_fpenv_leave(&env);
    return KT_OK;
}

KT_API int kt_ct_packed_dequant_bf16(const int32_t *packed, int64_t n, int64_t k, int bits, const float *scale,
                                     int64_t scale_stride, const int8_t *zero_point, int64_t zp_stride, int64_t group,
                                     int product_f16, int impl, uint16_t *out, int64_t row_begin, int64_t row_end) {
    int status = packed ? ct_args_bad(n, k, scale, scale_stride, zp_stride, group, out, row_begin, row_end)
                        : KT_E_ARG;
    if (status == KT_OK && bits != 2 && bits != 4 && bits != 8) status = KT_E_ARG;
    if (status != KT_OK) return status;
    const kt_decode_kernels *kern = kernels_for(impl, &status);
    if (!kern) return status;
    int8_t *row = malloc((size_t)k + 64);
    if (!row) return KT_E_ARG;
    const int64_t words = (k * bits + 31) / 32;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = row_begin; r < row_end; r++) {
        unpack_row(packed + r * words, k, bits, row);
        ct_row(kern, row, k, scale + r * scale_stride, zero_point ? zero_point + r * zp_stride : NULL, group,
               product_f16, out + r * k);
    }
    kt_fpenv_leave(&env);
    free(row);
    return KT_OK;
}

KT_API int kt_mxfp4_dequant_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t n, int64_t groups, int impl,
                                 uint16_t *out, int64_t row_begin, int64_t row_end) {
    if (!blocks || !scales || !out || bad_rows(n, row_begin, row_end)) return KT_E_ARG;
    if (n <= 0 || groups <= 0) return KT_E_SHAPE;
    int status;
    const kt_decode_kernels *kern = kernels_for(impl, &status);
    if (!kern) return status;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = row_begin; r < row_end; r++)
        kern->mx(blocks + r * groups * 16, scales + r * groups, groups, out + r * groups * 32);
    kt_fpenv_leave(&env);
    return KT_OK;
}
