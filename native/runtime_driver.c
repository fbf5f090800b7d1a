/* Verification runtime: tile walk, threads, and the routed-expert MoE forward (ABI in kt_runtime.h).
 *
 * Walk of an AMX blob [n, k] (kt-format.md 2.1 / 2.2), outermost first: N-blocks (128 rows INT4, 64 INT8) ->
 * K-blocks of 3584 columns -> 32-row panels -> 2048-byte tiles. Panel (nb0, kb0, s0) starts at element offset
 * nb0*k + kb0*nbs + s0*kbs (bytes: half of it for INT4) and holds kbs / tile_k consecutive tiles.
 * Threads split the N-blocks (BF16 and RAWINT4: groups of 16 rows); each row is summed by exactly one thread.
 * A RAWINT4 matrix is a strided view (rt_mat): a NUMA part of down is a column range of every row of the whole matrix.
 */
#define KT_RUNTIME_INTERNAL
#include "kt_runtime.h"
#include "kt_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define RT_K_BLOCK 3584
#define RT_N_STEP 32
#define RT_BF16_ROWS 16

/* One weight matrix: its weights and scales, and (RAWINT4) the strides of its rows: bytes of w, scales. */
typedef struct {
    const void *w, *scale;
    int64_t ldw, lds;
} rt_mat;

typedef struct {
    const kt_rt_kernels *kern;
    int wtype;
    int64_t group; /* RAWINT4 */
    rt_mat mat;
    int64_t n, k, m;
    const float *x;
    float *y;
    const kt_rt_xq *xq; /* set when the kernels have integer (VNNI) panels */
} rt_gemm_job;

static int64_t rt_n_block(int wtype) { return wtype == KT_RT_INT4 ? 128 : wtype == KT_RT_INT8 ? 64 : RT_BF16_ROWS; }
static int rt_tiled(int wtype) { return wtype == KT_RT_INT4 || wtype == KT_RT_INT8; }
static int64_t rt_tile_k(int wtype) { return wtype == KT_RT_INT4 ? 128 : 64; }

/* Rows [nb*NB, ...) of y for N-blocks [begin, end). */
static void rt_gemm_blocks(const rt_gemm_job *job, int64_t begin, int64_t end)
{
    const int64_t n = job->n, k = job->k, m = job->m, NB = rt_n_block(job->wtype);
    const uint8_t *w = (const uint8_t *)job->mat.w;
    const float *scale = (const float *)job->mat.scale;
    if (!rt_tiled(job->wtype)) {
        const int64_t r0 = begin * NB, r1 = end * NB < n ? end * NB : n;
        if (r1 <= r0) return;
        if (job->wtype == KT_RT_BF16)
            job->kern->bf16_rows((const uint16_t *)w + r0 * k, r1 - r0, k, job->x, m, job->y + r0, n);
        else
            job->kern->rawint4_rows(w + r0 * job->mat.ldw, job->mat.ldw, (const uint16_t *)job->mat.scale +
                                    r0 * job->mat.lds, job->mat.lds, r1 - r0, k, job->group, job->x, m, job->y + r0, n);
        return;
    }
    const int int4 = job->wtype == KT_RT_INT4;
    const int64_t tile_k = rt_tile_k(job->wtype);
    const kt_rt_panel_fn panel = int4 ? job->kern->int4_panel : job->kern->int8_panel;
    const kt_rt_qpanel_fn qpanel = int4 ? job->kern->int4_qpanel : job->kern->int8_qpanel;
    const float mult = int4 ? 16.0f : 1.0f; /* INT4 stores d = step / 16 */
    for (int64_t nb = begin; nb < end; nb++) {
        const int64_t nb0 = nb * NB, nbs = n - nb0 < NB ? n - nb0 : NB;
        for (int64_t t = 0; t < m; t++) memset(job->y + t * n + nb0, 0, (size_t)nbs * sizeof(float));
        for (int64_t kb0 = 0; kb0 < k; kb0 += RT_K_BLOCK) {
            const int64_t kbs = k - kb0 < RT_K_BLOCK ? k - kb0 : RT_K_BLOCK;
            for (int64_t s0 = 0; s0 < nbs; s0 += RT_N_STEP) {
                const int64_t elem = nb0 * k + kb0 * nbs + s0 * kbs;
                const uint8_t *p = w + (int4 ? elem / 2 : elem);
                if (job->xq) qpanel(p, kbs / tile_k, job->xq, kb0 / RT_K_BLOCK, m, job->y + nb0 + s0, n);
                else panel(p, kbs / tile_k, job->x + kb0, k, m, job->y + nb0 + s0, n);
            }
        }
        for (int64_t t = 0; t < m; t++)
            for (int64_t r = 0; r < nbs; r++) job->y[t * n + nb0 + r] *= scale[nb0 + r] * mult;
    }
}

