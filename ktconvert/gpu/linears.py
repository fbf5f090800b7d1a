"""Non-expert tensors of the GPU checkpoint: which are SGLang ``LinearBase`` layers, and how each is written.

SGLang-KT with ``linear_fp8_config`` gives *every* ``LinearBase`` block-FP8 weights (gpu-format.md §1.3): attention
projections, dense MLP and shared-expert projections. Those are written as ``weight`` F8_E4M3 [N, K] +
``weight_scale_inv`` F32 [ceil(N/128), ceil(K/128)] (W = q * s, s = block amax / 448). FP8-block sources with
[128, 128] blocks are copied byte for byte. Routers, embeddings, lm_head, norms, biases, MTP ``eh_proj`` /
``shared_head`` (plain parameters / nn.Linear in SGLang) stay as they are (FP8 ones are dequantized to BF16).
Linears stored in another quantized form a decoder reads (GPTQ / AWQ ``qweight``, compressed-tensors
``weight_packed``, NVFP4, MXFP8, per-tensor FP8) are decoded: to BF16, or to block FP8 for ``LinearBase`` layers in
``fp8`` mode.

Modes (``--linears``): ``fp8`` (above), ``bf16`` (every linear BF16, Kimi-K2 style), ``keep`` (as stored, when
SGLang can load that: all float, or all FP8-block; decoded linears are written BF16).

Which modules are LinearBase layers is family data: the manifest's ``[linears]`` (attention / shared / dense).
How a linear is stored and its weight as BF16 bits come from the source (``Source.stored_linear`` /
``read_linear``: formats/linear_storage.py, FP8 read by formats/decoders/fp8.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ktconvert.architectures.manifests import DEFAULT_LINEARS, Manifest, linear_kind
from ktconvert.errors import InputError
from ktconvert.formats.linear_storage import StoredLinear
from ktconvert.quant import fp8

FP8_BLOCK = (128, 128)
LINEAR_MODES = ("fp8", "bf16", "keep")
# HF shard names SGLang fuses (packed_modules_mapping / stacked_params_mapping)
FUSED_SHARDS = {"q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
                "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def module_of(name: str) -> str:
    """``a.b.weight`` -> ``a.b``; ``a.b.weight_scale_inv`` -> ``a.b``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def is_linear_base(module: str, manifest: Manifest | None = None) -> bool:
    """Whether HF module `module` becomes a quantizable SGLang LinearBase (not experts, routers, heads): a match of
    the family manifest's ``[linears]`` (None: SGLang's usual attention / shared-expert / dense MLP names)."""
    return linear_kind(module, manifest.linears if manifest is not None else DEFAULT_LINEARS) is not None


def sglang_names(modules) -> dict[str, str]:
    """{HF module: SGLang module name} for the linears `modules`: q_a_proj + kv_a_proj_with_mqa ->
    fused_qkv_a_proj_with_mqa (MLA with q LoRA), q/k/v_proj -> qkv_proj (when k_proj exists: GQA),
    gate/up_proj -> gate_up_proj; others unchanged."""
    modules = set(modules)
    out = {}
    for module in modules:
        head, _, last = module.rpartition(".")
        fused = FUSED_SHARDS.get(last)
        if last == "kv_a_proj_with_mqa" and f"{head}.q_a_proj" not in modules:
            fused = None
        if last in ("q_proj", "k_proj", "v_proj") and f"{head}.k_proj" not in modules:
            fused = None
        out[module] = f"{head}.{fused}" if fused else module
    return out


@dataclass(frozen=True)
class LinearPlan:
    """How one source linear (module `module`) is written: out specs [(name, dtype, shape)] and a producer
    ``produce(source) -> {name: array}`` that reads and transforms it (one tensor's memory)."""

    module: str
    specs: list
    produce: Callable


def fp8_scale_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])


def plan_linear(source, module: str, mode: str) -> LinearPlan:
    """The output of linear `module` of `source` under `mode` ("fp8" | "bf16" | "keep"); InputError for what
    SGLang cannot load."""
    stored = source.stored_linear(module)
    kind = stored.kind
    if kind == "decoded":
        n, k = stored.shape
    else:
        ref = stored.weight
        if ref is None:
            raise InputError("linear weight missing", file=source.tensors_file(), tensor=module + ".weight")
        if kind == "other" or len(ref.shape) != 2:
            raise InputError("linear weight stored in a form SGLang's GPU path cannot load here", file=ref.file.name,
                             tensor=ref.name, expected="BF16/F16/F32 or F8_E4M3 + weight_scale_inv",
                             found=f"{ref.dtype} {list(ref.shape)}")
        n, k = ref.shape
    if mode == "keep":
        mode = "fp8" if kind == "fp8-block" else "bf16"
    if mode == "bf16":
        return _bf16_plan(stored, n, k)
    if kind == "fp8-block" and _copyable_fp8(stored, n, k):
        return _copy_fp8_plan(stored)
    return _quantize_fp8_plan(module, n, k)


def _copyable_fp8(stored: StoredLinear, n: int, k: int) -> bool:
    """An FP8 source copies as is when its scale is F32 weight_scale_inv of the [128, 128] grid."""
    scale = stored.scale
    return scale.name == stored.module + ".weight_scale_inv" and scale.dtype == "F32" \
        and tuple(scale.shape) == fp8_scale_shape(n, k) and stored.block in (None, FP8_BLOCK)


def _bf16_plan(stored: StoredLinear, n: int, k: int) -> LinearPlan:
    module, name = stored.module, stored.module + ".weight"
    if stored.kind == "float" and stored.weight.dtype == "BF16":
        return LinearPlan(module, [(name, "BF16", (n, k))], lambda src: {name: src.read_tensor(name)})
    return LinearPlan(module, [(name, "BF16", (n, k))], lambda src: {name: src.read_linear(module)})


def _copy_fp8_plan(stored: StoredLinear) -> LinearPlan:
    refs = [stored.weight, stored.scale]
    specs = [(ref.name, ref.dtype, tuple(ref.shape)) for ref in refs]
    return LinearPlan(stored.module, specs, lambda src: {ref.name: src.read_tensor(ref.name) for ref in refs})


def _quantize_fp8_plan(module: str, n: int, k: int) -> LinearPlan:
    specs = [(module + ".weight", "F8_E4M3", (n, k)), (module + ".weight_scale_inv", "F32", fp8_scale_shape(n, k))]

    def produce(src):
        codes, scale_inv = quantize_linear_fp8(src.read_linear(module), where=module + ".weight")
        return {module + ".weight": codes, module + ".weight_scale_inv": scale_inv}

    return LinearPlan(module, specs, produce)


def quantize_linear_fp8(w_bf16: np.ndarray, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits uint16 [n, k] -> (F8_E4M3 codes uint8 [n, k], weight_scale_inv float32 [ceil(n/128), ceil(k/128)]),
    DeepSeek convention (ktconvert.quant.fp8.quantize_block): s = block amax / 448, q = e4m3(w / s)."""
    return fp8.quantize_block(w_bf16, FP8_BLOCK, where=where)
