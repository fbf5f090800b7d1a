"""Native decoders of quantized HF inputs (native/quant_decode.c via ktconvert.native.decode) against the numpy
references in ktconvert.quant (fp8.dequant_block, ct_int4.unpack_int32 / dequant, mxfp4.dequant): same bits for
every implementation this CPU runs, on random and adversarial inputs (every e4m3 code and E8M0 exponent, NaN / Inf /
zero / subnormal / huge scales, float16-product overflow and underflow, partial edge blocks, odd group tails), for
any thread count; KTCONVERT_FORCE_IMPL selection; and an end-to-end `ktconvert cpu` of an FP8 model.

The numpy reference needs IEEE mode (no FTZ/DAZ): if a library in this process turned FTZ/DAZ on (kt_kernel does),
the references are computed in a fresh process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ktconvert.native import decode
from ktconvert.quant import ct_int4, fp8, mxfp4

IMPLS = decode.usable_impls()
needs_native = pytest.mark.skipif(not IMPLS, reason="native library not built / not loadable")

# Scale values that stress every path: signed zeros, NaNs with payloads and signs, infinities, float32 subnormals,
# the extremes of the float32 range, and values whose products land on float16 overflow / subnormal boundaries.
SPECIAL_SCALE_BITS = [0x00000000, 0x80000000, 0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF812345, 0x7F800001,
                      0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00400000, 0x00800000,
                      0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x33800000, 0x38800000, 0x477FF000,
                      0x477FE000, 0x3B000000, 0x42000000]


def _ieee_mode() -> bool:
    """False once a library in this process switched on FTZ/DAZ: numpy then flushes subnormal products."""
    tiny = np.array([1e-40, 1e-30], dtype=np.float32)
    return bool(tiny[0] * np.float32(1) != 0 and tiny[1] * np.float32(1e-9) != 0)


def _f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    """float16 bit patterns -> the equal float32 values, built with integer operations only (so the inputs do not
    depend on this process's FTZ/DAZ mode)."""
    h = h.astype(np.uint32)
    sign, e, m = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    out = ((e + 112) << 23) | (m << 13)
    out = np.where(e == 31, 0x7F800000 | (m << 13), out)
    out = np.where(e == 0, 0, out)
    for p in range(10):             # subnormal m * 2^-24 with its top bit at p: exponent p - 24, normalized
        top = (e == 0) & (m >> p == 1)
        out = np.where(top, ((p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFF), out)
    return (sign | out).astype(np.uint32).view(np.float32)


def _scales(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """float32 scales as a decoder receives them after widening from `dtype` (F32, BF16 or F16): random bit
    patterns over the whole range (subnormals, huge values, NaN / Inf) with the special values mixed in; integer
    operations only."""
    size = int(np.prod(shape))
    if dtype == "F16":
        return _f16_bits_to_f32(rng.integers(0, 1 << 16, size, dtype=np.uint32)).reshape(shape)
    bits = rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32)
    pick = rng.random(size) < 0.3
    bits[pick] = np.array(SPECIAL_SCALE_BITS, dtype=np.uint32)[rng.integers(0, len(SPECIAL_SCALE_BITS),
                                                                             int(pick.sum()))]
    if dtype == "BF16":
        bits = (bits >> 16) << 16
    return bits.view(np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------
# Cases: (kind, params); _inputs builds seeded arrays, _decode runs one implementation ("numpy" is the reference).

FP8_CASES = [(n, k, block, sdtype, prod) for (n, k, block) in [(256, 384, (128, 128)), (200, 300, (128, 128)),
                                                               (37, 100, (7, 33)), (64, 96, (1, 96)),
                                                               (40, 70, (40, 70)), (20, 23, (3, 1)),
                                                               (48, 64, (16, 16))]
             for sdtype, prod in [("F32", "f32"), ("BF16", "f32"), ("F16", "f32"), ("F16", "f16")]]
CT_CASES = [(bits, n, k, strategy, group, zp, prod) for bits in (4, 8, 2)
            for (n, k, strategy, group) in [(24, 512, "group", 32), (24, 512, "group", 64),
                                            (24, 512, "group", 128), (17, 100, "channel", None),
                                            (9, 200, "tensor", None)]
            for zp in (False, True) for prod in ("f32", "f16")]
MX_CASES = [(n, groups) for (n, groups) in [(16, 16), (9, 3)]]


def _inputs(kind: str, params: tuple, seed: int = 0) -> dict:
    rng = np.random.default_rng([seed, zlib.crc32(repr((kind, params)).encode())])
    if kind == "fp8":
        n, k, block, sdtype, _ = params
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)            # every code, NaNs included
        return {"codes": codes, "scale": _scales(rng, fp8.block_scale_shape(n, k, block), sdtype)}
    if kind == "ct":
        bits, n, k, strategy, group, zp, _ = params
        packed = rng.integers(-2**31, 2**31, (n, ct_int4.packed_cols(k, bits)), dtype=np.int64).astype(np.int32)
        shape = {"group": (n, k // (group or 1)), "channel": (n, 1), "tensor": (1,)}[strategy]
        half = 1 << (bits - 1)
        arrays = {"packed": packed, "scale": _scales(rng, shape, "F16" if prod_is_f16(params) else "F32")}
        if zp:
            arrays["zero_point"] = rng.integers(-half, half, shape, dtype=np.int64).astype(np.int8)
        return arrays
    n, groups = params
    scales = rng.integers(0, 256, (n, groups), dtype=np.uint8)
    scales.reshape(-1)[:256] = np.arange(min(256, scales.size), dtype=np.uint8)   # every E8M0 exponent
    return {"blocks": rng.integers(0, 256, (n, groups, 16), dtype=np.uint8), "scales": scales}


def prod_is_f16(params: tuple) -> bool:
    return params[-1] == "f16"


def _decode(kind: str, params: tuple, arrays: dict, impl: str, threads: int = 1, fused: bool = True) -> np.ndarray:
    prod = np.float16 if kind != "mx" and prod_is_f16(params) else np.float32
    if kind == "fp8":
        return fp8.dequant_block(arrays["codes"], arrays["scale"], params[2], product_dtype=prod, impl=impl,
                                 threads=threads)
    if kind == "ct":
        bits, n, k, _, group, _, _ = params
        zp = arrays.get("zero_point")
        if fused:
            return ct_int4.dequant_packed(arrays["packed"], k, bits, arrays["scale"], group, zp, product_dtype=prod,
                                          impl=impl, threads=threads)
        q = ct_int4.unpack_int32(arrays["packed"], k, bits, impl=impl)
        return ct_int4.dequant(q, arrays["scale"], group, zp, product_dtype=prod, impl=impl, threads=threads)
    return mxfp4.dequant(arrays["blocks"], arrays["scales"], impl=impl, threads=threads)


ALL_CASES = [("fp8", p) for p in FP8_CASES] + [("ct", p) for p in CT_CASES] + [("mx", p) for p in MX_CASES]


def _all_references() -> dict[int, np.ndarray]:
    with np.errstate(all="ignore"):
        return {i: _decode(kind, params, _inputs(kind, params), "numpy") for i, (kind, params) in enumerate(ALL_CASES)}


_REFERENCE_SCRIPT = """import importlib.util, sys, numpy as np
spec = importlib.util.spec_from_file_location("ndt", sys.argv[1]); mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
refs = mod._all_references()
np.savez(sys.argv[2], **{str(i): a for i, a in refs.items()})
"""


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, np.ndarray]:
    """numpy's BF16 bits for every case, computed in IEEE mode (a fresh process when this one has FTZ/DAZ on)."""
    if _ieee_mode():
        return _all_references()
    out = tmp_path_factory.mktemp("ref") / "refs.npz"
    subprocess.run([sys.executable, "-c", _REFERENCE_SCRIPT, __file__, str(out)], check=True)
    with np.load(out) as data:
        return {int(i): data[i] for i in data.files}


def _fp8_both_nan(params: tuple, arrays: dict) -> np.ndarray:
    """bool [n, k]: e4m3 NaN code (0x7F / 0xFF) under a NaN scale."""
    n, k, (bn, bk) = params[0], params[1], params[2]
    scale_nan = np.isnan(arrays["scale"])
    per_element = np.repeat(np.repeat(scale_nan, bn, axis=0), bk, axis=1)[:n, :k]
    return ((arrays["codes"] & 0x7F) == 0x7F) & per_element


def _mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    if not bad.size:
        return "equal"
    r, c = bad[0]
    return f"{len(bad)} values differ; first at [{r}, {c}]: native {got[r, c]:#06x}, numpy {want[r, c]:#06x}"


# ---------------------------------------------------------------------------------------------------------------
# Bit identity, every implementation, every case


@needs_native
@pytest.mark.parametrize("case", range(len(ALL_CASES)), ids=[f"{k}-{p}" for k, p in ALL_CASES])
def test_native_equals_numpy(case, references):
    kind, params = ALL_CASES[case]
    arrays = _inputs(kind, params)
    want = references[case]
    assert want.dtype == np.uint16 and want.ndim == 2
    both_nan = _fp8_both_nan(params, arrays) if kind == "fp8" else None
    if both_nan is not None:
        # NaN code times NaN scale: numpy's multiply returns one operand's NaN or the other's depending on its
        # inner loop (broadcast, tail lanes), so only "a NaN" is defined there; native always gives the code's.
        assert ((want[both_nan] & 0x7F80) == 0x7F80).all() and (want[both_nan] & 0x7F).all()
        want = np.where(both_nan, np.uint16(0x7FC0), want)
    for impl in IMPLS:
        got = _decode(kind, params, arrays, impl)
        assert got.dtype == np.uint16 and got.shape == want.shape
        assert np.array_equal(got, want), f"{impl}: {_mismatch(got, want)}"
    if kind == "ct":   # the two-step route (native unpack, then native dequant of int8 values) too
        got = _decode(kind, params, arrays, IMPLS[-1], fused=False)
        assert np.array_equal(got, want), f"{IMPLS[-1]} unfused: {_mismatch(got, want)}"


@needs_native
@pytest.mark.parametrize("bits, k", [(4, 512), (4, 100), (4, 7), (8, 61), (2, 77)])
def test_unpack_equals_numpy(bits, k):
    rng = np.random.default_rng(bits * 1000 + k)
    packed = rng.integers(-2**31, 2**31, (13, ct_int4.packed_cols(k, bits)), dtype=np.int64).astype(np.int32)
    want = ct_int4.unpack_int32(packed, k, bits, impl="numpy")
    for impl in IMPLS:
        assert np.array_equal(ct_int4.unpack_int32(packed, k, bits, impl=impl), want), impl


@needs_native
@pytest.mark.parametrize("kind, params", [("fp8", FP8_CASES[3]), ("ct", CT_CASES[2]), ("mx", MX_CASES[0])])
def test_threads_do_not_change_bytes(kind, params, monkeypatch):
    monkeypatch.setattr(decode, "MIN_ELEMENTS_PER_THREAD", 1)     # split even these small matrices
    arrays = _inputs(kind, params)
    with np.errstate(all="ignore"):
        one = _decode(kind, params, arrays, IMPLS[-1], threads=1)
        for threads in (2, 3, 7):
            assert np.array_equal(_decode(kind, params, arrays, IMPLS[-1], threads=threads), one), threads


# ---------------------------------------------------------------------------------------------------------------
# An independent check of the element formulas (spec of e4m3fn, BF16 RNE) on all 256 codes


def _f32_bits_exact(x: Fraction, negative: bool) -> int:
    """float32 bit pattern of the exact rational (-1)^negative * x (x >= 0), round-to-nearest-even, with
    subnormals and overflow to Inf (integer arithmetic only)."""
    sign = 0x80000000 if negative else 0
    if x == 0:
        return sign
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    e = max(e, -126)                                     # below 2^-126: subnormal steps of 2^-149
    q = x / Fraction(2) ** (e - 23)                      # significand scaled to an integer part of 24 bits
    n, rem = divmod(q.numerator, q.denominator)
    if 2 * rem > q.denominator or (2 * rem == q.denominator and n & 1):
        n += 1
    if n == 1 << 24:
        n, e = n >> 1, e + 1
    if e > 127:
        return sign | 0x7F800000
    return sign | (n if n < 1 << 23 else ((e + 127) << 23) | (n - (1 << 23)))


def _bf16_rne_bits(u: int) -> int:
    return (u >> 16) | 0x40 if (u & 0x7FFFFFFF) > 0x7F800000 else ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _e4m3_magnitude(code: int) -> Fraction | None:
    """|value| of an e4m3fn code: 4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal; S.1111.111 is
    NaN (None)."""
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return None
    return Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)


@needs_native
@pytest.mark.parametrize("scale_bits", [0x3F800000, 0xBEC00000, 0x00000200, 0x7F61B1E6, 0x00012345])
def test_fp8_matches_format_definition(scale_bits):
    """All 256 codes times one scale (1, -0.375, 2^-140, ~3e38, a subnormal) against exact rational arithmetic."""
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scale = np.array([[scale_bits]], dtype=np.uint32).view(np.float32)
    got = fp8.dequant_block(codes, scale, (128, 128), impl=IMPLS[-1])
    e, m = scale_bits >> 23 & 0xFF, scale_bits & 0x7FFFFF
    s = Fraction(m, 1 << 23) * Fraction(2) ** -126 if e == 0 else (1 + Fraction(m, 1 << 23)) * Fraction(2) ** (e - 127)
    want = [0x7FC0 if _e4m3_magnitude(c) is None else
            _bf16_rne_bits(_f32_bits_exact(_e4m3_magnitude(c) * s, bool(c >> 7) != bool(scale_bits >> 31)))
            for c in range(256)]
    assert got.reshape(-1).tolist() == want


# ---------------------------------------------------------------------------------------------------------------
# Selection: automatic, numpy forced, each ISA forced through KTCONVERT_FORCE_IMPL in a fresh process


def test_force_numpy_routes_to_numpy(monkeypatch):
    monkeypatch.setenv("KTCONVERT_FORCE_IMPL", "numpy")
    assert decode.route(None) is None and decode.route("numpy") is None and not decode.usable()
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = fp8.dequant_block(codes, np.ones((1, 1), np.float32), (16, 16))
    assert out[0, 8] == 0x3C80 and out[3, 8] == 0x3F80 and out[7, 15] == 0x7FC0   # 2^-6, 1.0, NaN


_FORCED_SCRIPT = """import sys, numpy as np
from ktconvert import native
from ktconvert.quant import fp8, mxfp4
rng = np.random.default_rng(5)
codes = rng.integers(0, 256, (130, 257), dtype=np.uint8)
scale = (rng.standard_normal((2, 3)) * 1e-3).astype(np.float32)
blocks = rng.integers(0, 256, (33, 4, 16), dtype=np.uint8)
e8 = rng.integers(0, 256, (33, 4), dtype=np.uint8)
print(native.implementation())
np.savez(sys.argv[1], fp8=fp8.dequant_block(codes, scale, (128, 128)), mx=mxfp4.dequant(blocks, e8))
"""


@needs_native
def test_force_impl_env_selects_each_isa(tmp_path):
    """KTCONVERT_FORCE_IMPL picks the implementation the automatic route runs; all give numpy's bytes."""
    results = {}
    for impl in ["numpy"] + IMPLS:
        out = tmp_path / f"{impl}.npz"
        env = {**os.environ, "KTCONVERT_FORCE_IMPL": impl}
        proc = subprocess.run([sys.executable, "-c", _FORCED_SCRIPT, str(out)], env=env, check=True,
                              capture_output=True, text=True)
        assert proc.stdout.split()[-1] == ("None" if impl == "numpy" else impl)
        with np.load(out) as data:
            results[impl] = {name: data[name] for name in data.files}
    for impl in IMPLS:
        for name, want in results["numpy"].items():
            assert np.array_equal(results[impl][name], want), f"{impl} {name}"


# ---------------------------------------------------------------------------------------------------------------
# End to end: `ktconvert cpu` of a tiny FP8 model gives the same bytes with numpy decoding and native decoding


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@needs_native
def test_cli_fp8_numpy_and_native_identical(tiny_model, tmp_path):
    model = tiny_model("deepseek_v3", dtype="fp8")
    outs = {}
    for label, force in (("numpy", "numpy"), ("native", "")):
        env = {**os.environ, "KTCONVERT_FORCE_IMPL": force}
        out = tmp_path / label
        subprocess.run([sys.executable, "-c", "from ktconvert.cli.main import main; main()", "cpu", str(model),
                        str(out), "--method", "bf16", "--threads", "2"], env=env, check=True, capture_output=True)
        outs[label] = _tree_bytes(out)
    assert outs["numpy"].keys() == outs["native"].keys() and any(k.endswith(".safetensors") for k in outs["native"])
    differing = [name for name in outs["numpy"] if outs["numpy"][name] != outs["native"][name]]
    assert not differing, f"files differ between numpy and native decoding: {differing}"