typedef struct {
    const rt_gemm_job *job;
    int64_t begin, end;
} rt_slice;

static void *rt_slice_main(void *arg)
{
    const rt_slice *s = (const rt_slice *)arg;
    rt_gemm_blocks(s->job, s->begin, s->end);
    return NULL;
}

/* Static split of nwork N-blocks over min(threads, nwork) threads; the caller's thread takes slice 0. */
static int rt_gemm_parallel(const rt_gemm_job *job, int64_t nwork, int threads)
{
    int nt = threads < 1 ? 1 : threads;
    if (nt > nwork) nt = (int)nwork;
    if (nt <= 1) {
        rt_gemm_blocks(job, 0, nwork);
        return KT_OK;
    }
    rt_slice *slices = calloc((size_t)nt, sizeof *slices);
    pthread_t *tids = calloc((size_t)nt, sizeof *tids);
    int status = (slices && tids) ? KT_OK : KT_RT_E_NOMEM, started = 0;
    for (int i = 0; i < nt && status == KT_OK; i++) {
        slices[i] = (rt_slice){job, nwork * i / nt, nwork * (i + 1) / nt};
        if (i > 0) {
            if (pthread_create(&tids[i], NULL, rt_slice_main, &slices[i]) != 0) status = KT_RT_E_THREAD;
            else started = i;
        }
    }
    if (status == KT_OK) rt_gemm_blocks(job, slices[0].begin, slices[0].end);
    for (int i = 1; i <= started; i++) pthread_join(tids[i], NULL);
    free(slices);
    free(tids);
    return status;
}

/* The kernels a call with `impl` runs (dispatch.c's table), or NULL with *status set. */
static const kt_rt_kernels *rt_kernels(int impl, int *status)
{
    const kt_impl *chosen = kt_impl_get(impl, status);
    return chosen ? chosen->runtime : NULL;
}

/* x [m, k] fp32 -> exact integers for the VNNI panels (kt_rt_xq in kt_runtime.h). buf: KT_RT_XDIGITS*m*k int8 digits,
 * m*nkb int64 sums, m doubles. KT_E_NONFINITE if x holds NaN/Inf. Written as plain loops over one K-block that the
 * compiler vectorizes (no libm call per element): this runs on one thread before the panels, and for a GEMV with
 * k = 7168 it cost a fifth of the call. */
_Static_assert(KT_RT_XDIGITS == 4 && KT_RT_XBITS <= 30, "rt_quantize_x writes four digits of an int32");

