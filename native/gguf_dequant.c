/* Dequantization of ggml block formats, bit-identical to gguf-py's numpy `dequantize` (see kt_gguf.h).
 *
 * Each blk_* function decodes one block into float32 with exactly gguf-py's float32 operations, e.g. Q4_K
 * `(d * sc) * q - (dmin * m)`: scales are products of float32 values first, then one multiply and one subtract per
 * element. The element order of every format is written next to its function as gguf-py's reshapes produce it.
 * The bodies are written once (always_inline) and instantiated per ISA, so the compiler vectorizes them for
 * AVX2/AVX-512; a few types have hand-written SIMD bodies instead (nibble lookups, Q6_K), or use the SSE2 build in
 * every slot where GCC's wider code was measured slower (see KT_GGUF_TYPES). IEEE float32 multiply/subtract are
 * exact-rounded whatever the vector width, and -ffp-contract=off forbids fusing them, so every variant gives the
 * same bits (tests/test_input_gguf.py checks each against gguf-py).
 */
#include <string.h>

#include "kt_gguf.h"
#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>
#endif

#define KT_INLINE static inline __attribute__((always_inline))
#define QK_K 256

/* ---------------------------------------------------------------- scalar helpers */

KT_INLINE uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KT_INLINE uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float, exact and branch-free (so loops over F16 tensors vectorize). Normal and Inf/NaN halves:
 * shift the exponent and mantissa into place with the exponent biased by +224, then scale by 2^-112 (exact).
 * Subnormal halves: build the float 0.5 + man * 2^-24 and subtract 0.5 (exact). Sign is or-ed back in. */
KT_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = kt_f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
    const float denormalized = kt_f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return kt_f32_from_bits(sign | (two_w < (1u << 27) ? kt_f32_bits(denormalized) : kt_f32_bits(normalized)));
}

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 (subnormal for e < 2). */
KT_INLINE float e8m0_half(uint8_t e) {
    return kt_f32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---------------------------------------------------------------- element formats (block = 1 element) */

KT_INLINE void blk_f32(const uint8_t *b, float *y) { y[0] = kt_f32_from_bits(rd32(b)); }
KT_INLINE void blk_f16(const uint8_t *b, float *y) { y[0] = f16_to_f32(rd16(b)); }
KT_INLINE void blk_bf16(const uint8_t *b, float *y) { y[0] = kt_f32_from_bits((uint32_t)rd16(b) << 16); }

/* ---------------------------------------------------------------- 32-element blocks */

/* Q4_0 [d f16][qs 16]: element j < 16 is qs[j] & 15, j >= 16 is qs[j-16] >> 4; y = d * (q - 8). */
KT_INLINE void blk_q4_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b));
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((qs[j] & 15) - 8);   /* separate loops vectorize cleanly */
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((qs[j] >> 4) - 8);
}

/* Q4_1 [d][m][qs 16]: y = d * q + m. */
KT_INLINE void blk_q4_1(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b)), m = f16_to_f32(rd16(b + 2));
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) y[j] = d * (float)(qs[j] & 15) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)(qs[j] >> 4) + m;
}

/* Q5_0 [d][qh u32][qs 16]: bit 4 of element j is bit j of qh; y = d * (q - 16). */
KT_INLINE void blk_q5_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b));
    const uint32_t qh = rd32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((int)((qs[j] & 15) | (((qh >> j) & 1u) << 4)) - 16);
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16);
}

/* Q5_1 [d][m][qh u32][qs 16]: y = d * q + m. */
KT_INLINE void blk_q5_1(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b)), m = f16_to_f32(rd16(b + 2));
    const uint32_t qh = rd32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((qs[j] & 15) | (((qh >> j) & 1u) << 4)) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) + m;
}

/* Q8_0 [d][qs int8 32]: y = q * d. */
KT_INLINE void blk_q8_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b));
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* IQ4_NL [d][qs 16]: nibbles as Q4_0, y = d * kvalues[nibble]. */
/* The lookup formats (IQ4_NL, IQ4_XS, MXFP4) first build the 16 products scale * kvalue[i] -- the same single
 * float32 multiply gguf-py does per element -- then look each nibble up: 16 nibbles from q[0..15] (low halves)
 * go to y[0..15], the high halves to y[16..31]. */
KT_INLINE void lut16(float scale, const int8_t *kv, float *table) {
    for (int i = 0; i < 16; i++) table[i] = scale * (float)kv[i];
}

