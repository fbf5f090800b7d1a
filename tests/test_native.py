"""Native AMXINT4/AMXINT8 quantizer: every implementation this CPU runs is byte-identical to a per-element
reference written here from kt-format.md 2.1/2.2 (and to ktconvert.quant.amx_rows + layouts.tiles), on random and
adversarial matrices, for 1, 2 and 3 threads; plus errors, dispatch and the KTCONVERT_FORCE_IMPL contract.

Set KTCONVERT_REQUIRE_NATIVE=1 (CI) to fail instead of skip when the library is not built.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ktconvert import native
from ktconvert.errors import NativeError, NumericError, ShapeError

if native.lib() is None and not os.environ.get("KTCONVERT_REQUIRE_NATIVE"):
    pytest.skip(f"native library unavailable: {native.load_error()}", allow_module_level=True)


def _supported_impls() -> list[str]:
    handle = native.lib()
    return [name for name in ("scalar", "avx2", "avx512") if handle.kt_impl_missing(native.IMPL_IDS[name]) == 0]


IMPLS = _supported_impls()
F32_MIN_NORMAL = np.float32(2.0**-126)


# ---------------------------------------------------------------- reference from the spec (kt-format.md 2.1 / 2.2)

def spec_codes(w_bits: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """uint16 [n, k] -> (codes int8 [n, k], d float32 [n]), formulas of kt-format.md 2.1/2.2 taken literally."""
    x = (w_bits.astype(np.uint32) << 16).view(np.float32).copy()
    x[(w_bits & 0x7F80) == 0] = 0.0                                   # subnormal inputs read as 0
    amax = np.abs(x).max(axis=1)
    if bits == 4:
        d = (amax.astype(np.float64) / 112.0).astype(np.float32)
    else:
        d = amax * np.float32(1.0 / 127.0)                            # fp32 product with fp32(1/127)
    d = np.where(d < F32_MIN_NORMAL, np.float32(0), d).astype(np.float32)
    inv = np.zeros_like(d)
    inv[d != 0] = np.float32(1.0) / d[d != 0]
    q = np.clip(np.rint(x * inv[:, None]), -128, 127)                 # rint: round half to even
    if bits == 4:
        q = np.sign(q) * np.floor((np.abs(q) + 8) / 16)
    return q.astype(np.int8), d


def spec_blob(codes: np.ndarray, bits: int) -> np.ndarray:
    """int8 [n, k] -> uint8 blob, every element placed by the byte formula of kt-format.md 2.1/2.2."""
    n, k = codes.shape
    r = np.arange(n)[:, None]
    c = np.arange(k)[None, :]
    n_block, tile_k = (128, 128) if bits == 4 else (64, 64)
    nb0 = r // n_block * n_block
    nbs = np.minimum(n_block, n - nb0)
    kb0 = c // 3584 * 3584
    kbs = np.minimum(3584, k - kb0)
    r1 = r - nb0
    s0, rr = r1 // 32 * 32, r1 % 32
    c1 = c - kb0
    t0, cc = c1 // tile_k * tile_k, c1 % tile_k
    tile = nb0 * k + kb0 * nbs + s0 * kbs + t0 * 32
    j = cc % 64
    inner = (rr // 16) * 1024 + (j // 4) * 64 + (rr % 16) * 4 + j % 4
    if bits == 8:
        blob = np.zeros(n * k, np.uint8)
        blob[(tile + inner).ravel()] = codes.view(np.uint8).ravel()
        return blob
    byte = (tile // 2 + inner).ravel()
    nibble = (codes.astype(np.uint8) & 0xF).ravel()
    high = np.broadcast_to(cc >= 64, codes.shape).ravel()
    low_part, high_part = np.zeros(n * k // 2, np.uint8), np.zeros(n * k // 2, np.uint8)
    low_part[byte[~high]] = nibble[~high]
    high_part[byte[high]] = nibble[high]
    return low_part | (high_part << 4)


# ---------------------------------------------------------------- test matrices (BF16 bit patterns)

def bf16(x) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even (NaN not expected here)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def heavy_tailed(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0) ** rng.uniform(-4, 1, size=(n, 1)).astype(np.float32)
    return bf16(rng.standard_t(2.5, size=(n, k)).astype(np.float32) * scale)


def adversarial(n: int, k: int, seed: int) -> np.ndarray:
    """Rows with special structure, cycled over n rows (n % 32 == 0)."""
    rng = np.random.default_rng(seed)
    base = heavy_tailed(n, k, seed)
    rows = []
    tiny = np.arange(1, k + 1, dtype=np.uint16) % 0x7F                        # subnormal bit patterns
    for i in range(n):
        kind = i % 12
        row = base[i].copy()
        if kind == 0:
            row[:] = 0                                                        # zero row
        elif kind == 1:
            row[:] = bf16(np.float32(-0.375))                                 # constant row
        elif kind == 2:
            row[rng.integers(k)] = bf16(np.float32(3.0e38))                   # one huge outlier
        elif kind == 3:
            row[:] = tiny | (rng.integers(0, 2, k, dtype=np.uint16) << 15)   # subnormals only (+/-): amax reads 0
        elif kind == 4:
            row[::2] = 0x8000                                                 # -0 and +0 mixed in
            row[1::4] = 0
        elif kind == 5:                                                       # d exactly 2^-126 (INT4), subnormals
            row[:] = tiny
            row[0] = bf16(np.float32(112.0 * 2.0**-126))
            row[1] = bf16(np.float32(2.0**-126))
        elif kind == 6:                                                       # d would be subnormal -> 0
            row[:] = tiny
            row[0] = bf16(np.float32(100.0 * 2.0**-126))
            row[1] = bf16(np.float32(-2.0**-126))
        elif kind == 7:                                                       # largest finite BF16
            row[rng.integers(k)] = 0x7F7F
            row[rng.integers(k)] = 0xFF7F
        elif kind == 8:                                                       # exact halves on a power-of-2 grid
            row[:] = bf16(rng.integers(-224, 225, k).astype(np.float32) * np.float32(0.5 * 2.0**-10))
            row[0] = bf16(np.float32(112.0 * 2.0**-10))
        elif kind == 9:                                                       # INT8 d just normal, subnormals
            row[:] = tiny | (rng.integers(0, 2, k, dtype=np.uint16) << 15)   # would give codes +/-1 unflushed
            row[0] = bf16(np.float32(2.0**-119))
        rows.append(row)
    return np.stack(rows)


def exhaustive_rows(amax: float, k: int, seed: int) -> np.ndarray:
    """Every BF16 value with |x| <= amax (subnormals and +/-0 included), shuffled, one amax per row, n % 32 == 0."""
    amax_bits = int(bf16(np.float32(amax)))
    mags = np.arange(0, amax_bits + 1, dtype=np.uint16)
    values = np.concatenate([mags, mags | np.uint16(0x8000)])
    np.random.default_rng(seed).shuffle(values)
    per_row = k - 1
    n = -(-len(values) // per_row)
    n = -(-n // 32) * 32
    out = np.zeros((n, k), np.uint16)
    out[:, 0] = amax_bits
    flat = out[:, 1:].reshape(-1)
    flat[: len(values)] = values
    out[:, 1:] = flat.reshape(n, per_row)
    return out


CASES = {
    # several N-blocks for both widths (INT4: 128+128+32, INT8: 64*4+32), K > 3584 with a 256-column tail
    "heavy_tailed": lambda: heavy_tailed(288, 3840, 1),
    "adversarial": lambda: adversarial(192, 3584 + 128, 2),
    "exhaustive_1.0": lambda: exhaustive_rows(1.0, 2048, 3),
    "exhaustive_tiny": lambda: exhaustive_rows(2.0**-119, 1024, 4),      # d normal for both widths
}


@pytest.fixture(scope="module")
def matrices() -> dict[str, np.ndarray]:
    return {name: make() for name, make in CASES.items()}


@pytest.fixture(scope="module")
def references(matrices) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    out = {}
    for name, w in matrices.items():
        for bits in (4, 8):
            codes, d = spec_codes(w, bits)
            out[name, bits] = spec_blob(codes, bits), d
    return out


# ---------------------------------------------------------------- byte identity

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_equal_spec_reference(matrices, references, case, bits, impl):
    want_blob, want_d = references[case, bits]
    for threads in (1, 2, 3):
        blob, d = native.amx_quantize(matrices[case], bits, threads=threads, impl=impl)
        assert blob.dtype == np.uint8 and blob.shape == want_blob.shape
        np.testing.assert_array_equal(d.view(np.uint32), want_d.view(np.uint32))
        mismatch = np.flatnonzero(blob != want_blob)
        assert mismatch.size == 0, f"{mismatch.size} bytes differ, first at {mismatch[:5]} ({threads} threads)"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [4, 8])
def test_column_slice_read_in_place_equals_spec_reference(matrices, impl, bits):
    """A down projection's NUMA part is a column slice of its [H, I] matrix: rows lie I apart. It is read in place
    (no copy) and gives the spec's bytes of the same columns."""
    w = matrices["adversarial"]
    k = w.shape[1] // 2 // 128 * 128
    for part in (w[:, :k], w[:, w.shape[1] - k:]):
        assert not part.flags.c_contiguous
        codes, want_d = spec_codes(np.ascontiguousarray(part), bits)
        for threads in (1, 3):
            blob, d = native.amx_quantize(part, bits, threads=threads, impl=impl)
            np.testing.assert_array_equal(d.view(np.uint32), want_d.view(np.uint32))
            np.testing.assert_array_equal(blob, spec_blob(codes, bits))