static int rt_quantize_x(const float *x, int64_t m, int64_t k, kt_rt_xq *xq, int8_t *digits, int64_t *ksum,
                         double *pow2)
{
    const int64_t nkb = (k + RT_K_BLOCK - 1) / RT_K_BLOCK;
    *xq = (kt_rt_xq){digits, ksum, pow2, k, nkb};
    for (int64_t t = 0; t < m; t++) {
        const uint32_t *bits = (const uint32_t *)(x + t * k);
        uint32_t amax_bits = 0; /* largest |x| as bits; NaN and Inf are the largest */
        for (int64_t c = 0; c < k; c++) amax_bits = (bits[c] & 0x7fffffffu) > amax_bits ? bits[c] & 0x7fffffffu : amax_bits;
        if (amax_bits >= 0x7f800000u) return KT_E_NONFINITE;
        int e2 = 0;
        frexpf(kt_f32_from_bits(amax_bits), &e2); /* amax < 2^e2, so |x * 2^(XBITS - e2)| <= 2^XBITS */
        pow2[t] = amax_bits ? ldexp(1.0, e2 - KT_RT_XBITS) : 0.0;
        const double scale = amax_bits ? ldexp(1.0, KT_RT_XBITS - e2) : 0.0; /* x * scale is exact in double */
        int8_t *d0 = digits + t * KT_RT_XDIGITS * k, *d1 = d0 + k, *d2 = d1 + k, *d3 = d2 + k;
        for (int64_t kb0 = 0; kb0 < k; kb0 += RT_K_BLOCK) {
            const int64_t end = k - kb0 < RT_K_BLOCK ? k : kb0 + RT_K_BLOCK;
            int64_t sum = 0;
            for (int64_t c = kb0; c < end; c++) {
                /* round half to even: adding 1.5 * 2^52 leaves no fraction bits (|value| <= 2^30); without
                 * -ffast-math the compiler keeps both operations */
                const int32_t X = (int32_t)(((double)x[t * k + c] * scale + 6755399441055744.0) - 6755399441055744.0);
                /* balanced base-256 digits: the low byte as int8, then the exact quotient by 256 */
                const int32_t X1 = (X - (int8_t)X) >> 8, X2 = (X1 - (int8_t)X1) >> 8, X3 = (X2 - (int8_t)X2) >> 8;
                d0[c] = (int8_t)X;
                d1[c] = (int8_t)X1;
                d2[c] = (int8_t)X2;
                d3[c] = (int8_t)X3;
                sum += X;
            }
            ksum[t * nkb + kb0 / RT_K_BLOCK] = sum;
        }
    }
    return KT_OK;
}

/* A known weight type with a group size exactly where it has groups (RAWINT4: group > 0, else 0). */
static int rt_check_type(int wtype, int64_t group)
{
    if (wtype != KT_RT_INT4 && wtype != KT_RT_INT8 && wtype != KT_RT_BF16 && wtype != KT_RT_RAWINT4) return KT_E_ARG;
    return (wtype == KT_RT_RAWINT4 ? group > 0 : group == 0) ? KT_OK : KT_E_ARG;
}

static int rt_check_shape(int wtype, int64_t group, int64_t n, int64_t k)
{
    int status = rt_check_type(wtype, group);
    if (status != KT_OK) return status;
    if (n <= 0 || k <= 0) return KT_E_SHAPE;
    if (wtype == KT_RT_BF16) return KT_OK;
    if (wtype == KT_RT_RAWINT4) return (group % 8 || k % group) ? KT_E_SHAPE : KT_OK;
    return (n % RT_N_STEP || k % rt_tile_k(wtype)) ? KT_E_SHAPE : KT_OK;
}

static int rt_gemm(const kt_rt_kernels *kern, int wtype, int64_t group, const rt_mat *mat, int64_t n, int64_t k,
                   const float *x, int64_t m, float *y, int threads)
{
    int status = rt_check_shape(wtype, group, n, k);
    if (status != KT_OK) return status;
    if (!mat->w || !x || !y || m < 0 || (wtype != KT_RT_BF16 && !mat->scale)) return KT_E_ARG;
    if (m == 0) return KT_OK;
    rt_gemm_job job = {kern, wtype, group, *mat, n, k, m, x, y, NULL};
    const int64_t NB = rt_n_block(wtype), nkb = (k + RT_K_BLOCK - 1) / RT_K_BLOCK;
    kt_rt_xq xq;
    void *buf = NULL;
    if (rt_tiled(wtype) && kern->int4_qpanel) {
        buf = malloc((size_t)(m * nkb + m) * 8 + (size_t)(KT_RT_XDIGITS * m * k));
        if (!buf) return KT_RT_E_NOMEM;
        int64_t *ksum = buf;
        double *pow2 = (double *)(ksum + m * nkb);
        status = rt_quantize_x(x, m, k, &xq, (int8_t *)(pow2 + m), ksum, pow2);
        job.xq = &xq;
    }
    if (status == KT_OK) status = rt_gemm_parallel(&job, (n + NB - 1) / NB, threads);
    free(buf);
    return status;
}

