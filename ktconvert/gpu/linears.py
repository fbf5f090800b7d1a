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
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, has_weight, locate
from ktconvert.quant import fp8
from ktconvert.quant.bf16 import bf16_bits_to_f32, float_to_bf16_bits

FP8_BLOCK = (128, 128)
LINEAR_MODES = ("fp8", "bf16", "keep")
FLOAT_DTYPES = ("BF16", "F16", "F32")
# modules SGLang builds as LinearBase with the model's quant_config (attention, dense MLP, shared experts)
LINEAR_BASE_RE = re.compile(
    r"(^|.*\.)(self_attn|linear_attn|attention)\.[^.]*proj[^.]*$"
    r"|(^|.*\.)mlp\.(gate|up|down|gate_up)_proj$"
    r"|(^|.*\.)(mlp\.)?shared_experts?\.(gate|up|down|gate_up)_proj$")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# HF shard names SGLang fuses (packed_modules_mapping / stacked_params_mapping)
FUSED_SHARDS = {"q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
                "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def module_of(name: str) -> str:
    """``a.b.weight`` -> ``a.b``; ``a.b.weight_scale_inv`` -> ``a.b``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def is_linear_base(module: str) -> bool:
    """Whether HF module `module` becomes a quantizable SGLang LinearBase (not experts, routers, heads)."""
    return ".experts." not in module and LINEAR_BASE_RE.match(module) is not None


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
    ``produce(checkpoint) -> {name: array}`` that reads and transforms it (one tensor's memory)."""

    module: str
    specs: list
    produce: Callable


def fp8_scale_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])


def source_block(checkpoint) -> tuple[int, int] | None:
    """weight_block_size of an ``quant_method: fp8`` source, else None."""
    scheme = detect_scheme(checkpoint.config)
    if scheme is not None and scheme.quant_method == "fp8":
        return scheme.groups[0].block
    return None


def decoded_refs(checkpoint, module: str):
    """The decoder's MatrixRefs (formats.decoders) of `module` when it is stored quantized in a form other than
    float or FP8 with a 2-D float scale grid (GPTQ / AWQ ``qweight``, compressed-tensors ``weight_packed``,
    NVFP4, MXFP8, per-tensor FP8, ...), else None."""
    tensors = checkpoint.tensors
    ref = tensors.get(module + ".weight")
    if module in tensors or not has_weight(checkpoint, module) or (ref is not None and (
            ref.dtype in FLOAT_DTYPES or _fp8_grid(checkpoint, module, ref))):
        return None
    scheme = detect_scheme(checkpoint.config)
    return None if scheme is None else locate(checkpoint, module, scheme)


def _fp8_grid(checkpoint, module: str, ref) -> bool:
    """F8_E4M3 ``weight`` with a 2-D float scale (block grid, or [N, 1] per channel): read here directly."""
    scales = [checkpoint.tensors.get(f"{module}.{s}") for s in SCALE_SUFFIXES]
    return ref.dtype == "F8_E4M3" and any(s is not None and s.dtype in FLOAT_DTYPES and len(s.shape) == 2
                                          for s in scales)


def stored_kind(checkpoint, module: str) -> str:
    """"float" (BF16/F16/F32 ``weight``), "fp8-block" (F8_E4M3 + weight_scale_inv/weight_scale grid), "decoded"
    (another quantized storage a decoder reads: written as BF16 or re-quantized) or "other"."""
    if decoded_refs(checkpoint, module) is not None:
        return "decoded"
    ref = checkpoint.tensors.get(module + ".weight")
    if ref is None:
        return "other"
    if ref.dtype in FLOAT_DTYPES:
        return "float"
    if _fp8_grid(checkpoint, module, ref):
        return "fp8-block"
    return "other"


def read_bf16(checkpoint, module: str) -> np.ndarray:
    """The linear's weight as BF16 bits uint16 [n, k] (float sources converted RNE, FP8-block dequantized, other
    quantized storage decoded by formats.decoders)."""
    if decoded_refs(checkpoint, module) is not None:
        return decode_matrix(checkpoint, module, detect_scheme(checkpoint.config))
    ref = checkpoint.ref(module + ".weight")
    if ref.dtype in FLOAT_DTYPES:
        return float_to_bf16_bits(checkpoint.read(ref.name), ref.dtype)
    return _dequant_fp8(checkpoint, module)


