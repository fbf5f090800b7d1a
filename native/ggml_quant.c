/* ggml quantizers Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, byte-identical to llama.cpp's reference quantizer (ggml-quants.c
 * quantize_row_<type>_ref: what llama_model_quantize runs without an importance matrix) and to
 * ktconvert/quant/ggml_quant.py (numpy for the K-quants, gguf-py for Q8_0 / Q4_0), which documents the arithmetic;
 * and, given an importance matrix, to quantize_row_<type>_impl (kt_ggml_quantize_imatrix: Q4_K, Q5_K, Q6_K, Q4_0;
 * ggml's Q8_0 ignores the matrix; checked against ggml_quantize_chunk's bytes by tests/test_imatrix.py).
 *
 * Bit-exactness: every value llama.cpp keeps in a float is a float here, each product / sum rounded in its order
 * (w*l*x is (w*l)*x; sums over a block are sequential loops, which compilers do not reorder without -ffast-math);
 * the library is built with -ffp-contract=off (no FMA fusing, as llama.cpp's ggml-base, built without -march
 * flags, has none on x86-64); nearest_int is ggml's add-1.5*2^23 trick (round half to even); fp16 stores of d /
 * dmin round to nearest even and are read back before the final codes are chosen. The bodies are written once
 * (always_inline) and instantiated plainly and per ISA target: IEEE float operations round the same at every
 * vector width, so all variants give the same bytes (tests/test_ggml_quant.py checks each against numpy and
 * llama.cpp's bytes). The call runs with round-to-nearest-even and no FTZ/DAZ (kt_fpenv_enter_ieee).
 */
#include <math.h>
#include <string.h>

#include "kt_internal.h"
#include "kt_native.h"

#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors only pass between always_inline functions */

#define KT_INLINE static inline __attribute__((always_inline))
#define QK_K 256
#define GROUP_MAX_EPS 1e-15f

/* ---------------------------------------------------------------- helpers */

KT_INLINE int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* float -> IEEE half bits, round to nearest even (overflow to Inf), as numpy's astype(float16). */
KT_INLINE uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return sign | 0x7c00u | (x > 0x7f800000u ? 0x0200u : 0u);
    if (x >= 0x477ff000u) return sign | 0x7c00u;           /* >= 65520: rounds to Inf */
    if (x >= 0x38800000u) {                                 /* normal half */
        uint32_t r = x - 0x38000000u;
        r += 0x0fffu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    const int e = (int)(x >> 23), shift = 126 - e;          /* subnormal half: value / 2^-24 = m >> shift */
    if (shift > 24) return sign;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1);
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

KT_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float v = (float)man * 0x1p-24f;              /* exact */
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

KT_INLINE void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, sizeof v); }

/* ---------------------------------------------------------------- lane-parallel searches
 *
 * The searches run on 8 sub-blocks at once, one per vector lane (GCC vector extensions: SSE2 pairs in the plain
 * build, one register with AVX2 / AVX-512). Each lane does exactly the scalar reference's operations in its order
 * (sums stay sequential per lane), so lanes are 8 independent copies of the C loop; lanes the reference would have
 * left early (a flat or all-zero sub-block) compute garbage that is never selected. */

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

KT_INLINE vf splat(float a) { return (vf){a, a, a, a, a, a, a, a}; }
KT_INLINE vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
KT_INLINE vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }
KT_INLINE int any(vi m) {
    int r = 0;
    for (int j = 0; j < 8; j++) r |= m[j];
    return r;
}

/* nearest_int of every lane, clamped to [lo, hi], as float */
KT_INLINE vf nearest_clamp(vf v, float lo, float hi) {
    const vf val = v + splat(12582912.f);
    const vf f = __builtin_convertvector(((vi)val & 0x007fffff) - 0x00400000, vf);
    const vf a = sel(f < splat(lo), splat(lo), f);
    return sel(a > splat(hi), splat(hi), a);
}

