/* Verification runtime, AVX-512 kernels (F + BW + VL). One zmm lane per panel row: a 64-byte row of a tile half
 * is 16 dwords, dword i = panel row i, so byte b of every dword is one column for 16 rows at once.
 * INT4 nibbles become floats with one vpermps (the low 4 bits of each lane index a 16-entry table); INT8 bytes
 * with shift-left, arithmetic shift-right, convert. Up to 4 tokens share each decoded vector (RAWINT4's rows too).
 */
#define KT_RUNTIME_INTERNAL
#include "kt_runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <string.h>

#include "kt_internal.h"

#define RT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define RT_INLINE static inline __attribute__((always_inline))

/* acc[t*ldacc + 16h + lane] += a[h][0][t] + a[h][1][t] */
#define RT_FLUSH(MT)                                                                                          \
    for (int h = 0; h < 2; h++)                                                                               \
        for (int t = 0; t < (MT); t++) {                                                                      \
            float *dst = acc + t * ldacc + 16 * h;                                                            \
            _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_add_ps(a[h][0][t], a[h][1][t]))); \
        }

RT_AVX512 RT_INLINE void int4_panel_mt(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx,
                                       float *acc, int64_t ldacc, const int MT)
{
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    __m512 a[2][2][4]; /* [half][low / high nibble][token] */
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 2; s++)
            for (int t = 0; t < MT; t++) a[h][s][t] = _mm512_setzero_ps();
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const uint8_t *tp = panel + tile * 2048;
        const float *xc = x + tile * 128;
        for (int q = 0; q < 16; q++) {
            __m512i v0 = _mm512_loadu_si512((const void *)(tp + q * 64));
            __m512i v1 = _mm512_loadu_si512((const void *)(tp + 1024 + q * 64));
#define RT_INT4_BYTE(b)                                                                                       \
    {                                                                                                         \
        __m512 l0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 8 * (b)), lut);                               \
        __m512 l1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 8 * (b)), lut);                               \
        __m512 h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 8 * (b) + 4), lut);                           \
        __m512 h1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 8 * (b) + 4), lut);                           \
        for (int t = 0; t < MT; t++) {                                                                        \
            __m512 xl = _mm512_set1_ps(xc[t * ldx + 4 * q + (b)]);                                            \
            __m512 xh = _mm512_set1_ps(xc[t * ldx + 4 * q + (b) + 64]);                                       \
            a[0][0][t] = _mm512_fmadd_ps(l0, xl, a[0][0][t]);                                                 \
            a[1][0][t] = _mm512_fmadd_ps(l1, xl, a[1][0][t]);                                                 \
            a[0][1][t] = _mm512_fmadd_ps(h0, xh, a[0][1][t]);                                                 \
            a[1][1][t] = _mm512_fmadd_ps(h1, xh, a[1][1][t]);                                                 \
        }                                                                                                     \
    }
            RT_INT4_BYTE(0)
            RT_INT4_BYTE(1)
            RT_INT4_BYTE(2)
            RT_INT4_BYTE(3)
#undef RT_INT4_BYTE
        }
    }
    RT_FLUSH(MT)
}

RT_AVX512 RT_INLINE void int8_panel_mt(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx,
                                       float *acc, int64_t ldacc, const int MT)
{
    __m512 a[2][2][4]; /* [half][byte parity][token] */
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 2; s++)
            for (int t = 0; t < MT; t++) a[h][s][t] = _mm512_setzero_ps();
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const uint8_t *tp = panel + tile * 2048;
        const float *xc = x + tile * 64;
        for (int q = 0; q < 16; q++) {
            __m512i v0 = _mm512_loadu_si512((const void *)(tp + q * 64));
            __m512i v1 = _mm512_loadu_si512((const void *)(tp + 1024 + q * 64));
#define RT_INT8_BYTE(b)                                                                                       \
    {                                                                                                         \
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v0, 24 - 8 * (b)), 24));          \
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v1, 24 - 8 * (b)), 24));          \
        for (int t = 0; t < MT; t++) {                                                                        \
            __m512 xb = _mm512_set1_ps(xc[t * ldx + 4 * q + (b)]);                                            \
            a[0][(b)&1][t] = _mm512_fmadd_ps(w0, xb, a[0][(b)&1][t]);                                         \
            a[1][(b)&1][t] = _mm512_fmadd_ps(w1, xb, a[1][(b)&1][t]);                                         \
        }                                                                                                     \
    }
            RT_INT8_BYTE(0)
            RT_INT8_BYTE(1)
            RT_INT8_BYTE(2)
            RT_INT8_BYTE(3)
