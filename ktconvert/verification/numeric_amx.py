"""Numeric part of ``ktconvert verify``: run the converted experts through the native runtime and compare.

For each sampled layer (default: first, middle and last converted MoE layer) and sampled experts (default 4, or
"all"), seeded random activations (``tokens`` of them, routed top-k among the sampled experts) go through:

* the native runtime reading the files in place (``ktconvert.native.forward``; tile layout decoded by the kernel),
* (a) numpy: ``METHOD.dequantize(blob, scale)`` of the same bytes, from the layout spec. Kernel and numpy must agree
  to ``KERNEL_TOL`` relative L2 per projection and for the MoE output; more means a kernel or layout bug.
* (b) with ``source``: the original BF16 weights (the source's ``read_expert``: safetensors or GGUF). Reports per layer the relative L2 and
  cosine of the MoE output and of each projection's weights, names the worst experts, and counts weights outside
  the rounding bound of round-to-nearest (``quant == "rtn"``: |w_deq - w| <= 8.5 d INT4, 0.5 d INT8 per element).
* integrity: the sha256 of every tensor read is compared with ``ktconvert.json``'s ``tensors``. Check (a) cannot see
  corrupted bytes (kernel and numpy read the same ones); the hashes catch any changed byte, and (b) catches
  corruption that matters numerically (swapped tiles, another method's files) independently of the manifest.

Memory: one expert's blobs, dequantized and source weights at a time.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ktconvert.errors import InputError, KtConvertError, UsageError, VerifyError
from ktconvert.formats.sources import open_recorded_source
from ktconvert.native import forward as native_rt
from ktconvert.distributed.parts import parse_layers
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.verification.reader import KtOutput

KERNEL_TOL = 1e-5
# The limits on the layer's MoE output against the source weights (relative L2 max / cosine min) are the method's
# ``thresholds``. Measured (fp32 activations, 16 tokens, top-2, E=8): honest RTN per-row INT4 0.44-0.63 rel L2 /
# cosine >= 0.83 on Gaussian with 1% 12-sigma outliers, Student-t(1.5, 2, 3) and the tiny models; per-row INT8
# 0.03 / 0.9996. Garbage (tile layout misread as row-major, experts swapped) lands at 1.3-2.1 / cosine <= 0.15 for
# both. The limits sit between the two.
PROBE = "random"     # what the activations are: seeded Gaussian probe vectors (the report's "probe" key)


def check_numerics(out, manifest: dict, source=None, tokens: int = 8, layers=None, experts="4", threshold=None,
                   *, methods, impl: str | None = None, threads: int | None = None, seed: int = 0,
                   folder=None) -> dict:
    """Numeric verification of output folder ``out`` described by ``manifest`` (see module doc).

    source:    path of the original checkpoint, or None for check (a) and hashes only
    tokens:    activations per layer; layers: None (first/middle/last), "all", "1,3" or a list of ints
    experts:   experts per layer ("4", 4 or "all")
    threshold: None (the method's thresholds) or the MoE relative L2 limit
    methods:   the CPU method registry (ktconvert.methods.METHODS): the manifest's method and its thresholds
    folder:    the folder's verification.folder.OutputFolder when already walked
    returns:   {"ok", "problems": [str], "summary", "probe": "random", "thresholds", "variant", "layers": [row per
                layer; with a source also "expert_errors": [{expert, rel_l2}] of every sampled expert's output],
                "verification": compact dict for the manifest}
    """
    tokens, layers, experts, threshold = numeric_options(tokens, layers, experts, threshold)
    report = {"ok": False, "problems": [], "layers": [], "summary": "numerics not run", "probe": PROBE}
    try:
        rt = KtOutput.open(out, manifest, folder, methods=methods)
        # a method the native runtime has no kernels for (its kt_method is not a runtime weight type) is checked
        # with the numpy forward of its own dequantize alone
        variant = native_rt.variant(impl) if rt.kt_method in native_rt.WTYPES else "numpy (no native kernel)"
        thresholds = _thresholds(rt.method, threshold)
    except KtConvertError as exc:
        report["problems"].append(str(exc))
        return report
    try:
        chosen = choose_layers(rt.layers, layers)
    except InputError as exc:
        report["problems"].append(str(exc))
        return report
    src, mismatch = open_checked_source(source, manifest, rt.layers, (rt.hidden, rt.intermediate, rt.experts))
    if mismatch:
        report["problems"].append(mismatch)
        return report
    report.update(variant=variant, thresholds=thresholds, method=rt.kt_method, tokens=int(tokens), seed=seed)
    threads = threads or min(4, os.cpu_count() or 1)
    for layer in chosen:
        row = _check_layer(rt, src, layer, int(tokens), experts, thresholds, impl, threads, seed)
        report["layers"].append(row)
        report["problems"].extend(f"layer {layer}: {p}" for p in row.pop("problems"))
    report["ok"] = not report["problems"] and bool(report["layers"])
    report["summary"] = _summary(report, src is not None)
    report["verification"] = _verification(report)
    return report


def _thresholds(method, threshold) -> dict:
    limits = dict(method.thresholds)
    if threshold is not None:
        limits["moe_rel_l2"] = float(threshold)
        limits["moe_cosine"] = None
    limits["kernel_rel"] = KERNEL_TOL
    return limits


def open_checked_source(source, manifest: dict, layers, dims: tuple[int, int, int]):
    """(source, mismatch): the opened source (None without one) with every expert tensor header of its MoE layers,
    and of the `layers` among its MTP layers, checked as the conversion's plan checks them (dtype, shape, partners,
    data inside the file): the numerics sample experts, so a broken source must not pass unseen; and why it is not
    the model of the output's `dims` (hidden, intermediate, experts) and `layers` (None: it is). Raises InputError
    (exit 3, bad input) instead of reporting a verification problem."""
    if source is None:
        return None, None
    src = open_recorded_source(source, manifest)
    src.validate(include_mtp=bool(set(layers) & set(src.info.mtp_layers)))
    return src, source_mismatch(src, *dims, layers)


def check_layers(report: dict, chosen, src, limit: float, check_layer, what: str = "") -> None:
    """Each chosen layer's row (``check_layer(layer)``, holding its "problems" and, with a source, "moe_rel_l2")
    into report["layers"]; its problems, and the MoE output's relative L2 above `limit` against the source, into
    report["problems"] prefixed by the layer (`what` names the variant in that line)."""
    for layer in chosen:
        row = check_layer(layer)
        if src is not None and row["moe_rel_l2"] > limit:
            row["problems"].append(f"MoE output rel L2 {row['moe_rel_l2']:.4g} above the limit {limit:g}{what}")
        report["layers"].append(row)
        report["problems"].extend(f"layer {layer}: {p}" for p in row.pop("problems"))


def source_mismatch(src, hidden: int, intermediate: int, experts: int, layers) -> str | None:
    """Why `src` is not the model the output was converted from (dims, experts, layers), or None."""
    if src is None:
        return None
    info = src.info
    theirs, ours = (info.hidden, info.intermediate, info.n_experts), (hidden, intermediate, experts)
    if theirs != ours:
        return (f"--source is another model: hidden, intermediate, experts {list(theirs)}, the output's "
                f"ktconvert.json says {list(ours)}")
    missing = sorted(set(layers) - set(src.all_layers(include_mtp=True)))
    if missing:
        return f"--source has no routed experts in layer(s) {missing}, which the output holds"
    return None


def numeric_options(tokens, layers, experts, threshold) -> tuple[int, object, object, float | None]:
    """The numeric check's options, checked before anything is read: (tokens, an int >= 1; layers, None | "all" |
    sorted layer numbers; experts, "all" | an int >= 1; threshold, None | a finite float >= 0). UsageError (exit 2)
    naming the option otherwise (a NaN threshold would pass everything, --tokens 0 was a traceback)."""
    tokens = _positive_int(tokens, "--tokens", "an integer >= 1")
    if not (isinstance(experts, str) and experts.strip().lower() == "all"):
        experts = _positive_int(experts, "--experts", "'all' or an integer >= 1")
    else:
        experts = "all"
    if isinstance(layers, str) and layers.strip().lower() == "all":
        layers = "all"
    elif isinstance(layers, str):
        layers = parse_layers(layers)         # the conversions' syntax: 1-3, 1,3,5, 1-3,7
    elif layers is not None:
        try:
            layers = sorted({int(x) for x in layers})
        except (TypeError, ValueError):
            layers = []
        if not layers:
            raise UsageError("--layers is not usable", expected="'all' or layer numbers such as 1-3,7",
                             found=repr(layers))
    if threshold is not None:
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            threshold = float("nan")
        if not math.isfinite(threshold) or threshold < 0:
            raise UsageError("--threshold is not usable", expected="a finite number >= 0", found=repr(threshold))
    return tokens, layers, experts, threshold


def _positive_int(value, option: str, expected: str) -> int:
    try:
        number = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < 1:
        raise UsageError(f"{option} is not usable", expected=expected, found=repr(value))
    return number


def choose_layers(all_layers: list[int], layers) -> list[int]:
    """layers as numeric_options returns it: None: first, middle and last; "all"; a list: those (UsageError, exit 2:
    a --layers value naming a layer the output does not hold cannot work, naming the converted layers)."""
    if not all_layers:
        raise InputError("the manifest lists no converted MoE layers", file="ktconvert.json")
    if layers is None:
        return sorted({all_layers[0], all_layers[len(all_layers) // 2], all_layers[-1]})
    if layers == "all":
        return list(all_layers)
    bad = [x for x in layers if x not in all_layers]
    if bad:
        raise UsageError(f"--layers names layer(s) {bad} that this output does not hold",
                         expected=f"some of {all_layers} or 'all'", found=",".join(map(str, layers)))
    return list(layers)


def choose_experts(rng: np.random.Generator, n_experts: int, experts) -> list[int]:
    """experts as numeric_options returns it: "all" or how many to draw (at most n_experts), sorted."""
    if experts == "all":
        return list(range(n_experts))
    return sorted(int(e) for e in rng.choice(n_experts, size=min(int(experts), n_experts), replace=False))


def _routing(rng: np.random.Generator, sample: list[int], tokens: int, top_k: int):
    """int64 ids [tokens, k] (distinct per token, drawn from sample) and float32 weights summing to 1 per token."""
    k = max(1, min(top_k, len(sample)))
    ids = np.stack([rng.choice(sample, size=k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, k)) + 0.1
    return ids, (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb > 0 else float(np.linalg.norm(a) > 0)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else float(na == nb)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, with sigmoid written through tanh so large |g| cannot overflow."""
    return g * (0.5 + 0.5 * np.tanh(0.5 * g)) * u