/* A matrix whose rows hold row_k columns (RAWINT4 strides; the other types' rows are contiguous). */
static rt_mat rt_view(const void *w, const void *scale, int64_t row_k, int64_t group)
{
    return (rt_mat){w, scale, row_k / 2, group > 0 ? row_k / group : 0};
}

int kt_rt_gemm_grouped(int wtype, int64_t group, const void *w, const void *scale, int64_t n, int64_t k,
                       const float *x, int64_t m, float *y, int impl, int threads)
{
    int status;
    const kt_rt_kernels *kern = rt_kernels(impl, &status);
    const rt_mat mat = rt_view(w, scale, k, group);
    return kern ? rt_gemm(kern, wtype, group, &mat, n, k, x, m, y, threads) : status;
}

int kt_rt_gemm(int wtype, const void *w, const float *scale, int64_t n, int64_t k, const float *x, int64_t m,
               float *y, int impl, int threads)
{
    return kt_rt_gemm_grouped(wtype, 0, w, scale, n, k, x, m, y, impl, threads);
}

/* out_e[m, H] = sum_t down_t(silu(gate_t x) * up_t x); scratch holds 3*m*I + m*H floats. Rows of gate / up hold H
 * columns; rows of down hold parts * I (its NUMA parts are column ranges; only RAWINT4 reads the stride). */