def _scale_name(checkpoint, module: str) -> str:
    for suffix in SCALE_SUFFIXES:
        if f"{module}.{suffix}" in checkpoint.tensors:
            return f"{module}.{suffix}"
    raise InputError("FP8 weight without a scale tensor", tensor=module + ".weight",
                     expected="weight_scale_inv (F32)", found="none")


def _dequant_fp8(checkpoint, module: str) -> np.ndarray:
    w = checkpoint.read(module + ".weight")
    s_ref = checkpoint.ref(_scale_name(checkpoint, module))
    scale = float_to_bf16_bits(checkpoint.read(s_ref.name), s_ref.dtype) if s_ref.dtype != "F32" else None
    scale = checkpoint.read(s_ref.name) if scale is None else bf16_bits_to_f32(scale)
    n, k = w.shape
    sn, sk = scale.shape
    block = (-(-n // sn), -(-k // sk)) if source_block(checkpoint) is None else source_block(checkpoint)
    return fp8.dequant_block(w, np.asarray(scale, np.float32), block, where=module + ".weight")


def plan_linear(checkpoint, module: str, mode: str) -> LinearPlan:
    """The output of linear `module` under `mode` ("fp8" | "bf16" | "keep"); InputError for what SGLang cannot
    load."""
    kind = stored_kind(checkpoint, module)
    if kind == "decoded":
        n, k = decoded_refs(checkpoint, module).shape
    else:
        ref = checkpoint.ref(module + ".weight")
        if kind == "other" or len(ref.shape) != 2:
            raise InputError("linear weight stored in a form SGLang's GPU path cannot load here", file=ref.file.name,
                             tensor=ref.name, expected="BF16/F16/F32 or F8_E4M3 + weight_scale_inv",
                             found=f"{ref.dtype} {list(ref.shape)}")
        n, k = ref.shape
    if mode == "keep":
        mode = "fp8" if kind == "fp8-block" else "bf16"
    if mode == "bf16":
        return _bf16_plan(checkpoint, module, kind, n, k)
    if kind == "fp8-block" and _copyable_fp8(checkpoint, module, n, k):
        return _copy_fp8_plan(checkpoint, module)
    return _quantize_fp8_plan(module, n, k)


def _copyable_fp8(checkpoint, module: str, n: int, k: int) -> bool:
    """An FP8 source copies as is when its scale is F32 weight_scale_inv of the [128, 128] grid."""
    scale = checkpoint.tensors.get(module + ".weight_scale_inv")
    return scale is not None and scale.dtype == "F32" and tuple(scale.shape) == fp8_scale_shape(n, k) \
        and source_block(checkpoint) in (None, FP8_BLOCK)


def _bf16_plan(checkpoint, module: str, kind: str, n: int, k: int) -> LinearPlan:
    name = module + ".weight"
    if kind == "float" and checkpoint.ref(name).dtype == "BF16":
        return LinearPlan(module, [(name, "BF16", (n, k))], lambda ck: {name: ck.read(name)})
    return LinearPlan(module, [(name, "BF16", (n, k))], lambda ck: {name: read_bf16(ck, module)})


def _copy_fp8_plan(checkpoint, module: str) -> LinearPlan:
    names = [module + ".weight", module + ".weight_scale_inv"]
    specs = [(nm, checkpoint.ref(nm).dtype, tuple(checkpoint.ref(nm).shape)) for nm in names]
    return LinearPlan(module, specs, lambda ck: {nm: ck.read(nm) for nm in names})


def _quantize_fp8_plan(module: str, n: int, k: int) -> LinearPlan:
    specs = [(module + ".weight", "F8_E4M3", (n, k)), (module + ".weight_scale_inv", "F32", fp8_scale_shape(n, k))]

    def produce(ck):
        codes, scale_inv = quantize_linear_fp8(read_bf16(ck, module), where=module + ".weight")
        return {module + ".weight": codes, module + ".weight_scale_inv": scale_inv}

    return LinearPlan(module, specs, produce)


def quantize_linear_fp8(w_bf16: np.ndarray, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits uint16 [n, k] -> (F8_E4M3 codes uint8 [n, k], weight_scale_inv float32 [ceil(n/128), ceil(k/128)]),
    DeepSeek convention (ktconvert.quant.fp8.quantize_block): s = block amax / 448, q = e4m3(w / s)."""
    return fp8.quantize_block(w_bf16, FP8_BLOCK, where=where)
