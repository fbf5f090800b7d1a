"""ggml quantizers for the expert types kt-kernel's LLAMAFILE backend reads: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, BF16, F16.

Each is meant to give the bytes llama.cpp's reference quantizer gives (ggml-quants.c ``quantize_row_<type>_ref``,
which ``llama_model_quantize`` runs for these types when no importance matrix is given):

* Q8_0, Q4_0, BF16, F16 are gguf-py's ``gguf.quants.quantize``: gguf-py ports those reference functions to numpy
  (its Q8_0 is documented "bit-exact"; its Q4_0 takes the first largest magnitude, ``d = max / -8`` and truncates
  ``x / d + 8.5`` as the C code does). Writing them again here would duplicate a maintained library. One fix-up:
  an all-zero Q4_0 block whose first value is -0.0 gets llama.cpp's d = -0.0 (``_q4_0_zero_blocks``).
* Q4_K, Q5_K (``make_qkx2_quants``: a weighted search over 16-21 candidate scales with a free minimum) and Q6_K
  (``make_qx_quants`` with weights x^2: 19 candidate scales, symmetric) are written here: gguf-py 0.19 can dequantize
  them but has no quantizer.

Bit-exactness rules followed (``tests/test_ggml_quant.py`` compares with tensors llama.cpp wrote): every value the C
code keeps in a ``float`` is a float32 here and each product or sum is rounded in the C code's order (``w*l*x`` is
``(w*l)*x``); sums over a block are sequential (numpy's pairwise ``sum`` rounds differently); ``nearest_int`` (add
1.5*2^23, read the mantissa) is round-half-even, i.e. ``np.rint``; the super-block scales d / dmin are stored as
fp16 (round to nearest even) and read back before the final codes are chosen; a sub-block whose quantized scale
is 0 keeps the codes its search produced. The numpy K-quant searches run vectorised over sub-blocks, in chunks of
``CHUNK`` super-blocks so the working set stays a few MB whatever the matrix size; native/ggml_quant.c is the
same arithmetic in C (used when the native library has it, for Q8_0 / Q4_0 too), checked against these and
against llama.cpp's bytes. With an importance matrix (``imatrix``) only the native code runs: llama.cpp's
quantize_row_<type>_impl (make_qkx3_quants + make_qp_quants for Q4_K / Q5_K, make_qx_quants weighted by the matrix
for Q6_K and Q4_0), checked by tests/test_imatrix.py against ggml_quantize_chunk's bytes.
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import NativeError, NumericError, ShapeError
from ktconvert.native import ggml_quant as native_ggml

QK_K = 256
CHUNK = 4096          # super-blocks per vectorised step (working set ~ CHUNK * 256 * 4 B * ~10 arrays)
GROUP_MAX_EPS = np.float32(1e-15)   # ggml-quants.c: a group with |x| below this is all zero
F32 = np.float32

# type name -> (elements per block, bytes per block)   (ggml-common.h; gguf.constants.GGML_QUANT_SIZES)
BLOCKS: dict[str, tuple[int, int]] = {"F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
                                      "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
TYPES = tuple(BLOCKS)
GGUF_PY_TYPES = ("F16", "BF16", "Q8_0", "Q4_0")     # quantized by gguf-py
IMATRIX_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0")    # ggml's quantizer uses an importance matrix (the others ignore it)


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one row of k values stored as `ggml_type` (k a whole number of blocks, else ShapeError)."""
    elems, nbytes = _geometry(ggml_type)
    if k <= 0 or k % elems:
        raise ShapeError(f"row length is not a whole number of {ggml_type} blocks", expected=f"a multiple of {elems}",
                         found=str(k))
    return k // elems * nbytes


