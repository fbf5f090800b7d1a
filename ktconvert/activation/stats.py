"""``ktconvert expert-stats SRC OUT.pt --calibration FILE``: routed-token counts per layer and expert, for
SGLang-KT's frequency placement of GPU experts.

The calibration tokens go through the model one decoder layer at a time (``ktconvert.gptq.stream``: transformers'
own layer code, weights read per layer, FP8 / int4 / MXFP4 sources decoded as everywhere else) with the model's
float weights — no quantization, no Hessian, no GPTQ. In every MoE layer the experts module's input gives the
router's choice (``routing.counting``); the layer's real output becomes the next layer's input. The counts go to
OUT.pt (``counts.write_activation``), optionally with an HTML picture (``activation.report``).
"""
from __future__ import annotations

import os
from pathlib import Path

from ktconvert import __version__
from ktconvert.activation.counts import (FILE_NAME, FORMAT, FORMAT_VERSION, ExpertActivation,
                                         activation_from_layers, file_sha256, source_identity, tokens_sha256,
                                         write_activation)
from ktconvert.activation.placement import coverage, sglang_moe_layers
from ktconvert.activation.report import write_report
from ktconvert.activation.routing import counting
from ktconvert.errors import InputError, OutputError
from ktconvert.util.extras import require
from ktconvert.formats.fileio import record_for
from ktconvert.formats.hf_source import HFSource
from ktconvert.formats.out_manifest import placement_flags
from ktconvert.gptq.calibration import load_samples
from ktconvert.gptq.skeleton import routed_experts, torch_dtype, torch_dtype_of
from ktconvert.gptq.stream import DecoderStream

DTYPES = ("float32", "bfloat16")
COVERAGE_RATIOS = (0.1, 0.2, 0.5)


class RoutingStream(DecoderStream):
    """The model's own forward, layer by layer, with each MoE layer's routed choices counted on the way.
    process_layer returns a routing.RoutedCounts for MoE layers, None for dense ones."""

    def process_layer(self, L: int, layer):
        if L not in self.info.moe_layers:
            self.propagate(L, layer)
            return None
        experts = routed_experts(layer, L, self.info.n_experts)
        with counting(experts, self.info.n_experts, where=f"layer {L}") as counter:
            self.propagate(L, layer)
        return counter


def collect_activation(src, samples: list, *, dtype: str = "float32", device: str | None = None,
                       calibration_file=None, progress=None) -> ExpertActivation:
    """Counts for checkpoint `src` (path or HFSource) over `samples` (1-D int64 token tensors).

    dtype: "float32" (default; the routing a float32 forward of the model gives) or "bfloat16" (half the memory
    of a layer). Returns ExpertActivation (counts int64 [num_hidden_layers, num_experts]) with its metadata."""
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}", expected=" or ".join(DTYPES))
    source = src if isinstance(src, HFSource) else HFSource.open(src)
    stream = RoutingStream(source, samples, dtype=torch_dtype(dtype), device=device)
    if progress is not None:
        progress.start(0, len(stream.layers), "expert-stats", unit="layers")
    per_layer, top_k = {}, None
    for L, counter in stream.run_all():
        if counter is not None:
            per_layer[L], top_k = counter.counts.tolist(), counter.top_k
        if progress is not None:
            progress.advance(0, items=1, detail=f"layer {L}")
    meta = activation_meta(source, samples, top_k, calibration_file,
                           {"hidden_states": "float forward (no quantization)", "dtype": dtype})
    return activation_from_layers(per_layer, source.info.n_layers, source.info.n_experts, meta)


def activation_meta(source, samples: list, top_k: int | None, calibration_file, routing: dict) -> dict:
    """The metadata keys of an expert_activation.pt (counts.METADATA_KEYS) for `source` and `samples`."""
    info = source.info
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "model_type": info.model_type, "moe_layers": [int(L) for L in info.moe_layers],
            "top_k": int(top_k if top_k is not None else info.experts_per_tok),
            "tokens": int(sum(len(s) for s in samples)), "samples": len(samples),
            "calibration_sha256": None if calibration_file is None else file_sha256(calibration_file),
            "tokens_sha256": tokens_sha256(samples), "source": source_identity(source), "routing": dict(routing)}


