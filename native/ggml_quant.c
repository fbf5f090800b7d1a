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
 * The searches run on 16 sub-blocks at once (two super-blocks of Q4_K / Q5_K, one of Q6_K), one per vector lane:
 * G = 2 vectors of 8 (GCC vector extensions: SSE2 pairs in the plain build, one register with AVX2 / AVX-512),
 * each step done for both before the next, so two independent chains of sequential sums are in flight. Each lane
 * does exactly the scalar reference's operations in its order (sums stay sequential per lane), so lanes are
 * independent copies of the C loop; lanes the reference would have left early (a flat or all-zero sub-block, or
 * padding) compute garbage that is never selected. A search keeps the winning candidate's inverse scale (and the
 * min it subtracted) instead of copying its codes at every improvement, and recomputes those codes once at the end
 * from the same operands with nearest_clamp.
 *
 * Rounding: nearest_int(v) clamped to [lo, hi] (nearest_clamp: the magic add, the mantissa read as an integer, two
 * compares) equals round_clamp, ((v + 1.5*2^23) - 1.5*2^23) clamped, whenever |v| < 2^21: v + 1.5*2^23 then lies in
 * (2^23, 2^24), where floats are the integers, so the add rounds v to the nearest integer, ties to even (1.5*2^23
 * is even), and the subtraction is exact, giving the same integer (0 as +0.0) as the mantissa read. Where |v| >= 2^22,
 * v is not finite or v is NaN the two differ (the magic sum leaves the binade: nearest_int(Inf) is -2^22), so a
 * candidate takes the short rounding only when every lane that matters is proven in range before its codes are
 * computed: all x finite (checked once: no NaN / Inf among the lanes), and the bounds of v over the lane below 2^21
 * (fast_mode, qx_mode); where those bounds also keep v within half a code of [lo, hi], a clamp that cannot act is
 * left out. The codes only feed the sums that choose a candidate (the chosen one's are recomputed exactly), and
 * equal codes give equal sums. */

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint64_t vu __attribute__((vector_size(32)));

#define LANES 16                /* groups searched at once: G vectors of 8, G dependency chains in flight */
#define G (LANES / 8)

#define RNE_MAGIC 12582912.f    /* 1.5 * 2^23 */
#define FAST_LIMIT 0x1p21f      /* round_clamp equals nearest_clamp for |v| below this */

KT_INLINE vf splat(float a) { return (vf){0} + a; }
KT_INLINE vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
KT_INLINE vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }
KT_INLINE int any(vi m) {
    const vu u = (vu)m;
    return (u[0] | u[1] | u[2] | u[3]) != 0;
}
KT_INLINE vf ld(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
KT_INLINE void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
KT_INLINE int all(vi m) { return !any(~m); }

/* nearest_int of every lane, clamped to [lo, hi], as float: ggml's arithmetic for any v */
KT_INLINE vf nearest_clamp(vf v, vf lo, vf hi) {
    const vf val = v + RNE_MAGIC;
    const vf f = __builtin_convertvector(((vi)val & 0x007fffff) - 0x00400000, vf);
    const vf a = sel(f < lo, lo, f);
    return sel(a > hi, hi, a);
}

/* the same for lanes with |v| < 2^21 (see above); lo and hi are integers */
KT_INLINE vf round_clamp(vf v, vf lo, vf hi) {
    const vf f = (v + RNE_MAGIC) - RNE_MAGIC;
    const vf a = sel(f < lo, lo, f);
    return sel(a > hi, hi, a);
}

/* qkx2's v = iscale * (x - min) for x in [xmin, max] (x finite, so x - min is monotone in x and so is the product
 * with one finite iscale) lies between a = iscale * (xmin - min) and b = iscale * (max - min), computed the same way.
 * Both below 2^21 in magnitude (false for NaN / Inf) in every lane not flat: round_clamp gives nearest_clamp's codes
 * (FAST); both above -0.5 besides: no code rounds below 0 and the lower clamp changes nothing (NO_LO); both below
 * top + 0.5: none above top (NO_HI). 0: nearest_clamp. */
#define FAST 1
#define NO_LO 2
#define NO_HI 4
KT_INLINE int fast_mode(vf iscale, vf xmin, vf min, vf max, vi flat, vf top) {
    const vf a = iscale * (xmin - min), b = iscale * (max - min), lim = splat(FAST_LIMIT);
    if (!all(flat | ((vabs(a) < lim) & (vabs(b) < lim)))) return 0;
    const vf lo = splat(-0.5f), hi = top + 0.5f;
    return FAST | (all(flat | ((a > lo) & (b > lo))) ? NO_LO : 0) | (all(flat | ((a < hi) & (b < hi))) ? NO_HI : 0);
}

/* the codes of v under a fast_mode (a constant after inlining: one specialised loop per mode) */
KT_INLINE vf codes(vf v, vf lo, vf hi, int mode) {
    if (!(mode & FAST)) return nearest_clamp(v, lo, hi);
    vf f = (v + RNE_MAGIC) - RNE_MAGIC;
    if (!(mode & NO_LO)) f = sel(f < lo, lo, f);
    if (!(mode & NO_HI)) f = sel(f > hi, hi, f);
    return f;
}

/* one qkx2 candidate's codes Laux and sums (sequential per lane) */
KT_INLINE void qkx2_pass(const float (*x)[LANES], const float (*w)[LANES], const vf *iscale, const vf *min, vf top,
                         vf (*Laux)[G], vf *sum_l, vf *sum_l2, vf *sum_xl, int mode) {
    for (int i = 0; i < 32; ++i)
        for (int g = 0; g < G; ++g) {
            const vf xi = ld(&x[i][8 * g]);
            const vf l = codes(iscale[g] * (xi - min[g]), splat(0), top, mode), wl = ld(&w[i][8 * g]) * l;
            Laux[i][g] = l;
            sum_l[g] += wl;
            sum_l2[g] += wl * l;
            sum_xl[g] += wl * xi;
        }
}

/* make_qkx2_quants (use_mad false) on LANES sub-blocks of 32 (x[i][j]: value i of sub-block j; G vectors of 8
 * lanes side by side, each step done for every vector before the next): codes L[i][j] in 0..nmax, scale[j],
 * the_min[j] = -min >= 0. min follows the reference: a better candidate's min is the one the next candidates
 * subtract. */
KT_INLINE void qkx2(const float (*x)[LANES], const float (*w)[LANES], float (*L)[LANES], float *scale_out,
                    float *the_min, int nmax, float rmin, float rdelta, int nstep) {
    const vf zero = splat(0), top = splat((float)nmax);
    vf xmin[G], max[G], sum_w[G], sum_x[G], min[G], iscale[G], scale[G], best[G], best_iscale[G], best_sub[G];
    vf Laux[32][G];
    vi flat[G], finite = ~(vi){0};
    for (int g = 0; g < G; ++g) {
        const vf x0 = ld(&x[0][8 * g]), w0 = ld(&w[0][8 * g]);
        xmin[g] = max[g] = x0;
        sum_w[g] = w0;
        sum_x[g] = w0 * x0;
        finite &= vabs(x0) <= splat(__FLT_MAX__);
    }
    for (int i = 1; i < 32; ++i)
        for (int g = 0; g < G; ++g) {
            const vf xi = ld(&x[i][8 * g]), wi = ld(&w[i][8 * g]);
            xmin[g] = sel(xi < xmin[g], xi, xmin[g]);
            max[g] = sel(xi > max[g], xi, max[g]);
            sum_w[g] += wi;
            sum_x[g] += wi * xi;
            finite &= vabs(xi) <= splat(__FLT_MAX__);
        }
    const int checked = all(finite);       /* no NaN / Inf in any lane: the range test below is valid */
    int mode = checked ? FAST | NO_LO | NO_HI : 0;
    for (int g = 0; g < G; ++g) {
        min[g] = sel(xmin[g] > zero, zero, xmin[g]);
        flat[g] = max[g] == min[g];
        iscale[g] = top / (max[g] - min[g]);
        scale[g] = splat(1) / iscale[g];
        best[g] = zero;
        best_iscale[g] = iscale[g];
        best_sub[g] = min[g];
        mode &= fast_mode(iscale[g], xmin[g], min[g], max[g], flat[g], top);
    }
    for (int i = 0; i < 32; ++i)
        for (int g = 0; g < G; ++g) {
            const vf xi = ld(&x[i][8 * g]), v = iscale[g] * (xi - min[g]);
            const vf l = mode ? round_clamp(v, zero, top) : nearest_clamp(v, zero, top);
            vf diff = scale[g] * l + min[g] - xi;
            diff = diff * diff;
            best[g] += ld(&w[i][8 * g]) * diff;
        }
    for (int is = 0; is <= nstep; ++is) {
        vf sum_l[G], sum_l2[G], sum_xl[G], this_scale[G], this_min[G], cur[G];
        vi better[G], some = (vi){0};
        mode = checked ? FAST | NO_LO | NO_HI : 0;
        for (int g = 0; g < G; ++g) {
            iscale[g] = splat(rmin + rdelta * is + nmax) / (max[g] - min[g]);
            sum_l[g] = sum_l2[g] = sum_xl[g] = cur[g] = zero;
            mode &= fast_mode(iscale[g], xmin[g], min[g], max[g], flat[g], top);
        }
        switch (mode) {
        case FAST | NO_LO | NO_HI: qkx2_pass(x, w, iscale, min, top, Laux, sum_l, sum_l2, sum_xl, FAST | NO_LO | NO_HI);
            break;
        case FAST | NO_LO: qkx2_pass(x, w, iscale, min, top, Laux, sum_l, sum_l2, sum_xl, FAST | NO_LO); break;
        case FAST | NO_HI: qkx2_pass(x, w, iscale, min, top, Laux, sum_l, sum_l2, sum_xl, FAST | NO_HI); break;
        case FAST: qkx2_pass(x, w, iscale, min, top, Laux, sum_l, sum_l2, sum_xl, FAST); break;
        default: qkx2_pass(x, w, iscale, min, top, Laux, sum_l, sum_l2, sum_xl, 0);
        }
        for (int g = 0; g < G; ++g) {
            const vf D = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D;
            this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D;
            const vi clamp = this_min[g] > zero;
            this_min[g] = sel(clamp, zero, this_min[g]);
            this_scale[g] = sel(clamp, sum_xl[g] / sum_l2[g], this_scale[g]);
            better[g] = D > zero;
        }
        for (int i = 0; i < 32; ++i)
            for (int g = 0; g < G; ++g) {
                vf diff = this_scale[g] * Laux[i][g] + this_min[g] - ld(&x[i][8 * g]);
                diff = diff * diff;
                cur[g] += ld(&w[i][8 * g]) * diff;
            }
        for (int g = 0; g < G; ++g) {
            better[g] &= (cur[g] < best[g]) & ~flat[g];
            some |= better[g];
        }
        if (!any(some)) continue;
        for (int g = 0; g < G; ++g) {
            best[g] = sel(better[g], cur[g], best[g]);
            scale[g] = sel(better[g], this_scale[g], scale[g]);
            best_iscale[g] = sel(better[g], iscale[g], best_iscale[g]);
            best_sub[g] = sel(better[g], min[g], best_sub[g]);
            min[g] = sel(better[g], this_min[g], min[g]);
        }
    }
    /* the chosen candidate's codes, recomputed from the same operands (nearest_clamp: right for any v) */
    for (int i = 0; i < 32; ++i)
        for (int g = 0; g < G; ++g)
            st(&L[i][8 * g],
               sel(flat[g], zero, nearest_clamp(best_iscale[g] * (ld(&x[i][8 * g]) - best_sub[g]), zero, top)));
    for (int g = 0; g < G; ++g) {
        st(&the_min[8 * g], -min[g]);
        st(&scale_out[8 * g], sel(flat[g], zero, scale[g]));
    }
}

/* qx_w's v = iscale * x with |x| <= |max| (x finite) is at most m = |iscale * max| in magnitude: m below 2^21 in
 * every lane not all-zero: FAST; below -lo + 0.5 besides: NO_LO; below hi + 0.5: NO_HI (as fast_mode). */
KT_INLINE int qx_mode(vf m, vi zero_group, vf lo, vf hi) {
    if (!all(zero_group | (m < splat(FAST_LIMIT)))) return 0;
    return FAST | (all(zero_group | (m < 0.5f - lo)) ? NO_LO : 0) | (all(zero_group | (m < hi + 0.5f)) ? NO_HI : 0);
}

/* one qx_w candidate's sums (sequential per lane) */
KT_INLINE void qx_pass(const float (*x)[LANES], const float (*qw)[LANES], const vf *iscale, vf lo, vf hi, int n,
                       vf *sumlx, vf *suml2, int mode) {
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
            const vf xi = ld(&x[i][8 * g]), w = qw ? ld(&qw[i][8 * g]) : xi * xi;
            const vf l = codes(iscale[g] * xi, lo, hi, mode);
            sumlx[g] += w * xi * l;
            suml2[g] += w * l * l;
        }
}

