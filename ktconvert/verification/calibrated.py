"""``verify OUT --source SRC --calibration FILE [--compare OUT2]``: numerics on the hidden states real tokens
produce, instead of random probes.

The calibration tokens go through the source model one decoder layer at a time (``ktconvert.gptq.stream``:
transformers' own layer code in float32, weights read per layer), as ``expert-stats`` runs them. At every checked
MoE layer the experts module's input is kept (hidden states [T, H], the model's own router choice: top-k ids and
weights), and the routed experts' output is computed per token, summed over its top-k experts with the router's
weights, three ways:

    source  the expert modules (their family's activation and biases) with the source weights
    OUT     the same modules with OUT's experts as its files hold them (``CpuMethod.expert_reader``: the dequantized
            weights kt-kernel computes with, every tensor read checked against ``ktconvert.json``'s sha256)
    OUT2    the same with ``--compare``'s experts

Per layer: relative L2 ``|Y_out - Y_src| / |Y_src|`` and cosine over all calibration tokens; overall: the square root
of the summed squared errors over the summed squared norms. The stream carries the float layer output on, so each
layer's error is its own. The method's MoE limit (``thresholds["moe_rel_l2"]``, or ``--threshold``) applies to OUT.

Memory: one decoder layer's weights, the calibration hidden states, the layer's MoE outputs (T x H float32 each)
and one expert of each output at a time.
"""
from __future__ import annotations

from ktconvert.errors import InputError, KtConvertError, UsageError
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.gptq.skeleton import expert_forward, experts_module, float_params, routed
from ktconvert.gptq.stream import DecoderStream
from ktconvert.methods import CpuMethod
from ktconvert.verification.numeric_amx import choose_layers

PROBE = "calibration"


class ErrorStream(DecoderStream):
    """The float layer stream; process_layer returns ``layer_errors`` for the checked MoE layers, None elsewhere.
    readers: {name: read(layer, expert) -> {proj: float32 [n, k]}}."""

    def __init__(self, source, samples: list, readers: dict, layers: list[int], device: str | None = None):
        import torch

        super().__init__(source, samples, dtype=torch.float32, device=device)
        self.readers, self.checked = readers, set(layers)

    def process_layer(self, L: int, layer):
        experts = experts_module(layer) if L in self.checked else None
        if experts is None:
            self.propagate(L, layer)
            return None
        captured = []

        def hook(module, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("top_k_index", "top_k_weights") if k in kwargs]
            captured.append(tuple(v.detach().to("cpu") for v in values[:3]))

        handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.propagate(L, layer)
        finally:
            handle.remove()
        return layer_errors(L, experts, captured, self.readers)


