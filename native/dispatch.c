/* Run-time CPU detection (CPUID + XGETBV) and the one table of implementations every kernel family dispatches
 * through (kt_internal.h: kt_impl); see kt_native.h for the public contract. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt_internal.h"

#ifdef KT_X86
#include <cpuid.h>
#include <xmmintrin.h>
#else
#include <fenv.h>
#endif

static const char *const feature_names[KT_CPU_NFEATURES] = {
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
    "avx512dq", "avx512vnni", "avx512bf16", "amx-tile", "amx-int8", "amx-bf16", "sha",
};

KT_API int kt_abi_version(void) { return KT_ABI_VERSION; }

KT_API const char *kt_cpu_feature_name(int bit_index) {
    return (bit_index >= 0 && bit_index < KT_CPU_NFEATURES) ? feature_names[bit_index] : NULL;
}

#ifdef KT_X86
static uint64_t read_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int detect_features(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return 0;
    uint64_t xcr0 = read_xcr0();
    int os_ymm = (xcr0 & 0x6) == 0x6;       /* SSE + AVX state */
    int os_zmm = (xcr0 & 0xe6) == 0xe6;     /* + opmask, ZMM_Hi256, Hi16_ZMM */
    int os_tile = (xcr0 & 0x60000) == 0x60000; /* XTILECFG + XTILEDATA */
    if (!os_ymm) return 0;
    int f = (fma ? KT_CPU_FMA : 0) | (f16c ? KT_CPU_F16C : 0);
    if (__get_cpuid_max(0, NULL) < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    if ((b >> 5) & 1) f |= KT_CPU_AVX2;
    if ((b >> 29) & 1) f |= KT_CPU_SHA;     /* SHA extensions (the SSE4.1 they go with comes with AVX) */
    if (os_zmm) {
        if ((b >> 16) & 1) f |= KT_CPU_AVX512F;
        if ((b >> 17) & 1) f |= KT_CPU_AVX512DQ;
        if ((b >> 30) & 1) f |= KT_CPU_AVX512BW;
        if ((b >> 31) & 1) f |= KT_CPU_AVX512VL;
        if ((c >> 11) & 1) f |= KT_CPU_AVX512VNNI;
    }
    if (os_tile) {
        if ((d >> 24) & 1) f |= KT_CPU_AMX_TILE;
        if ((d >> 25) & 1) f |= KT_CPU_AMX_INT8;
        if ((d >> 22) & 1) f |= KT_CPU_AMX_BF16;
    }
    if (os_zmm && a >= 1) {
        unsigned a1, b1, c1, d1;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        if ((a1 >> 5) & 1) f |= KT_CPU_AVX512BF16;
    }
    if (!(f & KT_CPU_AVX512F)) f &= ~(KT_CPU_AVX512BW | KT_CPU_AVX512VL | KT_CPU_AVX512DQ | KT_CPU_AVX512VNNI |
                                      KT_CPU_AVX512BF16);
    return f;
}
#else
static int detect_features(void) { return 0; }
#endif

/* KTCONVERT_DISABLE_CPU_FEATURES: comma-separated feature names removed from the detected mask. */
static int disabled_features(void) {
    const char *env = getenv("KTCONVERT_DISABLE_CPU_FEATURES");
    int mask = 0;
    if (!env) return 0;
    for (int i = 0; i < KT_CPU_NFEATURES; i++) {
        size_t len = strlen(feature_names[i]);
        for (const char *p = env; (p = strstr(p, feature_names[i])) != NULL; p += len) {
            int starts = p == env || p[-1] == ',' || p[-1] == ' ';
            int ends = p[len] == '\0' || p[len] == ',' || p[len] == ' ';
            if (starts && ends) mask |= 1 << i;
        }
    }
    return mask;
}

/* Detected once; a race between first callers is harmless (they compute the same value). */
static int cached_features = -1;

KT_API int kt_cpu_features(void) {
    int f = __atomic_load_n(&cached_features, __ATOMIC_ACQUIRE);
    if (f < 0) {
        f = detect_features() & ~disabled_features();
        __atomic_store_n(&cached_features, f, __ATOMIC_RELEASE);
    }
    return f;
}