/* qx_pass specialised for the mode at hand */
KT_INLINE void qx_sums(const float (*x)[LANES], const float (*qw)[LANES], const vf *iscale, vf lo, vf hi, int n,
                       vf *sumlx, vf *suml2, int mode) {
    switch (mode) {
    case FAST | NO_LO | NO_HI: qx_pass(x, qw, iscale, lo, hi, n, sumlx, suml2, FAST | NO_LO | NO_HI); break;
    case FAST | NO_LO: qx_pass(x, qw, iscale, lo, hi, n, sumlx, suml2, FAST | NO_LO); break;
    case FAST | NO_HI: qx_pass(x, qw, iscale, lo, hi, n, sumlx, suml2, FAST | NO_HI); break;
    case FAST: qx_pass(x, qw, iscale, lo, hi, n, sumlx, suml2, FAST); break;
    default: qx_pass(x, qw, iscale, lo, hi, n, sumlx, suml2, 0);
    }
}

/* make_qx_quants with rmse_type 1 on LANES groups of n values (n <= 32, x[i][j]: value i of group j), codes l in
 * [-nmax, nmax-1]: weights qw[i][j] or, qw NULL, x^2. Codes L[i][j] = l + nmax (0 for an all-zero group), scales
 * scale[j]. Each candidate's codes take the shortest rounding qx_mode proves exact. */
