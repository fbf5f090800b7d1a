"""native/ggml_quant.c on hostile blocks, every implementation this CPU runs, with and without an importance matrix.

The searches take a short rounding path only where they have proven that it gives nearest_int's codes;
these rows are built to land on both sides of that test: flat and all-zero sub-blocks, ranges of a few denormals (the
inverse scale overflows to Inf), values near the float maximum (x - min and x^2 overflow), tiny ranges far from zero,
codes exactly halfway between two integers, one outlier a million times the rest, all-positive and all-negative
sub-blocks, exact grids and BF16-valued data.

Golden values, none from our code:
* LLAMA_SHA256: sha256 of llama.cpp's ``ggml_quantize_chunk(type, _hostile_rows(), ..., imatrix)`` bytes (the
  libggml-base that llama-cpp-python 0.3.36 vendors, as the other fixtures in golden/gguf; imatrix None, then each of
  _importances()), for every type the native quantizer writes.
* the numpy reference (ktconvert.quant.ggml_quant, impl="numpy": itself checked against llama.cpp's bytes) on rows
  where it follows llama.cpp (``_hostile_rows(numpy_defined=True)``); the others are left to LLAMA_SHA256.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ktconvert import native
from ktconvert.native import ggml_quant as native_ggml
from ktconvert.quant import ggml_quant as gq

ROWS, K = 48, 1024
KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0")

# ggml_quantize_chunk's bytes, sha256: {type: [no importance matrix, _importances()[0], _importances()[1]]}
LLAMA_SHA256 = {
    "Q4_K": [
        "16e5ac10fac462b66066f79aa789048171aff6e7dfcc471a346339cf84b2b31a",
        "46bd73c567173156b9a0c8bf3ab14f439921b957fb5820ddb44eb6399ecee12b",
        "96e87f6c9623f8e72e29866ca0d78b6aafe18afd5bcb9e2416d2c4e67f886a8d",
    ],
    "Q5_K": [
        "97133306a663d28827053180f2ef224d343817b8c90ad5a5110e18ec42443b7d",
        "522860bae4516f61911845c12e8fef46f6df349861e163b08715742ff549993d",
        "d71426e7efe7593c7b55d05bab21c83e8645b4e97e65ab5cdaa3184546a9e62f",
    ],
    "Q6_K": [
        "22a3cc9b66607f6c081106f646fdfd59589cd8500789327ed116f4f7bd2a33fe",
        "df024856e18a58c77bd766e6ce84bf9a1808a74baceb81cc066aa2dc95d44a21",
        "0238d80521dfbae30f59e6c958326ddb5f972a3ff61f825bb0d8b353672279b2",
    ],
    "Q8_0": [
        "59e873977eeb08fea4cd27f3d50ed88d31eca2720b2f26580fb11f5c95b72a7a",
    ],
    "Q4_0": [
        "148b2bb6290b5565cbd61fe0fa0bd3434d7c0ff8b82738134040e7987004eada",
        "3e426a708eb2565c786877e5f3322401d8516d4d68ca00a1c8db78444e89101a",
        "2cfc7634b385ff97a8cf2876374999b177cb46a4efaf0d2e4364a431a7338a4e",
    ],
}

# the same for _nonfinite_rows(): [no importance matrix, _importances()[0]]
LLAMA_NONFINITE_SHA256 = {
    "Q4_K": [
        "1cebd51497d7439e1922ff6653514f61f5cb180e1b97dc81bec24748fe17b8ca",
        "e2be1e16aa5ff2b26824097498e5340bd82f8b6d7d003cca40aa68dfe5c3ec66",
    ],
    "Q5_K": [
        "ca4b009ecb6a24ae669d564dee8694bab5c173e09260138818af4c756bf05500",
        "c3693540909a58c68142d290038ec187f94852319e97db81c866305fc28c8255",
    ],
    "Q6_K": [
        "00ef410f91b4d02a765939226c7669196426762ea313149de7627d5257921850",
        "62773a436906966c1f25cd2ca2f40613be8ac26a979f61e09d1335dc7993f428",
    ],
}


def _hostile_rows(numpy_defined: bool = False) -> np.ndarray:
    """float32 [ROWS, K], all finite: each 32-value sub-block one of 16 families (see the module docstring). Values
    near the float maximum make a row's mean square Inf (every importance weight of Q4_0 / of a K super-block Inf), so
    they are only in the last 8 rows; the first half of the rows stays below 1e19 in magnitude.

    numpy_defined: rows the numpy reference follows llama.cpp on: scales 1e-4 .. 1e4, no denormal, near-1e-38,
    near-maximum, tiny-range or outlier families. Where a value to round exceeds 2^22 (an inverse scale overflowing
    to Inf, a tiny range far from zero once the search has moved its minimum) llama.cpp's nearest_int gives other
    codes than numpy's rint, and where x^2 overflows numpy's argmax takes NaN as the largest Q6_K scale."""
    rng = np.random.default_rng(30 if numpy_defined else 28)
    half_exp = (-12, 12) if numpy_defined else (-140, 40)
    out = np.empty((ROWS, K // 32, 32), np.float64)
    for row in range(ROWS):
        families = [f for f in range(16) if f != 6 or row >= ROWS - 8]
        if numpy_defined:
            families = [f for f in families if f not in (5, 6, 7, 8, 11, 12)]
        top = 4 if numpy_defined else 12 if row < ROWS // 2 else 30
        for sub in range(K // 32):
            s = 10.0 ** rng.uniform(-4 if numpy_defined else -45, top)
            n = rng.standard_normal(32)
            family = families[(sub + row) % len(families)]
            out[row, sub] = [
                np.zeros(32),
                np.full(32, n[0] * s),                                       # flat
                n * s,
                rng.integers(-3, 4, 32) * s,                                 # few levels
                (rng.integers(0, 31, 32) + 0.5) * 2.0 ** int(rng.integers(*half_exp)),     # codes at .5
                rng.choice([0, 1e-45, 1e-40, -1e-40, 3e-39], 32),           # a denormal range
                rng.choice([3.4e38, -3.4e38, 1e38, 0, -1], 32),             # near the float maximum
                1 + rng.integers(0, 3, 32) * 2.0 ** -23,                     # a tiny range far from zero
                -(5 + rng.integers(0, 3, 32) * 2.0 ** -21),
                np.abs(n) * s + s,                                           # all positive
                -np.abs(n) * s - s,                                          # all negative
                np.where(np.arange(32) == rng.integers(0, 32), n * s * 1e6, n * s),   # one outlier
                n * 1e-38,
                np.where(rng.random(32) < 0.5, 0, n * s),
                rng.integers(-64, 64, 32) / 4.0 * s,                         # an exact grid
                (n.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32),   # BF16 values
            ][family]
    x = out.astype(np.float32).reshape(ROWS, K)
    assert np.isfinite(x).all()
    return x


def _importances() -> list[np.ndarray]:
    rng = np.random.default_rng(29)
    return [rng.uniform(0.1, 10, K).astype(np.float32),
            rng.choice(np.array([0, 1e-45, 1e-30, 1, 1e30, 3e38], np.float32), K)]


def _impls() -> list[str]:
    return native.usable_impls() if native_ggml.supports("Q4_K") else []


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


needs_native = pytest.mark.skipif(not _impls(), reason="the native library has no ggml quantizer (not built)")


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_hostile_rows_equal_llama_cpp(kind):
    x = _hostile_rows()
    qws = [None] + (_importances() if kind in gq.IMATRIX_TYPES else [])
    for impl in _impls():
        for qw, want in zip(qws, LLAMA_SHA256[kind]):
            got = gq.quantize(x, kind, impl=impl, imatrix=qw)
            assert _sha(got) == want, f"{kind} {impl} imatrix={qw is not None}"


@needs_native
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_hostile_rows_equal_numpy_reference(kind):
    x = _hostile_rows(numpy_defined=True)
    with np.errstate(all="ignore"):     # the reference's discarded lanes divide by zero
        want = gq.quantize(x, kind, impl="numpy")
    for impl in _impls():
        assert np.array_equal(gq.quantize(x, kind, impl=impl), want), impl


@needs_native
def test_q6_k_with_importances_x_squared_is_the_reference():
    """quantize_row_q6_K_impl weighs by the importances where the reference weighs by x^2: one row whose importances
    are its own x^2 gives the reference's bytes."""
    x = _hostile_rows(numpy_defined=True)[:4]
    with np.errstate(all="ignore"):
        want = gq.quantize(x, "Q6_K", impl="numpy")
    for impl in _impls():
        for r in range(x.shape[0]):
            got = gq.quantize(x[r:r + 1], "Q6_K", impl=impl, imatrix=x[r] * x[r])
            assert np.array_equal(got[0], want[r]), (impl, r)