def layer_errors(L: int, experts, captured: list, readers: dict) -> dict:
    """{"layer", "tokens", "outputs": {name: {"moe_rel_l2", "moe_cosine", "err2", "ref2"}}} of one MoE layer.
    captured: per sample (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""
    import torch

    x = torch.cat([c[0].reshape(-1, c[0].shape[-1]) for c in captured]).float()
    index = torch.cat([c[1].reshape(-1, c[1].shape[-1]) for c in captured])
    weight = torch.cat([c[2].reshape(-1, c[2].shape[-1]) for c in captured]).float()
    reference = torch.zeros_like(x)
    outputs = {name: torch.zeros_like(x) for name in readers}
    with torch.no_grad():
        for e in range(experts.num_experts):
            tokens, coef = routed(index, weight, e)
            if tokens.numel() == 0:
                continue
            expert, xe, coef = experts[e], x[tokens].to(experts[e].down_proj.weight.device), coef.unsqueeze(1)
            params = float_params(expert)
            reference.index_add_(0, tokens, (coef.to(xe.device) * expert_forward(expert, params, xe)).cpu())
            for name, read in readers.items():
                weights = {p: _tensor(w, xe.device) for p, w in read(L, e).items()}
                y = expert_forward(expert, params, xe, weights)
                outputs[name].index_add_(0, tokens, (coef.to(xe.device) * y).cpu())
    return {"layer": L, "tokens": int(x.shape[0]),
            "outputs": {name: _metrics(out, reference) for name, out in outputs.items()}}


def _tensor(array, device):
    import torch

    return torch.from_numpy(array).to(device)


def _metrics(out, reference) -> dict:
    diff, ref, got = (t.double().reshape(-1) for t in (out - reference, reference, out))
    err2, ref2, got2 = float(diff @ diff), float(ref @ ref), float(got @ got)
    rel = (err2 / ref2) ** 0.5 if ref2 > 0 else float(err2 > 0)
    cos = float(got @ ref) / (got2 * ref2) ** 0.5 if got2 > 0 and ref2 > 0 else float(got2 == ref2)
    return {"moe_rel_l2": rel, "moe_cosine": cos, "err2": err2, "ref2": ref2}


def check_calibrated(out, manifest: dict, source, calibration, *, compare=None, layers=None, threshold=None,
                     max_length: int = 2048, num_samples: int | None = None, folder=None,
                     device: str | None = None) -> dict:
    """The numerics report of ``verify --calibration`` (module docstring) for output folder `out`.

    source: the HF safetensors checkpoint OUT was converted from (required: the tokens run through it);
    calibration: jsonl path (ktconvert.gptq.calibration) or a list of 1-D int64 token tensors; compare: a second
    output folder of the same model; layers: None (every converted MoE layer), "all", "1,3" or a list.
    Returns {"ok", "problems", "summary", "probe": "calibration", "calibration": {...}, "outputs": {name: path},
    "layers": [row per layer], "overall": {name: rel L2}, "thresholds", "verification"}."""
    report = {"ok": False, "problems": [], "layers": [], "summary": "numerics not run", "probe": PROBE}
    try:
        src = _open_source(source)
    except KtConvertError as exc:
        report["problems"].append(str(exc))
        return report
    samples, calib = _samples(calibration, src, max_length, num_samples)   # a bad file is bad input: exit 3
    try:
        stream, outputs, chosen = _open(out, manifest, src, samples, compare, layers, folder, device)
    except UsageError:                        # a --layers value that cannot work: exit 2, not a finding
        raise
    except KtConvertError as exc:
        report["problems"].append(str(exc))
        return report
    report.update(outputs=outputs, calibration=calib, thresholds=_limit(manifest, threshold))
    try:
        for _, row in _run(stream, max(chosen)):
            if row is not None:
                report["layers"].append(row)
    except KtConvertError as exc:
        report["problems"].append(str(exc))
    return _finish(report)


def _open_source(source):
    from ktconvert.formats.hf_source import HFSource

    if source is None:
        raise InputError("--calibration needs --source: the calibration tokens run through the source model",
                         expected="--source SRC (the HF checkpoint OUT was converted from)")
    return source if isinstance(source, HFSource) else HFSource.open(source)


def _samples(calibration, src, max_length, num_samples) -> tuple[list, dict]:
    """(token tensors, the report's "calibration" entry) of a jsonl path or a list of tensors; InputError /
    UsageError (raised, not reported: bad input) for a file that is not calibration samples."""
    from ktconvert.gptq.calibration import load_samples

    if isinstance(calibration, list):
        samples, calib = calibration, {"file": None, "samples": len(calibration)}
    else:
        samples = load_samples(calibration, src.model_dir(), max_length=max_length, num_samples=num_samples,
                               vocab_size=src.info.config.get("vocab_size"))
        calib = {"file": str(calibration), "samples": len(samples)}
    calib["tokens"] = int(sum(len(s) for s in samples))
    return samples, calib


def _open(out, manifest, src, samples, compare, layers, folder, device):
    readers = {"out": CpuMethod.from_manifest(manifest).expert_reader(out, manifest, folder)}
    outputs = {"out": str(out)}
    if compare is not None:
        other = load_manifest(compare)
        _same_model(manifest, other, compare)
        readers["compare"] = CpuMethod.from_manifest(other).expert_reader(compare, other)
        outputs["compare"] = str(compare)
    _same_model(_source_model(src), manifest, out)
    chosen = choose_layers([int(x) for x in manifest["model"]["layers"]], layers)
    return ErrorStream(src, samples, readers, chosen, device), outputs, chosen


def _source_model(src) -> dict:
    info = src.info
    return {"model": {"hidden": info.hidden, "intermediate": info.intermediate, "experts": info.n_experts}}


def _same_model(a: dict, b: dict, where) -> None:
    """InputError naming `where` unless the two manifests' model dimensions agree."""
    for key in ("hidden", "intermediate", "experts"):
        want, got = a["model"].get(key), b["model"].get(key)
        if want != got:
            raise InputError(f"outputs are not of the same model: {key} differs", file=f"{where}/ktconvert.json",
                             expected=str(want), found=str(got))


def _run(stream, last: int):
    """Run the stream's layers up to `last` (later layers are not needed); yields (layer, row or None)."""
    while stream.done < last:
        L = stream.done + 1
        yield L, stream.run_layer(L)


def _limit(manifest: dict, threshold) -> dict:
    limit = CpuMethod.from_manifest(manifest).thresholds.get("moe_rel_l2")
    return {"moe_rel_l2": float(threshold) if threshold is not None else limit}


def _finish(report: dict) -> dict:
    rows = report["layers"]
    names = list(report.get("outputs", {}))
    report["overall"] = {name: overall_rel_l2(rows, name) for name in names}
    limit = report["thresholds"]["moe_rel_l2"]
    for row in rows:
        rel = row["outputs"]["out"]["moe_rel_l2"]
        if limit is not None and rel > limit:
            report["problems"].append(f"layer {row['layer']}: MoE output on the tokens of --calibration vs source: "
                                      f"relative L2 {rel:.4g} > {limit:g}")
    report["ok"] = not report["problems"] and bool(rows)
    report["summary"] = _summary(report) if rows else "no layers checked"
    report["verification"] = _verification(report)
    return report


def overall_rel_l2(rows: list, name: str) -> float:
    """Output `name`'s relative L2 over every row (layer_errors rows): sqrt(sum err2 / sum ref2)."""
    err2 = sum(r["outputs"][name]["err2"] for r in rows)
    ref2 = sum(r["outputs"][name]["ref2"] for r in rows)
    return (err2 / ref2) ** 0.5 if ref2 > 0 else 0.0


def _summary(report: dict) -> str:
    calib, overall = report["calibration"], report["overall"]
    text = (f"on calibration tokens ({calib['tokens']} tokens, {calib['samples']} samples, model's own routing), "
            f"{len(report['layers'])} layer(s): MoE vs source rel L2 {overall['out']:.4g}")
    if "compare" in overall:
        text += f", --compare {overall['compare']:.4g}"
    return text


def _verification(report: dict) -> dict:
    """Compact, deterministic record (4 significant digits)."""
    def r4(v):
        return float(f"{v:.4g}")

    layers = {str(r["layer"]): {name: {k: r4(v[k]) for k in ("moe_rel_l2", "moe_cosine")}
                                for name, v in r["outputs"].items()} for r in report["layers"]}
    return {"ok": report["ok"], "probe": PROBE, "calibration": report["calibration"],
            "overall": {k: r4(v) for k, v in report["overall"].items()}, "layers": layers}


def render_rows(report: dict) -> list[str]:
    """Per layer, side by side: `layer L  out rel L2 / cosine  [compare rel L2 / cosine]`."""
    names = list(report.get("outputs", {}))
    lines = ["  layer  " + "  ".join(f"{n + ' rel L2':>14} {'cosine':>8}" for n in names)]
    for row in report["layers"]:
        cells = "  ".join(f"{row['outputs'][n]['moe_rel_l2']:>14.4g} {row['outputs'][n]['moe_cosine']:>8.4f}"
                          for n in names)
        lines.append(f"  {row['layer']:>5}  {cells}")
    lines.append("  total  " + "  ".join(f"{report['overall'][n]:>14.4g} {'':>8}" for n in names))
    return lines