KT_INLINE void nibbles_lut(const uint8_t *q, const float *table, float *y) {
    for (int j = 0; j < 16; j++) {
        y[j] = table[q[j] & 15];
        y[j + 16] = table[q[j] >> 4];
    }
}

KT_INLINE void blk_iq4_nl(const uint8_t *b, float *y) {
    float table[16];
    lut16(f16_to_f32(rd16(b)), KV_IQ4NL, table);
    nibbles_lut(b + 2, table, y);
}

/* MXFP4 [e8m0][qs 16]: nibbles as Q4_0, y = e8m0_half(e) * kvalues_mxfp4[nibble] (doubled e2m1). */
KT_INLINE void blk_mxfp4(const uint8_t *b, float *y) {
    float table[16];
    lut16(e8m0_half(b[0]), KV_MXFP4, table);
    nibbles_lut(b + 1, table, y);
}

/* ---------------------------------------------------------------- 256-element super-blocks */

/* Second pass of the super-block formats: integer codes -> floats, one scale (and min) per run. The empty asm
 * keeps the compiler from vectorizing the caller's loop over runs (it would transpose 16 runs at a time) instead
 * of the run itself. */
KT_INLINE void scale_run(const int8_t *q, int n, float scale, float *y) {
    __asm__ volatile("");
    for (int j = 0; j < n; j++) y[j] = scale * (float)q[j];
}

KT_INLINE void affine_run(const uint8_t *q, int n, float scale, float min, float *y) {
    __asm__ volatile("");
    for (int j = 0; j < n; j++) y[j] = scale * (float)q[j] - min;
}

/* Q2_K [scales 16][qs 64][d][dmin]: element g*128 + s*32 + j = (qs[g*32+j] >> 2s) & 3, sub-block e/16;
 * y = (d * (sc & 15)) * q - (dmin * (sc >> 4)). */
KT_INLINE void blk_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16_to_f32(rd16(b + 80)), dmin = f16_to_f32(rd16(b + 82));
    uint8_t q[QK_K];
    for (int g = 0; g < 2; g++)
        for (int j = 0; j < 32; j++) {
            const int v = qs[g * 32 + j];
            q[g * 128 + j] = v & 3;
            q[g * 128 + 32 + j] = (v >> 2) & 3;
            q[g * 128 + 64 + j] = (v >> 4) & 3;
            q[g * 128 + 96 + j] = v >> 6;
        }
    for (int sub = 0; sub < 16; sub++)
        affine_run(q + sub * 16, 16, d * (float)(sc[sub] & 15), dmin * (float)(sc[sub] >> 4), y + sub * 16);
}

/* Q3_K [hmask 32][qs 64][scales 12][d]: 6-bit scale i = (low nibble: scales[i] & 15 for i < 8, scales[i-8] >> 4
 * above) | ((scales[8 + i%4] >> 2*(i/4)) & 3) << 4, minus 32. Element e = g*128 + s*32 + j:
 * q = ((qs[g*32+j] >> 2s) & 3) - 4 * !((hmask[j] >> (e/32)) & 1); y = (d * scale[e/16]) * q. */
KT_INLINE void blk_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16_to_f32(rd16(b + 108));
    int8_t q[QK_K];
    for (int g = 0; g < 2; g++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) {
                const int low = (qs[g * 32 + j] >> (2 * s)) & 3, high = (hm[j] >> (g * 4 + s)) & 1;
                q[g * 128 + s * 32 + j] = (int8_t)(low - ((high ^ 1) << 2));
            }
    for (int i = 0; i < 16; i++) {
        const int lo = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
        const int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        scale_run(q + i * 16, 16, d * (float)((lo | (hi << 4)) - 32), y + i * 16);
    }
}

/* Q4_K / Q5_K 6-bit scales and mins (12 bytes) -> sc[8], mn[8]. */
KT_INLINE void k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 0x3f;
        mn[i] = s[4 + i] & 0x3f;
        sc[4 + i] = (uint8_t)((s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30));
        mn[4 + i] = (uint8_t)((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
    }
}

/* Q4_K [d][dmin][scales 12][qs 128]: sub-block k (32 elements) = (qs[(k/2)*32 + j] >> 4*(k%2)) & 15;
 * y = (d * sc[k]) * q - (dmin * m[k]). */