KT_INLINE void qx_w(const float (*x)[LANES], const float (*qw)[LANES], float (*L)[LANES], float *scale_out, int n,
                    int nmax) {
    const vf zero = splat(0), lo = splat((float)-nmax), hi = splat((float)(nmax - 1)), off = splat((float)nmax);
    vf max[G], amax[G], iscale[G], best_iscale[G], scale[G], best[G];
    vi zero_group[G], finite = ~(vi){0};
    for (int g = 0; g < G; ++g) max[g] = amax[g] = zero;
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
            const vf xi = ld(&x[i][8 * g]), ax = vabs(xi);
            const vi m = ax > amax[g];
            amax[g] = sel(m, ax, amax[g]);
            max[g] = sel(m, xi, max[g]);
            finite &= ax <= splat(__FLT_MAX__);
        }
    const int checked = all(finite);       /* no NaN / Inf in any lane: the range test is valid */
    int mode = checked ? FAST | NO_LO | NO_HI : 0;
    vf sumlx[G], suml2[G];
    for (int g = 0; g < G; ++g) {
        zero_group[g] = amax[g] < splat(GROUP_MAX_EPS);
        iscale[g] = best_iscale[g] = splat((float)-nmax) / max[g];
        sumlx[g] = suml2[g] = zero;
        mode &= qx_mode(vabs(iscale[g] * max[g]), zero_group[g], lo, hi);
    }
    qx_sums(x, qw, iscale, lo, hi, n, sumlx, suml2, mode);
    for (int g = 0; g < G; ++g) {
        scale[g] = sel(suml2[g] != zero, sumlx[g] / suml2[g], zero);
        best[g] = scale[g] * sumlx[g];
    }
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        mode = checked ? FAST | NO_LO | NO_HI : 0;
        for (int g = 0; g < G; ++g) {
            iscale[g] = splat(-(nmax + 0.1f * is)) / max[g];
            sumlx[g] = suml2[g] = zero;
            mode &= qx_mode(vabs(iscale[g] * max[g]), zero_group[g], lo, hi);
        }
        qx_sums(x, qw, iscale, lo, hi, n, sumlx, suml2, mode);
        for (int g = 0; g < G; ++g) {
            const vi better = (suml2[g] > zero) & (sumlx[g] * sumlx[g] > best[g] * suml2[g]);
            best_iscale[g] = sel(better, iscale[g], best_iscale[g]);
            scale[g] = sel(better, sumlx[g] / suml2[g], scale[g]);
            best[g] = sel(better, scale[g] * sumlx[g], best[g]);
        }
    }
    /* the chosen candidate's codes, recomputed from the same operands */
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g)
            st(&L[i][8 * g], sel(zero_group[g], zero,
                                 nearest_clamp(best_iscale[g] * ld(&x[i][8 * g]), lo, hi) + off));
    for (int g = 0; g < G; ++g) st(&scale_out[8 * g], sel(zero_group[g], zero, scale[g]));
}

