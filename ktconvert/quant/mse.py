"""``--quant mse``: error-minimising per-row scales for AMXINT4 / AMXINT8, numpy reference (data-free).

Same on-disk format as kt-kernel's own rounding (quant/amx_rows.py): one fp32 scale ``d`` per output row over the row's
whole k (per NUMA part for down, since the pipeline quantizes each part separately), symmetric codes, no zero
point, so kt-kernel runs the files unchanged. Only the choice of ``d`` and of the codes differs: kt-kernel sets the
step from the row's largest value (one outlier flattens the rest of the row); here the step is picked from a grid of
clipped steps by least squares, then refitted in closed form.

Search definition (native/amx_mse.c implements the same steps and gives bit-identical codes and scales):

  qmax, step, G = 7, 0.5, 16 (INT4) or 127, 0.25, 16 (INT8).
  x[j]   the row as fp32, BF16 widened exactly, subnormals flushed to 0 (kt-kernel's DAZ); NaN/Inf -> NumericError.
  amax   max |x[j]| (fp32). A row with amax < 2**-118 (zero, or too small for fp32 inverse steps) gets kt-kernel's
         own rounding (quant/amx_rows.py: d = 0 and codes 0 when amax/112 resp. amax/127 is subnormal).
  e      the binary exponent of amax: amax = f * 2**e with 0.5 <= f < 1 (numpy.frexp).
  X[j]   rint_even(float64(x[j]) * 2**(24 - e)): the row as integers, |X| <= 2**24 (fixed point, exact for every
         value within 2**-16 of amax).
  candidate a (a count of levels: the row is clipped at amax * qmax / a), evaluated as
      isc    = fp32(a / amax)                          (fp32 division, round to nearest even)
      q[j]   = clamp(rint_even(fp32(x[j] * isc)), -qmax, qmax)
      P      = sum_j X[j] * q[j],  Q = sum_j q[j]**2   (float64; every term is an integer >= 0 and every partial
                                                        sum < 2**53, so the sums are exact in any order: k <= 2**22)
      S      = (P * P) / Q                             (float64; the squared error with the least-squares step is
                                                        sum(X**2) - S, up to the fixed-point scaling: larger is better)
  search over the grid a_j = qmax + step * j, j = 0 .. 15 (exact in fp32), coarse then fine:
      1. a_j for even j = 0, 2, .., 14, in that order; best = the first with the largest S.
      2. then a_{b-1} (only if b > 0) and a_{b+1}, in that order, for the best index b of step 1; each replaces the
         best only when its S is strictly larger.
  codes  q_best (-7..7 or -127..127: never -8 / -128; the element holding amax always gets +-qmax).
  d      fp32(ldexp(P_best / Q_best, e - 24 - 4)) for INT4 (the stored d is 1/16 of the step, kt-format.md 2.1),
         fp32(ldexp(P_best / Q_best, e - 24)) for INT8 (float64 division, one rounding to fp32).
         If d < 2**-126 (an fp32 subnormal, which kt-kernel would flush), the row gets kt-kernel's own rounding
         instead. So no row is ever worse than rtn: rtn's codes are a rounding at the step of grid point 0.

Dequantization is kt-kernel's unchanged: w ~= codes * 16 * d (INT4), codes * d (INT8).
"""
from __future__ import annotations

import numpy as np

from ktconvert import native
from ktconvert.errors import ShapeError
from ktconvert.native import mse as native_mse
from ktconvert.quant import amx_rows as amx
from ktconvert.quant.amx_rows import bf16_rows_ftz
from ktconvert.quant.row_quant import ROW_QUANT

GRID = {4: (7, 0.5, 16), 8: (127, 0.25, 16)}   # bits -> (qmax, step, grid points)
ZERO_ROW_AMAX = np.float32(2.0 ** -118)         # rows with a smaller amax quantize to d = 0, codes 0
MAX_K = 1 << 22                                  # keeps P, Q exact in float64
_F32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)
_ROW_CHUNK = 64                                  # rows per numpy pass (bounds the float64 temporaries)


def grid(bits: int) -> np.ndarray:
    """float32 [G]: the candidate level counts a_i = qmax + step * i of the search (module docstring)."""
    qmax, step, count = GRID[bits]
    return (qmax + step * np.arange(count)).astype(np.float32)


