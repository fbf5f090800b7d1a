/* compressed-tensors pack-quantized RTN (W4A16 / W8A16 experts of the GPU checkpoint); contract in kt_ct_quant.h.
 *
 * The scalar group kernel is the reference: per element the float32 operations of kt_ct_quant.h in order. The
 * AVX2 / AVX-512 kernels do the same 16 / 32 values at a time, as two vectors of 8 / 16 lanes (the even-indexed
 * values and the odd ones, so that each 32-bit lane packs into whole output bytes): IEEE division is exactly rounded
 * at any width, the BF16 rounding is integer arithmetic on the bits, and vcvtps2dq under round-to-nearest-even is
 * rint_even of a value that is already an integer or a BF16 half-step, so every implementation gives the same
 * bytes.
 */
#include "kt_ct_quant.h"
#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>
#endif

#define CT_BF16_EPS 0x3C00u /* 2^-7 = torch.finfo(bfloat16).eps: the scale of an all-zero group */
#define ROUND_MAGIC_F 12582912.0f /* 1.5 * 2^23: (v + M) - M == rint_even(v) for |v| < 2^22 */

/* One row of k values in groups of `group`: BF16 scales uint16 [k / group] and offset codes packed into
 * k * bits / 8 bytes. Returns 1 (nothing defined written) if the row holds NaN/Inf, else 0. Two passes: every
 * group's amax and scale first (independent, so their latencies overlap), then the codes. */
typedef int (*ctq_row_fn)(const uint16_t *x, int64_t k, int64_t group, int bits, uint16_t *scale, uint8_t *out);

struct kt_ctq_kernels {
    ctq_row_fn row;
};

/* The BF16 scale of a group whose largest |x| has bits amax_bits (< 0x7f80). */
static inline uint16_t group_scale(uint16_t amax_bits, int bits) {
    const float divisor = bits == 4 ? 7.5f : 127.5f; /* BF16 (qmax - qmin) / 2, exact */
    const uint16_t s = kt_f32_to_bf16(kt_bf16_to_f32(amax_bits) / divisor);
    return s == 0 ? (uint16_t)CT_BF16_EPS : s;
}

static inline uint16_t amax_bits_scalar(const uint16_t *x, int64_t len) {
    uint16_t m = 0;
    for (int64_t i = 0; i < len; i++) m = (uint16_t)(x[i] & 0x7fff) > m ? (uint16_t)(x[i] & 0x7fff) : m;
    return m;
}

/* Pass 1 of every row kernel: scales of all groups with the ISA's amax; 1 on NaN/Inf. */
#define CTQ_SCALES(AMAX)                                                     \
    for (int64_t g = 0; g < k / group; g++) {                                \
        const uint16_t amax = AMAX(x + g * group, group);                    \
        if (amax >= 0x7f80) return 1;                                        \
        scale[g] = group_scale(amax, bits);                                  \
    }

/* x / s rounded to BF16, clamped and rounded to an integer, plus the offset 2^(bits-1). */
static inline int code_scalar(uint16_t x, float s, float qmin, float qmax, int offset) {
    float v = kt_bf16_to_f32(kt_f32_to_bf16(kt_bf16_to_f32(x) / s));
    v = v < qmin ? qmin : (v > qmax ? qmax : v);
    return (int)((v + ROUND_MAGIC_F) - ROUND_MAGIC_F) + offset;
}

static void group_scalar(const uint16_t *x, int64_t len, float s, int bits, uint8_t *out) {
    const int offset = 1 << (bits - 1);
    const float qmin = (float)-offset, qmax = (float)(offset - 1);
    if (bits == 8) {
        for (int64_t i = 0; i < len; i++) out[i] = (uint8_t)code_scalar(x[i], s, qmin, qmax, offset);
        return;
    }
    for (int64_t i = 0; i < len; i += 2) /* value 2j in the low nibble, 2j + 1 in the high nibble */
        out[i / 2] = (uint8_t)(code_scalar(x[i], s, qmin, qmax, offset) |
                               (code_scalar(x[i + 1], s, qmin, qmax, offset) << 4));
}