KT_INLINE void blk_q4_k(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b)), dmin = f16_to_f32(rd16(b + 2));
    uint8_t sc[8], mn[8], q[QK_K];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 32; j++) {
            q[g * 64 + j] = qs[g * 32 + j] & 15;
            q[g * 64 + 32 + j] = qs[g * 32 + j] >> 4;
        }
    for (int k = 0; k < 8; k++) affine_run(q + k * 32, 32, d * (float)sc[k], dmin * (float)mn[k], y + k * 32);
}

/* Q5_K [d][dmin][scales 12][qh 32][qs 128]: as Q4_K with bit 4 of sub-block k's element j = (qh[j] >> k) & 1. */
KT_INLINE void blk_q5_k(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b)), dmin = f16_to_f32(rd16(b + 2));
    uint8_t sc[8], mn[8], q[QK_K];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 32; j++) {
            q[g * 64 + j] = (uint8_t)((qs[g * 32 + j] & 15) | (((qh[j] >> (2 * g)) & 1) << 4));
            q[g * 64 + 32 + j] = (uint8_t)((qs[g * 32 + j] >> 4) | (((qh[j] >> (2 * g + 1)) & 1) << 4));
        }
    for (int k = 0; k < 8; k++) affine_run(q + k * 32, 32, d * (float)sc[k], dmin * (float)mn[k], y + k * 32);
}

/* Q6_K [ql 128][qh 64][scales int8 16][d]: element e = g*128 + r: low = (ql[g*64 + r%64] >> 4*(r/64)) & 15,
 * high = (qh[g*32 + r%32] >> 2*(r/32)) & 3; y = (d * scale[e/16]) * ((low | high << 4) - 32). */
KT_INLINE void blk_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_to_f32(rd16(b + 208));
    int8_t q[QK_K];
    for (int g = 0; g < 2; g++)         /* r = j, 32+j, 64+j, 96+j of half g */
        for (int j = 0; j < 32; j++) {
            const int l0 = ql[g * 64 + j], l1 = ql[g * 64 + 32 + j], h = qh[g * 32 + j];
            q[g * 128 + j] = (int8_t)(((l0 & 15) | ((h & 3) << 4)) - 32);
            q[g * 128 + 32 + j] = (int8_t)(((l1 & 15) | (((h >> 2) & 3) << 4)) - 32);
            q[g * 128 + 64 + j] = (int8_t)(((l0 >> 4) | (((h >> 4) & 3) << 4)) - 32);
            q[g * 128 + 96 + j] = (int8_t)(((l1 >> 4) | (((h >> 6) & 3) << 4)) - 32);
        }
    for (int c = 0; c < 16; c++) scale_run(q + c * 16, 16, d * (float)sc[c], y + c * 16);
}

/* IQ4_XS [d][scales_h u16][scales_l 4][qs 128]: scale k = ((scales_l[k/2] >> 4*(k%2)) & 15 |
 * ((scales_h >> 2k) & 3) << 4) - 32; sub-block k element j: nibble of qs[k*16 + j%16] (low for j < 16);
 * y = (d * scale[k]) * kvalues[nibble]. */
KT_INLINE void blk_iq4_xs(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b));
    const uint16_t sh = rd16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int k = 0; k < 8; k++) {
        int s = (((sl[k >> 1] >> (4 * (k & 1))) & 15) | (((sh >> (2 * k)) & 3) << 4)) - 32;
        float table[16];
        lut16(d * (float)s, KV_IQ4NL, table);
        nibbles_lut(qs + k * 16, table, y + k * 32);
    }
}

/* TQ2_0 [qs 64][d]: element g*128 + s*32 + j = ((qs[g*32+j] >> 2s) & 3) - 1; y = d * q. */
KT_INLINE void blk_tq2_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(rd16(b + 64));
    for (int g = 0; g < 2; g++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) y[g * 128 + s * 32 + j] = d * (float)(((b[g * 32 + j] >> (2 * s)) & 3) - 1);
}

/* TQ1_0 [qs 48][qh 4][d]: base-3 digits: t = (uint8)(byte * 3^p); q = ((t * 3) >> 8) - 1. Elements p*32 + j
 * from qs[j] (j < 32), 160 + p*16 + j from qs[32+j], 240 + p*4 + j from qh[j]; y = d * q. */