class _Layer:
    """Accumulators of one layer's check."""

    def __init__(self, tokens: int, hidden: int):
        self.out_native = np.zeros((tokens, hidden), np.float32)
        self.out_deq = np.zeros((tokens, hidden), np.float64)
        self.out_src = np.zeros((tokens, hidden), np.float64)
        self.kernel_rel = 0.0
        self.problems: list[str] = []
        self.weight_err = {p: [0.0, 0.0, 0.0] for p in ("gate", "up", "down")}  # sum |d|^2, sum |w|^2, sum d.w
        self.expert_rel: dict[int, float] = {}
        self.bound_violations = 0
        self.hash_mismatches = 0


def _check_layer(rt, src, layer: int, tokens: int, experts, thresholds: dict, impl, threads: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, layer])
    row = {"layer": layer, "experts": [], "problems": [], "ok": False}
    try:
        rt.check_layer(layer)
        sample = choose_experts(rng, rt.experts, experts)
    except KtConvertError as exc:
        row["problems"].append(str(exc))
        return row
    top_k = int(getattr(getattr(src, "info", None), "experts_per_tok", 0) or 2)
    x = rng.standard_normal((tokens, rt.hidden)).astype(np.float32)
    ids, weights = _routing(rng, sample, tokens, top_k)
    acc = _Layer(tokens, rt.hidden)
    for e in sample:
        try:
            _check_expert(rt, src, layer, e, x, ids, weights, acc, impl, threads)
        except (VerifyError, KtConvertError) as exc:
            acc.problems.append(str(exc))
    row["experts"] = sample
    row.update(_layer_metrics(acc, src is not None, rt.kt_method))
    row["problems"] = acc.problems + _threshold_problems(row, thresholds)
    row["ok"] = not row["problems"]
    return row