def test_reference_is_not_trivial(matrices, references):
    """The cases exercise what they claim: ties, flushed scales, all code values, the sign of -7."""
    w = matrices["adversarial"]
    codes4, d4 = spec_codes(w, 4)
    assert (d4 == 0).sum() >= 3 * (w.shape[0] // 12)           # zero / subnormal-only / subnormal-scale rows
    assert d4[5] == F32_MIN_NORMAL and (codes4[5, 2:] == 0).all()  # subnormal inputs flushed in a 2^-126 row
    assert set(np.unique(codes4)) == set(range(-7, 8))
    codes8, _ = spec_codes(matrices["exhaustive_1.0"], 8)
    assert set(np.unique(codes8)) == set(range(-127, 128))
    x = (matrices["adversarial"][8].astype(np.uint32) << 16).view(np.float32)
    assert np.any(np.abs(x * np.float32(2.0**10) % 1) == 0.5)  # exact .5 ties present


def test_matches_numpy_reference_module(matrices, references):
    """The same bytes as ktconvert.quant.amx_rows + ktconvert.layouts.tiles (derived independently from the spec)."""
    amx = pytest.importorskip("ktconvert.quant.amx_rows")
    tiles = pytest.importorskip("ktconvert.layouts.tiles")
    for case in ("heavy_tailed", "adversarial"):
        w = matrices[case]
        for bits, quant, pack in ((4, amx.quantize_int4_rows, tiles.pack_int4),
                                  (8, amx.quantize_int8_rows, tiles.pack_int8)):
            codes, d = quant(w)
            blob, scale = native.amx_quantize(w, bits, threads=2)
            np.testing.assert_array_equal(blob, pack(codes))
            np.testing.assert_array_equal(scale.view(np.uint32), d.view(np.uint32))


def test_concurrent_callers_and_more_threads_than_blocks(matrices, references):
    """Several Python threads quantizing at once through the shared pool, with 1..8 threads (> N-blocks)."""
    from concurrent.futures import ThreadPoolExecutor
    w = matrices["adversarial"]
    want_blob, _ = references["adversarial", 8]
    with ThreadPoolExecutor(4) as callers:
        results = list(callers.map(lambda t: native.amx_quantize(w, 8, threads=t)[0], [1, 2, 3, 8] * 2))
    for blob in results:
        np.testing.assert_array_equal(blob, want_blob)


def test_caller_rounding_mode_does_not_matter(matrices, references):
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    fe_upward = 0x800 if os.uname().machine in ("x86_64", "i686") else None
    if fe_upward is None:
        pytest.skip("FE_UPWARD value known for x86 only")
    w = matrices["heavy_tailed"]
    want_blob, want_d = references["heavy_tailed", 4]
    for impl in IMPLS:
        assert libm.fesetround(fe_upward) == 0
        try:
            blob, d = native.amx_quantize(w, 4, threads=1, impl=impl)   # runs in this thread
        finally:
            libm.fesetround(0)
        np.testing.assert_array_equal(blob, want_blob)
        np.testing.assert_array_equal(d.view(np.uint32), want_d.view(np.uint32))


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 3])
def test_nonfinite_names_first_row(impl, threads):
    w = heavy_tailed(320, 256, 5)
    w[250, 7] = 0x7FC0          # NaN in a late N-block
    w[70, 9] = 0xFF80           # -Inf earlier: this one is reported
    for bits in (4, 8):
        with pytest.raises(NumericError, match=r"first Inf at row 70, column 9") as info:
            native.amx_quantize(w, bits, threads=threads, impl=impl, name="blk.3.ffn_up_exps.5")
        assert "blk.3.ffn_up_exps.5" in str(info.value) and "2 non-finite" in str(info.value)
    w[3, 0] = 0x7F81            # signalling-NaN pattern in the first block
    with pytest.raises(NumericError, match=r"first NaN at row 3, column 0"):
        native.amx_quantize(w, 8, threads=threads, impl=impl)