/* codes Lv[i][j] (value i of group j, integers 0..255 as float) -> L[n * j + i] */
KT_INLINE void untranspose(const float (*Lv)[LANES], int n, uint8_t *L) {
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
            const vi c = __builtin_convertvector(ld(&Lv[i][8 * g]), vi);
            for (int j = 0; j < 8; ++j) L[n * (8 * g + j) + i] = (uint8_t)c[j];
        }
}

/* the final codes of a K-quant with a minimum, sub-block j in lane j: nearest_int((x + m[j]) / d[j]) clamped to
 * 0..nmax where d[j] != 0 (the reference's `if (!d) continue` keeps the search codes) */
KT_INLINE void requant_min(const float (*xt)[LANES], float (*Lv)[LANES], const float *d, const float *m, int nmax) {
    for (int g = 0; g < G; ++g) {
        const vf dg = ld(d + 8 * g), mg = ld(m + 8 * g);
        const vi keep = dg == splat(0);
        for (int i = 0; i < 32; ++i)
            st(&Lv[i][8 * g], sel(keep, ld(&Lv[i][8 * g]),
                                  nearest_clamp((ld(&xt[i][8 * g]) + mg) / dg, splat(0), splat((float)nmax))));
    }
}

/* codes L[256] (0..nmax) of a Q4_K / Q5_K super-block into y: qs (low nibbles, sub-blocks 2p and 2p+1 in one byte), and
 * for Q5_K (five) the fifth bits in qh (sub-block j: bit j) */