def _check_expert(rt, src, layer: int, e: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, acc: _Layer,
                  impl, threads: int) -> None:
    blobs = rt.read_expert(layer, e)
    _check_hashes(rt.manifest, blobs.sha256, acc)
    parts = blobs.parts
    kernel = rt.kt_method in native_rt.WTYPES
    if kernel:
        native_rt.moe_forward(rt.kt_method, rt.hidden, rt.inter_part, {e: parts}, x, ids, weights,
                              out=acc.out_native, impl=impl, threads=threads, name=f"layer {layer} expert {e}")
    deq = [_dequantize_part(rt, part) for part in parts]
    if kernel:
        acc.kernel_rel = max(acc.kernel_rel, _kernel_check(rt, parts, deq, x, impl, threads))
    rows, cols = np.nonzero(ids == e)
    coef = weights[rows, cols].astype(np.float64)[:, None]
    x64 = x.astype(np.float64)
    out_deq_e = _expert_ref(deq, x64)
    acc.out_deq[rows] += coef * out_deq_e[rows]
    if not kernel:      # the numpy forward stands in for the kernels' output
        acc.out_native[rows] += (coef * out_deq_e[rows]).astype(acc.out_native.dtype)
    if src is None:
        return
    ew = src.read_expert(layer, e)
    full = _source_weights(ew)
    out_src_e = _expert_ref([(full[0], full[1], full[2])], x64)
    acc.out_src[rows] += coef * out_src_e[rows]
    acc.expert_rel[e] = rel_l2(out_deq_e, out_src_e)
    _weight_errors(rt, deq, parts, full, acc)