@pytest.mark.parametrize("shape,bits,dtype", [
    ((48, 128), 4, np.uint16),     # n % 32
    ((64, 192), 4, np.uint16),     # k % 128 for INT4
    ((64, 96), 8, np.uint16),      # k % 64 for INT8
    ((0, 128), 8, np.uint16),
    ((64, 128), 4, np.float32),    # not BF16 bits
    ((64, 128), 6, np.uint16),     # bit width
])
def test_bad_shape_raises(shape, bits, dtype):
    with pytest.raises(ShapeError, match=r"expected"):
        native.amx_quantize(np.zeros(shape, dtype), bits, name="t")


def test_c_entry_checks_again():
    """The C function re-checks shapes, block ranges and impl ids (the Python checks are not the only guard), and
    ctypes checks the arrays' dtype and contiguity (np.ctypeslib.ndpointer signatures)."""
    handle = native.amx_lib()
    w = np.zeros((64, 128), np.uint16)
    blob, scale, err = np.zeros(64 * 128, np.uint8), np.zeros(64, np.float32), np.zeros(1, np.int64)

    def call(n, k, bits, impl, begin, end):
        return handle.kt_amx_quantize(w, n, k, bits, impl, blob, scale, begin, end, err)
    assert call(64, 128, 8, 0, 0, 1) == native.KT_OK
    assert call(48, 128, 8, 0, 0, 1) == native.KT_E_SHAPE
    assert call(64, 100, 8, 0, 0, 1) == native.KT_E_SHAPE
    assert call(64, 128, 5, 0, 0, 1) == native.KT_E_ARG
    assert call(64, 128, 8, 0, 0, 2) == native.KT_E_ARG       # only one N-block of 64 rows
    assert call(64, 128, 8, 0, 1, 0) == native.KT_E_ARG
    assert call(64, 128, 8, 9, 0, 1) == native.KT_E_ARG       # unknown impl id
    raw = handle["kt_amx_quantize"]                            # a second, unchecked binding: NULL reaches C
    raw.restype = ctypes.c_int
    raw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    assert raw(None, 64, 128, 8, 0, blob.ctypes.data, scale.ctypes.data, 0, 1, None) == native.KT_E_ARG
    with pytest.raises(ctypes.ArgumentError):                 # wrong dtype / not contiguous: refused by ctypes
        handle.kt_amx_quantize(w.view(np.int16), 64, 128, 8, 0, blob, scale, 0, 1, err)
    with pytest.raises(ctypes.ArgumentError):
        handle.kt_amx_quantize(np.zeros((64, 256), np.uint16)[:, ::2], 64, 128, 8, 0, blob, scale, 0, 1, err)
    w[40, 3] = 0x7F80
    assert call(64, 128, 8, 1, 0, 1) == native.KT_E_NONFINITE and err[0] == 40


