/* Verification runtime, AVX-512 VNNI kernels: exact integer dot products on the tile's VNNI dwords.
 *
 * A tile half's 64-byte row is 16 dwords (one per panel row), each 4 consecutive columns: exactly vpdpbusd's
 * operand shape. Weights become unsigned bytes by +128 (INT8: w ^ 0x80; INT4: the nibble moved to the high half
 * of a byte, 16v, ^ 0x80), activations are the KT_RT_XDIGITS balanced int8 digits of kt_rt_xq, and
 *   sum_c (w_c + 128) * X_c = sum_c w_c * X_c + 128 * ksum.
 * Per K-block and lane the int32 sums stay below 2^27 (INT8: 896 steps * 4 * 255 * 128), so nothing overflows;
 * the digit sums are combined in int64, and the only rounding is fp32(S * 2^exp) once per K-block.
 */
#define KT_RUNTIME_INTERNAL
#include "kt_runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <string.h>

#define RT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define RT_K_BLOCK 3584
/* Bytes ahead of the weights being read that are prefetched: the blob is one sequential stream, but the hardware
 * prefetchers alone left the INT4 GEMV at ~50% of this machine's read bandwidth (82% with 4 KiB ahead). Prefetching
 * past the end of the blob is harmless (no fault). */
#define RT_PREFETCH 4096
#define RT_TERN_AND_XOR 0x6A /* (a & b) ^ c */

/* The two 64-byte lines (one per tile half) RT_PREFETCH bytes ahead of row line p of a tile. */
static inline void rt_prefetch(const uint8_t *p)
{
    _mm_prefetch((const char *)(p + RT_PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(p + RT_PREFETCH + 1024), _MM_HINT_T0);
}

static inline int32_t rt_load32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* acc[t*ldacc + r] += fp32((sum_i 256^i * lanes[i][r] - 128 * ksum) * pow2 * unit) for the 32 panel rows. */
static void rt_vnni_flush(const int32_t lanes[KT_RT_XDIGITS][32], const kt_rt_xq *xq, int64_t t, int64_t kb,
                          double unit, float *acc)
{
    const int64_t bias = 128 * xq->ksum[t * xq->nkb + kb];
    const double pow2 = xq->pow2[t] * unit;
    for (int r = 0; r < 32; r++) {
        int64_t s = -bias;
        for (int i = 0; i < KT_RT_XDIGITS; i++) s += (int64_t)lanes[i][r] << (8 * i);
        acc[r] += (float)((double)s * pow2);
    }
}

RT_VNNI static void int4_qpanel_vnni(const uint8_t *panel, int64_t ntiles, const kt_rt_xq *xq, int64_t kb,
                                     int64_t m, float *acc, int64_t ldacc)
{
    const __m512i nib = _mm512_set1_epi32((int)0xF0F0F0F0u), bias = _mm512_set1_epi32((int)0x80808080u);
    for (int64_t t = 0; t < m; t++) {
        const int8_t *d = xq->digits + t * KT_RT_XDIGITS * xq->k + kb * RT_K_BLOCK;
        __m512i a[2][2][KT_RT_XDIGITS]; /* [half][low / high nibble][digit] */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 2; s++)
                for (int i = 0; i < KT_RT_XDIGITS; i++) a[h][s][i] = _mm512_setzero_si512();
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const int8_t *dc = d + tile * 128;
            for (int q = 0; q < 16; q++) {
                rt_prefetch(tp + q * 64);
                __m512i v0 = _mm512_loadu_si512((const void *)(tp + q * 64));
                __m512i v1 = _mm512_loadu_si512((const void *)(tp + 1024 + q * 64));
                __m512i lo0 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(v0, 4), nib, bias, RT_TERN_AND_XOR);
                __m512i lo1 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(v1, 4), nib, bias, RT_TERN_AND_XOR);
                __m512i hi0 = _mm512_ternarylogic_epi32(v0, nib, bias, RT_TERN_AND_XOR);
                __m512i hi1 = _mm512_ternarylogic_epi32(v1, nib, bias, RT_TERN_AND_XOR);
                for (int i = 0; i < KT_RT_XDIGITS; i++) {
                    __m512i xl = _mm512_set1_epi32(rt_load32(dc + i * xq->k + 4 * q));
                    __m512i xh = _mm512_set1_epi32(rt_load32(dc + i * xq->k + 4 * q + 64));
                    a[0][0][i] = _mm512_dpbusd_epi32(a[0][0][i], lo0, xl);
                    a[1][0][i] = _mm512_dpbusd_epi32(a[1][0][i], lo1, xl);
                    a[0][1][i] = _mm512_dpbusd_epi32(a[0][1][i], hi0, xh);
                    a[1][1][i] = _mm512_dpbusd_epi32(a[1][1][i], hi1, xh);
                }
            }
        }
        int32_t lanes[KT_RT_XDIGITS][32];
        for (int i = 0; i < KT_RT_XDIGITS; i++)
            for (int h = 0; h < 2; h++)
                _mm512_storeu_si512((void *)(lanes[i] + 16 * h), _mm512_add_epi32(a[h][0][i], a[h][1][i]));
        rt_vnni_flush(lanes, xq, t, kb, 1.0 / 16.0, acc + t * ldacc); /* the bytes held 16 * code */
    }
}

RT_VNNI static void int8_qpanel_vnni(const uint8_t *panel, int64_t ntiles, const kt_rt_xq *xq, int64_t kb,
                                     int64_t m, float *acc, int64_t ldacc)
{
    const __m512i bias = _mm512_set1_epi32((int)0x80808080u);
    for (int64_t t = 0; t < m; t++) {
        const int8_t *d = xq->digits + t * KT_RT_XDIGITS * xq->k + kb * RT_K_BLOCK;
        __m512i a[2][KT_RT_XDIGITS]; /* [half][digit] */
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < KT_RT_XDIGITS; i++) a[h][i] = _mm512_setzero_si512();
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const uint8_t *tp = panel + tile * 2048;
            const int8_t *dc = d + tile * 64;
            for (int q = 0; q < 16; q++) {
                rt_prefetch(tp + q * 64);
                __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(tp + q * 64)), bias);
                __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(tp + 1024 + q * 64)), bias);
                for (int i = 0; i < KT_RT_XDIGITS; i++) {
                    __m512i xb = _mm512_set1_epi32(rt_load32(dc + i * xq->k + 4 * q));
                    a[0][i] = _mm512_dpbusd_epi32(a[0][i], w0, xb);
                    a[1][i] = _mm512_dpbusd_epi32(a[1][i], w1, xb);
                }
            }
        }
        int32_t lanes[KT_RT_XDIGITS][32];
        for (int i = 0; i < KT_RT_XDIGITS; i++)
            for (int h = 0; h < 2; h++) _mm512_storeu_si512((void *)(lanes[i] + 16 * h), a[h][i]);
        rt_vnni_flush(lanes, xq, t, kb, 1.0, acc + t * ldacc);
    }
}

/* BF16 and RAWINT4 rows have no integer form here: they run the AVX-512 fp32 kernels. */
const kt_rt_kernels kt_rt_kernels_avx512vnni = {NULL, NULL, kt_rt_bf16_rows_avx512, int4_qpanel_vnni, int8_qpanel_vnni,
                                                kt_rt_rawint4_rows_avx512};

#endif