/* make_qkx2_quants (use_mad false) on 8 sub-blocks of 32: codes L[i] (lane j: value i of sub-block j) in
 * 0..nmax, returns the scales, *the_min = -min >= 0. */
KT_INLINE vf qkx2(const vf *x, const vf *w, vf *L, vf *the_min, int nmax, float rmin, float rdelta, int nstep) {
    vf min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0], Laux[32];
    for (int i = 1; i < 32; ++i) {
        min = sel(x[i] < min, x[i], min);
        max = sel(x[i] > max, x[i], max);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    min = sel(min > splat(0), splat(0), min);
    const vi flat = max == min;
    vf iscale = splat((float)nmax) / (max - min), scale = splat(1) / iscale, best = splat(0);
    for (int i = 0; i < 32; ++i) {
        L[i] = nearest_clamp(iscale * (x[i] - min), 0, (float)nmax);
        vf diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        best += w[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = splat(rmin + rdelta * is + nmax) / (max - min);
        vf sum_l = splat(0), sum_l2 = splat(0), sum_xl = splat(0);
        for (int i = 0; i < 32; ++i) {
            const vf l = nearest_clamp(iscale * (x[i] - min), 0, (float)nmax);
            Laux[i] = l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const vf D = sum_w * sum_l2 - sum_l * sum_l;
        vf this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        const vi clamp = this_min > splat(0);
        this_min = sel(clamp, splat(0), this_min);
        this_scale = sel(clamp, sum_xl / sum_l2, this_scale);
        vf cur = splat(0);
        for (int i = 0; i < 32; ++i) {
            vf diff = this_scale * Laux[i] + this_min - x[i];
            diff = diff * diff;
            cur += w[i] * diff;
        }
        const vi better = (D > splat(0)) & (cur < best) & ~flat;
        if (!any(better)) continue;
        for (int i = 0; i < 32; ++i) L[i] = sel(better, Laux[i], L[i]);
        best = sel(better, cur, best);
        scale = sel(better, this_scale, scale);
        min = sel(better, this_min, min);
    }
    for (int i = 0; i < 32; ++i) L[i] = sel(flat, splat(0), L[i]);
    *the_min = -min;
    return sel(flat, splat(0), scale);
}

/* make_qx_quants with rmse_type 1 on 8 groups of n values (n <= 32), codes l in [-nmax, nmax-1]: weights qw[i]
 * (lane j: the importance of value i of group j) or, qw NULL, x^2. Codes L[i] = l + nmax (0 for an all-zero group),
 * returns the scales. */
KT_INLINE vf qx_w(const vf *x, const vf *qw, vf *L, int n, int nmax) {
    vf max = splat(0), amax = splat(0), laux[32];
    for (int i = 0; i < n; ++i) {
        const vf ax = vabs(x[i]);
        const vi m = ax > amax;
        amax = sel(m, ax, amax);
        max = sel(m, x[i], max);
    }
    const vi zero = amax < splat(GROUP_MAX_EPS);
    const float lo = (float)-nmax, hi = (float)(nmax - 1);
    vf iscale = splat((float)-nmax) / max, sumlx = splat(0), suml2 = splat(0);
    for (int i = 0; i < n; ++i) {
        const vf l = nearest_clamp(iscale * x[i], lo, hi), w = qw ? qw[i] : x[i] * x[i];
        L[i] = l + splat((float)nmax);
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    vf scale = sel(suml2 != splat(0), sumlx / suml2, splat(0)), best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = splat(-(nmax + 0.1f * is)) / max;
        sumlx = suml2 = splat(0);
        for (int i = 0; i < n; ++i) {
            const vf l = nearest_clamp(iscale * x[i], lo, hi), w = qw ? qw[i] : x[i] * x[i];
            laux[i] = l;
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        const vi better = (suml2 > splat(0)) & (sumlx * sumlx > best * suml2);
        if (!any(better)) continue;
        for (int i = 0; i < n; ++i) L[i] = sel(better, laux[i] + splat((float)nmax), L[i]);
        scale = sel(better, sumlx / suml2, scale);
        best = sel(better, scale * sumlx, best);
    }
    for (int i = 0; i < n; ++i) L[i] = sel(zero, splat(0), L[i]);
    return sel(zero, splat(0), scale);
}

/* ---------------------------------------------------------------- super-blocks */

/* Q4_K (nmax 15) / Q5_K (nmax 31, five): d, dmin, 12 scale bytes, [qh 32,] qs 128. */
KT_INLINE void block_qkx(const float *x, uint8_t *y, int nmax, float rmin, int nstep, int five) {
    uint8_t L[QK_K], ls[8], lm[8];
    vf xt[32], w[32], Lv[32], sum_x2 = splat(0), av_x, scales_v, mins_v;
    for (int i = 0; i < 32; ++i)
        for (int j = 0; j < 8; ++j) xt[i][j] = x[32 * j + i];
    for (int i = 0; i < 32; ++i) sum_x2 += xt[i] * xt[i];
    for (int j = 0; j < 8; ++j) av_x[j] = sqrtf(sum_x2[j] / 32);
    for (int i = 0; i < 32; ++i) w[i] = av_x + vabs(xt[i]);
    scales_v = qkx2(xt, w, Lv, &mins_v, nmax, rmin, 0.1f, nstep);
    float scales[8], mins[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        scales[j] = scales_v[j];
        mins[j] = mins_v[j];
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)Lv[i][j];
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = y + 4;
    for (int j = 0; j < 8; ++j) {
        const uint8_t a = (uint8_t)nearest_int(inv_scale * scales[j]), b = (uint8_t)nearest_int(inv_min * mins[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    for (int j = 0; j < 4; ++j) {
        sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        sc[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
    }
    const uint16_t d16 = f32_to_f16(max_scale / 63.f), m16 = f32_to_f16(max_min / 63.f);
    put16(y, d16);
    put16(y + 2, m16);
    const float dd = f16_to_f32(d16), dm = f16_to_f32(m16);
    for (int j = 0; j < 8; ++j) {
        const float d = dd * ls[j];
        if (!d) continue;
        const float m = dm * lm[j];
        for (int i = 0; i < 32; ++i) {
            const int l = nearest_int((x[32 * j + i] + m) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
    uint8_t *qh = y + 16, *qs = y + (five ? 48 : 16);
    if (five) memset(qh, 0, 32);
    for (int p = 0; p < 4; ++p) {           /* sub-blocks 2p (low nibbles) and 2p+1 (high nibbles) */
        for (int l = 0; l < 32; ++l) {
            const uint8_t a = L[64 * p + l], b = L[64 * p + 32 + l];
            qs[32 * p + l] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
            if (five) qh[l] |= (uint8_t)(((a >> 4) << (2 * p)) | ((b >> 4) << (2 * p + 1)));
        }
    }
}

/* Q6_K: ql 128, qh 64, 16 int8 scales, d. qw: the 256 importances of this super-block's columns (quantize_row_q6_K_impl
 * passes them to make_qx_quants unchanged) or NULL (weights x^2, quantize_row_q6_K_ref). */
KT_INLINE void block_q6k(const float *x, const float *qw, uint8_t *y) {
    uint8_t L[QK_K];
    int8_t sc[16];
    float scales[16], max_scale = 0, max_abs = 0;
    for (int half = 0; half < 2; ++half) {  /* sub-blocks 8*half .. 8*half+7 in the lanes */
        vf xt[16], wt[16], Lv[16];
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 8; ++j) {
                xt[i][j] = x[16 * (8 * half + j) + i];
                wt[i][j] = qw ? qw[16 * (8 * half + j) + i] : 0.f;
            }
        const vf s = qx_w(xt, qw ? wt : NULL, Lv, 16, 32);
        for (int j = 0; j < 8; ++j) {
            scales[8 * half + j] = s[j];
            for (int i = 0; i < 16; ++i) L[16 * (8 * half + j) + i] = (uint8_t)Lv[i][j];
        }
    }
    for (int j = 0; j < 16; ++j) {
        if (fabsf(scales[j]) > max_abs) {
            max_abs = fabsf(scales[j]);
            max_scale = scales[j];
        }
    }
    if (max_abs < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    const uint16_t d16 = f32_to_f16(1 / iscale);
    for (int j = 0; j < 16; ++j) {
        const int l = nearest_int(iscale * scales[j]);
        sc[j] = (int8_t)(l < 127 ? l : 127);
    }
    const float dd = f16_to_f32(d16);
    for (int j = 0; j < 16; ++j) {
        const float d = dd * sc[j];
        if (!d) continue;
        for (int i = 0; i < 16; ++i) {
            int l = nearest_int(x[16 * j + i] / d);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            L[16 * j + i] = (uint8_t)(l + 32);
        }
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int h = 0; h < 2; ++h) {           /* 128 values each: 4 groups of 32 */
        const uint8_t *g = L + 128 * h;
        for (int l = 0; l < 32; ++l) {
            const uint8_t a = g[l], b = g[l + 32], c = g[l + 64], e = g[l + 96];
            ql[64 * h + l] = (uint8_t)((a & 0xF) | ((c & 0xF) << 4));
            ql[64 * h + l + 32] = (uint8_t)((b & 0xF) | ((e & 0xF) << 4));
            qh[32 * h + l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
    }
    memcpy(y + 192, sc, 16);
    put16(y + 208, d16);
}

/* Q8_0: d = amax / 127 (fp16), codes roundf(x / d) (half away from zero) as int8. */
KT_INLINE void block_q8_0(const float *x, uint8_t *y) {
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
    const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
    put16(y, f32_to_f16(d));
    for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* Q4_0: d = (value of the first largest magnitude) / -8 (fp16), codes min(15, trunc(x / d + 8.5)). */
KT_INLINE void block_q4_0(const float *x, uint8_t *y) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / -8, id = d ? 1.0f / d : 0.0f;
    put16(y, f32_to_f16(d));
    for (int j = 0; j < 16; ++j) {
        const uint8_t a = (uint8_t)(int8_t)(x[j] * id + 8.5f), b = (uint8_t)(int8_t)(x[16 + j] * id + 8.5f);
        y[2 + j] = (uint8_t)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
    }
}

/* ---------------------------------------------------------------- with an importance matrix
 *
 * What llama_model_quantize runs when given one (ggml-quants.c quantize_<type> -> quantize_row_<type>_impl, row by
 * row; qw: the n_per_row importances of the row's columns, the same for every row of one expert). Q8_0 has no such
 * path (quantize_q8_0 ignores the matrix). uint8_t stores keep C's wrap-around where the reference stores an int
 * into a uint8_t, so even out-of-range codes match. */

/* make_qp_quants: n (<= 8) non-negative values x, weights w, codes 0..nmax in L; returns the scale. */
KT_INLINE float qp(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0;
    for (int i = 0; i < n; ++i) max = max > x[i] ? max : x[i];
    if (max < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; ++i) L[i] = (uint8_t)nearest_int(iscale * x[i]);
    const float scale = 1 / iscale;
    float best_mse = 0;
    for (int i = 0; i < n; ++i) {
        const float diff = x[i] - scale * L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * is + nmax) / max, scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale_is * x[i]);
            l = l < nmax ? l : nmax;
            const float diff = x[i] - scale_is * l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            float slx = sumlx - w[i] * x[i] * L[i], sl2 = suml2 - w[i] * L[i] * L[i];
            if (!(slx > 0 && sl2 > 0)) continue;
            int new_l = nearest_int(x[i] * sl2 / slx);
            new_l = new_l < nmax ? new_l : nmax;
            if (new_l == L[i]) continue;
            slx += w[i] * x[i] * new_l;
            sl2 += w[i] * new_l * new_l;
            if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (uint8_t)new_l;
                sumlx = slx;
                suml2 = sl2;
                ++changed;
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Q4_K / Q5_K (quantize_row_q{4,5}_K_impl): weights qw * sqrt(sigma2 + x^2) (sigma2 = 2 * mean x^2 of the
 * super-block), make_qkx3_quants (the make_qkx2 search with 37 steps from nmax - 0.9 by 0.05) per sub-block, the 8
 * scales and mins quantized to 6 bits by make_qp_quants weighted by each sub-block's weight sum. */
KT_INLINE void block_qkx_w(const float *x, const float *qw, uint8_t *y, int nmax, int five) {
    uint8_t L[QK_K], Ls[8], Lm[8];
    vf xt[32], w[32], Lv[32], mins_v;
    float sum_x2 = 0, sw[8], scales[8], mins[8];
    for (int l = 0; l < QK_K; ++l) sum_x2 += x[l] * x[l];
    const float sigma2 = 2 * sum_x2 / QK_K;
    for (int j = 0; j < 8; ++j) {
        float sumw = 0;
        for (int i = 0; i < 32; ++i) {
            const float v = x[32 * j + i], wi = qw[32 * j + i] * sqrtf(sigma2 + v * v);
            xt[i][j] = v;
            w[i][j] = wi;
            sumw += wi;
        }
        sw[j] = sumw;
    }
    const vf scales_v = qkx2(xt, w, Lv, &mins_v, nmax, -0.9f, 0.05f, 36);
    for (int j = 0; j < 8; ++j) {
        scales[j] = scales_v[j];
        mins[j] = mins_v[j];
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)Lv[i][j];
    }
    const float d_block = qp(8, 63, scales, Ls, sw), m_block = qp(8, 63, mins, Lm, sw);
    uint8_t *sc = y + 4;
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = Ls[j], lm = Lm[j];
        if (five) {
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
        }
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t d16 = f32_to_f16(d_block), m16 = f32_to_f16(m_block);
    put16(y, d16);
    put16(y + 2, m16);
    const float dd = f16_to_f32(d16), dm = f16_to_f32(m16);
    for (int j = 0; j < 8; ++j) {   /* get_scale_min_k4 of the packed bytes */
        const uint8_t s6 = j < 4 ? sc[j] & 63 : (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
        const uint8_t m6 = j < 4 ? sc[j + 4] & 63 : (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
        const float d = dd * s6;
        if (!d) continue;
        const float m = dm * m6;
        for (int i = 0; i < 32; ++i) {
            const int l = nearest_int((x[32 * j + i] + m) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
    uint8_t *qh = y + 16, *qs = y + (five ? 48 : 16);
    if (five) memset(qh, 0, 32);
    for (int p = 0; p < 4; ++p) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t a = L[64 * p + l], b = L[64 * p + 32 + l];
            qs[32 * p + l] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
            if (five) qh[l] |= (uint8_t)(((a >> 4) << (2 * p)) | ((b >> 4) << (2 * p + 1)));
        }
    }
}

/* Q4_0 of one row (quantize_row_q4_0_impl): weights qw * sqrt(sigma2 + x^2), sigma2 = mean x^2 of the whole row,
 * make_qx_quants (nmax 8) per block of 32, 8 blocks at a time in the lanes. */
KT_INLINE void row_q4_0_w(const float *x, const float *qw, int64_t k, uint8_t *y) {
    float sum_x2 = 0;
    for (int64_t j = 0; j < k; ++j) sum_x2 += x[j] * x[j];
    const float sigma2 = sum_x2 / k;
    for (int64_t b0 = 0; b0 < k / 32; b0 += 8) {
        const int nb = k / 32 - b0 < 8 ? (int)(k / 32 - b0) : 8;
        vf xt[32], wt[32], Lv[32];
        for (int i = 0; i < 32; ++i) {
            xt[i] = splat(0);
            wt[i] = splat(0);
            for (int j = 0; j < nb; ++j) {
                const float v = x[32 * (b0 + j) + i];
                xt[i][j] = v;
                wt[i][j] = qw[32 * (b0 + j) + i] * sqrtf(sigma2 + v * v);
            }
        }
        const vf d = qx_w(xt, wt, Lv, 32, 8);
        for (int j = 0; j < nb; ++j) {
            uint8_t *yb = y + 18 * (b0 + j);
            put16(yb, f32_to_f16(d[j]));
            for (int i = 0; i < 16; ++i)
                yb[2 + i] = (uint8_t)((uint8_t)Lv[i][j] | ((uint8_t)Lv[i + 16][j] << 4));
        }
    }
}

/* ---------------------------------------------------------------- instantiation and entry point */

#define KT_QUANT_VARIANTS(SUFFIX, ATTR)                                                    \
    ATTR static void q4k_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i++) block_qkx(x + QK_K * i, y + 144 * i, 15, -1.f, 20, 0); \
    }                                                                                      \
    ATTR static void q5k_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i++) block_qkx(x + QK_K * i, y + 176 * i, 31, -0.5f, 15, 1); \
    }                                                                                      \
    ATTR static void q6k_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i++) block_q6k(x + QK_K * i, NULL, y + 210 * i);            \
    }                                                                                      \
    ATTR static void q80_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i++) block_q8_0(x + 32 * i, y + 34 * i);              \
    }                                                                                      \
    ATTR static void q40_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i++) block_q4_0(x + 32 * i, y + 18 * i);              \
    }                                                                                      \
    ATTR static void q4kw_##SUFFIX(const float *x, const float *qw, int64_t k, uint8_t *y) { \
        for (int64_t i = 0; i < k / QK_K; i++) block_qkx_w(x + QK_K * i, qw + QK_K * i, y + 144 * i, 15, 0); \
    }                                                                                      \
    ATTR static void q5kw_##SUFFIX(const float *x, const float *qw, int64_t k, uint8_t *y) { \
        for (int64_t i = 0; i < k / QK_K; i++) block_qkx_w(x + QK_K * i, qw + QK_K * i, y + 176 * i, 31, 1); \
    }                                                                                      \
    ATTR static void q6kw_##SUFFIX(const float *x, const float *qw, int64_t k, uint8_t *y) { \
        for (int64_t i = 0; i < k / QK_K; i++) block_q6k(x + QK_K * i, qw + QK_K * i, y + 210 * i); \
    }                                                                                      \
    ATTR static void q40w_##SUFFIX(const float *x, const float *qw, int64_t k, uint8_t *y) { \
        row_q4_0_w(x, qw, k, y);                                                           \
    }