KT_INLINE void blk_tq1_0(const uint8_t *b, float *y) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    const float d = f16_to_f32(rd16(b + 52));
    for (int p = 0; p < 5; p++) {
        for (int j = 0; j < 32; j++) y[p * 32 + j] = d * (float)((((uint8_t)(b[j] * pow3[p])) * 3 >> 8) - 1);
        for (int j = 0; j < 16; j++)
            y[160 + p * 16 + j] = d * (float)((((uint8_t)(b[32 + j] * pow3[p])) * 3 >> 8) - 1);
    }
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 4; j++) y[240 + p * 4 + j] = d * (float)((((uint8_t)(b[48 + j] * pow3[p])) * 3 >> 8) - 1);
}

/* ---------------------------------------------------------------- BF16 rounding (quant/bf16.py) */

KT_INLINE void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = kt_f32_to_bf16(x[i]);
}

#ifdef KT_X86
/* SSE2 (x86-64 baseline) BF16 rounding for the scalar and AVX2 builds: GCC cannot narrow 32 -> 16 bits without
 * SSE4.1, so bias to signed, pack with signed saturation (values fit), and un-bias. */
KT_INLINE void to_bf16_sse2(const float *x, int64_t n, uint16_t *out) {
    const __m128i bias = _mm_set1_epi32(0x7fff), one = _mm_set1_epi32(1), inf = _mm_set1_epi32(0x7f800000);
    const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), quiet = _mm_set1_epi32(0x0040);
    const __m128i sign32 = _mm_set1_epi32(0x8000), sign16 = _mm_set1_epi16((short)0x8000);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i r[2];
        for (int h = 0; h < 2; h++) {
            const __m128i u = _mm_castps_si128(_mm_loadu_ps(x + i + 4 * h));
            const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), one);
            const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(bias, lsb)), 16);
            const __m128i nan = _mm_or_si128(_mm_srli_epi32(u, 16), quiet);
            const __m128i is_nan = _mm_cmpgt_epi32(_mm_and_si128(u, abs_mask), inf);
            const __m128i v = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, rounded));
            r[h] = _mm_sub_epi32(v, sign32);
        }
        _mm_storeu_si128((__m128i *)(out + i), _mm_xor_si128(_mm_packs_epi32(r[0], r[1]), sign16));
    }
    to_bf16(x + i, n - i, out + i);
}
#define KT_TO_BF16_SCALAR to_bf16_sse2
#else
#define KT_TO_BF16_SCALAR to_bf16
#endif

/* ---------------------------------------------------------------- per-ISA instantiation */

/* X(name, ggml type id, elements per block, bytes per block, SIMD: G generic body compiled per ISA, S own SIMD
 *   body, N every implementation slot uses the baseline (SSE2) build: GCC's AVX2/AVX-512 code for these bodies was
 *   measured slower than its SSE2 code) */
#define KT_GGUF_TYPES(X)              \
    X(f32, 0, 1, 4, G)                \
    X(f16, 1, 1, 2, G)                \
    X(q4_0, 2, 32, 18, G)             \
    X(q4_1, 3, 32, 20, G)             \
    X(q5_0, 6, 32, 22, G)             \
    X(q5_1, 7, 32, 24, G)             \
    X(q8_0, 8, 32, 34, G)             \
    X(q2_k, 10, QK_K, 84, N)          \
    X(q3_k, 11, QK_K, 110, N)         \
    X(q4_k, 12, QK_K, 144, G)         \
    X(q5_k, 13, QK_K, 176, G)         \
    X(q6_k, 14, QK_K, 210, S)         \
    X(iq4_nl, 20, 32, 18, S)          \
    X(iq4_xs, 23, QK_K, 136, S)       \
    X(bf16, 30, 1, 2, G)              \
    X(tq1_0, 34, QK_K, 54, G)         \
    X(tq2_0, 35, QK_K, 66, G)         \
    X(mxfp4, 39, 32, 17, S)

#define KT_BODY_G(NAME, ISA) blk_##NAME
#define KT_BODY_S(NAME, ISA) blk_##NAME##_##ISA
#define KT_BODY_N(NAME, ISA) blk_##NAME   /* instantiated but not used: see KT_PICK_N */

#ifdef KT_X86
/* SIMD nibble lookups: the 16-entry float table lives in registers (AVX-512: one permutexvar; AVX2: two 8-entry
 * permutes blended on bit 3). Tables are built with the same multiply as lut16, so the bits are unchanged. */
#define KT_ATTR_AVX2 __attribute__((target("avx2")))
#define KT_ATTR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