/* ---------------------------------------------------------------- the table of implementations */

extern const kt_mse_kernels kt_mse_kernels_scalar;
extern const kt_decode_kernels kt_decode_kernels_scalar;
extern const kt_gguf_kernels kt_gguf_kernels_scalar;
extern const kt_rt_kernels kt_rt_kernels_scalar;
extern const kt_ctq_kernels kt_ctq_kernels_scalar;
#ifdef KT_X86
extern const kt_mse_kernels kt_mse_kernels_avx512;
extern const kt_decode_kernels kt_decode_kernels_avx2, kt_decode_kernels_avx512;
extern const kt_gguf_kernels kt_gguf_kernels_avx2, kt_gguf_kernels_avx512;
extern const kt_rt_kernels kt_rt_kernels_avx2, kt_rt_kernels_avx512, kt_rt_kernels_avx512vnni;
extern const kt_ctq_kernels kt_ctq_kernels_avx2, kt_ctq_kernels_avx512;
#define X86_ONLY(x) (x)
#else
#define X86_ONLY(x) NULL /* rows kept so the names exist; their features are never detected off x86 */
#endif

#define NEEDS_AVX2 (KT_CPU_AVX2 | KT_CPU_FMA | KT_CPU_F16C)
#define NEEDS_AVX512 (KT_CPU_AVX512F | KT_CPU_AVX512BW | KT_CPU_AVX512VL | KT_CPU_FMA)

/* Best first; the scalar row (no requirement) is last and always supported. Rows sharing an id are ordered most
 * demanding first; the last of them states what the id needs at least. */
static const kt_impl IMPLS[] = {
    {KT_IMPL_AVX512, "avx512", "avx512-vnni", NEEDS_AVX512 | KT_CPU_AVX512VNNI, X86_ONLY(&kt_amx_kernels_avx512),
     X86_ONLY(&kt_mse_kernels_avx512), X86_ONLY(&kt_decode_kernels_avx512), X86_ONLY(&kt_gguf_kernels_avx512),
     X86_ONLY(&kt_rt_kernels_avx512vnni), X86_ONLY(&kt_ctq_kernels_avx512)},
    {KT_IMPL_AVX512, "avx512", "avx512", NEEDS_AVX512, X86_ONLY(&kt_amx_kernels_avx512),
     X86_ONLY(&kt_mse_kernels_avx512), X86_ONLY(&kt_decode_kernels_avx512), X86_ONLY(&kt_gguf_kernels_avx512),
     X86_ONLY(&kt_rt_kernels_avx512), X86_ONLY(&kt_ctq_kernels_avx512)},
    {KT_IMPL_AVX2, "avx2", "avx2", NEEDS_AVX2, X86_ONLY(&kt_amx_kernels_avx2), &kt_mse_kernels_scalar,
     X86_ONLY(&kt_decode_kernels_avx2), X86_ONLY(&kt_gguf_kernels_avx2), X86_ONLY(&kt_rt_kernels_avx2),
     X86_ONLY(&kt_ctq_kernels_avx2)},
    {KT_IMPL_SCALAR, "scalar", "scalar", 0, &kt_amx_kernels_scalar, &kt_mse_kernels_scalar,
     &kt_decode_kernels_scalar, &kt_gguf_kernels_scalar, &kt_rt_kernels_scalar, &kt_ctq_kernels_scalar},
};
#define N_IMPLS ((int)(sizeof IMPLS / sizeof IMPLS[0]))

static int row_supported(const kt_impl *row) { return (row->required & ~kt_cpu_features()) == 0; }

/* The first supported row of `id` (0: of any id), or NULL. */
static const kt_impl *best_row(int id) {
    for (int i = 0; i < N_IMPLS; i++)
        if ((id == 0 || IMPLS[i].id == id) && row_supported(&IMPLS[i])) return &IMPLS[i];
    return NULL;
}

/* The least demanding row of `id` (the last one), or NULL for an unknown id. */
static const kt_impl *base_row(int id) {
    const kt_impl *found = NULL;
    for (int i = 0; i < N_IMPLS; i++)
        if (IMPLS[i].id == id) found = &IMPLS[i];
    return found;
}

