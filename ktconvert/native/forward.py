"""ctypes bindings of the verification runtime (native/kt_runtime.h): GEMMs and the routed-expert MoE forward
computed on kt-kernel's on-disk weight layouts in place.

Weight types: "AMXINT4" / "AMXINT8" (tiled blob uint8 + float32 per-row scale d) and "BF16" (uint16 [n, k] rows,
HF orientation, no scale). Activations and results are float32; results equal ``dequantize(blob, d) @ x`` to fp32
summation accuracy (the avx512-vnni variant sums exactly in integers; see kt_runtime.h).

``impl``: None (the automatic choice, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512".
``threads``: C threads over row blocks; results never depend on it.
An expert ("parts") is a list of NUMA parts, each ``((gate_w, gate_s), (up_w, up_s), (down_w, down_s))``:
gate/up [n = inter_part, k = hidden], down [n = hidden, k = inter_part]; scales are None for BF16.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ktconvert import native
from ktconvert.errors import ShapeError, VerifyError

WTYPES = {"AMXINT4": 4, "AMXINT8": 8, "BF16": 16}
K_MULTIPLE = {"AMXINT4": 128, "AMXINT8": 64, "BF16": 1}
N_MULTIPLE = {"AMXINT4": 32, "AMXINT8": 32, "BF16": 1}

_I64, _INT = ctypes.c_int64, ctypes.c_int


def _signatures() -> dict:
    a, out, f32 = native.array, native.out_array, np.float32
    pointers = a(np.uintp)  # a table of matrix addresses, each checked by check_matrix first
    return {
        "kt_rt_gemm": (_INT, [_INT, a(), a(f32, nullable=True), _I64, _I64, a(f32), _I64, out(f32), _INT, _INT]),
        "kt_rt_expert_forward": (_INT, [_INT, _I64, _I64, _INT, pointers, a(f32), _I64, a(f32), out(f32), _INT, _INT]),
        "kt_rt_moe_forward": (_INT, [_INT, _I64, _I64, _INT, _I64, _I64, pointers, a(f32), _I64, a(np.int64), a(f32),
                                     _I64, out(f32), _INT, _INT]),
    }


def runtime_lib() -> ctypes.CDLL:
    """The native library with the runtime signatures set; NativeError if it is missing or lacks the runtime."""
    return native.bound_or_raise(_signatures, "the verification runtime")


def available() -> bool:
    """True when the native runtime can run here."""
    return native.bind(_signatures) is not None


def impl_id(impl: str | None = None) -> int:
    """Implementation id for ``impl`` (see module doc); NativeError naming what is missing."""
    runtime_lib()
    return native.resolve_impl(impl)


def variant(impl: str | None = None) -> str:
    """"scalar" | "avx2" | "avx512" | "avx512-vnni": the kernels a call with ``impl`` runs."""
    runtime_lib()
    return native.variant(impl)


def _wtype(wtype: str) -> int:
    if wtype not in WTYPES:
        raise ShapeError("unknown runtime weight type", expected=" | ".join(WTYPES), found=repr(wtype))
    return WTYPES[wtype]


def weight_nbytes(wtype: str, n: int, k: int) -> int:
    """Bytes of one [n, k] weight: n*k/2 (AMXINT4), n*k (AMXINT8), 2*n*k (BF16)."""
    return {"AMXINT4": n * k // 2, "AMXINT8": n * k, "BF16": 2 * n * k}[wtype]


def check_matrix(wtype: str, w: np.ndarray, scale: np.ndarray | None, n: int, k: int, name: str | None = None) -> None:
    """ShapeError / VerifyError naming ``name`` unless (w, scale) hold exactly one [n, k] weight of ``wtype``."""
    _wtype(wtype)
    if n <= 0 or k <= 0 or n % N_MULTIPLE[wtype] or k % K_MULTIPLE[wtype]:
        raise ShapeError(f"matrix shape incompatible with {wtype}", tensor=name,
                         expected=f"n % {N_MULTIPLE[wtype]} == 0, k % {K_MULTIPLE[wtype]} == 0", found=f"[{n}, {k}]")
    want = weight_nbytes(wtype, n, k)
    if not isinstance(w, np.ndarray) or not w.flags.c_contiguous or w.nbytes != want:
        raise VerifyError(f"{wtype} weight has the wrong size for [{n}, {k}]", tensor=name,
                          expected=f"{want} contiguous bytes", found=f"{getattr(w, 'nbytes', '?')} bytes")
    if wtype == "BF16":
        return
    if not isinstance(scale, np.ndarray) or scale.dtype != np.float32 or scale.size != n \
            or not scale.flags.c_contiguous:
        found = f"{getattr(scale, 'dtype', type(scale).__name__)} x {getattr(scale, 'size', '?')}"
        raise VerifyError(f"{wtype} scale has the wrong size", tensor=name, expected=f"float32 x {n}", found=found)


def _activations(x: np.ndarray, k: int, name: str | None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    if x2.ndim != 2 or x2.shape[1] != k:
        raise ShapeError("activations have the wrong shape", tensor=name, expected=f"float32 [m, {k}]",
                         found=list(x.shape))
    if not np.isfinite(x2).all():
        raise ShapeError("activations hold NaN/Inf", tensor=name)
    return x2


def _ptr(a: np.ndarray | None) -> int:
    return 0 if a is None else a.ctypes.data


def gemm(wtype: str, w: np.ndarray, scale: np.ndarray | None, n: int, k: int, x: np.ndarray,
         impl: str | None = None, threads: int = 1, name: str | None = None) -> np.ndarray:
    """y float32 [m, n] = x [m, k] @ W^T (x [k] gives y [n]), W read in place from its on-disk bytes."""
    check_matrix(wtype, w, scale, n, k, name)
    x2 = _activations(x, k, name)
    y = np.empty((x2.shape[0], n), np.float32)
    status = runtime_lib().kt_rt_gemm(_wtype(wtype), w, scale if wtype != "BF16" else None, n, k, x2, x2.shape[0], y,
                                      impl_id(impl), max(1, int(threads)))
    native.check_status(status, "kt_rt_gemm", name)
    return y[0] if np.ndim(x) == 1 else y


def _part_table(wtype: str, parts: Sequence, hidden: int, inter_part: int, name: str | None) -> list[int]:
    """6 pointers per NUMA part (gate_w, gate_s, up_w, up_s, down_w, down_s), after checking every size."""
    pointers = []
    for t, part in enumerate(parts):
        for proj, (w, s) in zip(("gate", "up", "down"), part):
            n, k = (inter_part, hidden) if proj != "down" else (hidden, inter_part)
            check_matrix(wtype, w, s, n, k, f"{name or 'expert'} {proj} numa {t}")
            pointers += [_ptr(w), _ptr(s) if wtype != "BF16" else 0]
    return pointers


def expert_forward(wtype: str, hidden: int, inter_part: int, parts: Sequence, x: np.ndarray,
                   impl: str | None = None, threads: int = 1, name: str | None = None) -> np.ndarray:
    """float32 [m, hidden]: sum over NUMA parts t of down_t(silu(gate_t x) * up_t x) for x float32 [m, hidden]."""
    table = _part_table(wtype, parts, hidden, inter_part, name)
    x2 = _activations(x, hidden, name)
    m = x2.shape[0]
    out = np.zeros((m, hidden), np.float32)
    coef = np.ones(m, np.float32)
    status = runtime_lib().kt_rt_expert_forward(_wtype(wtype), hidden, inter_part, len(parts),
                                                np.array(table, np.uintp), x2, m, coef, out, impl_id(impl),
                                                max(1, int(threads)))
    native.check_status(status, "kt_rt_expert_forward", name)
    return out


def moe_forward(wtype: str, hidden: int, inter_part: int, experts: dict, x: np.ndarray, topk_ids: np.ndarray,
                topk_weights: np.ndarray, out: np.ndarray | None = None, impl: str | None = None,
                threads: int = 1, name: str | None = None) -> np.ndarray:
    """Routed-expert MoE of one layer, accumulated into ``out`` float32 [m, hidden] (zeros when None).

    experts: {expert id: parts} for the experts loaded now; tokens' ids outside it are skipped, so a layer can be
    run a few experts at a time: call again with the next experts and the same ``out``.
    topk_ids int [m, topk], topk_weights float32 [m, topk]. out[i] += sum_j w_ij * expert_{id_ij}(x_i).
    """
    x2 = _activations(x, hidden, name)
    m = x2.shape[0]
    ids = np.ascontiguousarray(topk_ids, dtype=np.int64)
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    if ids.ndim != 2 or ids.shape[0] != m or weights.shape != ids.shape:
        raise ShapeError("routing arrays have the wrong shape", tensor=name, expected=f"[{m}, topk] ids and weights",
                         found=f"{list(ids.shape)} / {list(weights.shape)}")
    out = np.zeros((m, hidden), np.float32) if out is None else out
    if out.dtype != np.float32 or out.shape != (m, hidden) or not out.flags.c_contiguous:
        raise ShapeError("output buffer has the wrong shape", tensor=name, expected=f"float32 [{m}, {hidden}]",
                         found=f"{out.dtype} {list(out.shape)}")
    if not experts:
        return out
    lo, hi = min(experts), max(experts)
    table: list[int] = []
    n_parts = len(next(iter(experts.values())))
    for e in range(lo, hi + 1):
        parts = experts.get(e)
        if parts is not None and len(parts) != n_parts:
            raise VerifyError("experts have different NUMA part counts", tensor=f"{name or 'layer'} expert {e}",
                              expected=str(n_parts), found=str(len(parts)))
        table += _part_table(wtype, parts, hidden, inter_part, f"{name or 'layer'} expert {e}") if parts \
            else [0] * (6 * n_parts)
    status = runtime_lib().kt_rt_moe_forward(_wtype(wtype), hidden, inter_part, n_parts, lo, hi - lo + 1,
                                             np.array(table, np.uintp), x2, m, ids, weights, ids.shape[1], out,
                                             impl_id(impl), max(1, int(threads)))
    native.check_status(status, "kt_rt_moe_forward", name)
    return out
