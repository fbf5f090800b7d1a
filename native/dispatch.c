/* Run-time CPU detection (CPUID + XGETBV) and implementation selection; see kt_native.h for the contract. */
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
    "avx512dq", "avx512vnni", "avx512bf16", "amx-tile", "amx-int8", "amx-bf16",
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

static int impl_requirements(int impl) {
    switch (impl) {
    case KT_IMPL_SCALAR: return 0;
    case KT_IMPL_AVX2: return KT_CPU_AVX2;
    case KT_IMPL_AVX512: return KT_CPU_AVX512F | KT_CPU_AVX512BW | KT_CPU_AVX512VL;
    default: return -1;
    }
}

KT_API int kt_impl_missing(int impl) {
    int need = impl_requirements(impl);
    if (need < 0) return -1;
#ifndef KT_X86
    if (impl != KT_IMPL_SCALAR) return need;
#endif
    return need & ~kt_cpu_features();
}

KT_API const char *kt_impl_name(int impl) {
    switch (impl) {
    case KT_IMPL_SCALAR: return "scalar";
    case KT_IMPL_AVX2: return "avx2";
    case KT_IMPL_AVX512: return "avx512";
    default: return NULL;
    }
}

KT_API int kt_impl_best(void) {
    static const int best_first[] = {KT_IMPL_AVX512, KT_IMPL_AVX2, KT_IMPL_SCALAR};
    for (size_t i = 0; i < sizeof best_first / sizeof best_first[0]; i++)
        if (kt_impl_missing(best_first[i]) == 0) return best_first[i];
    return KT_IMPL_SCALAR;
}

static int select_from_env(void) {
    const char *env = getenv("KTCONVERT_FORCE_IMPL");
    /* "numpy" selects ktconvert's numpy paths in Python; kernels without one run the best implementation. */
    if (!env || !*env || strcmp(env, "auto") == 0 || strcmp(env, "numpy") == 0) return kt_impl_best();
    for (int impl = KT_IMPL_SCALAR; impl <= KT_IMPL_AVX512; impl++) {
        if (strcmp(env, kt_impl_name(impl)) == 0) return kt_impl_missing(impl) == 0 ? impl : -KT_E_IMPL;
    }
    return -KT_E_ARG;
}

static int cached_selection = 0;

KT_API int kt_select_impl(void) {
    int s = __atomic_load_n(&cached_selection, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = select_from_env();
        __atomic_store_n(&cached_selection, s, __ATOMIC_RELEASE);
    }
    return s;
}

KT_API int kt_resolve_impl(int impl) {
    if (impl == KT_IMPL_AUTO) return kt_select_impl();
    int missing = kt_impl_missing(impl);
    if (missing < 0) return -KT_E_ARG;
    return missing == 0 ? impl : -KT_E_IMPL;
}

#ifdef KT_X86
void kt_fpenv_enter(kt_fpenv *env) {
    env->saved = _mm_getcsr();
    _mm_setcsr(0x1f80u | 0x8000u | 0x0040u); /* exceptions masked, round to nearest even, FTZ, DAZ */
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

void kt_fpenv_leave(const kt_fpenv *env) { fesetround((int)env->saved); }
#endif
