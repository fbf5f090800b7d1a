/* ktconvert native library: the public C ABI (loaded from Python with ctypes).
 *
 * Plain functions, plain pointers and sizes, int status codes; no Python objects, no global state visible to the
 * caller. Every function is safe to call from several threads at once on disjoint outputs.
 *
 * ---------------------------------------------------------------------------------------------------------------
 * Run-time ISA dispatch (reuse this for every kernel added to native/)
 * ---------------------------------------------------------------------------------------------------------------
 * Nothing is built with -march flags. ISA-specific functions carry GCC __attribute__((target(...))) and are only
 * called after the CPU (CPUID) *and* the OS (XGETBV/XCR0: saved YMM / ZMM / tile state) were found to support them.
 *
 *   kt_cpu_features()   bit mask of KT_CPU_* features usable on this machine, detected once per process.
 *                       The environment variable KTCONVERT_DISABLE_CPU_FEATURES="avx512bw,avx2,..." (names as in
 *                       kt_cpu_feature_name) removes features from the mask, to exercise the fallbacks on one host.
 *   kt_impl_missing(i)  KT_CPU_* bits that implementation i needs and this machine lacks (0: supported).
 *   kt_select_impl()    the implementation every kernel uses when called with KT_IMPL_AUTO: the best supported one
 *                       (avx512 > avx2 > scalar), unless KTCONVERT_FORCE_IMPL=scalar|avx2|avx512 names another
 *                       ("auto", empty, or "numpy" -- which makes Python use its numpy paths where it has them --
 *                       mean the best one here).
 *                       Returns KT_E_IMPL if the forced one is unsupported (kt_impl_missing says what is missing),
 *                       KT_E_ARG if the variable holds an unknown name. Chosen once per process.
 *   kt_resolve_impl(i)  KT_IMPL_AUTO -> kt_select_impl(); an explicit id -> itself if supported, else KT_E_IMPL.
 *   kt_impl_variant(i)  the kernels a call with i runs ("avx512-vnni", "avx512", "avx2", "scalar"); NULL if none.
 *
 * The choice is made in one place, dispatch.c: a table of implementations, best first, each with the CPU features
 * it needs (with the OS state they use) and the kernels of every family; simdjson's implementation list is the
 * model:
 *   avx512 (variant avx512-vnni)  AVX512F | AVX512BW | AVX512VL | FMA | AVX512VNNI
 *   avx512                        AVX512F | AVX512BW | AVX512VL | FMA
 *   avx2                          AVX2 | FMA | F16C
 *   scalar                        nothing (portable C, the reference)
 * Every implementation gives the same bytes for the converters and decoders; the runtime's sums differ only by
 * fp32 rounding (the VNNI variant sums in integers).
 *
 * Floating point: kernels set MXCSR to round-to-nearest-even with FTZ+DAZ (kt-kernel's mode; off x86 the C99 fenv
 * rounding mode) for the duration of a call and restore the caller's value afterwards, so results never depend on
 * the caller's mode. Denormal handling that a format requires is also done explicitly in the code, so the results
 * would be the same without FTZ/DAZ (they only avoid slow microcode assists).
 */
#ifndef KT_NATIVE_H
#define KT_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KT_API __attribute__((visibility("default")))
#else
#define KT_API
#endif

/* Status codes (0 = success, all errors positive). */
#define KT_OK 0
#define KT_E_SHAPE 1     /* a dimension violates the format's constraints (n % 32, k % 128 / 64, sizes <= 0) */
#define KT_E_NONFINITE 2 /* NaN or Inf in the input; *err_row holds the first offending row */
#define KT_E_IMPL 3      /* the requested / forced implementation is not supported by this CPU + OS */
#define KT_E_ARG 4       /* bad argument: NULL pointer, bits not 4/8, block range, unknown impl name */

/* Implementation ids. */
#define KT_IMPL_AUTO 0
#define KT_IMPL_SCALAR 1
#define KT_IMPL_AVX2 2
#define KT_IMPL_AVX512 3

/* CPU feature bits (usable = CPU reports it and the OS saves the matching register state). */
#define KT_CPU_AVX2 (1 << 0)
#define KT_CPU_FMA (1 << 1)
#define KT_CPU_F16C (1 << 2)
#define KT_CPU_AVX512F (1 << 3)
#define KT_CPU_AVX512BW (1 << 4)
#define KT_CPU_AVX512VL (1 << 5)
#define KT_CPU_AVX512DQ (1 << 6)
#define KT_CPU_AVX512VNNI (1 << 7)
#define KT_CPU_AVX512BF16 (1 << 8)
#define KT_CPU_AMX_TILE (1 << 9) /* CPUID + XCR0 tile bits; the process still needs arch_prctl permission */
#define KT_CPU_AMX_INT8 (1 << 10)
#define KT_CPU_AMX_BF16 (1 << 11)
#define KT_CPU_SHA (1 << 12)      /* SHA extensions (sha256rnds2, ...): native/sha256_multi.c */
#define KT_CPU_NFEATURES 13

