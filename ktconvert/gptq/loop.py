"""The layer-streaming GPTQ loop: llmcompressor's GPTQ functions over one decoder layer at a time.

    skeleton   AutoModelForCausalLM.from_config on the meta device (eager attention), experts linearised with
               llmcompressor's ``linearize_moe`` (2-D ``mlp.experts.E.{gate,up,down}_proj`` Linear modules)
    inputs     one recording forward of the real model code with every decoder layer replaced by a recorder:
               layer 0's hidden states and each layer's keyword arguments (causal mask, rotary embeddings)
    per layer  weights read from safetensors (experts through ``HFSource``, so FP8 / int4 sources arrive as BF16),
               assigned into the skeleton layer; calibration forward stops at the experts module and caches its
               input (hidden states [T, H], top-k indices and weights) per sample; then, **one expert at a time**:
               ``accumulate_hessian`` on the expert's inputs (gate/up share one Hessian: same input), the
               quantizer (``GpuQuantizer`` / ``amx.AmxQuantizer``) runs ``quantize_weight``; then the propagation
               forward with the quantised weights gives the next layer's input; the layer is freed.

Details carried over for bit-identity with llmcompressor ``oneshot`` (gptq-streaming.md §2): eager attention and
the real causal mask (``causal_mask=False`` reproduces oneshot's Qwen3-MoE mask=None, tests only); tensors loaded
in the dtype ``from_pretrained`` gives them (``_keep_in_fp32_modules_strict`` stay float32); propagation under
``DisableQuantization``; samples in oneshot's unshuffled order (``calibration.oneshot_order``: longest first — the
order sets the float32 summation order of every Hessian), batch size 1; ``malloc_trim`` after each layer; routed
token counts
per expert, and experts no calibration token reaches (routed-only mode) go to the quantizer's data-free fallback
instead of a zero Hessian (which llmcompressor turns into all-zero weights).

Memory: one layer's weights + the calibration activations (T x H per sample, x2 while propagating) + one
expert's two Hessians (H^2 + I^2 float32). Runs on CUDA when torch sees a GPU (``device=None``), else on CPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ktconvert.errors import InputError
from ktconvert.safe_read import read_json

EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


@dataclass(frozen=True)
class GptqOptions:
    """dampening: GPTQ percdamp (kt's convert_gpu_weights default 0.1); block_size: GPTQ column block;
    calibrate_all: every expert sees every token (llmcompressor's default moe_calibrate_all_experts=True), else
    routed tokens only; causal_mask: False passes attention_mask=None to the layers (oneshot's Qwen3-MoE
    behaviour, gptq-streaming.md §1.4 — tests only); device: "cpu" / "cuda" / None (CUDA when available)."""

    dampening: float = 0.1
    block_size: int = 128
    calibrate_all: bool = True
    causal_mask: bool = True
    device: str | None = None


@dataclass
class LayerResult:
    """One MoE layer: payloads[(expert, proj)] from the quantizer; tokens[e] = calibration tokens routed to
    expert e (top-k choices over all samples); fallback = experts quantized data-free (no routed token)."""

    layer: int
    payloads: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)
    fallback_quant: str | None = None   # the data-free quantizer the fallback experts went through
    clamped: int = 0                    # AMX: codes clamped to the range so far (see gptq/amx.py)


class _Stop(Exception):
    """Raised by a hook to end a forward early once its input is captured."""


# ---------------------------------------------------------------------------------------------- helpers

def pick_device(device: str | None):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def malloc_trim() -> None:
    """Hand freed heap back to the OS (glibc arenas otherwise grow over the first layers, §2 detail 5)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _to(obj, device):
    """Move every tensor inside obj (tuples, lists, dicts) to device."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def bits_to_torch(arr, dtype: str):
    """numpy array as Checkpoint.read returns it (BF16 as uint16 bits) -> torch tensor of that dtype."""
    import numpy as np
    import torch

    if dtype == "BF16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def torch_dtype_of(config: dict):
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


# model_types whose checkpoints transformers runs with another model_type's classes (same tensors, same forward)
TRANSFORMERS_ALIASES = {"kimi_k2": "deepseek_v3"}


def _aliased_config(root: Path):
    """The transformers config of an aliased model_type (Kimi-K2 is DeepSeek-V3 to transformers), or None."""
    from transformers import CONFIG_MAPPING

    data = read_json(Path(root) / "config.json")
    alias = TRANSFORMERS_ALIASES.get(data.get("model_type", ""))
    if alias is None:
        return None
    data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map", "architectures")}
    return CONFIG_MAPPING[alias](**data)


def build_skeleton(root: Path, dtype):
    """Meta-device AutoModelForCausalLM from root/config.json (eager attention), experts linearised; rotary
    embeddings rebuilt on CPU (their buffers are computed, not loaded)."""
    import torch
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modeling.moe import linear_experts
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        config = _aliased_config(root)
        if config is None:
            raise InputError(f"transformers cannot build a model from config.json ({exc})", file="config.json",
                             hint="GPTQ needs a model_type known to the installed transformers") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.device("meta"), patch_attr(linear_experts, "offload_module", lambda *a, **k: None):
        linearize_moe(model)   # new 2-D expert modules on meta too; nothing to offload
    model.eval()
    inner = model.model
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is not None:
        with torch.device("cpu"):
            inner.rotary_emb = type(rotary)(config=getattr(rotary, "config", model.config))
    return model


class _Recorder:
    """Stands in for decoder layer L during the recording forward: keeps its kwargs (and layer 0's input)."""

    def __init__(self, original, store: dict, index: int):
        import torch

        class Rec(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                store.setdefault("kwargs", {})[index] = kwargs
                if index == 0:
                    store["hidden"] = hidden_states
                return hidden_states

        self.module = Rec()
        for attr in ("attention_type", "layer_type", "layer_idx", "is_sliding"):
            if hasattr(original, attr):
                setattr(self.module, attr, getattr(original, attr))


# ---------------------------------------------------------------------------------------------- the stream

class LayerStream:
    """GPTQ over checkpoint `src`'s decoder layers in order, with calibration `samples` (list of 1-D int64
    token tensors, calibrated in ``oneshot_order``), quantizer `quantizer` (see GpuQuantizer for the interface)
    and GptqOptions."""

    def __init__(self, src, samples: list, quantizer, options: GptqOptions = GptqOptions()):
        from ktconvert.formats.hf_source import HFSource
        from ktconvert.gptq.calibration import oneshot_order

        if not samples:
            raise InputError("no calibration samples", hint="--calibration FILE must hold at least one sample")
        self.source = src if isinstance(src, HFSource) else HFSource.open(src)
        self.checkpoint, self.info = self.source.checkpoint, self.source.info
        self.quantizer, self.options = quantizer, options
        self.device = pick_device(options.device)
        self.dtype = torch_dtype_of(self.checkpoint.config)
        self.model = build_skeleton(self.checkpoint.root, self.dtype)
        self.layers = self.model.model.layers
        self.fp32_keys = tuple(getattr(self.model, "_keep_in_fp32_modules_strict", None) or ())
        self.prefix = self.info.name_prefix
        self.hidden, self.kwargs = self._record_inputs(oneshot_order(samples))
        self.done = -1

    # -- inputs

    def _record_inputs(self, samples: list):
        """(hidden states of layer 0 per sample [1, S, H] on CPU, per sample {layer: kwargs})."""
        import torch

        inner = self.model.model
        embed_name = self.prefix + "embed_tokens.weight"
        inner.embed_tokens.load_state_dict({"weight": self._tensor(embed_name, inner.embed_tokens.weight)},
                                           assign=True)
        originals, norm = inner.layers, getattr(inner, "norm", None)
        hidden, kwargs = [], []
        try:
            if norm is not None:
                inner.norm = torch.nn.Identity()
            for ids in samples:
                store: dict = {}
                inner.layers = torch.nn.ModuleList(_Recorder(layer, store, i).module
                                                   for i, layer in enumerate(originals))
                ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
                with torch.no_grad():
                    inner(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                hidden.append(store["hidden"].detach())
                per_layer = store["kwargs"]
                if not self.options.causal_mask:
                    per_layer = {k: {**v, "attention_mask": None} for k, v in per_layer.items()}
                kwargs.append(per_layer)
        finally:
            inner.layers = originals
            if norm is not None:
                inner.norm = norm
        inner.embed_tokens = torch.nn.Identity()   # frees the embedding
        return hidden, kwargs

    # -- weights

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for transformers' in-memory tensor `name`: the same, or with transformers'
        renaming for this model_type undone (MiniMax / Mixtral keep `block_sparse_moe.` on disk, `mlp.` in memory)."""
        if name in self.checkpoint.tensors:
            return name
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping

        for rule in get_checkpoint_conversion_mapping(self.model.config.model_type) or ():
            if not isinstance(rule, WeightRenaming):
                continue
            for on_disk, in_memory in zip(rule.source_patterns, rule.target_patterns):
                candidate = name.replace(in_memory, on_disk)
                if candidate != name and candidate in self.checkpoint.tensors:
                    return candidate
        return name

    def _tensor(self, name: str, like):
        """Checkpoint tensor `name` as a torch tensor with `like`'s shape, in from_pretrained's dtype."""
        name = self._checkpoint_name(name)
        ref = self.checkpoint.tensors.get(name)
        if ref is None:
            raise InputError("tensor the model needs is missing from the checkpoint", file=self._index_name(),
                             tensor=name, expected=f"shape {list(like.shape)}")
        if ref.dtype in ("BF16", "F16", "F32"):
            t = bits_to_torch(self.checkpoint.read(name), ref.dtype)
        else:
            t = self._decode_quantized(name)
        if tuple(t.shape) != tuple(like.shape):
            raise InputError("checkpoint tensor shape disagrees with the model transformers builds from "
                             "config.json", file=ref.file.name, tensor=name, expected=str(list(like.shape)),
                             found=str(list(t.shape)))
        return t.to(self._dtype_for(name, like))

    def _decode_quantized(self, name: str):
        """FP8 / packed-int weights of non-expert modules, through ktconvert's decoders, as BF16."""
        from ktconvert.formats.decoders import decode_matrix, detect_scheme

        base = name[: -len(".weight")] if name.endswith(".weight") else name
        return bits_to_torch(decode_matrix(self.checkpoint, base, detect_scheme(self.checkpoint.config)), "BF16")

    def _dtype_for(self, name: str, like):
        import torch

        if any(key in name for key in self.fp32_keys):
            return torch.float32
        return like.dtype

    def _index_name(self) -> str:
        ck = self.checkpoint
        return (ck.index_file or ck.shards[0].path).name

    def _load_layer(self, L: int):
        """Assign layer L's weights into the skeleton (experts via HFSource); returns the layer module."""
        layer = self.layers[L]
        state, experts = {}, {}
        for key, like in layer.state_dict(keep_vars=True).items():
            m = EXPERT_KEY.match(key)
            if m and L in self.info.moe_layers:
                e = int(m.group(1))
                if e not in experts:
                    experts[e] = self.source.read_expert(L, e)
                state[key] = self._expert_tensor(experts[e], m.group(2), m.group(3), like, L, e)
            else:
                state[key] = self._tensor(f"{self.prefix}layers.{L}.{key}", like)
            if len(experts) > 1:
                experts.pop(min(experts))
        layer.load_state_dict(state, assign=True, strict=True)
        meta = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if meta:
            raise InputError(f"layer {L}: tensors left unloaded", found=", ".join(meta[:5]))
        return layer.to(self.device)

    def _expert_tensor(self, ew, proj: str, kind: str, like, L: int, e: int):
        import torch

        value = getattr(ew, proj if kind == "weight" else proj + "_bias")
        if value is None:
            raise InputError(f"layer {L} expert {e}: {proj} {kind} missing in the source", tensor=f"{proj}_{kind}")
        t = bits_to_torch(value, "BF16") if kind == "weight" else torch.from_numpy(value)
        return t.to(like.dtype)

    # -- the loop

    def layers_results(self) -> Iterator[LayerResult]:
        """Run every decoder layer in order; yields a LayerResult after each MoE layer is quantized."""
        for L in range(len(self.layers)):
            result = self.run_layer(L)
            if result is not None:
                yield result

    def run_layer(self, L: int) -> LayerResult | None:
        """Layer L (layers must be run in order): GPTQ of its experts (MoE layers), then propagation."""
        import torch

        if L != self.done + 1:
            raise ValueError(f"layers must be run in order: expected {self.done + 1}, got {L}")
        layer = self._load_layer(L)
        result = None
        with torch.no_grad():
            experts = _experts_module(layer) if L in self.info.moe_layers else None
            if experts is not None:
                result = self._quantize_experts(L, layer, experts)
            self._propagate(L, layer)
        self.layers[L] = torch.nn.Identity()
        del layer
        self.done = L
        malloc_trim()
        return result

    def _forward(self, layer, i: int, L: int):
        out = layer(self.hidden[i].to(self.device), **_to(self.kwargs[i][L], self.device))
        return out[0] if isinstance(out, tuple) else out

    def _capture_moe_inputs(self, L: int, layer, experts) -> list:
        """Per sample: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) reaching the experts module."""
        captured = []

        def hook(module, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("top_k_index", "top_k_weights") if k in kwargs]
            captured.append(tuple(v.detach() for v in values[:3]))
            raise _Stop

        handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i in range(len(self.hidden)):
                try:
                    self._forward(layer, i, L)
                except _Stop:
                    pass
        finally:
            handle.remove()
        return captured

    def _quantize_experts(self, L: int, layer, experts) -> LayerResult:
        import torch

        cached = self._capture_moe_inputs(L, layer, experts)
        n_experts = experts.num_experts
        routes = [_routes(idx, n_experts) for _, idx, _ in cached]
        result = LayerResult(L, tokens=[sum(int(r[e].numel()) for r in routes) for e in range(n_experts)])
        shared_gu = self._shared_gate_up(experts, cached) if self.options.calibrate_all else None
        for e in range(n_experts):
            expert, where = experts[e], f"layer {L} expert {e}"
            if not self.options.calibrate_all and result.tokens[e] == 0:
                result.payloads.update({(e, p): v for p, v in self.quantizer.fallback(expert, where).items()})
                result.fallback.append(e)
                continue
            inputs = [h if self.options.calibrate_all else h[r[e]] for (h, _, _), r in zip(cached, routes)]
            gate_up, down = _expert_hessians(expert, inputs, shared_gu)
            payloads = self.quantizer.quantize(expert, gate_up, down, self.options, where)
            result.payloads.update({(e, p): v for p, v in payloads.items()})
            del gate_up, down, inputs
        del cached
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return result

    def _shared_gate_up(self, experts, cached):
        """calibrate-all: every expert's gate/up input is the whole [T, H]: one Hessian for the layer."""
        from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

        module = experts[0].gate_proj
        H, n = make_empty_hessian(module, device=self.device), _zero(self.device)
        for h, _, _ in cached:
            H, n = accumulate_hessian(h, module, H, n)
        return H, n

    def _propagate(self, L: int, layer) -> None:
        """Next layer's inputs: the layer forward with quantized weights (oneshot's propagation pass)."""
        from llmcompressor.modeling.moe.context import moe_calibration_context
        from llmcompressor.utils.helpers import DisableQuantization

        moe = moe_calibration_context() if self.options.calibrate_all else contextlib.nullcontext()
        with moe, DisableQuantization(layer):
            for i in range(len(self.hidden)):
                self.hidden[i] = self._forward(layer, i, L).to("cpu")


def _experts_module(layer):
    """The linearised experts module (llmcompressor LinearExperts2D) of a decoder layer, or None."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    for module in layer.modules():
        if isinstance(module, LinearExperts2D):
            return module
    return None


def _routes(top_k_index, n_experts: int) -> list:
    """Per expert: the token indices routed to it, in the order LinearExperts2D.forward selects them."""
    import torch

    mask = torch.nn.functional.one_hot(top_k_index, n_experts).permute(2, 1, 0)
    return [torch.where(mask[e])[1] for e in range(n_experts)]


def _zero(device):
    import torch

    return torch.zeros((), device=device)


def _expert_hessians(expert, inputs: list, shared_gu=None):
    """((H_gate_up, n), (H_down, n)) of one expert from its per-sample inputs, with llmcompressor's
    accumulate_hessian; gate_proj and up_proj read the same input, so one Hessian serves both."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

    device = expert.down_proj.weight.device
    gu = shared_gu or (make_empty_hessian(expert.gate_proj, device=device), _zero(device))
    down = [make_empty_hessian(expert.down_proj, device=device), _zero(device)]
    state = {"gu": list(gu)}

    def gate_hook(module, args):
        state["gu"][0], state["gu"][1] = accumulate_hessian(args[0], module, *state["gu"])

    def down_hook(module, args):
        down[0], down[1] = accumulate_hessian(args[0], module, down[0], down[1])
        raise _Stop

    handles = [expert.down_proj.register_forward_pre_hook(down_hook)]
    if shared_gu is None:
        handles.append(expert.gate_proj.register_forward_pre_hook(gate_hook))
    try:
        for x in inputs:
            try:
                expert(x.to(device))
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return tuple(state["gu"]), tuple(down)


# ---------------------------------------------------------------------------------------------- GPU quantizer

def gptq_module(module, quant_args, hessian, num_samples, options: GptqOptions, qparams=None):
    """llmcompressor GPTQ of one Linear: observer qparams (or the given {"scale", "zero_point",
    "global_scale"}), prepare_batch, quantize_weight. Returns (quantized float32 [n, k], scale, zero_point,
    global_scale, used_rtn_fallback). `module` must carry a quantization scheme unless qparams is given."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import prepare_batch

    if qparams is None:
        from llmcompressor.modifiers.quantization.calibration import initialize_observer, observe

        initialize_observer(module, "weight")
        observe(module, base_name="weight")
        qparams = module.weight_observer.get_qparams()
    weights, hessians, scales, zero_points, global_scales = prepare_batch(
        [module], [qparams], {module: hessian}, {module: num_samples})
    with single_thread_on_cpu(weights.device):
        quantized, _losses, rtn = quantize_weight(weights=weights, hessians=hessians, scale=scales,
                                                  zero_point=zero_points, global_scale=global_scales,
                                                  quant_args=quant_args, blocksize=options.block_size,
                                                  percdamp=options.dampening)
    return quantized, scales, zero_points, global_scales, bool(rtn[0])


@contextlib.contextmanager
def single_thread_on_cpu(device):
    """One torch thread while a CPU GPTQ solve runs: MKL's Cholesky factorisation / inverse
    (``torch.linalg.cholesky``, ``cholesky_inverse``) round differently with the thread count, which would make the
    codes depend on the host's cores. (oneshot on CPU has that dependence; compare with it at one thread.)"""
    import torch

    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class GpuQuantizer:
    """compressed-tensors pack-quantized W4A16/W8A16 (symmetric int, group `group_size`, actorder static, as
    llmcompressor's GPTQModifier resolves it). Quantizer interface used by LayerStream:

    quantize(expert, (H_gu, n_gu), (H_down, n_down), options, where) -> {proj: payload}  (sets the QDQ weights
        on the modules for the propagation pass)
    fallback(expert, where) -> {proj: payload}  (data-free; experts no calibration token reaches)

    payload: {"weight_packed": int32 [n, k*bits/32], "weight_scale": uint16 BF16 bits [n, k/gs],
    "weight_shape": int64 [2]} — the same dict as ktconvert.gpu.experts.quantize_expert_rtn."""

    def __init__(self, bits: int, group_size: int, actorder: str | None = "static"):
        from ktconvert.gpu.experts import scheme

        self.bits, self.group_size = bits, group_size
        self.scheme = scheme(bits, group_size, actorder)
        self.rtn_fallback: list[str] = []   # modules where llmcompressor itself fell back (not positive definite)

    def quantize(self, expert, gate_up, down, options: GptqOptions, where: str) -> dict:
        from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
        from llmcompressor.modifiers.gptq.helpers import update_batch_qparams
        from llmcompressor.modifiers.quantization.calibration import freeze_module_quantization

        out = {}
        for proj, (H, n) in (("gate", gate_up), ("up", gate_up), ("down", down)):
            module = getattr(expert, proj + "_proj")
            initialize_module_for_quantization(module, self.scheme)
            quantized, scales, zps, gscales, rtn = gptq_module(module, self.scheme.weights, H, n, options)
            if rtn:
                self.rtn_fallback.append(f"{where} {proj}")
            update_batch_qparams([module], quantized, scales, zps, gscales, self.scheme.weights)
            freeze_module_quantization(module)
            out[proj] = self._packed(module)
        return out

    def _packed(self, module) -> dict:
        """PackedQuantizationCompressor.compress of the module's state (what compress_module writes); the
        module keeps its QDQ weight for propagation."""
        import numpy as np
        import torch
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        state = {"weight": module.weight.detach(), "weight_scale": module.weight_scale.detach(),
                 "weight_zero_point": module.weight_zero_point.detach()}
        packed = PackedQuantizationCompressor.compress(state, self.scheme)
        return {"weight_packed": packed["weight_packed"].cpu().numpy(),
                "weight_scale": packed["weight_scale"].cpu().view(torch.int16).numpy().view(np.uint16),
                "weight_shape": packed["weight_shape"].cpu().to(torch.int64).numpy()}

    def fallback(self, expert, where: str) -> dict:
        """RTN exactly as model_free_ptq (ktconvert.gpu.experts.quantize_expert_rtn)."""
        import numpy as np
        import torch

        from ktconvert.gpu.experts import quantize_expert_rtn

        out = {}
        for proj in ("gate", "up", "down"):
            w = getattr(expert, proj + "_proj").weight.detach().to("cpu", torch.bfloat16)
            bits = w.view(torch.int16).numpy().view(np.uint16)
            out[proj] = quantize_expert_rtn(bits, self.bits, self.group_size, where=f"{where} {proj}")
        return out
