"""AMXINT4/AMXINT8 per-row quantization against a slow per-element reference written here from kt-format.md §2.1/§2.2.

The reference uses only Python floats and ``struct`` (fp32 rounding = pack/unpack of a C float, both round to
nearest even), never numpy arithmetic, so it shares no code path with ktconvert.quant.amx_rows.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from ktconvert.errors import NumericError, ShapeError, UnknownNameError
from ktconvert.layouts import tiles
from ktconvert.quant import amx_rows as amx
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktconvert.methods import METHODS
from ktconvert.methods.amx import AmxInt4, AmxInt8
from ktkernel_util import ADVERSARIAL_KINDS, adversarial_bf16, heavy_tailed_bf16

MIN_NORMAL = 2.0 ** -126


# ----------------------------------------------------------------------------------------------------------------
# slow reference, straight from the spec


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_value(bits: int) -> float:
    """BF16 bits -> value; a subnormal (exponent 0) reads as 0 (kt-kernel runs with DAZ)."""
    if (bits >> 7) & 0xFF == 0:
        return 0.0
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def ref_quant_row(row_bits, bits: int):
    """One row -> (codes list, d) per kt-format.md: d, inv = 1/d in fp32, q = sat8(rint_even(fp32(x*inv)))."""
    xs = [bf16_value(int(b)) for b in row_bits]
    amax = max(abs(x) for x in xs)
    d = f32(amax / 112.0) if bits == 4 else f32(amax * f32(1.0 / 127.0))
    if d < MIN_NORMAL:
        d = 0.0
    inv = f32(1.0 / d) if d != 0.0 else 0.0
    codes = []
    for x in xs:
        q = round(f32(x * inv))          # Python's round() is round-half-even
        q = max(-128, min(127, q))
        if bits == 4:
            sign = 1 if q > 0 else -1 if q < 0 else 0
            q = sign * ((abs(q) + 8) // 16)
        codes.append(q)
    return codes, d


def ref_quant(w_bits: np.ndarray, bits: int):
    rows = [ref_quant_row(r, bits) for r in w_bits.tolist()]
    return np.array([c for c, _ in rows], np.int64), np.array([d for _, d in rows], np.float64)


def _assert_same(w_bits: np.ndarray, bits: int) -> None:
    fast = amx.quantize_int4_rows if bits == 4 else amx.quantize_int8_rows
    codes, d = fast(w_bits)
    ref_codes, ref_d = ref_quant(w_bits, bits)
    assert codes.dtype == np.int8 and d.dtype == np.float32
    bad_rows = np.flatnonzero((codes != ref_codes).any(axis=1) | (d.astype(np.float64) != ref_d))
    assert bad_rows.size == 0, f"{bad_rows.size} rows differ, first {bad_rows[0]}: d {d[bad_rows[0]]!r} " \
                               f"vs {ref_d[bad_rows[0]]!r}"


# ----------------------------------------------------------------------------------------------------------------
# fast path == slow reference


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adversarial_rows_match_reference(bits, seed):
    rng = np.random.default_rng(seed)
    w = adversarial_bf16(rng, 3 * ADVERSARIAL_KINDS, 256)
    _assert_same(w, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_random_and_heavy_tailed_match_reference(bits):
    rng = np.random.default_rng(7)
    _assert_same(f32_to_bf16_bits(rng.standard_normal((16, 384)).astype(np.float32)), bits)
    _assert_same(heavy_tailed_bf16(rng, (16, 384)), bits)
    _assert_same(rng.integers(0, 1 << 16, (8, 256), dtype=np.uint16) & np.uint16(0xBF7F), bits)  # any finite bits


def test_ties_are_exercised_by_the_adversarial_rows():
    """Non-vacuity: the adversarial set really produces exact .5 products for both methods."""
    rng = np.random.default_rng(0)
    w = adversarial_bf16(rng, 2 * ADVERSARIAL_KINDS, 256)
    for bits in (4, 8):
        ties = 0
        for row in w.tolist():
            xs = [bf16_value(b) for b in row]
            amax = max(abs(x) for x in xs)
            d = f32(amax / 112.0) if bits == 4 else f32(amax * f32(1.0 / 127.0))
            if d >= MIN_NORMAL:
                inv = f32(1.0 / d)
                ties += sum(1 for x in xs if (f32(x * inv) % 1.0) == 0.5)
        assert ties > 100, (bits, ties)


# ----------------------------------------------------------------------------------------------------------------
# hand-worked golden values from the spec


def test_int4_double_rounding_golden():
    """amax 112 -> d = 1, inv = 1: q8 = rint_even(x), v = sign*floor((|q8|+8)/16)."""
    x = [112, 0.5, 1.5, 2.5, -2.5, 7, 7.5, 8, 8.5, 9, 23.5, 24, 24.5, -24, 40, -40, 56, 104, 111.5, -112]
    want = [7, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, -2, 3, -3, 4, 7, 7, -7]
    row = np.zeros((1, 128), np.float32)
    row[0, : len(x)] = x
    codes, d = amx.quantize_int4_rows(f32_to_bf16_bits(row))
    assert d.tolist() == [1.0]
    assert codes[0, : len(x)].tolist() == want   # 40 -> 3: one round-half-even of 40/16 = 2.5 would give 2


def test_int8_rne_golden():
    x = [127, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5, 3.25]
    want = [127, 0, 2, 2, -2, 0, 126, -126, 3]
    row = np.zeros((1, 64), np.float32)
    row[0, : len(x)] = x
    codes, d = amx.quantize_int8_rows(f32_to_bf16_bits(row))
    assert d.tolist() == [1.0]
    assert codes[0, : len(x)].tolist() == want


def _bf16_values(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return f32_to_bf16_bits(rng.uniform(0.5, 200.0, n).astype(np.float32))


def test_int8_scale_uses_the_rounded_reciprocal():
    """Observed: d = fp32(amax * fp32(1/127)), which differs from fp32(amax/127) on a few % of rows."""
    amax_bits = _bf16_values(4096, 1)
    amax = bf16_bits_to_f32(amax_bits).astype(np.float64)
    recip = np.array([f32(a * f32(1 / 127)) for a in amax])
    divided = np.array([f32(a / 127) for a in amax])
    differ = np.flatnonzero(recip != divided)
    assert differ.size > 20
    w = np.zeros((differ.size, 64), np.uint16)
    w[:, 3] = amax_bits[differ]
    _, d = amx.quantize_int8_rows(w)
    assert np.array_equal(d.astype(np.float64), recip[differ])


def test_int4_scale_is_correctly_rounded_division():
    amax_bits = _bf16_values(4096, 2)
    amax = bf16_bits_to_f32(amax_bits).astype(np.float64)
    divided = np.array([f32(a / 112) for a in amax])
    recip = np.array([f32(a * f32(1 / 112)) for a in amax])
    differ = np.flatnonzero(recip != divided)
    assert differ.size > 20
    w = np.zeros((differ.size, 128), np.uint16)
    w[:, 5] = amax_bits[differ] | np.uint16(0x8000)      # negative max: amax uses |x|
    _, d = amx.quantize_int4_rows(w)
    assert np.array_equal(d.astype(np.float64), divided[differ])


@pytest.mark.parametrize("quant,divisor", [(amx.quantize_int4_rows, 112), (amx.quantize_int8_rows, 127)])
def test_subnormal_inputs_and_scales_flush_to_zero(quant, divisor):
    w = np.zeros((4, 128), np.uint16)
    w[0] = 0x0001                                           # all subnormal inputs -> zero row
    w[1, :] = 0x8040
    w[1, 7] = f32_to_bf16_bits(np.float32(2.0 ** -100))     # normal max, subnormal neighbours read as 0
    w[2, 0] = f32_to_bf16_bits(np.float32(divisor * 2.0 ** -126 * 0.9921875))  # d would be subnormal
    w[3, 0] = f32_to_bf16_bits(np.float32(divisor * 2.0 ** -126))              # d = 2^-126, normal
    w[3, 1] = f32_to_bf16_bits(np.float32(-divisor * 2.0 ** -127))
    codes, d = quant(w)
    assert d[0] == 0 and not codes[0].any()
    assert d[1] > 0 and codes[1, 7] != 0 and np.count_nonzero(codes[1]) == 1
    assert d[2] == 0 and not codes[2].any()
    assert d[3] == np.float32(2.0 ** -126) and codes[3, 0] > 0 and codes[3, 1] < 0


@pytest.mark.parametrize("quant", [amx.quantize_int4_rows, amx.quantize_int8_rows])
@pytest.mark.parametrize("bad,kind", [(0x7FC0, "NaN"), (0xFF80, "Inf"), (0x7F80, "Inf"), (0xFFC1, "NaN")])
def test_nan_inf_raise_numeric_error_with_location(quant, bad, kind):
    w = np.zeros((64, 128), np.uint16)
    w[5, 9] = bad
    with pytest.raises(NumericError) as err:
        quant(w, where="layer 3 expert 7 gate")
    msg = str(err.value)
    assert "layer 3 expert 7 gate" in msg and kind in msg and "row 5, column 9" in msg


def test_non_bf16_input_is_refused():
    with pytest.raises(NumericError):
        amx.quantize_int4_rows(np.zeros((32, 128), np.float32))


# ----------------------------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("seed", range(3))
def test_dequant_error_bounded_and_no_minus_eight(seed):
    rng = np.random.default_rng(seed)
    w = np.concatenate([adversarial_bf16(rng, 2 * ADVERSARIAL_KINDS, 512), heavy_tailed_bf16(rng, (32, 512))])
    x = bf16_bits_to_f32(w).astype(np.float64)
    x[np.abs(x) < MIN_NORMAL] = 0.0
    codes4, d4 = amx.quantize_int4_rows(w)
    codes8, d8 = amx.quantize_int8_rows(w)
    assert codes4.min() >= -7 and codes4.max() <= 7
    assert codes8.min() >= -127 and codes8.max() <= 127
    err4 = np.abs(amx.dequantize_int4_rows(codes4, d4) - x)
    err8 = np.abs(amx.dequantize_int8_rows(codes8, d8) - x)
    tol = 1e-6 * np.abs(x) + 1e-45             # bounds in float64: no FTZ surprises at d = 2^-126
    flushed4, flushed8 = d4 == 0, d8 == 0
    assert np.all(err4[~flushed4] <= (8.5 * d4.astype(np.float64)[:, None] + tol)[~flushed4])
    assert np.all(err8[~flushed8] <= (0.5 * d8.astype(np.float64)[:, None] + tol)[~flushed8])
    assert np.all(np.abs(x[flushed4]) < 112 * MIN_NORMAL) and np.all(np.abs(x[flushed8]) < 127 * MIN_NORMAL)
    packed = AmxInt4.quantize(w[:32, :512])[0]
    assert not np.any((packed & 0x0F) == 0x08) and not np.any((packed >> 4) == 0x08)


def test_quantization_is_deterministic():
    w = adversarial_bf16(np.random.default_rng(5), 64, 256)
    a, b = AmxInt8.quantize(w), AmxInt8.quantize(w.copy())
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


# ----------------------------------------------------------------------------------------------------------------
# the method registry


def test_registry_names_and_geometry():
    assert METHODS.get("int4") is AmxInt4 and METHODS.get("AMXINT4") is AmxInt4 and METHODS.get("amx-int4") is AmxInt4
    assert METHODS.get("AMX_INT8") is AmxInt8 and METHODS.get("int8") is AmxInt8
    with pytest.raises(UnknownNameError, match="amxint4"):
        METHODS.get("int5")
    assert (AmxInt4.kt_method, AmxInt4.file_prefix, AmxInt4.n_multiple, AmxInt4.k_multiple, AmxInt4.n_block) == \
        ("AMXINT4", "INT4", 32, 128, 128)
    assert (AmxInt8.kt_method, AmxInt8.file_prefix, AmxInt8.n_multiple, AmxInt8.k_multiple, AmxInt8.n_block) == \
        ("AMXINT8", "INT8", 32, 64, 64)
    # kt-format.md §2.1 real sizes: DeepSeek-V3 gate part 1024 x 7168, down part 7168 x 1024
    assert AmxInt4.matrix_bytes(1024, 7168)["weight"] == 3670016 and AmxInt4.matrix_bytes(7168, 1024)["scale"] == 28672
    assert AmxInt8.matrix_bytes(64, 128) == {"weight": 8192, "scale": 256}


@pytest.mark.parametrize("method", [AmxInt4, AmxInt8])
def test_method_quantize_is_quant_plus_pack_and_dequantize_inverts_layout(method, monkeypatch):
    monkeypatch.setenv("KTCONVERT_FORCE_IMPL", "numpy")
    w = adversarial_bf16(np.random.default_rng(3), 160, 3712)          # K tail + several N-blocks
    blob, scale = method.quantize(w, where="x")
    codes, d = method._quantize_rows(w)
    pack = tiles.pack_int4 if method is AmxInt4 else tiles.pack_int8
    assert blob.dtype == np.uint8 and blob.size == method.matrix_bytes(160, 3712)["weight"]
    assert scale.dtype == np.float32 and scale.nbytes == method.matrix_bytes(160, 3712)["scale"]
    assert blob.tobytes() == pack(codes).tobytes() and scale.tobytes() == d.tobytes()
    deq = method.dequantize(blob, scale, 160, 3712)
    ref = (amx.dequantize_int4_rows if method is AmxInt4 else amx.dequantize_int8_rows)(codes, d)
    assert np.array_equal(deq, ref)


@pytest.mark.parametrize("method,shape", [(AmxInt4, (32, 64)), (AmxInt4, (48, 128)), (AmxInt8, (32, 96)),
                                          (AmxInt8, (16, 64))])
def test_method_shape_errors_name_the_tensor(method, shape):
    with pytest.raises(ShapeError, match="blk.3 gate"):
        method.quantize(np.zeros(shape, np.uint16), where="blk.3 gate")


def test_method_nan_error_names_the_tensor():
    w = np.zeros((32, 128), np.uint16)
    w[31, 127] = 0x7FC0
    with pytest.raises(NumericError, match="layer 1 expert 2 down"):
        AmxInt4.quantize(w, where="layer 1 expert 2 down")


def test_native_and_numpy_give_identical_bytes(monkeypatch):
    from ktconvert.methods import amx as methods

    if methods.quantize_impl() == "numpy":
        pytest.skip("ktconvert.native.amx_quantize is not built")
    w = adversarial_bf16(np.random.default_rng(11), 192, 3712)
    for method in (AmxInt4, AmxInt8):
        native = method.quantize(w, threads=2)
        monkeypatch.setenv("KTCONVERT_FORCE_IMPL", "numpy")
        assert methods.quantize_impl() == "numpy"
        numpy_out = method.quantize(w)
        monkeypatch.delenv("KTCONVERT_FORCE_IMPL")
        assert native[0].tobytes() == numpy_out[0].tobytes() and native[1].tobytes() == numpy_out[1].tobytes()


def test_quant_variants_are_looked_up_and_validated(monkeypatch):
    from ktconvert.quant import row_quant as methods

    def halve_scale(w_bf16, bits, where):           # a stand-in variant: rtn codes with another scale
        codes, d = methods.ROW_QUANT.get("rtn")(w_bf16, bits, where)
        return codes, d * np.float32(0.5)

    def minus_eight(w_bf16, bits, where):
        return np.full(w_bf16.shape, -8, np.int8), np.ones(w_bf16.shape[0], np.float32)

    monkeypatch.setitem(methods.ROW_QUANT._items, "halve", halve_scale)
    monkeypatch.setitem(methods.ROW_QUANT._items, "minus-eight", minus_eight)
    w = adversarial_bf16(np.random.default_rng(4), 64, 256)
    blob, scale = AmxInt4.quantize(w, quant="halve")
    codes, d = amx.quantize_int4_rows(w)
    assert blob.tobytes() == tiles.pack_int4(codes).tobytes() and np.array_equal(scale, d * np.float32(0.5))
    with pytest.raises(NumericError, match="-7..7"):
        AmxInt4.quantize(w, quant="minus-eight", where="t")
    with pytest.raises(UnknownNameError, match="rtn"):
        AmxInt8.quantize(w, quant="no-such-variant")
