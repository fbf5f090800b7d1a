/* Verification runtime, AVX2 + FMA kernels. A 64-byte row of a tile half is two ymm of 8 dwords (panel rows
 * 0-7 and 8-15 of the half); byte b of each dword is one column, sign-extended by shift-left / arithmetic
 * shift-right and converted to float. One token at a time (16 ymm registers leave no room for more); the
 * driver's panel is small enough that further tokens re-read it from cache. RAWINT4 rows at the end.
 */
#define KT_RUNTIME_INTERNAL
#include "kt_runtime.h"
#include "kt_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <string.h>

#define RT_AVX2 __attribute__((target("avx2,fma")))
#define RT_INLINE static inline __attribute__((always_inline))

/* Column (4q+b) of 8 rows: INT4 low nibble, INT4 high nibble, INT8 byte. */
#define RT_LO4(v, b) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((v), 28 - 8 * (b)), 28))
#define RT_HI4(v, b) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((v), 24 - 8 * (b)), 28))
#define RT_B8(v, b) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((v), 24 - 8 * (b)), 24))

RT_AVX2 RT_INLINE void flush8x4(float *dst, const __m256 a[4][2])
{
    for (int g = 0; g < 4; g++)
        _mm256_storeu_ps(dst + 8 * g, _mm256_add_ps(_mm256_loadu_ps(dst + 8 * g), _mm256_add_ps(a[g][0], a[g][1])));
}

RT_AVX2 static void int4_panel_avx2(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx, int64_t m,
                                    float *acc, int64_t ldacc)
{
    for (int64_t t = 0; t < m; t++) {
        __m256 a[4][2]; /* [8-row group of the panel][low / high nibble] */
        for (int g = 0; g < 4; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const float *xc = x + t * ldx + tile * 128;
            for (int q = 0; q < 16; q++) {
                __m256i v[4];
                for (int g = 0; g < 4; g++)
                    v[g] = _mm256_loadu_si256((const __m256i *)(tp + (g >> 1) * 1024 + q * 64 + (g & 1) * 32));
#define RT_INT4_BYTE(b)                                                                                       \
    {                                                                                                         \
        __m256 xl = _mm256_set1_ps(xc[4 * q + (b)]), xh = _mm256_set1_ps(xc[4 * q + (b) + 64]);               \
        for (int g = 0; g < 4; g++) {                                                                         \
            a[g][0] = _mm256_fmadd_ps(RT_LO4(v[g], b), xl, a[g][0]);                                          \
            a[g][1] = _mm256_fmadd_ps(RT_HI4(v[g], b), xh, a[g][1]);                                          \
        }                                                                                                     \
    }
                RT_INT4_BYTE(0)
                RT_INT4_BYTE(1)
                RT_INT4_BYTE(2)
                RT_INT4_BYTE(3)
#undef RT_INT4_BYTE
            }
        }
        flush8x4(acc + t * ldacc, a);
    }
}

RT_AVX2 static void int8_panel_avx2(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx, int64_t m,
                                    float *acc, int64_t ldacc)
{
    for (int64_t t = 0; t < m; t++) {
        __m256 a[4][2]; /* [8-row group of the panel][byte parity] */
        for (int g = 0; g < 4; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const float *xc = x + t * ldx + tile * 64;
            for (int q = 0; q < 16; q++) {
                __m256i v[4];
                for (int g = 0; g < 4; g++)
                    v[g] = _mm256_loadu_si256((const __m256i *)(tp + (g >> 1) * 1024 + q * 64 + (g & 1) * 32));
#define RT_INT8_BYTE(b)                                                                                       \
    {                                                                                                         \
        __m256 xb = _mm256_set1_ps(xc[4 * q + (b)]);                                                          \
        for (int g = 0; g < 4; g++) a[g][(b)&1] = _mm256_fmadd_ps(RT_B8(v[g], b), xb, a[g][(b)&1]);           \
    }
                RT_INT8_BYTE(0)
                RT_INT8_BYTE(1)
                RT_INT8_BYTE(2)
                RT_INT8_BYTE(3)
#undef RT_INT8_BYTE
            }
        }
        flush8x4(acc + t * ldacc, a);
    }
}

RT_AVX2 RT_INLINE float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

RT_AVX2 static void bf16_rows_avx2(const uint16_t *w, int64_t rows, int64_t k, const float *x, int64_t m, float *y,
                                   int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * k;
        for (int64_t t = 0; t < m; t++) {
            const float *xt = x + t * k;
            __m256 s = _mm256_setzero_ps();
            int64_t c = 0;
            for (; c + 8 <= k; c += 8) {
                __m256i wi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + c))), 16);
                s = _mm256_fmadd_ps(_mm256_castsi256_ps(wi), _mm256_loadu_ps(xt + c), s);
            }
            float tail = 0.0f;
            for (; c < k; c++) tail += kt_bf16_to_f32(row[c]) * xt[c];
            y[t * ldy + r] = hsum8(s) + tail;
        }
    }
}

/* RAWINT4, MT tokens of one row: 8 columns (one int32 word, 4 bytes) per step, the word broadcast and each lane
 * shifted to its nibble (element i at bits 4i..4i+3), minus 8. Per group one vector sum per token, scaled into a
 * running vector total; the total's lanes are added at the end. */
RT_AVX2 RT_INLINE void rawint4_row_mt(const uint8_t *row, const uint16_t *srow, int64_t k, int64_t group,
                                      const float *x, float *y, int64_t ldy, const int MT)
{
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low4 = _mm256_set1_epi32(0x0F);
    const __m256 eight = _mm256_set1_ps(8.0f);
    __m256 total[4];
    for (int t = 0; t < MT; t++) total[t] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        __m256 acc[4];
        for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t c = g0; c < g0 + group; c += 8) {
            int32_t word;
            memcpy(&word, row + c / 2, sizeof word);
            const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), low4);
            const __m256 wv = _mm256_sub_ps(_mm256_cvtepi32_ps(nib), eight);
            for (int t = 0; t < MT; t++) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * k + c), acc[t]);
        }
        const __m256 sv = _mm256_set1_ps(kt_bf16_to_f32(srow[g0 / group]));
        for (int t = 0; t < MT; t++) total[t] = _mm256_fmadd_ps(acc[t], sv, total[t]);
    }
    for (int t = 0; t < MT; t++) y[t * ldy] = hsum8(total[t]);
}

RT_AVX2 static void rawint4_rows_avx2(const uint8_t *w, int64_t ldw, const uint16_t *scale, int64_t lds,
                                      int64_t rows, int64_t k, int64_t group, const float *x, int64_t m, float *y,
                                      int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * ldw;
        const uint16_t *srow = scale + r * lds;
        int64_t t = 0;
        for (; t + 4 <= m; t += 4) rawint4_row_mt(row, srow, k, group, x + t * k, y + t * ldy + r, ldy, 4);
        switch (m - t) {
        case 3: rawint4_row_mt(row, srow, k, group, x + t * k, y + t * ldy + r, ldy, 3); break;
        case 2: rawint4_row_mt(row, srow, k, group, x + t * k, y + t * ldy + r, ldy, 2); break;
        case 1: rawint4_row_mt(row, srow, k, group, x + t * k, y + t * ldy + r, ldy, 1); break;
        default: break;
        }
    }
}

const kt_rt_kernels kt_rt_kernels_avx2 = {int4_panel_avx2, int8_panel_avx2, bf16_rows_avx2, 0, 0, rawint4_rows_avx2};

#endif
