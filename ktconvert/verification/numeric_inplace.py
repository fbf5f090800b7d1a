"""Numeric part of ``ktconvert verify`` for the in-place outputs (bf16, rawint4, fp8).

These files are ordinary HF tensors that kt-kernel's native loaders read and slice themselves, so the check decodes
each sampled expert matrix with the input decoders (``formats/decoders``: compressed-tensors int4 and FP8 block
dequantization, the same code that reads such checkpoints as inputs) and compares, with ``source``, against the
source weights: relative L2 and cosine per projection and of the layer's MoE output on seeded random activations.
Without a source only decodability, finiteness and the hashes of what was read are checked.

RAWINT4 goes further (``numeric_rawint4``): the group size kt-kernel infers and whether kt-kernel 0.7.2 runs it, and
the layer's MoE forward through the native runtime on the files' bytes, split into NUMA parts as kt-kernel splits
them, against numpy's exact dequantization (to fp32 summation accuracy) and, with a source, against the source's
("runtime_moe_rel_l2", next to the decoded output's moe_rel_l2, which the limit applies to as for every method).
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import InputError, KtConvertError, VerifyError
from ktconvert.formats.digests import digest_like
from ktconvert.formats.inplace_sink import PROJ_NAMES, expert_module
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.verification import numeric_rawint4
from ktconvert.verification.folder import OutputFolder
from ktconvert.verification.numeric_amx import (PROBE, check_layers, choose_experts, choose_layers,
                                                kernel_problems, numeric_options, open_checked_source, rel_l2, silu_mul)



def check_inplace_numerics(out, manifest: dict, source=None, tokens: int = 8, layers=None, experts="4",
                           threshold=None, seed: int = 0, folder: OutputFolder | None = None, *, method,
                           impl: str | None = None, threads: int | None = None) -> dict:
    """{"ok", "problems", "summary", "probe": "random", "layers": [{layer, experts, weight_rel_l2 (the worst
    matrix), with a source also moe_rel_l2, gate_rel_l2 / up_rel_l2 / down_rel_l2 (over the sampled experts) and
    expert_errors [{expert, rel_l2 of its output}]}]} for an in-place output folder (see module doc).
    RAWINT4 where the native runtime runs: also "variant" and "thresholds" at the top and kernel_rel /
    moe_kernel_rel (and with a source runtime_moe_rel_l2) per layer, as numeric_amx reports them (impl, threads:
    the runtime's, as there).
    folder: the folder's verification.folder.OutputFolder when already walked (its shard headers are reused);
    method: the manifest's CPU method (its thresholds["moe_rel_l2"] is the default MoE-output limit)."""
    tokens, layers, experts, threshold = numeric_options(tokens, layers, experts, threshold)
    report = {"ok": False, "problems": [], "layers": [], "summary": "numerics not run", "probe": PROBE}
    try:
        ck = (folder or OutputFolder.scan(out)).checkpoint()
        scheme = detect_scheme(ck.config)
        model = manifest["model"]
        all_layers = [int(x) for x in model["layers"]]
        dims = (int(model["hidden"]), int(model["intermediate"]), int(model["experts"]))
        runtime = numeric_rawint4.Runtime(manifest, method, impl, threads) if numeric_rawint4.applies(method) else None
    except KtConvertError as exc:
        report["problems"].append(str(exc))
        return report
    except (KeyError, TypeError, ValueError) as exc:
        report["problems"].append(f"ktconvert.json: model lacks what the numerics need ({exc!r})")
        return report
    try:
        chosen = choose_layers(all_layers, layers)
    except InputError as exc:
        report["problems"].append(str(exc))
        return report
    src, mismatch = open_checked_source(source, manifest, all_layers, dims)
    if mismatch:
        report["problems"].append(mismatch)
        return report
    limit = method.thresholds["moe_rel_l2"] if threshold is None else float(threshold)
    rng = np.random.default_rng(seed)
    check_layers(report, chosen, src, limit, lambda layer: _check_layer(
        ck, scheme, src, manifest, layer, choose_experts(rng, dims[2], experts), tokens, rng, runtime, method))
    if runtime is not None:
        report["problems"] = list(runtime.problems) + report["problems"]
        report.update(runtime.report_fields(limit))
    report["ok"] = not report["problems"]
    worst = max((r.get("moe_rel_l2", 0.0) for r in report["layers"]), default=0.0)
    report["summary"] = (f"{len(report['layers'])} layer(s), decoded and hashed"
                         + (runtime.summary(report["layers"]) if runtime is not None else "")
                         + (f"; MoE vs source rel L2 max {worst:.4g} (limit {limit:g})" if src else ""))
    return report


def expert_reader(out, manifest: dict, folder: OutputFolder | None = None, method=None):
    """A function (layer, expert) -> {"gate", "up": float32 [I, H], "down": float32 [H, I]}: the expert as the
    folder's tensors hold it, decoded with the input decoders; every tensor read must hash as ``ktconvert.json``
    records it (VerifyError otherwise). method: the manifest's CPU method (its module naming; None: HF's)."""
    ck = (folder or OutputFolder.scan(out)).checkpoint()
    scheme = detect_scheme(ck.config)

    def read(layer: int, e: int) -> dict:
        mats, problems = {}, []
        for proj in PROJ_NAMES:
            base = expert_module(method, layer, e, proj)
            _check_hashes(ck, base, manifest, problems)
            mats[proj] = _f32(decode_matrix(ck, base, scheme))
        if problems:
            raise VerifyError(problems[0], tensor=f"layer {layer} expert {e}")
        return mats

    return read


def _check_layer(ck, scheme, src, manifest, layer, sample, tokens, rng, runtime=None, method=None) -> dict:
    hidden, inter = int(manifest["model"]["hidden"]), int(manifest["model"]["intermediate"])
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    forward = runtime.layer(ck, layer, x, sample) if runtime is not None else None
    got_y = np.zeros((tokens, hidden), np.float64)
    ref_y = np.zeros((tokens, hidden), np.float64)
    row = {"layer": layer, "experts": list(sample), "problems": [], "weight_rel_l2": 0.0}
    energy = {p: [0.0, 0.0] for p in PROJ_NAMES}      # sum |w_out - w_src|^2, sum |w_src|^2 per projection
    experts = []
    for e in sample:
        try:
            mats = _decoded_expert(ck, scheme, manifest, layer, e, (hidden, inter), row["problems"], method)
            if forward is not None:
                forward.expert(e)
        except KtConvertError as exc:      # a tensor of the output missing, misshapen or undecodable
            row["problems"].append(str(exc))
            continue
        got_e = _expert(mats, x)
        got_y += got_e
        if src is not None:
            ew = src.read_expert(layer, e)
            ref = {p: _f32(getattr(ew, p)) for p in PROJ_NAMES}
            ref_e = _expert(ref, x)
            ref_y += ref_e
            experts.append({"expert": e, "rel_l2": rel_l2(got_e, ref_e)})
            err = max(rel_l2(mats[p], ref[p]) for p in PROJ_NAMES)
            row["weight_rel_l2"] = max(row["weight_rel_l2"], err)
            for p in PROJ_NAMES:
                energy[p][0] += float(((mats[p].astype(np.float64) - ref[p]) ** 2).sum())
                energy[p][1] += float((ref[p].astype(np.float64) ** 2).sum())
    if src is not None:
        row["moe_rel_l2"] = rel_l2(got_y, ref_y)
        row.update({f"{p}_rel_l2": float(np.sqrt(d2 / w2)) if w2 > 0 else 0.0 for p, (d2, w2) in energy.items()})
        row["expert_errors"] = experts
    if forward is not None:
        row.update(forward.metrics(ref_y if src is not None else None))
        row["problems"] += kernel_problems(row)
    return row


def _decoded_expert(ck, scheme, manifest, layer: int, e: int, dims: tuple[int, int], problems: list,
                    method=None) -> dict:
    """{proj: float32 matrix} of one output expert, each checked to be gate/up [I, H], down [H, I] (dims = (H, I))
    before decoding; hash and finiteness problems are appended to `problems`."""
    hidden, inter = dims
    mats = {}
    for proj in PROJ_NAMES:
        base = expert_module(method, layer, e, proj)
        validate_matrix(ck, base, scheme, (hidden, inter) if proj == "down" else (inter, hidden))
        _check_hashes(ck, base, manifest, problems)
        mats[proj] = _f32(decode_matrix(ck, base, scheme))
        if not np.isfinite(mats[proj]).all():
            problems.append(f"{base}: non-finite values after decoding")
    return mats


def _check_hashes(ck, base: str, manifest: dict, problems: list) -> None:
    """Every tensor of module `base` read back must hash as recorded in ktconvert.json."""
    for name in (n for n in ck.tensors if n.startswith(base + ".")):
        want = manifest.get("tensors", {}).get(name)
        ref = ck.tensors[name]
        data = ck.read(name).tobytes()
        if want is not None and digest_like(want, data) != want:
            problems.append(f"{ref.file.name}: {name}: sha256 differs from ktconvert.json")


def _f32(bits: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(bits)


def _expert(m: dict, x: np.ndarray) -> np.ndarray:
    return silu_mul(x @ m["gate"].T, x @ m["up"].T) @ m["down"].T
