"""``config.json`` of the GPU checkpoint: the source config with ``quantization_config`` replaced by the minimal
compressed-tensors dict of gpu-format.md §4.3, plus both ``ignore`` matchers.

* ``weights`` holds only keys compressed-tensors 0.19 knows (``QuantizationArgs`` is extra="forbid" in SGLang's
  parser); the one target is ``"Linear"`` (SGLang's WNA16 MoE scheme reads ``target_scheme_map["Linear"]``); the
  top-level ``format`` is ``pack-quantized``.
* ``ignore`` is the regex list of §4.3, plus an entry per extra non-expert linear kind the source has (MiniMax
  ``block_sparse_moe.gate``, Qwen ``shared_expert``, MTP ``eh_proj`` ...), so that both matchers skip every
  non-expert linear: compressed-tensors (``re:`` = re.match, else exact, on HF names) and SGLang (``re:`` = re.match,
  else case-insensitive substring, on SGLang's fused names ``fused_qkv_a_proj_with_mqa`` / ``gate_up_proj``).
* ``linear_fp8_config`` (``--linears fp8``) is added last as a plain dict entry — never null (a null value crashes
  SGLang at startup, gpu-format.md §1.2), and never through compressed-tensors' serializer (which drops it).
"""
from __future__ import annotations

import re

BASE_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", r"re:.*mlp\.gate$"]
# appended (in this order) only when a non-expert linear of the source needs them
EXTRA_IGNORE = [r"re:.*shared_expert\..*", r"re:.*shared_expert_gate$", r"re:.*block_sparse_moe\.gate$",
                r"re:.*linear_attn.*", r"re:.*mlp\.router$", r"re:.*eh_proj$", r"re:.*shared_head.*"]
LINEAR_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}


def ct_ignored(name: str, ignore) -> bool:
    """compressed-tensors' rule (``compressed_tensors.utils.match.match_name`` 0.19, no fused mapping) on an HF
    module name: ``re:`` entries are ``re.match``-ed, other entries must equal the name. Stated here so that a
    conversion imports no torch; tests check it against match_name itself."""
    return any(re.match(t[3:], name) is not None if t.startswith("re:") else t == name for t in ignore)


def sglang_ignored(name: str, ignore) -> bool:
    """SGLang's ``should_ignore_layer`` rule (check_contains=True) on an SGLang module name: ``re:`` entries are
    ``re.match``-ed, other entries match as a case-insensitive substring."""
    for target in ignore:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target.lower() in name.lower():
            return True
    return False


def build_ignore(hf_modules, sglang_modules, expert_modules) -> list[str]:
    """The ignore list: BASE_IGNORE plus the EXTRA_IGNORE entries (else an exact-name regex) needed so that every
    module of `hf_modules` (CT rule) and `sglang_modules` (SGLang rule) is ignored; ValueError if an entry would
    ignore one of `expert_modules`."""
    ignore = list(BASE_IGNORE)
    for name in sorted(hf_modules):
        if not ct_ignored(name, ignore):
            ignore.append(_entry_for(name, ct=True))
    for name in sorted(sglang_modules):
        if not sglang_ignored(name, ignore):
            ignore.append(_entry_for(name, ct=False))
    hit = [m for m in expert_modules if ct_ignored(m, ignore) or sglang_ignored(m, ignore)]
    if hit:
        raise ValueError(f"ignore list would skip expert {hit[0]}")
    return ignore


def _entry_for(name: str, ct: bool) -> str:
    for entry in EXTRA_IGNORE:
        if (ct_ignored(name, [entry]) if ct else sglang_ignored(name, [entry])):
            return entry
    return "re:" + re.escape(name) + "$"


GPTQ_OBSERVER = "mse"   # llmcompressor's weight observer for GPTQ's group scales (its MSE grid search)


def quantization_config(bits: int, group_size: int, ignore: list[str], actorder: str | None = None,
                        linear_fp8: bool = False, observer: str = "minmax") -> dict:
    """The §4.3 dict (num_bits `bits`, group_size, actorder null for RTN / "static" for GPTQ, the weight observer
    the scales were chosen with: "minmax" for RTN, GPTQ_OBSERVER for GPTQ); with linear_fp8,
    ``linear_fp8_config`` is the last key."""
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": actorder, "block_structure": None, "observer": observer,
               "observer_kwargs": {}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "version": _ct_version(),
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights,
                                        "input_activations": None, "output_activations": None}},
          "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
          "sparsity_config": {}, "transform_config": {}}
    if linear_fp8:
        qc["linear_fp8_config"] = dict(LINEAR_FP8_CONFIG)
    return qc


def _ct_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return "0.19.0"


def validate_with_ct(qc: dict):
    """compressed-tensors' own parse of the dict (without linear_fp8_config); returns the QuantizationConfig.
    Not called while converting (it imports torch); ``verify`` parses the written config the same way."""
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "linear_fp8_config"})


def output_config(source_config: dict, qc: dict) -> dict:
    """The source config with quantization_config (also a nested text_config one, and compression_config)
    replaced by `qc`, appended as the last top-level key."""
    config = {k: v for k, v in source_config.items() if k not in ("quantization_config", "compression_config")}
    for key, value in list(config.items()):
        if isinstance(value, dict) and "quantization_config" in value:
            config[key] = {k: v for k, v in value.items() if k != "quantization_config"}
    config["quantization_config"] = qc
    return config