KT_ATTR_AVX512 KT_INLINE void nibbles_lut_avx512(const uint8_t *q, const float *table, float *y) {
    const __m512 t = _mm512_loadu_ps(table);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    _mm512_storeu_ps(y, _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), t));
    _mm512_storeu_ps(y + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t));
}

KT_ATTR_AVX2 KT_INLINE __m256 lut16_avx2(__m256i idx, __m256 lo, __m256 hi) {
    const __m256 from_lo = _mm256_permutevar8x32_ps(lo, idx), from_hi = _mm256_permutevar8x32_ps(hi, idx);
    return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

KT_ATTR_AVX2 KT_INLINE void nibbles_lut_avx2(const uint8_t *q, const float *table, float *y) {
    const __m256 lo = _mm256_loadu_ps(table), hi = _mm256_loadu_ps(table + 8);
    const __m256i m15 = _mm256_set1_epi32(15);
    for (int h = 0; h < 16; h += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + h)));
        _mm256_storeu_ps(y + h, lut16_avx2(_mm256_and_si256(b, m15), lo, hi));
        _mm256_storeu_ps(y + 16 + h, lut16_avx2(_mm256_srli_epi32(b, 4), lo, hi));
    }
}

/* BF16 rounding of a run of floats, as to_bf16 (RNE; NaN -> quiet NaN with the top bits kept). */
KT_ATTR_AVX512 KT_INLINE void to_bf16_avx512(const float *x, int64_t n, uint16_t *out) {
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), quiet = _mm512_set1_epi32(0x0040);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
        const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet);
        const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan)));
    }
    to_bf16(x + i, n - i, out + i);
}

/* Q6_K codes for one half (128 elements) of a super-block, as blk_q6_k's first pass, 32 bytes at a time. */
KT_ATTR_AVX2 KT_INLINE void q6_k_codes_avx2(const uint8_t *ql, const uint8_t *qh, int8_t *q) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                           _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
    for (int k = 0; k < 4; k++) {
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * k), m2);
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo[k], _mm256_slli_epi16(hi, 4)), off);
        _mm256_storeu_si256((__m256i *)(q + 32 * k), v);
    }
}

/* All 256 codes of a Q6_K block into q; returns d. */
KT_ATTR_AVX2 KT_INLINE float q6_k_block_codes(const uint8_t *b, int8_t *q) {
    q6_k_codes_avx2(b, b + 128, q);
    q6_k_codes_avx2(b + 64, b + 160, q + 128);
    return f16_to_f32(rd16(b + 208));
}

KT_ATTR_AVX2 KT_INLINE void blk_q6_k_avx2(const uint8_t *b, float *y) {
    const int8_t *sc = (const int8_t *)(b + 192);
    int8_t q[QK_K];
    const float d = q6_k_block_codes(b, q);
    for (int c = 0; c < 16; c++) {
        const __m256 scale = _mm256_set1_ps(d * (float)sc[c]);
        for (int h = 0; h < 16; h += 8) {
            const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + c * 16 + h)));
            _mm256_storeu_ps(y + c * 16 + h, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(v)));
        }
    }
}

KT_ATTR_AVX512 KT_INLINE void blk_q6_k_avx512(const uint8_t *b, float *y) {
    const int8_t *sc = (const int8_t *)(b + 192);
    int8_t q[QK_K];
    const float d = q6_k_block_codes(b, q);
    for (int c = 0; c < 16; c++) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + c * 16)));
        _mm512_storeu_ps(y + c * 16, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[c]), _mm512_cvtepi32_ps(v)));
    }
}

#define KT_LOOKUP_BODIES(ISA, ATTR)                                                                   \
    ATTR KT_INLINE void blk_iq4_nl_##ISA(const uint8_t *b, float *y) {                               \
        float table[16];                                                                             \
        lut16(f16_to_f32(rd16(b)), KV_IQ4NL, table);                                                 \
        nibbles_lut_##ISA(b + 2, table, y);                                                          \
    }                                                                                                \
    ATTR KT_INLINE void blk_mxfp4_##ISA(const uint8_t *b, float *y) {                                \
        float table[16];                                                                             \
        lut16(e8m0_half(b[0]), KV_MXFP4, table);                                                     \
        nibbles_lut_##ISA(b + 1, table, y);                                                          \
    }                                                                                                \
    ATTR KT_INLINE void blk_iq4_xs_##ISA(const uint8_t *b, float *y) {                               \
        const float d = f16_to_f32(rd16(b));                                                         \
        const uint16_t sh = rd16(b + 2);                                                             \
        for (int k = 0; k < 8; k++) {                                                                \
            int s = (((b[4 + (k >> 1)] >> (4 * (k & 1))) & 15) | (((sh >> (2 * k)) & 3) << 4)) - 32; \
            float table[16];                                                                         \
            lut16(d * (float)s, KV_IQ4NL, table);                                                    \
            nibbles_lut_##ISA(b + 8 + k * 16, table, y + k * 32);                                    \
        }                                                                                            \
    }