static int rt_expert(const kt_rt_kernels *kern, int wtype, int64_t group, int64_t H, int64_t I, int parts,
                     const void *const *mats, const float *x, int64_t m, float *out_e, float *scratch, int threads)
{
    float *g = scratch, *u = g + m * I, *h = u + m * I, *d = h + m * I;
    memset(out_e, 0, (size_t)(m * H) * sizeof(float));
    for (int t = 0; t < parts; t++) {
        const void *const *p = mats + 6 * t;
        const rt_mat gate = rt_view(p[0], p[1], H, group), up = rt_view(p[2], p[3], H, group),
                     down = rt_view(p[4], p[5], parts * I, group);
        int status = rt_gemm(kern, wtype, group, &gate, I, H, x, m, g, threads);
        if (status == KT_OK) status = rt_gemm(kern, wtype, group, &up, I, H, x, m, u, threads);
        if (status != KT_OK) return status;
        for (int64_t i = 0; i < m * I; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        status = rt_gemm(kern, wtype, group, &down, H, I, h, m, d, threads);
        if (status != KT_OK) return status;
        for (int64_t i = 0; i < m * H; i++) out_e[i] += d[i];
    }
    return KT_OK;
}

static int rt_expert_dims(int wtype, int64_t group, int64_t H, int64_t I, int parts)
{
    if (parts < 1) return KT_E_ARG;
    int status = rt_check_shape(wtype, group, I, H);
    return status != KT_OK ? status : rt_check_shape(wtype, group, H, I);
}

int kt_rt_expert_forward_grouped(int wtype, int64_t group, int64_t hidden, int64_t inter_part, int parts,
                                 const void *const *mats, const float *x, int64_t m, const float *coef, float *out,
                                 int impl, int threads)
{
    int status;
    const kt_rt_kernels *kern = rt_kernels(impl, &status);
    if (!kern) return status;
    if ((status = rt_expert_dims(wtype, group, hidden, inter_part, parts)) != KT_OK) return status;
    if (!mats || !x || !coef || !out || m < 0) return KT_E_ARG;
    if (m == 0) return KT_OK;
    float *buf = malloc((size_t)(m * hidden * 2 + 3 * m * inter_part) * sizeof(float));
    if (!buf) return KT_RT_E_NOMEM;
    float *out_e = buf, *scratch = buf + m * hidden;
    status = rt_expert(kern, wtype, group, hidden, inter_part, parts, mats, x, m, out_e, scratch, threads);
    for (int64_t i = 0; status == KT_OK && i < m; i++)
        for (int64_t c = 0; c < hidden; c++) out[i * hidden + c] += coef[i] * out_e[i * hidden + c];
    free(buf);
    return status;
}

int kt_rt_expert_forward(int wtype, int64_t hidden, int64_t inter_part, int parts, const void *const *mats,
                         const float *x, int64_t m, const float *coef, float *out, int impl, int threads)
{
    return kt_rt_expert_forward_grouped(wtype, 0, hidden, inter_part, parts, mats, x, m, coef, out, impl, threads);
}

/* Gather the (token, weight) pairs routed to expert id; returns how many. */
static int64_t rt_route(int64_t id, const int64_t *topk_ids, const float *topk_weights, int64_t m, int64_t topk,
                        const float *x, int64_t H, int64_t *rows, float *coef, float *xs)
{
    int64_t me = 0;
    for (int64_t i = 0; i < m * topk; i++) {
        if (topk_ids[i] != id) continue;
        rows[me] = i / topk;
        coef[me] = topk_weights[i];
        memcpy(xs + me * H, x + rows[me] * H, (size_t)H * sizeof(float));
        me++;
    }
    return me;
}

int kt_rt_moe_forward_grouped(int wtype, int64_t group, int64_t hidden, int64_t inter_part, int parts,
                              int64_t expert_lo, int64_t n_table, const void *const *table, const float *x, int64_t m,
                              const int64_t *topk_ids, const float *topk_weights, int64_t topk, float *out, int impl,
                              int threads)
{
    int status;
    const kt_rt_kernels *kern = rt_kernels(impl, &status);
    if (!kern) return status;
    if ((status = rt_expert_dims(wtype, group, hidden, inter_part, parts)) != KT_OK) return status;
    if (!table || !x || !topk_ids || !topk_weights || !out || m < 0 || topk < 1 || n_table < 0) return KT_E_ARG;
    const int64_t H = hidden, I = inter_part, mk = m * topk;
    if (mk == 0) return KT_OK;
    int64_t *rows = malloc((size_t)mk * sizeof(int64_t));
    float *buf = malloc((size_t)(mk + 3 * mk * H + 3 * mk * I) * sizeof(float));
    if (!rows || !buf) {
        free(rows);
        free(buf);
        return KT_RT_E_NOMEM;
    }
    float *coef = buf, *xs = coef + mk, *out_e = xs + mk * H, *scratch = out_e + mk * H;
    for (int64_t e = 0; e < n_table && status == KT_OK; e++) {
        if (!table[(size_t)e * 6 * (size_t)parts]) continue;
        int64_t me = rt_route(expert_lo + e, topk_ids, topk_weights, m, topk, x, H, rows, coef, xs);
        if (me == 0) continue;
        const void *const *mats = table + (size_t)e * 6 * (size_t)parts;
        status = rt_expert(kern, wtype, group, H, I, parts, mats, xs, me, out_e, scratch, threads);
        for (int64_t j = 0; status == KT_OK && j < me; j++)
            for (int64_t c = 0; c < H; c++) out[rows[j] * H + c] += coef[j] * out_e[j * H + c];
    }
    free(rows);
    free(buf);
    return status;
}

int kt_rt_moe_forward(int wtype, int64_t hidden, int64_t inter_part, int parts, int64_t expert_lo, int64_t n_table,
                      const void *const *table, const float *x, int64_t m, const int64_t *topk_ids,
                      const float *topk_weights, int64_t topk, float *out, int impl, int threads)
{
    return kt_rt_moe_forward_grouped(wtype, 0, hidden, inter_part, parts, expert_lo, n_table, table, x, m, topk_ids,
                                     topk_weights, topk, out, impl, threads);
}
