"""What ``ktconvert gpu`` would write, from headers and config only: shards with exact bytes, bytes per component,
GPU memory per expert, and the shape rules SGLang's kernels need."""
from __future__ import annotations

from ktconvert.gpu.linears import module_of


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


def plan_gpu(src, experts: str = "w4a16", group_size: int = 128, linears: str = "fp8",
             include_mtp: bool = False, expert_orientation: str | None = None) -> dict:
    """Plan the GPU checkpoint of `src`. Returns {experts, bits, group_size, linears, linear_fp8, layers, files
    [{path, bytes}], components {routed_experts, linears, embeddings, other: bytes}, total_bytes,
    vram_per_expert_bytes (one routed expert: 3 matrices), vram_per_layer_all_experts_bytes, checks}."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.st_writer import build_header, tensor_nbytes
    from ktconvert.gpu.experts import bits_of, expert_bytes
    from ktconvert.gpu.layout import GpuLayout

    bits = bits_of(experts)
    source = HFSource.open(src, expert_orientation)
    info = source.info
    layers = list(source.all_layers(include_mtp))
    layout = GpuLayout(source, layers, linears, bits, group_size)
    files, components = [], {"routed_experts": 0, "linears": 0, "embeddings": 0, "other": 0}
    for shard in sorted(layout.shards.values(), key=lambda s: s.name):
        specs = shard.specs(bits, group_size)
        header, spans = build_header(specs, None)
        files.append({"path": shard.name, "bytes": len(header) + sum(e - b for b, e in spans.values()),
                      "layer": shard.layer})
        for name, dtype, shape in specs:
            components[_component(name, layout)] += tensor_nbytes(dtype, shape)
    H, I = info.hidden, info.intermediate
    per_expert = expert_bytes(I, H, bits, group_size) * 2 + expert_bytes(H, I, bits, group_size)
    return {"source": str(src), "family": info.family, "experts": experts.lower(), "bits": bits,
            "group_size": group_size, "linears": linears, "linear_fp8": layout.linear_fp8, "layers": layers,
            "n_experts": info.n_experts, "files": files, "components": components,
            "total_bytes": sum(f["bytes"] for f in files), "vram_per_expert_bytes": per_expert,
            "vram_per_layer_all_experts_bytes": per_expert * info.n_experts,
            "checks": _checks(info, bits, group_size, layout)}


def render_gpu(result: dict) -> str:
    lines = [f"gpu plan: {result['source']} ({result['family']}) -> {result['experts'].upper()} g{result['group_size']}"
             f", linears {result['linears']}{' (linear_fp8_config)' if result['linear_fp8'] else ''}",
             f"layers: {len(result['layers'])} MoE x {result['n_experts']} experts; per GPU expert "
             f"{result['vram_per_expert_bytes']} bytes, all experts of a layer "
             f"{result['vram_per_layer_all_experts_bytes']} bytes"]
    lines += [f"  {f['path']:<40} {f['bytes']}" for f in result["files"]]
    lines += [f"  {k}: {v} bytes" for k, v in result["components"].items()]
    lines.append(f"total: {result['total_bytes']} bytes")
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in result["checks"]]
    return "\n".join(lines)