# ---------------------------------------------------------------- dispatch

def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KTCONVERT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60)


_PROBE = ("from ktconvert import native\n"
          "try:\n    print(native.implementation())\n"
          "except Exception as exc:\n    print(type(exc).__name__, exc)\n")


def test_default_is_best_supported():
    if not os.environ.get("KTCONVERT_FORCE_IMPL"):
        assert native.implementation() == IMPLS[-1]
    if not os.environ.get("KTCONVERT_DISABLE_CPU_FEATURES"):   # the child runs without this process's KTCONVERT_*
        assert _run_python(_PROBE).stdout.strip() == IMPLS[-1]


@pytest.mark.parametrize("impl", IMPLS)
def test_force_supported_impl(impl):
    assert _run_python(_PROBE, KTCONVERT_FORCE_IMPL=impl).stdout.strip() == impl


def test_force_unknown_impl_errors():
    out = _run_python(_PROBE, KTCONVERT_FORCE_IMPL="sse9").stdout
    assert out.startswith("NativeError") and "sse9" in out


def test_force_unsupported_impl_names_missing_feature():
    """Simulate a CPU without AVX-512BW / AVX2: the best choice drops, forcing it names the missing feature."""
    out = _run_python(_PROBE, KTCONVERT_FORCE_IMPL="avx512", KTCONVERT_DISABLE_CPU_FEATURES="avx512bw").stdout
    # the missing features are listed together: "lacks avx512bw", or on a CPU without AVX-512 "lacks avx512f, ..."
    assert out.startswith("NativeError") and re.search(r"lacks [a-z0-9, ]*avx512bw", out), out
    assert "KTCONVERT_FORCE_IMPL=avx512" in out
    if "avx2" in IMPLS:
        assert _run_python(_PROBE, KTCONVERT_DISABLE_CPU_FEATURES="avx512f").stdout.strip() == "avx2"
    code = ("from ktconvert import native\nimport numpy as np\n"
            "print(native.implementation())\n"
            "try:\n    native.amx_quantize(np.zeros((32, 128), np.uint16), 4, impl='avx2')\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    lines = _run_python(code, KTCONVERT_DISABLE_CPU_FEATURES="avx2,avx512f").stdout.splitlines()
    assert lines[0] == "scalar" and lines[1].startswith("NativeError") and "lacks avx2" in lines[1]


@pytest.mark.parametrize("impl", [i for i in ("avx2", "avx512") if i not in IMPLS])
def test_unsupported_impl_on_this_cpu_errors(impl):
    with pytest.raises(NativeError, match="lacks"):
        native.amx_quantize(np.zeros((32, 128), np.uint16), 4, impl=impl)


def test_no_native_env_hides_library():
    code = "from ktconvert import native\nprint(native.available(), native.implementation(), native.lib() is None)"
    assert _run_python(code, KTCONVERT_NO_NATIVE="1").stdout.strip() == "False None True"
    # "numpy" steers callers to their numpy paths, but the library stays loadable for other kernels
    assert _run_python(code, KTCONVERT_FORCE_IMPL="numpy").stdout.strip() == "False None False"


def test_cpu_features_are_consistent():
    features = native.cpu_features()
    if "avx512" in IMPLS:
        assert {"avx512f", "avx512bw", "avx512vl"} <= set(features)
    if "avx2" in IMPLS:
        assert "avx2" in features


def test_one_table_decides_every_family():
    """dispatch.c's table: each row's features decide every kernel family at once (quantizer, decoders, runtime)."""
    code = ("from ktconvert import native\nfrom ktconvert.native import forward\n"
            "print(native.implementation(), native.variant(), forward.variant())\n"
            "try:\n    native.resolve_impl('avx2')\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    if "avx512" in IMPLS and "avx512vnni" in native.cpu_features():
        out = _run_python(code, KTCONVERT_DISABLE_CPU_FEATURES="avx512vnni").stdout.split()
        assert out[:3] == ["avx512", "avx512", "avx512"]
        assert _run_python(code).stdout.split()[:3] == ["avx512", "avx512-vnni", "avx512-vnni"]
    if "avx2" in IMPLS:
        out = _run_python(code, KTCONVERT_DISABLE_CPU_FEATURES="avx512f,f16c").stdout.splitlines()
        assert out[0] == "scalar scalar scalar"          # the avx2 row needs F16C for every family, not only decode
        assert out[1].startswith("NativeError") and "lacks f16c" in out[1]
