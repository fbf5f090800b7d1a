"""`ktconvert plan --experts` / `gpu --dry-run` and the first step of every GPU conversion: the SGLang-KT GPU
checkpoint checked and laid out from headers and config only, before OUT is created.

    options = GpuOptions.make(experts="w4a16", linears="fp8")
    plan = plan_gpu(open_input(src), options)    # GpuPlan: the opened source, the layout (gpu.layout.GpuLayout)
    plan.report -> {experts, bits, group_size, linears, linear_fp8, layers, files [{path, bytes}] (exact),
                    components {routed_experts, linears, embeddings, other: bytes}, total_bytes,
                    vram_per_expert_bytes, vram_per_layer_all_experts_bytes, checks}; render_gpu(report) -> text
"""
from __future__ import annotations

from functools import cached_property

from ktconvert.errors import InputError, ShapeError, UsageError
from ktconvert.formats.hf_source import HFSource
from ktconvert.formats.st_writer import build_header, tensor_nbytes
from ktconvert.gpu.experts import GROUP_SIZES, expert_bytes
from ktconvert.gpu.layout import GpuLayout
from ktconvert.gpu.config import ct_ignored, sglang_ignored
from ktconvert.gpu.linears import module_of, sglang_names
from ktconvert.gpu.options import QUANTS, GpuOptions  # noqa: F401  (QUANTS: vocabulary's)
from ktconvert.run.inputs import Input, open_input
from ktconvert.run.options import Plan


class GpuPlan(Plan):
    """A validated GPU conversion: input (inputs.Input), options, layers, layout (gpu.layout.GpuLayout: which
    tensor goes where); report (JSON-ready sizes, computed on first use); plan[key] reads the report."""

    def __init__(self, input: Input, options: GpuOptions, layers: list[int], layout: GpuLayout, checks: list[dict],
                 ignored: dict | None = None):
        self.input, self.options, self.layers, self.layout, self.checks = input, options, layers, layout, checks
        self.ignored = ignored or {}

    def journal_options(self) -> dict:
        return {"kind": "gpu", **self.options.journalled(), "layers": self.layers,
                "source_config_sha256": self.input.source.config_sha256()}

    @cached_property
    def report(self) -> dict:
        info, opts, layout = self.input.source.info, self.options, self.layout
        files, components = [], {"routed_experts": 0, "linears": 0, "embeddings": 0, "other": 0}
        for shard in sorted(layout.shards.values(), key=lambda s: s.name):
            specs = shard.specs(opts.bits, opts.group_size)
            header, spans = build_header(specs, None)
            files.append({"path": shard.name, "bytes": len(header) + sum(e - b for b, e in spans.values()),
                          "layer": shard.layer})
            for name, dtype, shape in specs:
                components[_component(name, layout)] += tensor_nbytes(dtype, shape)
        H, I = info.hidden, info.intermediate
        per_expert = expert_bytes(I, H, opts.bits, opts.group_size) * 2 + expert_bytes(H, I, opts.bits,
                                                                                         opts.group_size)
        report = {"source": self.input.spec, "family": info.family, "experts": opts.experts, "bits": opts.bits,
                  "group_size": opts.group_size, "linears": opts.linears, "linear_fp8": layout.linear_fp8,
                  "layers": self.layers, "n_experts": info.n_experts, "files": files, "components": components,
                  "total_bytes": sum(f["bytes"] for f in files), "vram_per_expert_bytes": per_expert,
                  "vram_per_layer_all_experts_bytes": per_expert * info.n_experts, "checks": self.checks}
        if opts.ignore:
            report["ignore"] = dict(self.ignored)
        return report


def plan_gpu(src, options: GpuOptions) -> GpuPlan:
    """Plan the GPU checkpoint of `src` (a path, hf:// / ms:// source or an opened inputs.Input): every routed
    expert present with the config's shapes, the layout of every tensor, SGLang's shape rules. Raises
    InputError (not an HF safetensors source, missing / unsupported tensors), ShapeError (a rule SGLang's kernels
    need, e.g. H % group size), UsageError. Reads headers and config only."""
    input = open_input(src)
    source = input.source
    if not isinstance(source, HFSource):
        raise InputError(f"the GPU checkpoint is written from HF safetensors sources; this input is "
                         f"{source.input_format}", file=str(input.path))
    source.validate(include_mtp=options.include_mtp)
    layers = list(source.all_layers(options.include_mtp))
    layout = GpuLayout(source, layers, options.linears, options.bits, options.group_size)
    checks = _checks(source.info, options.bits, options.group_size, layout)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        raise ShapeError("the GPU checkpoint would not load in SGLang", expected=failed[0]["check"],
                         found=failed[0]["detail"],
                         hint=f"choose --group-size among {list(GROUP_SIZES)} dividing H and I" if "H %" in
                         failed[0]["check"] or "I %" in failed[0]["check"] else None)
    return GpuPlan(input, options, layers, layout, checks, ignore_matches(layout, options.ignore))


