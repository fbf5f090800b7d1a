/* --quant mse: error-minimising per-row scales for AMXINT4 / AMXINT8 (the search of ktconvert/quant/mse.py, whose
 * docstring is the specification; codes and scales here are bit-identical to it).
 *
 * Per row: amax (the AMX kernels' row_amax_bits), x = the row as fp32 (subnormals flushed), X = the row as integers
 * (rint_even(x * 2^(24-e)), |X| <= 2^24), then for candidate inverse steps isc = fp32(a_j / amax) on a 16-point grid
 * (8 coarse points, then the 2 neighbours of the best) the codes q = clamp(rint_even(fp32(x * isc)), -qmax, qmax)
 * and the sums P = sum X*q, Q = sum q*q. Every term is an
 * integer >= 0 and every partial sum < 2^53 (k <= 2^22), so P and Q are exact in double whatever the summation
 * order: the SIMD and scalar versions agree bit for bit with each other and with numpy. The best candidate is the
 * first (in evaluation order) with the largest P*P/Q; d = fp32(ldexp(P/Q, e - 24 [- 4 for INT4])).
 *
 * Packing reuses kt_amx_quantize: a row of integer codes written as BF16 has amax = qmax, so kt-kernel's own
 * rounding of it gives back exactly those codes (INT4: d = 7/112 = 1/16, x * 16 is exact; INT8: d ~ 1, |q| < 128).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "kt_internal.h"

#define MSE_GRID 16 /* grid points a_j = qmax + step * j */
#define MSE_MAX_K ((int64_t)1 << 22)
#define MSE_ZERO_ROW_AMAX 0x1p-118f /* rows with a smaller amax get d = 0, codes 0 */
#define ROUND_MAGIC_F 12582912.0f   /* 1.5 * 2^23: (v + M) - M == rint_even(v) for |v| < 2^22 */
#define ROUND_MAGIC_D 6755399441055744.0 /* 1.5 * 2^52: the same for doubles, |v| < 2^51 */

/* Per-ISA kernels. prep: BF16 row -> x (fp32, subnormals 0) and X = rint_even(x * pow2) (double).
 * sums: P and Q of one candidate. codes: the codes of one candidate as BF16 bits. */
struct kt_mse_kernels {
    void (*prep)(const uint16_t *row, int64_t k, double pow2, float *x, double *X);
    void (*sums)(const float *x, const double *X, int64_t k, float isc, float qmax, double *pq);
    void (*codes)(const float *x, int64_t k, float isc, float qmax, uint16_t *out);
};

static inline float code_scalar(float x, float isc, float qmax) {
    float y = x * isc;
    y = (y + ROUND_MAGIC_F) - ROUND_MAGIC_F;
    return y > qmax ? qmax : (y < -qmax ? -qmax : y);
}

static void prep_scalar(const uint16_t *row, int64_t k, double pow2, float *x, double *X) {
    for (int64_t j = 0; j < k; j++) {
        float v = (row[j] & 0x7f80) ? kt_bf16_to_f32(row[j]) : 0.0f;
        double s = (double)v * pow2;
        x[j] = v;
        X[j] = (s + ROUND_MAGIC_D) - ROUND_MAGIC_D;
    }
}

static void sums_scalar(const float *x, const double *X, int64_t k, float isc, float qmax, double *pq) {
    double p = 0.0, q = 0.0;
    for (int64_t j = 0; j < k; j++) {
        double c = (double)code_scalar(x[j], isc, qmax);
        p += X[j] * c;
        q += c * c;
    }
    pq[0] = p;
    pq[1] = q;
}

static void codes_scalar(const float *x, int64_t k, float isc, float qmax, uint16_t *out) {
    for (int64_t j = 0; j < k; j++) {
        float c = code_scalar(x[j], isc, qmax);
        uint32_t u;
        memcpy(&u, &c, sizeof u);
        out[j] = (uint16_t)(u >> 16); /* small integers are exact in BF16 */
    }
}

const kt_mse_kernels kt_mse_kernels_scalar = {prep_scalar, sums_scalar, codes_scalar};

#ifdef KT_X86
#include <immintrin.h>

#define KT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define KT_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