KT_INLINE void pack_qkx(const uint8_t *L, uint8_t *y, int five) {
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

/* ---------------------------------------------------------------- super-blocks */

/* Q4_K (nmax 15) / Q5_K (nmax 31, five) of nsb (1 or 2) super-blocks, their 16 sub-blocks in the lanes (a missing
 * second super-block: zeros, flat lanes never stored): d, dmin, 12 scale bytes, [qh 32,] qs 128 each. */
KT_INLINE void blocks_qkx(const float *x, uint8_t *y, int nsb, int nmax, float rmin, int nstep, int five) {
    const int bytes = five ? 176 : 144;
    uint8_t L[2 * QK_K];
    float xt[32][LANES], w[32][LANES], Lv[32][LANES], scales_v[LANES], mins_v[LANES], d[LANES] = {0}, m[LANES] = {0};
    for (int j = 0; j < LANES; ++j)
        for (int i = 0; i < 32; ++i) xt[i][j] = j < 8 * nsb ? x[32 * j + i] : 0.f;
    for (int g = 0; g < G; ++g) {           /* weights av_x + |x|, av_x = sqrt(mean x^2) of the sub-block */
        vf sum_x2 = splat(0), av_x;
        for (int i = 0; i < 32; ++i) sum_x2 += ld(&xt[i][8 * g]) * ld(&xt[i][8 * g]);
        for (int j = 0; j < 8; ++j) av_x[j] = sqrtf(sum_x2[j] / 32);
        for (int i = 0; i < 32; ++i) st(&w[i][8 * g], av_x + vabs(ld(&xt[i][8 * g])));
    }
    qkx2(xt, w, Lv, scales_v, mins_v, nmax, rmin, 0.1f, nstep);
    for (int b = 0; b < nsb; ++b) {
        uint8_t ls[8], lm[8], *yb = y + bytes * b, *sc = yb + 4;
        float scales[8], mins[8], max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            scales[j] = scales_v[8 * b + j];
            mins[j] = mins_v[8 * b + j];
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        for (int j = 0; j < 8; ++j) {
            const uint8_t a = (uint8_t)nearest_int(inv_scale * scales[j]), c = (uint8_t)nearest_int(inv_min * mins[j]);
            ls[j] = a < 63 ? a : 63;
            lm[j] = c < 63 ? c : 63;
        }
        for (int j = 0; j < 4; ++j) {
            sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
            sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
            sc[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
        }
        const uint16_t d16 = f32_to_f16(max_scale / 63.f), m16 = f32_to_f16(max_min / 63.f);
        put16(yb, d16);
        put16(yb + 2, m16);
        const float dd = f16_to_f32(d16), dm = f16_to_f32(m16);
        for (int j = 0; j < 8; ++j) {
            d[8 * b + j] = dd * ls[j];
            m[8 * b + j] = dm * lm[j];
        }
    }
    requant_min(xt, Lv, d, m, nmax);
    untranspose(Lv, 32, L);
    for (int b = 0; b < nsb; ++b) pack_qkx(L + QK_K * b, y + bytes * b, five);
}

/* Q6_K: ql 128, qh 64, 16 int8 scales, d. qw: the 256 importances of this super-block's columns (quantize_row_q6_K_impl
 * passes them to make_qx_quants unchanged) or NULL (weights x^2, quantize_row_q6_K_ref). */
KT_INLINE void block_q6k(const float *x, const float *qw, uint8_t *y) {
    uint8_t L[QK_K];
    int8_t sc[16];
    float scales[16], max_scale = 0, max_abs = 0;
    float xt[16][LANES], wt[16][LANES], Lv[16][LANES];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            xt[i][j] = x[16 * j + i];
            wt[i][j] = qw ? qw[16 * j + i] : 0.f;
        }
    qx_w(xt, qw ? wt : NULL, Lv, scales, 16, 32);
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
    for (int g = 0; g < G; ++g) {           /* nearest_int(x / d) in -32..31, + 32, where d != 0 */
        vf d;
        for (int j = 0; j < 8; ++j) d[j] = dd * sc[8 * g + j];
        const vi keep = d == splat(0);
        for (int i = 0; i < 16; ++i)
            st(&Lv[i][8 * g], sel(keep, ld(&Lv[i][8 * g]),
                                  nearest_clamp(ld(&xt[i][8 * g]) / d, splat(-32), splat(31)) + 32));
    }
    untranspose(Lv, 16, L);
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
 * scales and mins quantized to 6 bits by make_qp_quants weighted by each sub-block's weight sum; nsb (1 or 2)
 * super-blocks of one row (qw: their importances), searched together as in blocks_qkx. */
KT_INLINE void blocks_qkx_w(const float *x, const float *qw, uint8_t *y, int nsb, int nmax, int five) {
    const int bytes = five ? 176 : 144;
    uint8_t L[2 * QK_K];
    float xt[32][LANES], w[32][LANES], Lv[32][LANES], scales_v[LANES], mins_v[LANES], d[LANES] = {0}, m[LANES] = {0};
    float sw[LANES];
    for (int b = 0; b < 2; ++b) {
        float sum_x2 = 0;
        if (b < nsb)
            for (int l = 0; l < QK_K; ++l) sum_x2 += x[QK_K * b + l] * x[QK_K * b + l];
        const float sigma2 = 2 * sum_x2 / QK_K;
        for (int j = 8 * b; j < 8 * b + 8; ++j) {
            float sumw = 0;
            for (int i = 0; i < 32; ++i) {
                const float v = b < nsb ? x[32 * j + i] : 0.f;
                const float wi = b < nsb ? qw[32 * j + i] * sqrtf(sigma2 + v * v) : 0.f;
                xt[i][j] = v;
                w[i][j] = wi;
                sumw += wi;
            }
            sw[j] = sumw;
        }
    }
    qkx2(xt, w, Lv, scales_v, mins_v, nmax, -0.9f, 0.05f, 36);
    for (int b = 0; b < nsb; ++b) {
        uint8_t Ls[8], Lm[8], *yb = y + bytes * b, *sc = yb + 4;
        float scales[8], mins[8];
        for (int j = 0; j < 8; ++j) {
            scales[j] = scales_v[8 * b + j];
            mins[j] = mins_v[8 * b + j];
        }
        const float d_block = qp(8, 63, scales, Ls, sw + 8 * b), m_block = qp(8, 63, mins, Lm, sw + 8 * b);
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
        put16(yb, d16);
        put16(yb + 2, m16);
        const float dd = f16_to_f32(d16), dm = f16_to_f32(m16);
        for (int j = 0; j < 8; ++j) {   /* get_scale_min_k4 of the packed bytes */
            const uint8_t s6 = j < 4 ? sc[j] & 63 : (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
            const uint8_t m6 = j < 4 ? sc[j + 4] & 63 : (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
            d[8 * b + j] = dd * s6;
            m[8 * b + j] = dm * m6;
        }
    }
    requant_min(xt, Lv, d, m, nmax);
    untranspose(Lv, 32, L);
    for (int b = 0; b < nsb; ++b) pack_qkx(L + QK_K * b, y + bytes * b, five);
}

/* Q4_0 of one row (quantize_row_q4_0_impl): weights qw * sqrt(sigma2 + x^2), sigma2 = mean x^2 of the whole row,
 * make_qx_quants (nmax 8) per block of 32, 8 blocks at a time in the lanes. */
KT_INLINE void row_q4_0_w(const float *x, const float *qw, int64_t k, uint8_t *y) {
    float sum_x2 = 0;
    for (int64_t j = 0; j < k; ++j) sum_x2 += x[j] * x[j];
    const float sigma2 = sum_x2 / k;
    for (int64_t b0 = 0; b0 < k / 32; b0 += LANES) {
        const int nb = k / 32 - b0 < LANES ? (int)(k / 32 - b0) : LANES;
        float xt[32][LANES] = {{0}}, wt[32][LANES] = {{0}}, Lv[32][LANES], d[LANES];
        for (int i = 0; i < 32; ++i)
            for (int j = 0; j < nb; ++j) {
                const float v = x[32 * (b0 + j) + i];
                xt[i][j] = v;
                wt[i][j] = qw[32 * (b0 + j) + i] * sqrtf(sigma2 + v * v);
            }
        qx_w(xt, wt, Lv, d, 32, 8);
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
        for (int64_t i = 0; i < nb; i += 2)                                               \
            blocks_qkx(x + QK_K * i, y + 144 * i, nb - i < 2 ? 1 : 2, 15, -1.f, 20, 0);       \
    }                                                                                      \
    ATTR static void q5k_##SUFFIX(const float *x, int64_t nb, uint8_t *y) {              \
        for (int64_t i = 0; i < nb; i += 2)                                               \
            blocks_qkx(x + QK_K * i, y + 176 * i, nb - i < 2 ? 1 : 2, 31, -0.5f, 15, 1);      \
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
        for (int64_t i = 0; i < k / QK_K; i += 2)                                         \
            blocks_qkx_w(x + QK_K * i, qw + QK_K * i, y + 144 * i, k / QK_K - i < 2 ? 1 : 2, 15, 0); \
    }                                                                                      \
    ATTR static void q5kw_##SUFFIX(const float *x, const float *qw, int64_t k, uint8_t *y) { \
        for (int64_t i = 0; i < k / QK_K; i += 2)                                         \
            blocks_qkx_w(x + QK_K * i, qw + QK_K * i, y + 176 * i, k / QK_K - i < 2 ? 1 : 2, 31, 1); \
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