def expert_reader(out, manifest: dict, folder=None, *, methods):
    """A function (layer, expert) -> {"gate", "up": float32 [I, H], "down": float32 [H, I]}: the expert as the
    folder's files hold it (numpy dequantization from the layout spec, NUMA parts joined). Every tensor read must
    hash as ``ktconvert.json`` records it (VerifyError otherwise)."""
    rt = KtOutput.open(out, manifest, folder, methods=methods)

    def read(layer: int, e: int) -> dict:
        blobs = rt.read_expert(layer, e)
        problems = hash_problems(rt.manifest, blobs.sha256)
        if problems:
            raise VerifyError(problems[0], tensor=f"layer {layer} expert {e}")
        parts = [_dequantize_part(rt, part) for part in blobs.parts]
        return {"gate": np.concatenate([p[0] for p in parts]), "up": np.concatenate([p[1] for p in parts]),
                "down": np.concatenate([p[2] for p in parts], axis=1)}

    return read


def _check_hashes(manifest: dict, sha256: dict, acc: _Layer) -> None:
    problems = hash_problems(manifest, sha256)
    acc.hash_mismatches += len(problems)
    acc.problems.extend(problems)


def hash_problems(manifest: dict, sha256: dict) -> list[str]:
    """One line per tensor whose sha256 (``sha256[key]``) is not what ktconvert.json's ``tensors`` records."""
    recorded = manifest.get("tensors", {})
    return [f"{key}: sha256 differs from ktconvert.json (file changed after conversion)" if key in recorded
            else f"{key}: not listed in ktconvert.json tensors"
            for key, digest in sorted(sha256.items()) if recorded.get(key) != digest]


