/* AMXINT4 / AMXINT8 kernels, AVX2. Only called after dispatch.c found the CPU and OS support AVX2.
 * Rounding uses _mm256_round_ps with an explicit round-to-nearest-even encoding, then an exact truncating convert. */
#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>

#define KT_AVX2 __attribute__((target("avx2")))

KT_AVX2 static uint16_t amax_bits_avx2(const uint16_t *row, int64_t k) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff);
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + i)), magnitude));
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    uint16_t m = 0;
    for (int j = 0; j < 16; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < k; i++) {
        uint16_t a = (uint16_t)(row[i] & 0x7fff);
        m = a > m ? a : m;
    }
    return m;
}

/* 8 BF16 -> 8 int32 of rne(x * inv); zero and subnormal inputs -> 0. */
KT_AVX2 static inline __m256i codes8_i32(const uint16_t *p, __m256 inv) {
    __m256i xbits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __m256i is_zero = _mm256_cmpeq_epi32(_mm256_and_si256(xbits, _mm256_set1_epi32(0x7f800000)),
                                         _mm256_setzero_si256());
    __m256 x = _mm256_castsi256_ps(_mm256_andnot_si256(is_zero, xbits));
    __m256 y = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvttps_epi32(y); /* exact: y is integral (and |y| <= 2^7 for finite inputs) */
}

/* 32 consecutive BF16 -> 32 int8 codes of the first rounding, saturated, in order. */
KT_AVX2 static inline __m256i codes32(const uint16_t *p, __m256 inv) {
    __m256i ab = _mm256_packs_epi32(codes8_i32(p, inv), codes8_i32(p + 8, inv));
    __m256i cd = _mm256_packs_epi32(codes8_i32(p + 16, inv), codes8_i32(p + 24, inv));
    __m256i bytes = _mm256_packs_epi16(ab, cd); /* dwords in order a0 b0 c0 d0 a1 b1 c1 d1 */
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* INT4 second rounding per byte: sign(q) * floor((|q| + 8) / 16). */
KT_AVX2 static inline __m256i round_4bit(__m256i q) {
    __m256i biased = _mm256_adds_epu8(_mm256_abs_epi8(q), _mm256_set1_epi8(8));
    __m256i mag = _mm256_and_si256(_mm256_srli_epi16(biased, 4), _mm256_set1_epi8(0x0f));
    return _mm256_sign_epi8(mag, q);
}

/* Transpose an 8x8 dword block: in[r] at in_base + r * in_stride (bytes), out line c at out + c * out_stride. */
KT_AVX2 static inline void transpose8x8(const uint8_t *in, int in_stride, uint8_t *out, int out_stride) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(in + i * in_stride));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + j], lane L: column 4L + j of rows 4i .. 4i+3 */
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)(out + j * out_stride), _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
        _mm256_storeu_si256((__m256i *)(out + (4 + j) * out_stride),
                            _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
    }
}

/* rows: 16 lines of 64 bytes (16 dwords) -> the tile half: line c holds dword c of every row. */
KT_AVX2 static inline void store_transposed(const uint8_t *rows, uint8_t *out) {
    for (int rb = 0; rb < 2; rb++)
        for (int cb = 0; cb < 2; cb++) transpose8x8(rows + rb * 8 * 64 + cb * 32, 64, out + cb * 8 * 64 + rb * 32, 64);
}

KT_AVX2 static void tile_int8_avx2(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    _Alignas(32) uint8_t rows[16 * 64];
    for (int half = 0; half < 2; half++) {
        for (int r = 0; r < 16; r++) {
            int rr = half * 16 + r;
            __m256 row_inv = _mm256_set1_ps(inv[rr]);
            _mm256_store_si256((__m256i *)(rows + r * 64), codes32(src + rr * stride, row_inv));
            _mm256_store_si256((__m256i *)(rows + r * 64 + 32), codes32(src + rr * stride + 32, row_inv));
        }
        store_transposed(rows, tile + half * 1024);
    }
}

KT_AVX2 static void tile_int4_avx2(const uint16_t *src, int64_t stride, const float *inv, uint8_t *tile) {
    _Alignas(32) uint8_t rows[16 * 64];
    const __m256i low_nibble = _mm256_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        for (int r = 0; r < 16; r++) {
            int rr = half * 16 + r;
            const uint16_t *row = src + rr * stride;
            __m256 row_inv = _mm256_set1_ps(inv[rr]);
            for (int part = 0; part < 2; part++) {
                __m256i lo = round_4bit(codes32(row + part * 32, row_inv));
                __m256i hi = round_4bit(codes32(row + 64 + part * 32, row_inv));
                __m256i packed = _mm256_or_si256(_mm256_and_si256(lo, low_nibble),
                                                 _mm256_slli_epi16(_mm256_and_si256(hi, low_nibble), 4));
                _mm256_store_si256((__m256i *)(rows + r * 64 + part * 32), packed);
            }
        }
        store_transposed(rows, tile + half * 1024);
    }
}

const kt_amx_kernels kt_amx_kernels_avx2 = {amax_bits_avx2, tile_int4_avx2, tile_int8_avx2};
#endif