static int row_scalar(const uint16_t *x, int64_t k, int64_t group, int bits, uint16_t *scale, uint8_t *out) {
    CTQ_SCALES(amax_bits_scalar)
    for (int64_t g = 0; g < k / group; g++)
        group_scalar(x + g * group, group, kt_bf16_to_f32(scale[g]), bits, out + g * group * bits / 8);
    return 0;
}

const kt_ctq_kernels kt_ctq_kernels_scalar = {row_scalar};

#ifdef KT_X86
#define KT_AVX2 __attribute__((target("avx2")))
#define KT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* float32 lanes v holding BF16 values -> codes rint_even(clamp(bf16(v / s), lo, hi)) in int32 lanes. */
KT_AVX2 static inline __m256i codes_avx2(__m256 v, __m256 s, __m256 lo, __m256 hi) {
    const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7fff), top = _mm256_set1_epi32(-65536);
    __m256i u = _mm256_castps_si256(_mm256_div_ps(v, s));
    u = _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    v = _mm256_max_ps(_mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(u, top)), hi), lo);
    return _mm256_cvtps_epi32(v);
}

/* 16 BF16 at x -> 16 codes stored at out (8 bytes for bits 4, 16 for bits 8). The values at even indexes are the
 * low halves of the 32-bit lanes, the odd ones the high halves: each lane yields one output byte (bits 4: even code
 * + 8 in the low nibble, odd code + 8 in the high one) or two (bits 8: the codes + 128), packed in order. */
KT_AVX2 static inline void pair_avx2(const uint16_t *x, __m256 s, __m256 lo, __m256 hi, int bits, uint8_t *out) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)x), top = _mm256_set1_epi32(-65536);
    const __m256i even = codes_avx2(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), s, lo, hi);
    const __m256i odd = codes_avx2(_mm256_castsi256_ps(_mm256_and_si256(raw, top)), s, lo, hi);
    const __m256i lane = bits == 4 ? _mm256_add_epi32(_mm256_add_epi32(even, _mm256_slli_epi32(odd, 4)),
                                                      _mm256_set1_epi32(0x88))
                                   : _mm256_add_epi32(_mm256_add_epi32(even, _mm256_slli_epi32(odd, 8)),
                                                      _mm256_set1_epi32(0x8080));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(lane), _mm256_extracti128_si256(lane, 1));
    if (bits == 4)
        _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(words, words));
    else
        _mm_storeu_si128((__m128i *)out, words);
}

KT_AVX2 static void group_avx2(const uint16_t *x, int64_t len, float s, int bits, uint8_t *out) {
    const int offset = 1 << (bits - 1);
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps((float)-offset), hi = _mm256_set1_ps((float)(offset - 1));
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) pair_avx2(x + i, vs, lo, hi, bits, out + i * bits / 8);
    if (i < len) group_scalar(x + i, len - i, s, bits, out + i * bits / 8);
}

KT_AVX512 static inline __m512i codes_avx512(__m512 v, __m512 s, __m512 lo, __m512 hi) {
    const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7fff), top = _mm512_set1_epi32(-65536);
    __m512i u = _mm512_castps_si512(_mm512_div_ps(v, s));
    u = _mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    v = _mm512_max_ps(_mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(u, top)), hi), lo);
    return _mm512_cvtps_epi32(v);
}

/* 32 BF16 -> 32 codes, as pair_avx2 (16 bytes for bits 4, 32 for bits 8). */
KT_AVX512 static inline void pair_avx512(const uint16_t *x, __m512 s, __m512 lo, __m512 hi, int bits, uint8_t *out) {
    const __m512i raw = _mm512_loadu_si512((const void *)x), top = _mm512_set1_epi32(-65536);
    const __m512i even = codes_avx512(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), s, lo, hi);
    const __m512i odd = codes_avx512(_mm512_castsi512_ps(_mm512_and_si512(raw, top)), s, lo, hi);
    if (bits == 4)
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_add_epi32(
            _mm512_add_epi32(even, _mm512_slli_epi32(odd, 4)), _mm512_set1_epi32(0x88))));
    else
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_add_epi32(
            _mm512_add_epi32(even, _mm512_slli_epi32(odd, 8)), _mm512_set1_epi32(0x8080))));
}