#undef RT_INT8_BYTE
        }
    }
    RT_FLUSH(MT)
}

RT_AVX512 static void int4_panel_avx512(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx,
                                        int64_t m, float *acc, int64_t ldacc)
{
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) int4_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 4);
    switch (m - t) {
    case 3: int4_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 3); break;
    case 2: int4_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 2); break;
    case 1: int4_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 1); break;
    default: break;
    }
}

RT_AVX512 static void int8_panel_avx512(const uint8_t *panel, int64_t ntiles, const float *x, int64_t ldx,
                                        int64_t m, float *acc, int64_t ldacc)
{
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) int8_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 4);
    switch (m - t) {
    case 3: int8_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 3); break;
    case 2: int8_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 2); break;
    case 1: int8_panel_mt(panel, ntiles, x + t * ldx, ldx, acc + t * ldacc, ldacc, 1); break;
    default: break;
    }
}

/* 16 BF16 values -> 16 floats (exact widening); mask selects the valid lanes of a tail. */
RT_AVX512 RT_INLINE __m512 bf16x16(const uint16_t *p, __mmask16 mask)
{
    __m256i raw = _mm256_maskz_loadu_epi16(mask, (const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

RT_AVX512 void kt_rt_bf16_rows_avx512(const uint16_t *w, int64_t rows, int64_t k, const float *x, int64_t m, float *y,
                                      int64_t ldy)
{
    int64_t r = 0;
    for (; r < rows; r += 4) {
        int nr = rows - r < 4 ? (int)(rows - r) : 4;
        for (int64_t t = 0; t < m; t++) {
            __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t c = 0; c < k; c += 16) {
                __mmask16 mask = k - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - c)) - 1u);
                __m512 xv = _mm512_maskz_loadu_ps(mask, x + t * k + c);
                for (int j = 0; j < nr; j++) s[j] = _mm512_fmadd_ps(bf16x16(w + (r + j) * k + c, mask), xv, s[j]);
            }
            for (int j = 0; j < nr; j++) y[t * ldy + r + j] = _mm512_reduce_add_ps(s[j]);
        }
    }
}

/* RAWINT4, MT tokens of one row: 16 columns (8 bytes, two int32 words) per step. Word 0 goes to lanes 0-7, word 1
 * to lanes 8-15, each lane shifted to its nibble; vpermps maps the nibble (its low 4 bits) to q = nibble - 8. A group
 * of 8 mod 16 ends with one word, its upper lanes' x masked to zero. Per group one vector sum per token, scaled into
 * a running vector total; the total's lanes are added at the end. */
RT_AVX512 RT_INLINE void rawint4_row_mt(const uint8_t *row, const uint16_t *srow, int64_t k, int64_t group,
                                        const float *x, float *y, int64_t ldy, const int MT)
{
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i words = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512 total[4];
    for (int t = 0; t < MT; t++) total[t] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const int64_t end = g0 + group;
        __m512 acc[4];
        for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t c = g0; c < end; c += 16) {
            const int whole = end - c >= 16;
            const __mmask16 mask = whole ? (__mmask16)0xFFFF : (__mmask16)0x00FF;
            int32_t word;
            memcpy(&word, row + c / 2, sizeof word);
            const __m128i raw = whole ? _mm_loadl_epi64((const __m128i *)(row + c / 2)) : _mm_cvtsi32_si128(word);
            const __m512i v = _mm512_permutexvar_epi32(words, _mm512_castsi128_si512(raw));
            const __m512 wv = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shifts), lut);
            for (int t = 0; t < MT; t++)
                acc[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + t * k + c), acc[t]);
        }
        const __m512 sv = _mm512_set1_ps(kt_bf16_to_f32(srow[g0 / group]));
        for (int t = 0; t < MT; t++) total[t] = _mm512_fmadd_ps(acc[t], sv, total[t]);
    }
    for (int t = 0; t < MT; t++) y[t * ldy] = _mm512_reduce_add_ps(total[t]);
}

RT_AVX512 void kt_rt_rawint4_rows_avx512(const uint8_t *w, int64_t ldw, const uint16_t *scale, int64_t lds,
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

const kt_rt_kernels kt_rt_kernels_avx512 = {int4_panel_avx512, int8_panel_avx512, kt_rt_bf16_rows_avx512, 0, 0,
                                            kt_rt_rawint4_rows_avx512};

#endif