KT_LOOKUP_BODIES(avx2, KT_ATTR_AVX2)
KT_LOOKUP_BODIES(avx512, KT_ATTR_AVX512)
#endif

/* An empty volatile asm in the loop over blocks keeps the compiler from vectorizing across blocks (strided
 * gathers, much slower) instead of within a block. Element formats (1 element per block) are exempt. */
#define KT_NO_OUTER_VECTORIZE(ELEMS) do { if ((ELEMS) > 1) __asm__ volatile(""); } while (0)

#define KT_UNUSED __attribute__((unused)) /* N types instantiate ISA variants that the table does not use */
#define BF16_CHUNK 4096 /* floats of scratch per bf16 call step (16 KiB on the stack) */

typedef void (*dq_f32_fn)(const uint8_t *src, int64_t nblocks, float *dst);
typedef void (*dq_bf16_fn)(const uint8_t *src, int64_t nblocks, uint16_t *dst);

/* dq_NAME_SUFFIX: blocks -> float32; dqb_NAME_SUFFIX: blocks -> BF16 bits through a float buffer rounded by TO_BF16. */
#define KT_DEFINE_TYPE2(ATTR, SUFFIX, BODY, TO_BF16, NAME, ID, ELEMS, BYTES)                                   \
    ATTR KT_UNUSED static void dq_##NAME##_##SUFFIX(const uint8_t *src, int64_t nblocks, float *dst) {      \
        for (int64_t i = 0; i < nblocks; i++) {                                                      \
            KT_NO_OUTER_VECTORIZE(ELEMS);                                                               \
            BODY(src + i * (BYTES), dst + i * (ELEMS));                                              \
        }                                                                                            \
    }                                                                                                \
    ATTR KT_UNUSED static void dqb_##NAME##_##SUFFIX(const uint8_t *src, int64_t nblocks, uint16_t *dst) {  \
        float buf[BF16_CHUNK];                                                                       \
        const int64_t step = BF16_CHUNK / (ELEMS);                                                   \
        for (int64_t i = 0; i < nblocks; i += step) {                                                \
            int64_t n = nblocks - i < step ? nblocks - i : step;                                     \
            for (int64_t k = 0; k < n; k++) {                                                        \
                KT_NO_OUTER_VECTORIZE(ELEMS);                                                           \
                BODY(src + (i + k) * (BYTES), buf + k * (ELEMS));                                    \
            }                                                                                        \
            TO_BF16(buf, n * (ELEMS), dst + i * (ELEMS));                                            \
        }                                                                                            \
    }