typedef void (*quant_fn)(const float *, int64_t, uint8_t *);
typedef void (*row_fn)(const float *, const float *, int64_t, uint8_t *);   /* one row of k values, importances */

KT_QUANT_VARIANTS(scalar, )
#ifdef KT_X86
KT_QUANT_VARIANTS(avx2, __attribute__((target("avx2"))))
KT_QUANT_VARIANTS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif

static const struct {
    int type;
    int64_t elems, bytes; /* values and bytes per block */
    quant_fn fn[3]; /* scalar, avx2, avx512 */
    row_fn wfn[3];  /* with an importance matrix; NULL: ggml ignores it (Q8_0) */
} TYPES[] = {
#ifdef KT_X86
    {12, 256, 144, {q4k_scalar, q4k_avx2, q4k_avx512}, {q4kw_scalar, q4kw_avx2, q4kw_avx512}},
    {13, 256, 176, {q5k_scalar, q5k_avx2, q5k_avx512}, {q5kw_scalar, q5kw_avx2, q5kw_avx512}},
    {14, 256, 210, {q6k_scalar, q6k_avx2, q6k_avx512}, {q6kw_scalar, q6kw_avx2, q6kw_avx512}},
    {8, 32, 34, {q80_scalar, q80_avx2, q80_avx512}, {NULL, NULL, NULL}},
    {2, 32, 18, {q40_scalar, q40_avx2, q40_avx512}, {q40w_scalar, q40w_avx2, q40w_avx512}},
#else
    {12, 256, 144, {q4k_scalar, q4k_scalar, q4k_scalar}, {q4kw_scalar, q4kw_scalar, q4kw_scalar}},
    {13, 256, 176, {q5k_scalar, q5k_scalar, q5k_scalar}, {q5kw_scalar, q5kw_scalar, q5kw_scalar}},
    {14, 256, 210, {q6k_scalar, q6k_scalar, q6k_scalar}, {q6kw_scalar, q6kw_scalar, q6kw_scalar}},
    {8, 32, 34, {q80_scalar, q80_scalar, q80_scalar}, {NULL, NULL, NULL}},
    {2, 32, 18, {q40_scalar, q40_scalar, q40_scalar}, {q40w_scalar, q40w_scalar, q40w_scalar}},
#endif
};

