/* AMXINT4 / AMXINT8 kernels, AVX-512 (F + BW + VL). Only called after dispatch.c found the CPU and OS support them.
 * Rounding uses explicit round-to-nearest-even encodings, so it does not depend on MXCSR. */
#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>

#define KT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define KT_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

KT_AVX512 static uint16_t amax_bits_avx512(const uint16_t *row, int64_t k) {
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512((const void *)(row + i)), magnitude));
    uint16_t lanes[32];
    _mm512_storeu_si512((void *)lanes, acc);
    uint16_t m = 0;
    for (int j = 0; j < 32; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < k; i++) {
        uint16_t a = (uint16_t)(row[i] & 0x7fff);
        m = a > m ? a : m;
    }
    return m;
}

/* 16 BF16 -> 16 int8 codes of the first rounding: sat(rne(x * inv)), zero and subnormal inputs -> 0. */
KT_AVX512 static inline __m128i codes16(const uint16_t *p, __m512 inv) {
    __m512i xbits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    __mmask16 normal = _mm512_test_epi32_mask(xbits, _mm512_set1_epi32(0x7f800000));
    __m512 y = _mm512_maskz_mul_round_ps(normal, _mm512_castsi512_ps(xbits), inv, KT_RNE);
    return _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32(y, KT_RNE));
}

/* 64 consecutive BF16 -> 64 int8 codes. */
KT_AVX512 static inline __m512i codes64(const uint16_t *p, __m512 inv) {
    __m512i r = _mm512_castsi128_si512(codes16(p, inv));
    r = _mm512_inserti32x4(r, codes16(p + 16, inv), 1);
    r = _mm512_inserti32x4(r, codes16(p + 32, inv), 2);
    return _mm512_inserti32x4(r, codes16(p + 48, inv), 3);
}

/* INT4 second rounding per byte: sign(q) * floor((|q| + 8) / 16). */
KT_AVX512 static inline __m512i round_4bit(__m512i q) {
    __m512i biased = _mm512_adds_epu8(_mm512_abs_epi8(q), _mm512_set1_epi8(8));
    __m512i mag = _mm512_and_si512(_mm512_srli_epi16(biased, 4), _mm512_set1_epi8(0x0f));
    return _mm512_mask_sub_epi8(mag, _mm512_movepi8_mask(q), _mm512_setzero_si512(), mag);
}

/* Write the transpose of a 16x16 dword matrix (rows[r] = row r) as 16 lines of 64 bytes. */
KT_AVX512 static inline void store_transposed(__m512i rows[16], uint8_t *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    /* u[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i+3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        _mm512_storeu_si512((void *)(out + (0 + j) * 64), _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512((void *)(out + (4 + j) * 64), _mm512_shuffle_i32x4(v0, v2, 0xdd));
        _mm512_storeu_si512((void *)(out + (8 + j) * 64), _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512((void *)(out + (12 + j) * 64), _mm512_shuffle_i32x4(v1, v3, 0xdd));
    }
}

KT_AVX512 static void tile_int8_avx512(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    for (int half = 0; half < 2; half++) {
        __m512i rows[16];
        for (int r = 0; r < 16; r++) {
            int rr = half * 16 + r;
            rows[r] = codes64(src + rr * stride, _mm512_set1_ps(inv[rr]));
        }
        store_transposed(rows, tile + half * 1024);
    }
}

KT_AVX512 static void tile_int4_avx512(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    const __m512i low_nibble = _mm512_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        __m512i rows[16];
        for (int r = 0; r < 16; r++) {
            int rr = half * 16 + r;
            __m512 row_inv = _mm512_set1_ps(inv[rr]);
            __m512i lo = round_4bit(codes64(src + rr * stride, row_inv));
            __m512i hi = round_4bit(codes64(src + rr * stride + 64, row_inv));
            rows[r] = _mm512_or_si512(_mm512_and_si512(lo, low_nibble),
                                      _mm512_slli_epi16(_mm512_and_si512(hi, low_nibble), 4));
        }
        store_transposed(rows, tile + half * 1024);
    }
}

const kt_amx_kernels kt_amx_kernels_avx512 = {amax_bits_avx512, tile_int4_avx512, tile_int8_avx512};
#endif