KT_AVX512 static void group_avx512(const uint16_t *x, int64_t len, float s, int bits, uint8_t *out) {
    const int offset = 1 << (bits - 1);
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps((float)-offset), hi = _mm512_set1_ps((float)(offset - 1));
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) pair_avx512(x + i, vs, lo, hi, bits, out + i * bits / 8);
    if (i + 16 <= len) {
        pair_avx2(x + i, _mm256_set1_ps(s), _mm256_set1_ps((float)-offset), _mm256_set1_ps((float)(offset - 1)), bits,
                  out + i * bits / 8);
        i += 16;
    }
    if (i < len) group_scalar(x + i, len - i, s, bits, out + i * bits / 8);
}

/* Largest (bits & 0x7fff) of 8 u16 lanes: phminposuw on the complement. */
KT_AVX2 static inline uint16_t max8_epu16(__m128i m) {
    const __m128i ones = _mm_set1_epi16(-1);
    return (uint16_t)(0xffff ^ _mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(m, ones)), 0));
}

KT_AVX2 static inline uint16_t amax_bits_avx2(const uint16_t *x, int64_t len) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff);
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), magnitude));
    const uint16_t m = max8_epu16(_mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1)));
    const uint16_t t = amax_bits_scalar(x + i, len - i);
    return t > m ? t : m;
}

KT_AVX512 static inline uint16_t amax_bits_avx512(const uint16_t *x, int64_t len) {
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= len; i += 32)
        acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), magnitude));
    const __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    const uint16_t v = max8_epu16(_mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
    const uint16_t t = amax_bits_scalar(x + i, len - i);
    return t > v ? t : v;
}

KT_AVX2 static int row_avx2(const uint16_t *x, int64_t k, int64_t group, int bits, uint16_t *scale, uint8_t *out) {
    CTQ_SCALES(amax_bits_avx2)
    for (int64_t g = 0; g < k / group; g++)
        group_avx2(x + g * group, group, kt_bf16_to_f32(scale[g]), bits, out + g * group * bits / 8);
    return 0;
}

KT_AVX512 static int row_avx512(const uint16_t *x, int64_t k, int64_t group, int bits, uint16_t *scale,
                                uint8_t *out) {
    CTQ_SCALES(amax_bits_avx512)
    for (int64_t g = 0; g < k / group; g++)
        group_avx512(x + g * group, group, kt_bf16_to_f32(scale[g]), bits, out + g * group * bits / 8);
    return 0;
}

const kt_ctq_kernels kt_ctq_kernels_avx2 = {row_avx2};
const kt_ctq_kernels kt_ctq_kernels_avx512 = {row_avx512};
#endif

static int check_args(const uint16_t *w, int64_t n, int64_t k, int bits, int64_t group, const int32_t *packed,
                      const uint16_t *scale, int64_t row_begin, int64_t row_end) {
    if (!w || !packed || !scale || (bits != 4 && bits != 8)) return KT_E_ARG;
    if (row_begin < 0 || row_end < row_begin || row_end > n) return KT_E_ARG;
    if (n <= 0 || k <= 0 || group <= 0 || k % group || (group * bits) % 8 || (k * bits) % 32) return KT_E_SHAPE;
    return KT_OK;
}

KT_API int kt_ct_rtn_quantize(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int64_t group, int impl,
                              int32_t *packed, uint16_t *scale, int64_t row_begin, int64_t row_end,
                              int64_t *err_row) {
    int status = check_args(w_bf16, n, k, bits, group, packed, scale, row_begin, row_end);
    if (status != KT_OK) return status;
    const kt_impl *chosen = kt_impl_get(impl, &status);
    if (!chosen) return status;
    const int64_t row_bytes = k * bits / 8;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = row_begin; r < row_end; r++) {
        if (chosen->ctq->row(w_bf16 + r * k, k, group, bits, scale + r * (k / group), (uint8_t *)packed + r * row_bytes)) {
            if (err_row) *err_row = r;
            status = KT_E_NONFINITE;
            break;
        }
    }
    kt_fpenv_leave(&env);
    return status;
}
