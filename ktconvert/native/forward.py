"""ctypes bindings of the verification runtime (native/kt_runtime.h): GEMMs and the routed-expert MoE forward
computed on kt-kernel's on-disk weight layouts in place.

Weight types: "AMXINT4" / "AMXINT8" (tiled blob uint8 + float32 per-row scale d), "BF16" (uint16 [n, k] rows,
HF orientation, no scale) and "RAWINT4" (kt-format.md 2.6: ``weight_packed`` int32 [n, k/8] or its bytes uint8
[n, k/2], ``weight_scale`` BF16 bits uint16 [n, k/group]; ``group`` None infers it as kt-kernel does, k / scale
columns). Activations and results are float32; results equal ``dequantize(w, scale) @ x`` to fp32 summation
accuracy (the avx512-vnni variant sums AMX blobs exactly in integers; see kt_runtime.h). RAWINT4's dequantized
weights are q * fp32(scale), exact (compressed-tensors' decompression rounds them to BF16).

``impl``: None (the automatic choice, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512".
``threads``: C threads over row blocks; results never depend on it.
An expert ("parts") is a list of NUMA parts, each ``((gate_w, gate_s), (up_w, up_s), (down_w, down_s))``:
gate/up [n = inter_part, k = hidden], down [n = hidden, k = inter_part]; scales are None for BF16. RAWINT4 parts are
views into the whole matrices, split as kt-kernel splits them in memory: ``rawint4_parts`` makes them.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ktconvert import native
from ktconvert.errors import ShapeError, VerifyError

WTYPES = {"AMXINT4": 4, "AMXINT8": 8, "BF16": 16, "RAWINT4": 41}
K_MULTIPLE = {"AMXINT4": 128, "AMXINT8": 64, "BF16": 1}
N_MULTIPLE = {"AMXINT4": 32, "AMXINT8": 32, "BF16": 1}
GROUPED = ("RAWINT4",)  # weight types with group scales: their calls carry the group size
GROUP_MULTIPLE = 8     # RAWINT4: whole int32 words per group

_I64, _INT = ctypes.c_int64, ctypes.c_int


def _signatures() -> dict:
    a, out, f32 = native.array, native.out_array, np.float32
    pointers = a(np.uintp)  # a table of matrix addresses, each checked by check_matrix / rawint4_matrix first
    return {  # the *_grouped calls: kt_rt_gemm & co. with the group size (0 for the ungrouped types)
        "kt_rt_gemm_grouped": (_INT, [_INT, _I64, a(), a(nullable=True), _I64, _I64, a(f32), _I64, out(f32), _INT,
                                      _INT]),
        "kt_rt_expert_forward_grouped": (_INT, [_INT, _I64, _I64, _I64, _INT, pointers, a(f32), _I64, a(f32),
                                                out(f32), _INT, _INT]),
        "kt_rt_moe_forward_grouped": (_INT, [_INT, _I64, _I64, _I64, _INT, _I64, _I64, pointers, a(f32), _I64,
                                             a(np.int64), a(f32), _I64, out(f32), _INT, _INT]),
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


def variant(impl: str | None = None, wtype: str | None = None) -> str:
    """"scalar" | "avx2" | "avx512" | "avx512-vnni": the kernels a call with ``impl`` runs (for ``wtype``: BF16 and
    RAWINT4 have no integer kernels, the avx512-vnni row runs the AVX-512 fp32 ones for them)."""
    runtime_lib()
    name = native.variant(impl)
    return "avx512" if name == "avx512-vnni" and wtype in ("BF16", "RAWINT4") else name


def _wtype(wtype: str) -> int:
    if wtype not in WTYPES:
        raise ShapeError("unknown runtime weight type", expected=" | ".join(WTYPES), found=repr(wtype))
    return WTYPES[wtype]


def weight_nbytes(wtype: str, n: int, k: int) -> int:
    """Bytes of one [n, k] weight: n*k/2 (AMXINT4, RAWINT4), n*k (AMXINT8), 2*n*k (BF16)."""
    return {"AMXINT4": n * k // 2, "AMXINT8": n * k, "BF16": 2 * n * k, "RAWINT4": n * k // 2}[wtype]


def check_matrix(wtype: str, w: np.ndarray, scale: np.ndarray | None, n: int, k: int, name: str | None = None) -> None:
    """ShapeError / VerifyError naming ``name`` unless (w, scale) hold exactly one [n, k] weight of ``wtype``."""
    if _wtype(wtype) == WTYPES["RAWINT4"]:
        rawint4_matrix(w, scale, n, k, None, name)
        return
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


def infer_group(k: int, scale, name: str | None = None) -> int:
    """RAWINT4's group size as kt-kernel infers it: k / the columns of weight_scale [n, k/group] (k = hidden for the
    gate scale). ShapeError naming ``name`` when the columns do not divide k."""
    cols = scale.shape[1] if isinstance(scale, np.ndarray) and scale.ndim == 2 else 0
    if cols <= 0 or k % cols:
        raise ShapeError("RAWINT4 group size cannot be inferred (k / weight_scale columns)", tensor=name,
                         expected=f"weight_scale [n, k/group] with k = {k}", found=str(list(np.shape(scale))))
    return k // cols


def rawint4_matrix(w: np.ndarray, scale: np.ndarray, n: int, k: int, group: int | None, name: str | None = None,
                   row_k: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(packed bytes uint8 [n, k/2], scale bits uint16 [n, k/group], group) of one RAWINT4 matrix, checked: w is
    weight_packed (int32 [n, k/8]) or its bytes, scale BF16 bits; rows row_k columns apart (None: k, contiguous;
    a NUMA part of down is a column range of the whole matrix's rows). group None: inferred (``infer_group``).
    ShapeError for a shape RAWINT4 cannot have, VerifyError naming ``name`` for arrays that do not match it."""
    group = infer_group(k, scale, name) if group is None else int(group)
    if n <= 0 or k <= 0 or group <= 0 or group % GROUP_MULTIPLE or k % group:
        raise ShapeError("matrix shape incompatible with RAWINT4", tensor=name, found=f"[{n}, {k}], group {group}",
                         expected=f"k % group == 0, group % {GROUP_MULTIPLE} == 0")
    row_k = k if row_k is None else row_k
    packed = w.view(np.uint8) if isinstance(w, np.ndarray) and w.dtype == np.int32 and w.ndim == 2 else w
    if not _strided(packed, np.uint8, (n, k // 2), row_k // 2):
        raise VerifyError("RAWINT4 weight_packed has the wrong shape", tensor=name,
                          expected=f"int32 [{n}, {k // 8}] (uint8 [{n}, {k // 2}]), rows {row_k // 2} bytes apart",
                          found=_describe(w))
    if not _strided(scale, np.uint16, (n, k // group), row_k // group):
        raise VerifyError("RAWINT4 weight_scale has the wrong shape", tensor=name,
                          expected=f"BF16 bits uint16 [{n}, {k // group}], rows {row_k // group} scales apart",
                          found=_describe(scale))
    return packed, scale, group


def _strided(a, dtype, shape: tuple[int, int], row_stride: int) -> bool:
    """a is a 2-D ``dtype`` array of ``shape``, contiguous along rows, rows ``row_stride`` items apart."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
        return False
    item = a.itemsize
    return a.strides[1] == item and (shape[0] == 1 or a.strides[0] == row_stride * item)


def _describe(a) -> str:
    if not isinstance(a, np.ndarray):
        return type(a).__name__
    return f"{a.dtype} {list(a.shape)}" + ("" if a.flags.c_contiguous else f", strides {list(a.strides)}")


def rawint4_parts(gate: tuple, up: tuple, down: tuple, parts: int) -> list:
    """NUMA parts of one RAWINT4 expert as kt-kernel splits them in memory (kt-format.md 2.6): part t holds gate/up
    rows [t*I/T, (t+1)*I/T) with their scale rows, and down's columns of the same range in every row with the
    matching scale groups. gate / up / down: (weight_packed, weight_scale) of the whole matrices (gate/up [I, H],
    down [H, I]). Views, no copies; ShapeError when I/T is not a whole number of down's groups."""
    (gw, gs), (uw, us), (dw, ds) = ((_bytes(w), s) for w, s in (gate, up, down))
    inter = gw.shape[0]
    if parts < 1 or inter % parts or ds.ndim != 2 or ds.shape[1] % parts:
        raise ShapeError("RAWINT4 expert cannot be split into NUMA parts", expected=f"I/T whole groups of down, "
                         f"T = {parts}", found=f"I = {inter}, down scale {list(np.shape(ds))}")
    ip, gp = inter // parts, ds.shape[1] // parts
    return [((gw[t * ip:(t + 1) * ip], gs[t * ip:(t + 1) * ip]), (uw[t * ip:(t + 1) * ip], us[t * ip:(t + 1) * ip]),
             (dw[:, t * ip // 2:(t + 1) * ip // 2], ds[:, t * gp:(t + 1) * gp])) for t in range(parts)]


def _bytes(w):
    return np.ascontiguousarray(w).view(np.uint8) if isinstance(w, np.ndarray) and w.dtype == np.int32 else w


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
         impl: str | None = None, threads: int = 1, name: str | None = None, group: int | None = None) -> np.ndarray:
    """y float32 [m, n] = x [m, k] @ W^T (x [k] gives y [n]), W read in place from its on-disk bytes.
    group: RAWINT4's group size (None: inferred from the scale); ignored by the other types."""
    if _wtype(wtype) == WTYPES["RAWINT4"]:
        w, scale, group = rawint4_matrix(w, scale, n, k, group, name)
    else:
        check_matrix(wtype, w, scale, n, k, name)
        group = 0
    x2 = _activations(x, k, name)
    y = np.empty((x2.shape[0], n), np.float32)
    status = runtime_lib().kt_rt_gemm_grouped(_wtype(wtype), group, w, scale if wtype != "BF16" else None, n, k, x2,
                                              x2.shape[0], y, impl_id(impl), max(1, int(threads)))
    native.check_status(status, "kt_rt_gemm", name)
    return y[0] if np.ndim(x) == 1 else y


def _part_table(wtype: str, parts: Sequence, hidden: int, inter_part: int, name: str | None,
                group: int = 0) -> list[int]:
    """6 pointers per NUMA part (gate_w, gate_s, up_w, up_s, down_w, down_s), after checking every size (RAWINT4:
    every view, down's rows as long as the whole matrix's)."""
    pointers = []
    for t, part in enumerate(parts):
        for proj, (w, s) in zip(("gate", "up", "down"), part):
            n, k = (inter_part, hidden) if proj != "down" else (hidden, inter_part)
            where = f"{name or 'expert'} {proj} numa {t}"
            if group:
                w, s, _ = rawint4_matrix(w, s, n, k, group, where, k if proj != "down" else len(parts) * k)
            else:
                check_matrix(wtype, w, s, n, k, where)
            pointers += [_ptr(w), _ptr(s) if wtype != "BF16" else 0]
    return pointers


def _group(wtype: str, parts: Sequence, hidden: int, group: int | None, name: str | None) -> int:
    """The group size of the call: RAWINT4's (None: inferred from part 0's gate scale, as kt-kernel does), else 0."""
    if _wtype(wtype) != WTYPES["RAWINT4"]:
        return 0
    return infer_group(hidden, parts[0][0][1], f"{name or 'expert'} gate numa 0") if group is None else int(group)


def expert_forward(wtype: str, hidden: int, inter_part: int, parts: Sequence, x: np.ndarray,
                   impl: str | None = None, threads: int = 1, name: str | None = None,
                   group: int | None = None) -> np.ndarray:
    """float32 [m, hidden]: sum over NUMA parts t of down_t(silu(gate_t x) * up_t x) for x float32 [m, hidden]."""
    group = _group(wtype, parts, hidden, group, name)
    table = _part_table(wtype, parts, hidden, inter_part, name, group)
    x2 = _activations(x, hidden, name)
    m = x2.shape[0]
    out = np.zeros((m, hidden), np.float32)
    coef = np.ones(m, np.float32)
    status = runtime_lib().kt_rt_expert_forward_grouped(_wtype(wtype), group, hidden, inter_part, len(parts),
                                                        np.array(table, np.uintp), x2, m, coef, out, impl_id(impl),
                                                        max(1, int(threads)))
    native.check_status(status, "kt_rt_expert_forward", name)
    return out


def moe_forward(wtype: str, hidden: int, inter_part: int, experts: dict, x: np.ndarray, topk_ids: np.ndarray,
                topk_weights: np.ndarray, out: np.ndarray | None = None, impl: str | None = None,
                threads: int = 1, name: str | None = None, group: int | None = None) -> np.ndarray:
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
    group = _group(wtype, experts[lo], hidden, group, f"{name or 'layer'} expert {lo}")
    for e in range(lo, hi + 1):
        parts = experts.get(e)
        if parts is not None and len(parts) != n_parts:
            raise VerifyError("experts have different NUMA part counts", tensor=f"{name or 'layer'} expert {e}",
                              expected=str(n_parts), found=str(len(parts)))
        table += _part_table(wtype, parts, hidden, inter_part, f"{name or 'layer'} expert {e}", group) if parts \
            else [0] * (6 * n_parts)
    status = runtime_lib().kt_rt_moe_forward_grouped(_wtype(wtype), group, hidden, inter_part, n_parts, lo,
                                                     hi - lo + 1, np.array(table, np.uintp), x2, m, ids, weights,
                                                     ids.shape[1], out, impl_id(impl), max(1, int(threads)))
    native.check_status(status, "kt_rt_moe_forward", name)
    return out