def ignore_matches(layout: GpuLayout, patterns) -> dict[str, int]:
    """{--ignore entry: how many linears of the checkpoint it matches} (compressed-tensors' rule on HF names, SGLang's
    on its fused names). UsageError for an entry that would leave something unquantized that the checkpoint must
    quantize: a routed expert (the GPU experts are what the checkpoint's scheme is for, and SGLang loads a MoE layer
    under one scheme), or, with linear_fp8_config, a LinearBase linear (SGLang-KT then makes every linear FP8, with
    no per-layer opt-out: gpu-format.md §1.3)."""
    hf, sgl = layout.ignore_modules()
    fused = sglang_names(layout.linear_modules)
    experts = sorted(layout.expert_check_names())
    out = {}
    for pattern in patterns:
        hit = [m for m in experts if ct_ignored(m, [pattern]) or sglang_ignored(m, [pattern])]
        if hit:
            raise UsageError("--ignore would leave a routed expert unquantized; the GPU checkpoint quantizes every "
                             "routed expert (SGLang loads a MoE layer under one scheme)", found=f"{pattern} matches "
                             f"{hit[0]}", hint="plain names match exactly in compressed-tensors but as a substring "
                                               "in SGLang; use re: with an anchored regex")
        if layout.linear_fp8:
            hit = sorted(m for m in layout.linear_modules if ct_ignored(m, [pattern])
                         or sglang_ignored(fused[m], [pattern]))
            if hit:
                raise UsageError("--ignore matches an FP8 linear, which SGLang-KT quantizes whatever the ignore list "
                                 "says (linear_fp8_config applies to every linear)", found=f"{pattern} matches "
                                 f"{hit[0]}", hint="--linears bf16 leaves every linear unquantized")
        out[pattern] = len({m for m in hf if ct_ignored(m, [pattern])}
                           | {m for m in sgl if sglang_ignored(m, [pattern])})
    return out


def _component(name: str, layout) -> str:
    module = module_of(name)
    if module in layout.expert_modules:
        return "routed_experts"
    if module in layout.linear_modules:
        return "linears"
    if "embed_tokens" in module or module.endswith("lm_head") or "shared_head" in module:
        return "embeddings"
    return "other"


def _checks(info, bits: int, group_size: int, layout) -> list[dict]:
    H, I = info.hidden, info.intermediate
    out = [{"check": f"H % {group_size} == 0", "ok": H % group_size == 0, "detail": f"H = {H}"},
           {"check": f"I % {group_size} == 0", "ok": I % group_size == 0, "detail": f"I = {I}"}]
    if layout.linear_fp8:
        q_lora = info.config.get("q_lora_rank")
        if q_lora:
            out.append({"check": "q_lora_rank % 128 == 0 (SGLang concatenates q_a / kv_a block scales)",
                        "ok": q_lora % 128 == 0, "detail": f"q_lora_rank = {q_lora}"})
        dense = info.config.get("intermediate_size")
        if dense:
            out.append({"check": "dense intermediate % 128 == 0 (FP8 gate_up shards)", "ok": dense % 128 == 0,
                        "detail": f"intermediate_size = {dense}"})
    return out


def render_gpu(result: dict) -> str:
    """The GPU plan report as text."""
    lines = [f"gpu plan: {result['source']} ({result['family']}) -> {result['experts'].upper()} g{result['group_size']}"
             f", linears {result['linears']}{' (linear_fp8_config)' if result['linear_fp8'] else ''}",
             f"layers: {len(result['layers'])} MoE x {result['n_experts']} experts; per GPU expert "
             f"{result['vram_per_expert_bytes']} bytes, all experts of a layer "
             f"{result['vram_per_layer_all_experts_bytes']} bytes"]
    lines += [f"  {f['path']:<40} {f['bytes']}" for f in result["files"]]
    lines += [f"  {k}: {v} bytes" for k, v in result["components"].items()]
    lines.append(f"total: {result['total_bytes']} bytes")
    lines += [f"  ignore {p} (added to config.json): {n} linear{'' if n == 1 else 's'}"
              for p, n in result.get("ignore", {}).items()]
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in result["checks"]]
    return "\n".join(lines)