KT_API int64_t kt_ggml_quant_block_bytes(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return TYPES[i].bytes;
    return 0;
}

KT_API int kt_ggml_quantize(int type, int impl, const float *src, int64_t nblocks, uint8_t *dst) {
    size_t t = 0;
    while (t < sizeof TYPES / sizeof TYPES[0] && TYPES[t].type != type) t++;
    if (t == sizeof TYPES / sizeof TYPES[0] || nblocks < 0 || (nblocks > 0 && (src == NULL || dst == NULL)))
        return KT_E_ARG;
    const int id = kt_resolve_impl(impl);
    if (id < KT_IMPL_SCALAR || id > KT_IMPL_AVX512) return id < 0 ? -id : KT_E_IMPL;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    TYPES[t].fn[id - KT_IMPL_SCALAR](src, nblocks, dst);
    kt_fpenv_leave(&env);
    return KT_OK;
}

/* rows [nrows, k] with the importances qw [k] of their columns (one expert's slice of the imatrix), as
 * ggml_quantize_chunk(type, src, dst, 0, nrows, k, qw); k a whole number of blocks. A type whose quantizer ignores
 * the matrix (Q8_0) gives kt_ggml_quantize's bytes. */
KT_API int kt_ggml_quantize_imatrix(int type, int impl, const float *src, int64_t nrows, int64_t k, const float *qw,
                                    uint8_t *dst) {
    size_t t = 0;
    while (t < sizeof TYPES / sizeof TYPES[0] && TYPES[t].type != type) t++;
    if (t == sizeof TYPES / sizeof TYPES[0] || nrows < 0 || k <= 0 || k % TYPES[t].elems ||
        (nrows > 0 && (src == NULL || dst == NULL || qw == NULL)))
        return KT_E_ARG;
    const int64_t row_bytes = k / TYPES[t].elems * TYPES[t].bytes;
    if (TYPES[t].wfn[0] == NULL) return kt_ggml_quantize(type, impl, src, nrows * (k / TYPES[t].elems), dst);
    const int id = kt_resolve_impl(impl);
    if (id < KT_IMPL_SCALAR || id > KT_IMPL_AVX512) return id < 0 ? -id : KT_E_IMPL;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    for (int64_t r = 0; r < nrows; r++) TYPES[t].wfn[id - KT_IMPL_SCALAR](src + r * k, qw, k, dst + r * row_bytes);
    kt_fpenv_leave(&env);
    return KT_OK;
}