def quantize(x: np.ndarray, ggml_type: str, where: str = "", threads: int = 1, impl: str | None = None,
             imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 [..., k] -> uint8 [..., row_bytes(ggml_type, k)]: the bytes llama.cpp's reference quantizer writes.

    ``imatrix``: float32 [k], the importance of each column (one expert's slice of an importance matrix,
    ``quant.imatrix``): the bytes ``ggml_quantize_chunk`` writes given it (quantize_row_<type>_impl, native only;
    Q4_K, Q5_K, Q6_K, Q4_0; ggml's Q8_0, F16 and BF16 ignore it, ``IMATRIX_TYPES``).

    Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 run in C (native/ggml_quant.c: same bytes; K-quants measured 200-310 MB/s
    of BF16 input per AVX2 thread (Q4_K ~200) against 3-15 in numpy) when the native library has them, else in
    numpy / gguf-py; ``impl``: None (native where possible, KTCONVERT_FORCE_IMPL honoured), "numpy" (never
    native), or "scalar" | "avx2" | "avx512". ``threads``: block ranges on the shared native pool (bytes never
    depend on it). NumericError for NaN / Inf (llama.cpp's output is undefined for them), ShapeError for k not a
    whole number of blocks; ``where`` names the tensor in both.
    """
    _geometry(ggml_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ShapeError("nothing to quantize", tensor=where or None, expected="float32 [..., k]",
                         found=str(list(x.shape)))
    try:
        out_row = row_bytes(ggml_type, x.shape[-1])
    except ShapeError as e:
        raise ShapeError(e.args[0], tensor=where or None, expected=e.expected, found=e.found) from None
    if not np.isfinite(x).all():
        raise NumericError("NaN or Inf in weights", tensor=where or None)
    if imatrix is not None and ggml_type in IMATRIX_TYPES:
        return _quantize_imatrix(x, ggml_type, imatrix, where, threads, impl).reshape(*x.shape[:-1], out_row)
    native = impl != "numpy" and ggml_type in native_ggml.TYPE_IDS
    if native and (impl is not None or native_ggml.supports(ggml_type)):
        out = native_ggml.quantize(x, ggml_type, BLOCKS[ggml_type][1], threads=threads, impl=impl, name=where)
        return out.reshape(*x.shape[:-1], out_row)
    if ggml_type in GGUF_PY_TYPES:
        from gguf import GGMLQuantizationType, quants

        out = np.ascontiguousarray(quants.quantize(x, GGMLQuantizationType[ggml_type])).view(np.uint8)
        if ggml_type == "Q4_0":
            _q4_0_zero_blocks(x, out)
        return out.reshape(*x.shape[:-1], out_row)
    flat = x.reshape(-1, QK_K)
    encode = _K_QUANTS[ggml_type]
    out = np.empty((flat.shape[0], BLOCKS[ggml_type][1]), dtype=np.uint8)
    for start in range(0, flat.shape[0], CHUNK):
        with np.errstate(all="ignore"):     # lanes a search discards may divide by zero; they are masked out
            out[start:start + CHUNK] = encode(flat[start:start + CHUNK])
    return out.reshape(*x.shape[:-1], out_row)


def _quantize_imatrix(x: np.ndarray, ggml_type: str, imatrix: np.ndarray, where: str, threads: int,
                      impl: str | None) -> np.ndarray:
    qw = np.ascontiguousarray(imatrix, dtype=np.float32)
    k = x.shape[-1]
    if qw.shape != (k,):
        raise ShapeError("importance matrix slice does not match the rows", tensor=where or None,
                         expected=f"{k} values", found=str(list(qw.shape)))
    if not np.isfinite(qw).all():
        raise NumericError("NaN or Inf in the importance matrix", tensor=where or None)
    if impl == "numpy":
        raise NativeError("quantizing with an importance matrix needs the native library", tensor=where or None)
    return native_ggml.quantize_imatrix(x.reshape(-1, k), ggml_type, qw, BLOCKS[ggml_type][1], threads=threads,
                                        impl=impl, name=where or None)


def dequantize(raw: np.ndarray, ggml_type: str, k: int) -> np.ndarray:
    """uint8 [..., row_bytes(ggml_type, k)] -> float32 [..., k] through gguf-py's ``gguf.quants.dequantize`` (an
    independent decoder: tests check quantize against it)."""
    from gguf import GGMLQuantizationType, quants

    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rb = row_bytes(ggml_type, k)
    if raw.shape[-1] != rb:
        raise ShapeError(f"{ggml_type} row has the wrong size", expected=f"{rb} bytes", found=f"{raw.shape[-1]} bytes")
    out = quants.dequantize(raw.reshape(-1, rb), GGMLQuantizationType[ggml_type])
    return np.asarray(out, dtype=np.float32).reshape(*raw.shape[:-1], k)


def _q4_0_zero_blocks(x: np.ndarray, out: np.ndarray) -> None:
    """gguf-py's Q4_0 divides the block's largest-magnitude value by -8 even when it is -0.0; llama.cpp starts from
    max = +0.0 and so stores d = -0.0 (fp16 0x8000) for every all-zero block: set that (the only difference, found
    against ggml's bytes on an all -0.0 row)."""
    zero = (np.abs(x.reshape(-1, 32)).max(axis=1) == 0)
    if zero.any():
        out.reshape(-1, 18)[zero, 0:2] = np.array([0x00, 0x80], dtype=np.uint8)


def _geometry(ggml_type: str) -> tuple[int, int]:
    if ggml_type not in BLOCKS:
        raise ShapeError("ggml type has no quantizer here", expected=" or ".join(TYPES), found=str(ggml_type))
    return BLOCKS[ggml_type]


# ---------------------------------------------------------------- helpers (arrays are [elements, blocks]: each
# ---------------------------------------------------------------- sequential sum adds contiguous rows)

def _seq_sum(terms: np.ndarray, from_first: bool = False) -> np.ndarray:
    """Sum over axis 0 one term after another, as the C loop ``s = 0; s += t[i]`` (from_first: ``s = t[0]``; the
    two differ only in the sign of an all-zero sum)."""
    acc = terms[0].copy() if from_first else np.zeros(terms.shape[1:], dtype=np.float32) + terms[0]
    for t in terms[1:]:
        acc += t
    return acc


def _rint(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even) of float32 values, kept as float32 integers."""
    return np.rint(v)


def _fp16_bits(v: np.ndarray) -> np.ndarray:
    """float32 -> fp16 (round to nearest even, as GGML_FP32_TO_FP16) as uint8 pairs [..., 2]."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _fp16_round(v: np.ndarray) -> np.ndarray:
    """The float32 value an fp16-stored float32 reads back as."""
    return v.astype(np.float16).astype(np.float32)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants (use_mad false) on sub-blocks x, w [n, B]: (codes float32 [n, B] in 0..nmax, scale [B],
    the_min [B] = -min >= 0)."""
    nmax_f = F32(nmax)
    mn = x.min(axis=0)
    mn = np.where(mn > 0, F32(0), mn)
    mx = x.max(axis=0)
    sum_w = _seq_sum(w, from_first=True)
    sum_x = _seq_sum(w * x, from_first=True)
    flat = mx == mn
    iscale = nmax_f / (mx - mn)
    scale = F32(1) / iscale
    L = np.clip(_rint(iscale * (x - mn)), 0, nmax_f)
    diff = scale * L + mn - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):
        num = F32(rmin) + F32(rdelta) * F32(step) + nmax_f
        iscale = num / (mx - mn)
        laux = np.clip(_rint(iscale * (x - mn)), 0, nmax_f)
        wl = w * laux
        sum_l = _seq_sum(wl)
        sum_l2 = _seq_sum(wl * laux)
        sum_xl = _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        diff = this_scale * laux + this_min - x
        cur = _seq_sum(w * (diff * diff))
        better = (D > 0) & (cur < best)
        L = np.where(better, laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale)
    return L, scale, -mn


def _make_qx_sq(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants with rmse_type 1 (weights x^2), no importance: (codes + nmax float32 [n, B], scale [B])."""
    n, B = x.shape
    ax = np.abs(x)
    first = np.argmax(ax, axis=0)                     # the first largest magnitude, as the C loop's strict ">"
    amax = ax[first, np.arange(B)]
    mx = x[first, np.arange(B)]
    zero = amax < GROUP_MAX_EPS
    w = x * x
    lo, hi = F32(-nmax), F32(nmax - 1)

    def sums(iscale):
        l = np.clip(_rint(iscale * x), lo, hi)
        return l, _seq_sum(w * x * l), _seq_sum(w * l * l)

    l, sumlx, suml2 = sums(F32(-nmax) / mx)
    L = l + F32(nmax)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, sumlx, suml2 = sums(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better, l + F32(nmax), L)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), L), np.where(zero, F32(0), scale)


def _requantize_min(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int) -> np.ndarray:
    """The final codes of K-quants with a minimum: nearest_int((x + dm) / d) clamped, where d != 0."""
    q = np.clip(_rint((x + dm) / d), F32(0), F32(nmax))
    return np.where(d != 0, q, L)


def _scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [8, B] -> the 12 packed bytes [B, 12] (get_scale_min_k4's inverse)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.empty((ls.shape[1], 12), dtype=np.uint8)
    out[:, 0:4] = (ls[0:4] | ((ls[4:8] >> 4) << 6)).T
    out[:, 4:8] = (lm[0:4] | ((lm[4:8] >> 4) << 6)).T
    out[:, 8:12] = ((ls[4:8] & 0xF) | ((lm[4:8] & 0xF) << 4)).T
    return out


def _qkx_superblocks(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared part of Q4_K / Q5_K: (codes uint8 [B, 256], d fp16 bytes [B, 2], dmin fp16 bytes [B, 2],
    scales [B, 12])."""
    B = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(B * 8, 32).T)         # [32, B*8]: sub-blocks as columns
    sum_x2 = _seq_sum(x * x)
    av_x = np.sqrt(sum_x2 / F32(32))
    w = av_x + np.abs(x)
    L, scales, mins = _make_qkx2(x, w, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(B, 8).T, mins.reshape(B, 8).T   # [8, B]
    max_scale, max_min = scales.max(axis=0), mins.max(axis=0)
    max_scale = np.where(max_scale > 0, max_scale, F32(0))        # C: the largest above a starting +0.0
    max_min = np.where(max_min > 0, max_min, F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(_rint(inv_scale * scales).astype(np.int64) & 0xFF, 63)   # C: uint8 of nearest_int, MIN 63
    lm = np.minimum(_rint(inv_min * mins).astype(np.int64) & 0xFF, 63)
    d16 = max_scale / F32(63)
    dmin16 = max_min / F32(63)
    d = _fp16_round(d16) * ls.astype(np.float32)                 # [8, B]
    dm = _fp16_round(dmin16) * lm.astype(np.float32)
    L = _requantize_min(x, L, d.T.reshape(1, B * 8), dm.T.reshape(1, B * 8), nmax)   # column b*8 + j
    codes = L.T.reshape(B, 256).astype(np.uint8)
    return codes, _fp16_bits(d16), _fp16_bits(dmin16), _scales_k4(ls, lm)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    codes, d, dmin, scales = _qkx_superblocks(blocks, 15, -1.0, 0.1, 20)
    c = codes.reshape(-1, 4, 2, 32)                               # 4 pairs of 32-value sub-blocks
    qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    codes, d, dmin, scales = _qkx_superblocks(blocks, 31, -0.5, 0.1, 15)
    c = codes.reshape(-1, 4, 2, 32)
    lo = c & 0xF
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (codes.reshape(-1, 8, 32) >> 4).astype(np.uint8)        # bit 4 of sub-block j goes to bit j of qh[l]
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= hi[:, j] << j
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    B = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(B * 16, 16).T)        # [16, B*16]
    L, scales = _make_qx_sq(x, 32)
    scales = scales.reshape(B, 16)
    first = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(B), first]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(zero, F32(1), F32(-128) / max_scale)
    d16 = F32(1) / iscale
    sc = np.minimum(_rint(iscale[:, None] * scales), F32(127)).astype(np.int8)   # [B, 16]
    d = (_fp16_round(d16)[:, None] * sc.astype(np.float32)).reshape(1, B * 16)
    q = np.clip(_rint(x / d), F32(-32), F32(31)) + F32(32)
    L = np.where(d != 0, q, L)
    codes = L.T.reshape(B, 256).astype(np.uint8)
    c = codes.reshape(B, 2, 4, 32)                                # per 128 values: 4 groups of 32
    ql = np.concatenate([(c[:, :, 0] & 0xF) | ((c[:, :, 2] & 0xF) << 4),
                         (c[:, :, 1] & 0xF) | ((c[:, :, 3] & 0xF) << 4)], axis=2).reshape(B, 128)
    h = c >> 4
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(B, 64)
    d_bytes = _fp16_bits(d16)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    out[zero] = 0                                                 # an all-zero block: every byte 0 (d = +0.0)
    return out


_K_QUANTS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