@needs_native
@pytest.mark.parametrize("blocks", [1, 3])
def test_odd_block_counts_equal_even_ones(blocks):
    """The searches take two super-blocks at a time: a lone last one (padding lanes) gets the bytes it gets in a
    pair."""
    x = _hostile_rows()[:, :256 * (blocks + 1)]
    for impl in _impls():
        for kind in ("Q4_K", "Q5_K", "Q6_K"):
            whole = gq.quantize(x, kind, impl=impl)
            part = gq.quantize(np.ascontiguousarray(x[:, :256 * blocks]), kind, impl=impl)
            assert np.array_equal(part, whole[:, :part.shape[1]]), (impl, kind)
            for qw in _importances():
                whole = gq.quantize(x, kind, impl=impl, imatrix=qw[:x.shape[1]])
                part = gq.quantize(np.ascontiguousarray(x[:, :256 * blocks]), kind, impl=impl,
                                   imatrix=qw[:256 * blocks])
                assert np.array_equal(part, whole[:, :part.shape[1]]), (impl, kind)


def _nonfinite_rows() -> np.ndarray:
    """_hostile_rows with about one value in 300 replaced by NaN, +Inf or -Inf."""
    rng = np.random.default_rng(31)
    x = _hostile_rows().reshape(-1)
    at = rng.choice(x.size, x.size // 300, replace=False)
    x[at] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), at.size)
    return x.reshape(ROWS, K)


@needs_native
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_nan_and_inf_give_llama_cpp_bytes(kind):
    """ggml.quantize refuses NaN / Inf (llama.cpp's result is not meant to be used), but the C port still gives the
    bytes llama.cpp's C code gives for them (its nearest_int reads the magic sum's mantissa: Inf -> code 0), which the
    short rounding path must not change. Called below the Python checks, through the binding."""
    x = _nonfinite_rows()
    block = gq.BLOCKS[kind][1]
    for impl in _impls():
        got = native_ggml.quantize(x, kind, block, impl=impl).reshape(ROWS, -1)
        assert _sha(got) == LLAMA_NONFINITE_SHA256[kind][0], impl
        got = native_ggml.quantize_imatrix(x, kind, _importances()[0], block, impl=impl)
        assert _sha(got) == LLAMA_NONFINITE_SHA256[kind][1], impl