def expert_stats(src, out, calibration, *, max_length: int = 2048, num_samples: int | None = None,
                 dtype: str = "float32", device: str | None = None, report=None, force: bool = False,
                 progress=None) -> dict:
    """Count the routed calibration tokens of checkpoint `src` and write them to `out` (must end in .pt), and
    the HTML picture to `report` when given. Existing files are refused unless `force`. MissingExtraError (exit
    2) without the [gpu] extra, before anything is written.

    Returns {path, report, model_type, layers, moe_layers, experts, top_k, tokens, samples, sglang_args,
    coverage: [{ratio, gpu_experts, routed_share}]} (coverage: SGLang-KT's frequency placement at a few ratios)."""
    require("gpu", "ktconvert expert-stats")
    out = Path(out)
    targets = [out] + ([Path(report)] if report else [])
    _check_targets(out, targets, force)
    source = HFSource.open(src)
    samples = load_samples(calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                           vocab_size=source.info.config.get("vocab_size"))
    activation = collect_activation(source, samples, dtype=dtype, device=device, calibration_file=calibration,
                                    progress=progress)
    write_activation(out, activation)
    if report:
        write_report(report, activation, title=f"Expert activation: {source.model_dir().name}",
                     layers=sglang_moe_layers(source.config_json()))
    return summary(activation, out, report, source.config_json())


def write_gptq_activation(out_dir, source, tokens_by_layer: dict, calibration, *, max_length: int = 2048,
                          num_samples: int | None = None):
    """The by-product of a calibrated conversion: OUT/expert_activation.pt from the GPTQ stream's routed-token
    counts ({layer: per expert}, e.g. LayerResult.tokens), the same file expert-stats writes. Its hidden states are
    the GPTQ stream's (each layer's input from the quantized layers before it, the model's dtype): the routing of
    the quantized model; ``routing`` in the file says so. `calibration`: the jsonl path (re-read for the metadata)
    or the list of 1-D token tensors the conversion used. Returns the file's FileRecord for the manifest."""
    samples, calibration_file = calibration, None
    if not isinstance(calibration, list):
        calibration_file = calibration
        samples = load_samples(calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                               vocab_size=source.info.config.get("vocab_size"))
    dtype = str(torch_dtype_of(source.config_json())).replace("torch.", "")
    meta = activation_meta(source, samples, None, calibration_file,
                           {"hidden_states": "GPTQ stream (inputs from the quantized layers before)", "dtype": dtype})
    activation = activation_from_layers(tokens_by_layer, source.info.n_layers, source.info.n_experts, meta)
    routed = activation.counts[list(tokens_by_layer)].sum(axis=1)
    if (routed != meta["tokens"] * meta["top_k"]).any():
        raise ValueError(f"routed-token counts {routed.tolist()} do not match {meta['tokens']} tokens x top-"
                         f"{meta['top_k']}")
    write_activation(Path(out_dir) / FILE_NAME, activation)
    return record_for(out_dir, FILE_NAME)


def _check_targets(out: Path, targets: list[Path], force: bool) -> None:
    if out.suffix != ".pt":
        raise OutputError("SGLang-KT reads activation counts only from a file whose name ends in .pt",
                          file=str(out), found=out.suffix or "no suffix")
    for path in targets:
        if os.path.lexists(path) and not force:       # a symlink too: replaced with --force, never followed
            raise OutputError("file exists", file=str(path), hint="pass --force to overwrite it")
        if not path.parent.is_dir():
            raise OutputError("folder does not exist", file=str(path.parent))


def summary(activation: ExpertActivation, path, report, config: dict) -> dict:
    """What expert_stats returns (see there)."""
    meta = activation.meta
    layers = sglang_moe_layers(config)
    return {"path": str(path), "report": None if report is None else str(report),
            "model_type": meta.get("model_type"), "layers": activation.n_layers, "moe_layers": meta["moe_layers"],
            "experts": activation.n_experts, "top_k": meta["top_k"], "tokens": meta["tokens"],
            "samples": meta["samples"], "sglang_args": placement_flags(path),
            "coverage": [coverage(layers, activation.counts, ratio) for ratio in COVERAGE_RATIOS]}


def render(result: dict) -> str:
    """Human-readable summary with the SGLang-KT flags."""
    lines = [f"wrote {result['path']}: {result['tokens']} tokens ({result['samples']} samples), top-{result['top_k']}"
             f", {len(result['moe_layers'])} MoE layers x {result['experts']} experts"]
    if result["report"]:
        lines.append(f"report: {result['report']}")
    lines.append("routed (token, expert) pairs the GPU would serve with SGLang-KT's frequency placement:")
    lines += [f"  --kt-gpu-experts-ratio {c['ratio']:<4} ({c['gpu_experts']} experts): {100 * c['routed_share']:.1f}%"
              for c in result["coverage"]]
    lines.append(f"SGLang-KT flags: {result['sglang_args']} --kt-gpu-experts-ratio R (or --kt-num-gpu-experts N)")
    return "\n".join(lines)