KT_AVX512 static inline __m256 upper8(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

KT_AVX512 static void prep_avx512(const uint16_t *row, int64_t k, double pow2, float *x, double *X) {
    const __m512d p2 = _mm512_set1_pd(pow2);
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + j))), 16);
        __mmask16 normal = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7f800000));
        __m512 v = _mm512_maskz_mov_ps(normal, _mm512_castsi512_ps(bits));
        _mm512_storeu_ps(x + j, v);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d hi = _mm512_cvtps_pd(upper8(v));
        _mm512_storeu_pd(X + j, _mm512_roundscale_pd(_mm512_mul_pd(lo, p2), KT_RNE));
        _mm512_storeu_pd(X + j + 8, _mm512_roundscale_pd(_mm512_mul_pd(hi, p2), KT_RNE));
    }
    prep_scalar(row + j, k - j, pow2, x + j, X + j);
}

KT_AVX512 static inline __m512 codes16_avx512(const float *x, __m512 isc, __m512 lo, __m512 hi) {
    __m512 y = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x), isc), KT_RNE);
    return _mm512_min_ps(_mm512_max_ps(y, lo), hi);
}

/* P (double: products up to 2^31) and Q (fp32 per lane over <= 1024-element blocks: at most 64 * 127^2 < 2^24, so
 * exact, then added into double): every partial sum is an exact integer. Two 16-lane steps per iteration. */
KT_AVX512 static void sums_avx512(const float *x, const double *X, int64_t k, float isc, float qmax, double *pq) {
    const __m512 vi = _mm512_set1_ps(isc), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    __m512d p0 = _mm512_setzero_pd(), p1 = p0, p2 = p0, p3 = p0, qd = p0;
    int64_t j = 0;
    while (j + 32 <= k) {
        int64_t block_end = j + 1024 < k ? j + 1024 : k;
        __m512 qa = _mm512_setzero_ps(), qb = qa;
        for (; j + 32 <= block_end; j += 32) {
            __m512 c = codes16_avx512(x + j, vi, lo, hi), e = codes16_avx512(x + j + 16, vi, lo, hi);
            qa = _mm512_fmadd_ps(c, c, qa);
            qb = _mm512_fmadd_ps(e, e, qb);
            p0 = _mm512_fmadd_pd(_mm512_loadu_pd(X + j), _mm512_cvtps_pd(_mm512_castps512_ps256(c)), p0);
            p1 = _mm512_fmadd_pd(_mm512_loadu_pd(X + j + 8), _mm512_cvtps_pd(upper8(c)), p1);
            p2 = _mm512_fmadd_pd(_mm512_loadu_pd(X + j + 16), _mm512_cvtps_pd(_mm512_castps512_ps256(e)), p2);
            p3 = _mm512_fmadd_pd(_mm512_loadu_pd(X + j + 24), _mm512_cvtps_pd(upper8(e)), p3);
        }
        __m512 qs = _mm512_add_ps(qa, qb);
        qd = _mm512_add_pd(qd, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(qs)),
                                             _mm512_cvtps_pd(upper8(qs))));
    }
    double tail[2];
    sums_scalar(x + j, X + j, k - j, isc, qmax, tail);
    pq[0] = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(p0, p1), _mm512_add_pd(p2, p3))) + tail[0];
    pq[1] = _mm512_reduce_add_pd(qd) + tail[1];
}

KT_AVX512 static void codes_avx512(const float *x, int64_t k, float isc, float qmax, uint16_t *out) {
    const __m512 vi = _mm512_set1_ps(isc), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(codes16_avx512(x + j, vi, lo, hi)), 16);
        _mm256_storeu_si256((__m256i *)(out + j), _mm512_cvtepi32_epi16(bits));
    }
    codes_scalar(x + j, k - j, isc, qmax, out + j);
}

const kt_mse_kernels kt_mse_kernels_avx512 = {prep_avx512, sums_avx512, codes_avx512};
#endif

/* Scratch of one call: x, X for one row, and BF16 codes of `rows` rows. */
typedef struct {
    float *x;
    double *X;
    uint16_t *codes;
} mse_scratch;