def _dequantize_part(rt, part) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 gate [I_t, H], up [I_t, H], down [H, I_t] of one NUMA part, from the layout spec (numpy)."""
    out = []
    for proj, (w, s) in zip(("gate", "up", "down"), part):
        n, k = rt.shapes[proj][:2]
        out.append(rt.method.dequantize(w, s, n, k))
    return tuple(out)


def _expert_ref(deq_parts, x64: np.ndarray) -> np.ndarray:
    """float64 [tokens, H]: sum over parts of down (silu(gate x) * up x)."""
    out = np.zeros((x64.shape[0], deq_parts[0][2].shape[0]))
    for gate, up, down in deq_parts:
        h = silu_mul(x64 @ gate.T.astype(np.float64), x64 @ up.T.astype(np.float64))
        out += h @ down.T.astype(np.float64)
    return out


def _kernel_check(rt, parts, deq, x: np.ndarray, impl, threads: int) -> float:
    """Largest relative L2 between the native GEMMs and numpy's dequantized weights, over every projection."""
    worst = 0.0
    for part, (gate, up, down) in zip(parts, deq):
        ys = []
        for (w, s), wf, proj in zip(part[:2], (gate, up), ("gate", "up")):
            n, k = rt.shapes[proj][:2]
            y = native_rt.gemm(rt.kt_method, w, s, n, k, x, impl=impl, threads=threads)
            ys.append(y)
            worst = max(worst, rel_l2(y, x.astype(np.float64) @ wf.T.astype(np.float64)))
        h = silu_mul(ys[0].astype(np.float64), ys[1].astype(np.float64)).astype(np.float32)
        n, k = rt.shapes["down"][:2]
        y = native_rt.gemm(rt.kt_method, part[2][0], part[2][1], n, k, h, impl=impl, threads=threads)
        worst = max(worst, rel_l2(y, h.astype(np.float64) @ down.T.astype(np.float64)))
    return worst


def _source_weights(ew) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return bf16_bits_to_f32(ew.gate), bf16_bits_to_f32(ew.up), bf16_bits_to_f32(ew.down)


def _weight_errors(rt, deq, parts, full, acc: _Layer) -> None:
    """Accumulate per-projection error energy and the count of weights outside the RTN rounding bound."""
    gate = np.concatenate([d[0] for d in deq], axis=0)
    up = np.concatenate([d[1] for d in deq], axis=0)
    down = np.concatenate([d[2] for d in deq], axis=1)
    for proj, wq, w in (("gate", gate, full[0]), ("up", up, full[1]), ("down", down, full[2])):
        wq64, w64 = wq.astype(np.float64), w.astype(np.float64)
        err = acc.weight_err[proj]
        err[0] += float(((wq64 - w64) ** 2).sum())
        err[1] += float((w64 ** 2).sum())
        err[2] += float((wq64 * w64).sum())
    bound = getattr(rt.method, "rtn_bound", 0.0)
    if rt.manifest.get("quant", "rtn") != "rtn" or not bound:
        return
    for t, part in enumerate(parts):
        i0, i1 = t * rt.inter_part, (t + 1) * rt.inter_part
        for (w, s), wq, ws in zip(part, deq[t], (full[0][i0:i1], full[1][i0:i1], full[2][:, i0:i1])):
            limit = bound * _per_weight(s, wq.shape) * (1 + 1e-5) + 1e-35
            acc.bound_violations += int((np.abs(wq.astype(np.float64) - ws) > limit).sum())