/* Library ABI version; bump when a signature changes. */
#define KT_ABI_VERSION 1

KT_API int kt_abi_version(void);

/* ---- dispatch (see above) ---- */
KT_API int kt_cpu_features(void);
KT_API const char *kt_cpu_feature_name(int bit_index); /* "avx2", "avx512bw", ...; NULL when out of range */
KT_API int kt_impl_missing(int impl);                  /* KT_CPU_* mask; -1 for an unknown impl id */
KT_API int kt_impl_best(void);                         /* best supported id, ignoring KTCONVERT_FORCE_IMPL */
KT_API int kt_select_impl(void);                       /* id >= 1, or -KT_E_IMPL / -KT_E_ARG */
KT_API int kt_resolve_impl(int impl);                  /* id >= 1, or -KT_E_IMPL / -KT_E_ARG */
KT_API const char *kt_impl_name(int impl);             /* "scalar" | "avx2" | "avx512"; NULL when unknown */
KT_API const char *kt_impl_variant(int impl);          /* kernels a call with impl runs; NULL when it cannot */

/* The calling thread's flush-to-zero / denormals-are-zero mode. kt-kernel switches both on for the process when it
 * loads (its converter and kernels run that way); numpy code in the same process then silently flushes subnormals.
 * kt_fp_flush_mode() returns 1 when FTZ or DAZ is on; kt_fp_set_flush_mode(on) switches both on or off, keeping the
 * rest of the mode. ktconvert's own kernels set the mode they need per call either way. */
KT_API int kt_fp_flush_mode(void);
KT_API void kt_fp_set_flush_mode(int on);

/* ---- AMXINT4 / AMXINT8 quantize + tile packing (kt-format.md 2.1, 2.2) ----
 *
 * w_bf16  [n, k] BF16 bit patterns, row-major, contiguous (HF [out_features, in_features]); kt_amx_quantize_rows
 *         takes rows `ld` >= k elements apart (a column slice of a wider matrix, read in place).
 * bits    4 (AMXINT4: N_BLOCK 128, codes -7..7, d = fp32(double(amax)/112)) or
 *         8 (AMXINT8: N_BLOCK 64, codes -127..127, d = fp32(amax * fp32(1/127))).
 * impl    KT_IMPL_AUTO or an explicit id (unsupported -> KT_E_IMPL, nothing written).
 * blob    the whole quant blob of the [n, k] matrix: n*k/2 bytes (bits 4) or n*k bytes (bits 8).
 * scales  float32 [n], d per row.
 * Only N-blocks [nblock_begin, nblock_end) are written (blocks of N_BLOCK rows; the last may be shorter), so several
 * threads can fill one blob without overlap; the bytes never depend on how the blocks are split.
 * err_row may be NULL; on KT_E_NONFINITE it receives the first row (global index) holding NaN/Inf. The N-block
 * holding it is left incomplete (its tiles unwritten); earlier N-blocks of the range are complete.
 * Constraints: n > 0, k > 0, n % 32 == 0, k % 128 == 0 (bits 4) or k % 64 == 0 (bits 8), else KT_E_SHAPE.
 */
KT_API int64_t kt_amx_nblock_rows(int bits);           /* 128, 64, or 0 for bad bits */
KT_API int64_t kt_amx_nblocks(int64_t n, int bits);    /* ceil(n / N_BLOCK) */
KT_API int kt_amx_check_shape(int64_t n, int64_t k, int bits); /* KT_OK, KT_E_SHAPE or KT_E_ARG */
KT_API int kt_amx_quantize(const uint16_t *w_bf16, int64_t n, int64_t k, int bits, int impl, uint8_t *blob,
                           float *scales, int64_t nblock_begin, int64_t nblock_end, int64_t *err_row);
KT_API int kt_amx_quantize_rows(const uint16_t *w_bf16, int64_t n, int64_t k, int64_t ld, int bits, int impl,
                                uint8_t *blob, float *scales, int64_t nblock_begin, int64_t nblock_end,
                                int64_t *err_row);

#ifdef __cplusplus
}
#endif

#endif /* KT_NATIVE_H */