static int scratch_alloc(mse_scratch *s, int64_t k, int64_t rows) {
    s->x = malloc((size_t)k * sizeof *s->x);
    s->X = malloc((size_t)k * sizeof *s->X);
    s->codes = malloc((size_t)(k * rows) * sizeof *s->codes);
    return s->x && s->X && s->codes ? KT_OK : KT_E_ARG;
}

static void scratch_free(mse_scratch *s) {
    free(s->x);
    free(s->X);
    free(s->codes);
}

typedef struct {
    double score, p, q;
    float isc;
    int index;
} mse_best;

/* Evaluate grid point j (a = qmax + step * j); it replaces the best only with a strictly larger score. */
static void offer(const kt_mse_kernels *mk, const mse_scratch *s, int64_t k, float amax, float qmax, float step, int j,
                  mse_best *best) {
    float isc = (qmax + step * (float)j) / amax;
    double pq[2];
    mk->sums(s->x, s->X, k, isc, qmax, pq);
    double score = (pq[0] * pq[0]) / pq[1];
    if (score > best->score) {
        best->score = score, best->p = pq[0], best->q = pq[1], best->isc = isc, best->index = j;
    }
}

/* kt-kernel's own rounding of one row (kt-format.md 2.1 / 2.2), codes as BF16 bits: the fallback for rows whose
 * search would give a subnormal scale (and for rows too small to search). Its largest code is qmax (or all 0). */
static void rtn_row(const uint16_t *row, int64_t k, int bits, float amax, uint16_t *out, float *d_out) {
    float d = bits == 4 ? (float)((double)amax / 112.0) : amax * (1.0f / 127.0f);
    if (!(d >= FLT_MIN)) d = 0.0f;
    float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t j = 0; j < k; j++) {
        float v = (row[j] & 0x7f80) ? kt_bf16_to_f32(row[j]) : 0.0f;
        float q = (v * inv + ROUND_MAGIC_F) - ROUND_MAGIC_F; /* |v * inv| <= ~127: in the magic's range */
        q = q > 127.0f ? 127.0f : (q < -128.0f ? -128.0f : q);
        if (bits == 4) q = q < 0.0f ? -floorf((-q + 8.0f) / 16.0f) : floorf((q + 8.0f) / 16.0f);
        uint32_t u;
        memcpy(&u, &q, sizeof u);
        out[j] = (uint16_t)(u >> 16);
    }
    *d_out = d;
}

/* One row: codes (BF16 bits of the integers) into `out`, d into *d_out. KT_E_NONFINITE on NaN/Inf. */
static int search_row(const kt_mse_kernels *mk, const kt_amx_kernels *ak, const uint16_t *row, int64_t k, int bits,
                      const mse_scratch *s, uint16_t *out, float *d_out) {
    uint16_t amax_bits = ak->row_amax_bits(row, k);
    if (amax_bits >= 0x7f80) return KT_E_NONFINITE;
    float amax = amax_bits >= 0x0080 ? kt_bf16_to_f32(amax_bits) : 0.0f;
    if (!(amax >= MSE_ZERO_ROW_AMAX)) {
        rtn_row(row, k, bits, amax, out, d_out);
        return KT_OK;
    }
    int e = (amax_bits >> 7) - 126; /* amax = f * 2^e, 0.5 <= f < 1 */
    mk->prep(row, k, ldexp(1.0, 24 - e), s->x, s->X);
    float qmax = bits == 4 ? 7.0f : 127.0f, step = bits == 4 ? 0.5f : 0.25f;
    mse_best best = {-INFINITY, 0.0, 1.0, 0.0f, 0};
    for (int j = 0; j < MSE_GRID; j += 2) /* 1. coarse: even grid points */
        offer(mk, s, k, amax, qmax, step, j, &best);
    int coarse = best.index;
    if (coarse > 0) offer(mk, s, k, amax, qmax, step, coarse - 1, &best); /* 2. fine: the two neighbours */
    if (coarse + 1 < MSE_GRID) offer(mk, s, k, amax, qmax, step, coarse + 1, &best);
    float d = (float)ldexp(best.p / best.q, e - 24 - (bits == 4 ? 4 : 0));
    if (!(d >= FLT_MIN)) { /* a subnormal scale: kt-kernel's own rounding instead */
        rtn_row(row, k, bits, amax, out, d_out);
        return KT_OK;
    }
    mk->codes(s->x, k, best.isc, qmax, out);
    *d_out = d;
    return KT_OK;
}