def _per_weight(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float64 [n, k]: each weight's scale, from scales of any declared shape with n rows ([n]: per row, [n, g]:
    one per k/g in-features)."""
    n, k = shape
    per_row = np.asarray(scale, np.float64).reshape(n, -1)
    return np.repeat(per_row, k // per_row.shape[1], axis=1)


def _layer_metrics(acc: _Layer, with_source: bool, kt_method: str) -> dict:
    row = {"kernel_rel": acc.kernel_rel, "moe_kernel_rel": rel_l2(acc.out_native, acc.out_deq),
           "hash_mismatches": acc.hash_mismatches}
    if not with_source:
        return row
    row["moe_rel_l2"] = rel_l2(acc.out_native, acc.out_src)
    row["moe_cosine"] = _cos(acc.out_native, acc.out_src)
    for proj, (d2, w2, dw) in acc.weight_err.items():
        row[f"{proj}_rel_l2"] = float(np.sqrt(d2 / w2)) if w2 > 0 else 0.0
        q2 = d2 + 2 * dw - w2            # |wq|^2 from |wq - w|^2 = |wq|^2 - 2 wq.w + |w|^2
        row[f"{proj}_cosine"] = float(dw / np.sqrt(max(q2, 1e-300) * w2)) if w2 > 0 else 1.0
    row["rtn_bound_violations"] = acc.bound_violations
    row["expert_errors"] = [{"expert": e, "rel_l2": r} for e, r in sorted(acc.expert_rel.items())]
    worst = sorted(acc.expert_rel.items(), key=lambda kv: -kv[1])[:3]
    row["worst_experts"] = [{"expert": e, "rel_l2": r} for e, r in worst]
    return row


def kernel_problems(row: dict) -> list[str]:
    """The line for a layer row whose native runtime ("kernel_rel": projections, "moe_kernel_rel": MoE output)
    differs from numpy's dequantized weights by more than KERNEL_TOL (NaN included)."""
    bad = [v for v in (row.get("kernel_rel", 0.0), row.get("moe_kernel_rel", 0.0)) if not v <= KERNEL_TOL]
    if bad:
        return [f"native runtime differs from numpy's dequantized weights: relative L2 {max(bad):.3g} > {KERNEL_TOL} "
                f"(kernel or layout bug)"]
    return []


def _threshold_problems(row: dict, thresholds: dict) -> list[str]:
    problems = kernel_problems(row)
    if "moe_rel_l2" not in row:
        return problems
    worst = ", ".join(f"expert {w['expert']} ({w['rel_l2']:.3g})" for w in row["worst_experts"])
    if row["moe_rel_l2"] > thresholds["moe_rel_l2"]:
        problems.append(f"MoE output vs source weights: relative L2 {row['moe_rel_l2']:.3g} > "
                        f"{thresholds['moe_rel_l2']} (worst: {worst})")
    if thresholds.get("moe_cosine") is not None and row["moe_cosine"] < thresholds["moe_cosine"]:
        problems.append(f"MoE output vs source weights: cosine {row['moe_cosine']:.3g} < {thresholds['moe_cosine']}"
                        f" (worst: {worst})")
    if row["rtn_bound_violations"]:
        problems.append(f"{row['rtn_bound_violations']} weight(s) farther from the source than round-to-nearest "
                        f"allows (corrupted or misplaced data; worst: {worst})")
    return problems


def _summary(report: dict, with_source: bool) -> str:
    rows = report["layers"]
    if not rows:
        return "no layers checked"
    n_exp = sum(len(r["experts"]) for r in rows)
    text = (f"{len(rows)} layer(s), {n_exp} expert(s), {report['tokens']} tokens, {report['variant']}; kernel vs "
            f"numpy max {max(r.get('kernel_rel', 0) for r in rows):.2g}")
    if with_source and all("moe_rel_l2" in r for r in rows):
        text += (f"; MoE vs source rel L2 max {max(r['moe_rel_l2'] for r in rows):.3g} "
                 f"(limit {report['thresholds']['moe_rel_l2']})")
    return text


def _verification(report: dict) -> dict:
    """Compact, deterministic record for ktconvert.json (4 significant digits, no time, no host)."""
    def r4(v):
        return float(f"{v:.4g}")

    layers = {}
    for row in report["layers"]:
        entry = {"experts": row["experts"], "ok": row["ok"], "kernel_rel": r4(row.get("kernel_rel", 0.0))}
        for key in ("moe_rel_l2", "moe_cosine", "gate_rel_l2", "up_rel_l2", "down_rel_l2"):
            if key in row:
                entry[key] = r4(row[key])
        layers[str(row["layer"])] = entry
    return {"ok": report["ok"], "method": report.get("method"), "tokens": report.get("tokens"),
            "seed": report.get("seed"), "thresholds": report.get("thresholds"), "layers": layers}