KT_API int kt_impl_missing(int impl) {
    const kt_impl *row = base_row(impl);
    return row ? row->required & ~kt_cpu_features() : -1;
}

KT_API const char *kt_impl_name(int impl) {
    const kt_impl *row = base_row(impl);
    return row ? row->name : NULL;
}

KT_API int kt_impl_best(void) { return best_row(0)->id; }

/* Index of the row KTCONVERT_FORCE_IMPL selects (read once per process), or -KT_E_IMPL / -KT_E_ARG.
 * "numpy" selects ktconvert's numpy paths in Python; kernels without one run the best implementation. */
static int select_from_env(void) {
    const char *env = getenv("KTCONVERT_FORCE_IMPL");
    int id = 0;
    if (env && *env && strcmp(env, "auto") != 0 && strcmp(env, "numpy") != 0) {
        for (int i = 0; i < N_IMPLS && id == 0; i++)
            if (strcmp(env, IMPLS[i].name) == 0) id = IMPLS[i].id;
        if (id == 0) return -KT_E_ARG;
    }
    const kt_impl *row = best_row(id);
    return row ? (int)(row - IMPLS) : -KT_E_IMPL;
}

static int cached_selection = INT32_MIN; /* row index or -KT_E_*; a race between first callers is harmless */

const kt_impl *kt_impl_get(int impl, int *status) {
    const kt_impl *row;
    if (impl == KT_IMPL_AUTO) {
        int s = __atomic_load_n(&cached_selection, __ATOMIC_ACQUIRE);
        if (s == INT32_MIN) {
            s = select_from_env();
            __atomic_store_n(&cached_selection, s, __ATOMIC_RELEASE);
        }
        *status = s < 0 ? -s : KT_OK;
        return s < 0 ? NULL : &IMPLS[s];
    }
    if (base_row(impl) == NULL) {
        *status = KT_E_ARG;
        return NULL;
    }
    row = best_row(impl);
    *status = row ? KT_OK : KT_E_IMPL;
    return row;
}

KT_API int kt_select_impl(void) { return kt_resolve_impl(KT_IMPL_AUTO); }

KT_API int kt_resolve_impl(int impl) {
    int status;
    const kt_impl *row = kt_impl_get(impl, &status);
    return row ? row->id : -status;
}

KT_API const char *kt_impl_variant(int impl) {
    int status;
    const kt_impl *row = kt_impl_get(impl, &status);
    return row ? row->variant : NULL;
}

/* ---------------------------------------------------------------- floating-point environment */

#ifdef KT_X86
void kt_fpenv_enter(kt_fpenv *env) {
    env->saved = _mm_getcsr();
    _mm_setcsr(0x1f80u | 0x8000u | 0x0040u); /* exceptions masked, round to nearest even, FTZ, DAZ */
}

void kt_fpenv_enter_ieee(kt_fpenv *env) {
    env->saved = _mm_getcsr();
    _mm_setcsr(0x1f80u); /* exceptions masked, round to nearest even, subnormals kept */
}

void kt_fpenv_leave(const kt_fpenv *env) { _mm_setcsr(env->saved); }

KT_API int kt_fp_flush_mode(void) { return (_mm_getcsr() & (0x8000u | 0x0040u)) != 0; }

KT_API void kt_fp_set_flush_mode(int on) {
    unsigned int csr = _mm_getcsr() & ~(0x8000u | 0x0040u);
    _mm_setcsr(on ? csr | 0x8000u | 0x0040u : csr);
}
#else
KT_API int kt_fp_flush_mode(void) { return 0; }

KT_API void kt_fp_set_flush_mode(int on) { (void)on; }

void kt_fpenv_enter(kt_fpenv *env) {
    env->saved = (unsigned int)fegetround();
    fesetround(FE_TONEAREST);
}

void kt_fpenv_enter_ieee(kt_fpenv *env) { kt_fpenv_enter(env); }

void kt_fpenv_leave(const kt_fpenv *env) { fesetround((int)env->saved); }
#endif