def _fixed_point(x: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [r, k], float32 [r] -> (X float64 [r, k] integers |X| <= 2**24, e int [r] with amax = f * 2**e)."""
    e = np.frexp(amax)[1].astype(np.int64)
    return np.rint(np.ldexp(x.astype(np.float64), (24 - e)[:, None])), e


def _candidate(x: np.ndarray, X: np.ndarray, isc: np.ndarray, qmax: int, qmin: int | None = None):
    """Codes float32 [r, k] in qmin..qmax (qmin None: -qmax), P float64 [r], Q float64 [r] of one candidate
    (inverse steps isc float32 [r])."""
    q = np.multiply(x, isc[:, None])            # fp32 product, round to nearest even
    np.rint(q, out=q)
    np.clip(q, -qmax if qmin is None else qmin, qmax, out=q)
    q64 = q.astype(np.float64)
    return q, np.sum(X * q64, axis=1), np.sum(q64 * q64, axis=1)


class _Best:
    """Running best candidate per row: grid index, codes float32 [r, k], P, Q, S float64 [r]."""

    def __init__(self, rows: int, shape: tuple[int, int]):
        self.index = np.zeros(rows, np.int64)
        self.q = np.zeros(shape, np.float32)
        self.p, self.qq, self.s = np.zeros(rows), np.ones(rows), np.full(rows, -np.inf)

    def offer(self, index: np.ndarray, candidate, valid: np.ndarray | None = None) -> None:
        """Take the candidate (codes, P, Q) in rows where its S is strictly larger (and ``valid``)."""
        q, p, qq = candidate
        s = (p * p) / qq
        better = s > self.s if valid is None else valid & (s > self.s)
        self.index[better], self.s[better], self.p[better], self.qq[better] = index[better], s[better], \
            p[better], qq[better]
        self.q[better] = q[better]


def _search_chunk(w_bf16: np.ndarray, x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits uint16 [r, k] and the same rows as float32 (flushed, finite) -> (codes int8 [r, k], d float32 [r])."""
    qmax = GRID[bits][0]
    amax = np.max(np.abs(x), axis=1)
    live = amax >= ZERO_ROW_AMAX
    codes, d = np.zeros(x.shape, np.int8), np.zeros(len(amax), np.float32)
    if live.any():
        codes[live], d[live] = _search_live(x[live], amax[live], bits, qmax)
    fallback = ~(d >= _F32_MIN_NORMAL)                      # tiny rows and subnormal d: kt-kernel's rounding
    if fallback.any():
        rtn = amx.quantize_int4_rows if bits == 4 else amx.quantize_int8_rows
        codes[fallback], d[fallback] = rtn(np.ascontiguousarray(w_bf16[fallback]))
    return codes, d


def _search_live(x: np.ndarray, amax: np.ndarray, bits: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows with amax >= 2**-118: (codes int8, d float32; d may be subnormal, the caller replaces those rows)."""
    codes, ratio, e = least_squares_search(x, amax, grid(bits), qmax)
    d = np.ldexp(ratio, e - 24 - (4 if bits == 4 else 0)).astype(np.float32)
    return codes.astype(np.int8), d


def least_squares_search(x: np.ndarray, amax: np.ndarray, levels: np.ndarray, qmax: int, qmin: int | None = None):
    """The coarse-then-fine search of the module docstring over rows x float32 [r, k] with amax float32 [r]
    (>= 2**-118), candidate level counts ``levels`` and codes qmin..qmax (None: -qmax). Returns (codes float32
    [r, k], P / Q float64 [r], e int64 [r]): the least-squares step of each row is ldexp(P / Q, e - 24)."""
    X, e = _fixed_point(x, amax)
    best = _Best(len(amax), x.shape)
    for j in range(0, len(levels), 2):                      # 1. coarse: even grid points
        best.offer(np.full(len(amax), j), _candidate(x, X, (levels[j] / amax).astype(np.float32), qmax, qmin))
    coarse = best.index.copy()
    for delta in (-1, 1):                                   # 2. fine: the two neighbours of the coarse best
        j = coarse + delta
        valid = (j >= 0) & (j < len(levels))
        a = levels[np.clip(j, 0, len(levels) - 1)]
        best.offer(j, _candidate(x, X, (a / amax).astype(np.float32), qmax, qmin), valid)
    return best.q, best.p / best.qq, e


def search_rows(w_bf16: np.ndarray, bits: int, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The scale search of the module docstring for AMXINT4 (bits=4) or AMXINT8 (bits=8).

    w_bf16: uint16 [n, k] BF16 bits. returns (codes int8 [n, k], d float32 [n]); NumericError naming ``where`` on
    NaN/Inf, ShapeError when k > 2**22.
    """
    if bits not in GRID:
        raise ShapeError("unsupported AMX bit width", tensor=where or None, expected="4 or 8", found=bits)
    x = bf16_rows_ftz(w_bf16, where)
    n, k = x.shape
    if k > MAX_K:
        raise ShapeError("row too long for the mse scale search", tensor=where or None,
                         expected=f"k <= {MAX_K}", found=k)
    codes = np.zeros((n, k), np.int8)
    d = np.zeros(n, np.float32)
    if k == 0:
        return codes, d
    for r0 in range(0, n, _ROW_CHUNK):
        rows = slice(r0, r0 + _ROW_CHUNK)
        codes[rows], d[rows] = _search_chunk(w_bf16[rows], x[rows], bits)
    return codes, d


def _native_mse():
    """ktconvert.native.mse when the native library is usable and has the search, else None (numpy then)."""
    return native_mse if native.available() and native_mse.mse_available() else None


@ROW_QUANT.register("mse")
def mse_rows(w_bf16: np.ndarray, bits: int, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """ROW_QUANT entry: (codes, d) of the search, native when built (bit-identical), numpy otherwise."""
    fast = _native_mse()
    if fast is not None and isinstance(w_bf16, np.ndarray) and w_bf16.dtype == np.uint16 and w_bf16.ndim == 2:
        return fast.mse_rows(w_bf16, bits, name=where or None)   # NaN/Inf: NumericError naming `where`
    return search_rows(w_bf16, bits, where)


def _quantize_packed(w_bf16: np.ndarray, bits: int, threads: int = 1, where: str = ""):
    """(blob, scale) straight from C (search + tile packing), or None when the native library is missing."""
    fast = _native_mse()
    if fast is None or not isinstance(w_bf16, np.ndarray) or w_bf16.dtype != np.uint16:
        return None
    return fast.amx_mse_quantize(w_bf16, bits, threads=threads, name=where or None)


mse_rows.quantize_packed = _quantize_packed