/* The search and AMX kernels of the implementation a call with `impl` runs (dispatch.c's table). */
static int kernels_for(int impl, const kt_mse_kernels **mk, const kt_amx_kernels **ak) {
    int status;
    const kt_impl *chosen = kt_impl_get(impl, &status);
    if (!chosen) return status;
    *mk = chosen->mse;
    *ak = chosen->amx;
    return KT_OK;
}

KT_API int kt_mse_rows(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int impl, int8_t *codes,
                       float *scales, int64_t row_begin, int64_t row_end, int64_t *err_row) {
    if (bits != 4 && bits != 8) return KT_E_ARG;
    if (n <= 0 || k <= 0 || k > MSE_MAX_K) return KT_E_SHAPE;
    if (!w_bf16 || !codes || !scales || row_begin < 0 || row_begin > row_end || row_end > n) return KT_E_ARG;
    const kt_mse_kernels *mk = NULL;
    const kt_amx_kernels *ak = NULL;
    int status = kernels_for(impl, &mk, &ak);
    if (status != KT_OK) return status;
    mse_scratch s;
    if (scratch_alloc(&s, k, 1) != KT_OK) {
        scratch_free(&s);
        return KT_E_ARG;
    }
    kt_fpenv env;
    kt_fpenv_enter(&env);
    for (int64_t r = row_begin; r < row_end && status == KT_OK; r++) {
        status = search_row(mk, ak, w_bf16 + r * k, k, bits, &s, s.codes, &scales[r]);
        if (status == KT_E_NONFINITE && err_row) *err_row = r;
        for (int64_t j = 0; j < k && status == KT_OK; j++) codes[r * k + j] = (int8_t)kt_bf16_to_f32(s.codes[j]);
    }
    kt_fpenv_leave(&env);
    scratch_free(&s);
    return status;
}

KT_API int kt_amx_mse_quantize(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int impl, uint8_t *blob,
                               float *scales, int64_t nblock_begin, int64_t nblock_end, int64_t *err_row) {
    int status = kt_amx_check_shape(n, k, bits);
    if (status != KT_OK) return status;
    if (k > MSE_MAX_K) return KT_E_SHAPE;
    if (!w_bf16 || !blob || !scales) return KT_E_ARG;
    if (nblock_begin < 0 || nblock_begin > nblock_end || nblock_end > kt_amx_nblocks(n, bits)) return KT_E_ARG;
    const kt_mse_kernels *mk = NULL;
    const kt_amx_kernels *ak = NULL;
    if ((status = kernels_for(impl, &mk, &ak)) != KT_OK) return status;
    int64_t nb_rows = kt_amx_nblock_rows(bits);
    mse_scratch s;
    if (scratch_alloc(&s, k, nb_rows) != KT_OK) {
        scratch_free(&s);
        return KT_E_ARG;
    }
    float unit_scales[128];
    kt_fpenv env;
    kt_fpenv_enter(&env);
    for (int64_t nb = nblock_begin; nb < nblock_end && status == KT_OK; nb++) {
        int64_t nb0 = nb * nb_rows, nbs = n - nb0 < nb_rows ? n - nb0 : nb_rows;
        for (int64_t r = 0; r < nbs && status == KT_OK; r++) {
            status = search_row(mk, ak, w_bf16 + (nb0 + r) * k, k, bits, &s, s.codes + r * k, &scales[nb0 + r]);
            if (status == KT_E_NONFINITE && err_row) *err_row = nb0 + r;
        }
        if (status == KT_OK) /* tiles of the codes: this N-block is a whole [nbs, k] matrix at its byte offset */
            status = kt_amx_quantize(s.codes, nbs, k, bits, impl, blob + nb0 * k * bits / 8, unit_scales, 0, 1, NULL);
    }
    kt_fpenv_leave(&env);
    scratch_free(&s);
    return status;
}