#define KT_DEFINE_TYPE_scalar(NAME, ID, ELEMS, BYTES, SIMD) \
    KT_DEFINE_TYPE2(, scalar, blk_##NAME, KT_TO_BF16_SCALAR, NAME, ID, ELEMS, BYTES)
KT_GGUF_TYPES(KT_DEFINE_TYPE_scalar)

#ifdef KT_X86
#define KT_DEFINE_TYPE_avx2(NAME, ID, ELEMS, BYTES, SIMD) \
    KT_DEFINE_TYPE2(KT_ATTR_AVX2, avx2, KT_BODY_##SIMD(NAME, avx2), to_bf16_sse2, NAME, ID, ELEMS, BYTES)
#define KT_DEFINE_TYPE_avx512(NAME, ID, ELEMS, BYTES, SIMD) \
    KT_DEFINE_TYPE2(KT_ATTR_AVX512, avx512, KT_BODY_##SIMD(NAME, avx512), to_bf16_avx512, NAME, ID, ELEMS, BYTES)
KT_GGUF_TYPES(KT_DEFINE_TYPE_avx2)
KT_GGUF_TYPES(KT_DEFINE_TYPE_avx512)
#endif

/* Per type: ggml id, elements and bytes per block; a type's position here is its index in every kernel table. */
typedef struct {
    int type;
    int64_t elems, bytes;
} kt_gguf_entry;

#define KT_ENTRY(NAME, ID, ELEMS, BYTES, SIMD) {ID, ELEMS, BYTES},
static const kt_gguf_entry KT_GGUF_TABLE[] = {KT_GGUF_TYPES(KT_ENTRY)};
#define KT_GGUF_NTYPES ((int)(sizeof KT_GGUF_TABLE / sizeof KT_GGUF_TABLE[0]))

/* One table per ISA, referenced by dispatch.c's table of implementations. N types use the scalar build everywhere. */
struct kt_gguf_kernels {
    dq_f32_fn f32[KT_GGUF_NTYPES];
    dq_bf16_fn bf16[KT_GGUF_NTYPES];
};

#define KT_PICK_G(PFX, NAME, ISA) PFX##NAME##_##ISA,
#define KT_PICK_S(PFX, NAME, ISA) PFX##NAME##_##ISA,
#define KT_PICK_N(PFX, NAME, ISA) PFX##NAME##_scalar,
#define KT_F32_scalar(NAME, ID, ELEMS, BYTES, SIMD) dq_##NAME##_scalar,
#define KT_BF16_scalar(NAME, ID, ELEMS, BYTES, SIMD) dqb_##NAME##_scalar,
const kt_gguf_kernels kt_gguf_kernels_scalar = {{KT_GGUF_TYPES(KT_F32_scalar)}, {KT_GGUF_TYPES(KT_BF16_scalar)}};
#ifdef KT_X86
#define KT_F32_avx2(NAME, ID, ELEMS, BYTES, SIMD) KT_PICK_##SIMD(dq_, NAME, avx2)
#define KT_BF16_avx2(NAME, ID, ELEMS, BYTES, SIMD) KT_PICK_##SIMD(dqb_, NAME, avx2)
#define KT_F32_avx512(NAME, ID, ELEMS, BYTES, SIMD) KT_PICK_##SIMD(dq_, NAME, avx512)
#define KT_BF16_avx512(NAME, ID, ELEMS, BYTES, SIMD) KT_PICK_##SIMD(dqb_, NAME, avx512)
const kt_gguf_kernels kt_gguf_kernels_avx2 = {{KT_GGUF_TYPES(KT_F32_avx2)}, {KT_GGUF_TYPES(KT_BF16_avx2)}};
const kt_gguf_kernels kt_gguf_kernels_avx512 = {{KT_GGUF_TYPES(KT_F32_avx512)}, {KT_GGUF_TYPES(KT_BF16_avx512)}};
#endif

static int find_type(int type) {
    for (int i = 0; i < KT_GGUF_NTYPES; i++)
        if (KT_GGUF_TABLE[i].type == type) return i;
    return -1;
}

KT_API int64_t kt_gguf_block_elems(int type) {
    const int i = find_type(type);
    return i >= 0 ? KT_GGUF_TABLE[i].elems : 0;
}

KT_API int64_t kt_gguf_block_bytes(int type) {
    const int i = find_type(type);
    return i >= 0 ? KT_GGUF_TABLE[i].bytes : 0;
}

/* numpy's floating-point mode for the call: round to nearest even, all exceptions masked, no FTZ/DAZ (so subnormal
 * results match; kt_fpenv_enter would set FTZ/DAZ). The caller's mode is restored. */
static int run(int type, int impl, const uint8_t *src, int64_t nblocks, void *dst, int bf16) {
    const int i = find_type(type);
    if (i < 0 || nblocks < 0 || (nblocks > 0 && (src == NULL || dst == NULL))) return KT_E_ARG;
    int status;
    const kt_impl *chosen = kt_impl_get(impl, &status);
    if (!chosen) return status;
    kt_fpenv env;
    kt_fpenv_enter_ieee(&env);
    if (bf16)
        chosen->gguf->bf16[i](src, nblocks, (uint16_t *)dst);
    else
        chosen->gguf->f32[i](src, nblocks, (float *)dst);
    kt_fpenv_leave(&env);
    return KT_OK;
}

KT_API int kt_gguf_dequant_f32(int type, int impl, const uint8_t *src, int64_t nblocks, float *dst) {
    return run(type, impl, src, nblocks, dst, 0);
}

KT_API int kt_gguf_dequant_bf16(int type, int impl, const uint8_t *src, int64_t nblocks, uint16_t *dst) {
    return run(type, impl, src, nblocks, dst, 1);
}
