"""The layer-streaming GPTQ loop: llmcompressor's GPTQ functions over one decoder layer at a time.

    skeleton   AutoModelForCausalLM.from_config on the meta device (eager attention), experts linearised with
               llmcompressor's ``linearize_moe`` (skeleton.py)
    inputs     one recording forward of the real model code with every decoder layer replaced by a recorder:
               layer 0's hidden states and each layer's keyword arguments (inputs.py)
    per layer  weights read from safetensors and assigned into the skeleton layer (stream.py); calibration
               forward stops at the experts module and caches its input (hidden states [T, H], top-k indices and
               weights) per sample; then, **one expert at a time**: ``accumulate_hessian`` on the expert's inputs
               (hessians.py), the quantizer (``GpuQuantizer`` / ``cpu.AmxQuantizer``) runs ``quantize_weight``;
               then the propagation forward with the quantised weights gives the next layer's input; the layer
               is freed. ``ExpertSolver`` is the part between capture and propagation (it needs no forward), which
               gptq.distributed runs on the processes owning some of a layer's experts.

Details carried over for bit-identity with llmcompressor ``oneshot`` (gptq-streaming.md §2): eager attention and
the real causal mask (``causal_mask=False`` reproduces oneshot's Qwen3-MoE mask=None, tests only); tensors loaded
in the dtype ``from_pretrained`` gives them (``_keep_in_fp32_modules_strict`` stay float32); propagation under
``DisableQuantization``; samples in oneshot's unshuffled order (``calibration.oneshot_order``: longest first — the
order sets the float32 summation order of every Hessian), batch size 1; ``malloc_trim`` after each layer; routed
token counts per expert, and experts no calibration token reaches (routed-only mode) go to the quantizer's
data-free fallback instead of a zero Hessian (which llmcompressor turns into all-zero weights).

Memory: one layer's weights + the calibration activations (T x H per sample, x2 while propagating) + one
expert's two Hessians (H^2 + I^2 float32). Runs on CUDA when torch sees a GPU (``device=None``), else on CPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from ktconvert.gpu.experts import quantize_expert_rtn, scheme
from ktconvert.gptq.calibration import oneshot_permutation
from ktconvert.gptq.determinism import pin_process
from ktconvert.gptq.grid import Grid
from ktconvert.gptq.hessians import expert_hessians, gptq_module, routes, shared_gate_up
from ktconvert.gptq.holdout import DATA_FREE, FEW_TOKENS, GPTQ, NOT_PD, choose, expert_errors, holdout_masks
from ktconvert.gptq.skeleton import experts_module, routed
from ktconvert.gptq.stream import DecoderStream


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
    expert e (top-k choices over all samples); fallback = experts written data-free; reasons[e] = why expert e got
    what it got (holdout.GPTQ, DATA_FREE: held-out judgement, FEW_TOKENS, NOT_PD); errors[e] = {GPTQ, DATA_FREE:
    held-out squared error} of the experts the held-out split judged."""

    layer: int
    payloads: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    errors: dict = field(default_factory=dict)
    fallback_quant: str | None = None   # the data-free quantizer the fallback experts went through

    def add(self, expert: int, reason: str, payloads: dict) -> None:
        self.payloads.update({(expert, p): v for p, v in payloads.items()})
        self.reasons.append(reason)
        if reason != GPTQ:
            self.fallback.append(expert)


class LayerStream(DecoderStream):
    """GPTQ over checkpoint `src`'s decoder layers in order, with calibration `samples` (list of 1-D int64
    token tensors in file order; calibrated in ``oneshot_order``), quantizer `quantizer` (see GpuQuantizer for
    the interface) and GptqOptions. A quantizer with a ``selection`` (holdout.SelectionOptions) and
    ``dequantized`` gets the held-out selection of ``holdout.py``: its Hessians come from the fit tokens only.
    mtp_layers: MTP layers quantized after the decoder layers (DecoderStream)."""

    def __init__(self, src, samples: list, quantizer, options: GptqOptions = GptqOptions(), mtp_layers=()):
        pin_process()                      # before torch computes anything here (gptq.determinism)
        self.quantizer, self.options = quantizer, options
        order = oneshot_permutation(samples) if samples else []
        held_masks = calibration_holdout(quantizer, samples, order)
        super().__init__(src, [samples[i] for i in order], device=options.device, causal_mask=options.causal_mask,
                         mtp_layers=mtp_layers)
        self.solver = ExpertSolver(quantizer, options, held_masks, self.device)

    def layers_results(self) -> Iterator[LayerResult]:
        """Run every decoder layer in order; yields a LayerResult after each MoE layer is quantized."""
        for _, result in self.run_all():
            if result is not None:
                yield result

    def process_layer(self, L: int, layer) -> LayerResult | None:
        """GPTQ of layer L's experts (MoE layers), then propagation with the quantized weights."""
        experts = self.experts_of(L, layer)
        result = None
        if experts is not None:
            result = self.solver.quantize(L, experts, self.capture_inputs(L, layer, experts))
        self.propagate(L, layer, lambda: propagation_context(layer, self.options.calibrate_all))
        return result

    def experts_of(self, L: int, layer):
        """Layer L's routed experts module (MoE and MTP layers), or None."""
        return experts_module(layer) if self.has_experts(L) else None


def calibration_holdout(quantizer, samples: list, order: list[int]) -> list | None:
    """The held-out masks (holdout.holdout_masks of `samples` in file order) in calibration `order`, or None when
    the quantizer has no enabled ``selection``."""
    selection = getattr(quantizer, "selection", None)
    every = selection.holdout_every if selection is not None else 0
    if not every:
        return None
    masks = holdout_masks([len(s) for s in samples], every)
    return [masks[i] for i in order]


@contextlib.contextmanager
def propagation_context(layer, calibrate_all: bool):
    """oneshot's propagation pass: quantized weights as they are (no second fake-quantisation), every expert
    computing on every token under calibrate-all."""
    from llmcompressor.modeling.moe.context import moe_calibration_context
    from llmcompressor.utils.helpers import DisableQuantization

    moe = moe_calibration_context() if calibrate_all else contextlib.nullcontext()
    with moe, DisableQuantization(layer):
        yield


class ExpertSolver:
    """GPTQ of one MoE layer's experts from the inputs captured at its experts module, no forward of the layer:
    the part of LayerStream a process owning some of the experts runs (gptq.distributed). quantizer / options as
    LayerStream's; held_masks: per calibration sample (calibration order) bool [S], True where held out, or None
    (no held-out selection); device: where the Hessians are accumulated."""

    def __init__(self, quantizer, options: GptqOptions, held_masks: list | None, device):
        self.quantizer, self.options, self.held_masks, self.device = quantizer, options, held_masks, device
        self.selection = getattr(quantizer, "selection", None) if held_masks is not None else None

    def quantize(self, L: int, experts, cached: list, owned=None, shared_gu=None) -> LayerResult:
        """LayerResult of the experts in `owned` (None: all, in order; the written weights are left on them);
        cached: per calibration sample, in calibration order, (hidden [T, H], top_k_index [T, k], top_k_weights
        [T, k]) reaching the experts module; shared_gu: the calibrate-all gate/up Hessian (``shared_gate_up``),
        computed here when None. ``tokens`` counts every expert's routed tokens."""
        import torch

        n_experts = experts.num_experts
        result = LayerResult(L, tokens=torch.bincount(torch.cat([idx.reshape(-1) for _, idx, _ in cached]).cpu(),
                                                      minlength=n_experts).tolist())
        fit, held = self.split(cached)
        del cached
        per_sample = [routes(idx, n_experts) for _, idx, _ in fit]
        if self.options.calibrate_all and shared_gu is None:
            shared_gu = shared_gate_up(experts, fit, self.device)
        for e in range(n_experts) if owned is None else owned:
            inputs = [h if self.options.calibrate_all else h[r[e]] for (h, _, _), r in zip(fit, per_sample)]
            reason, payloads = self._quantize_expert(experts[e], e, f"layer {L} expert {e}", inputs, shared_gu,
                                                     result, held)
            result.add(e, reason, payloads)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return result

    def shared_gate_up(self, experts, cached: list):
        """The calibrate-all gate/up (Hessian, count) over the fit part of `cached` (as ``quantize`` takes it)."""
        return shared_gate_up(experts, self.split(cached)[0], self.device)

    def split(self, cached: list) -> tuple[list, tuple | None]:
        """(fit samples [(hidden, top_k_index, top_k_weights)], held-out tokens of all samples concatenated as one
        such triple, or None without a split)."""
        import torch

        if self.held_masks is None:
            return cached, None
        fit = [tuple(t[~m] for t in c) for c, m in zip(cached, self.held_masks) if bool((~m).any())]
        held = tuple(torch.cat([c[i][m] for c, m in zip(cached, self.held_masks)]) for i in range(3))
        return fit, held

    def _quantize_expert(self, expert, e: int, where: str, inputs: list, shared_gu, result: LayerResult,
                         held) -> tuple[str, dict]:
        """(reason, payloads) of one expert; leaves the written weights on the expert for propagation."""
        q = self.quantizer
        fit_tokens = sum(int(x.shape[0]) for x in inputs)
        if held is None:
            if fit_tokens == 0:
                return self._written(expert, FEW_TOKENS, q.fallback(expert, where))
            payloads = q.quantize(expert, *expert_hessians(expert, inputs, shared_gu), self.options, where)
            return self._written(expert, *((GPTQ, payloads) if payloads is not None
                                           else (NOT_PD, q.fallback(expert, where))))
        tokens, weights = routed(held[1], held[2], e)
        data_free = q.fallback(expert, where)
        if fit_tokens == 0 or result.tokens[e] < self.selection.min_tokens or tokens.numel() == 0:
            return self._written(expert, FEW_TOKENS, data_free)
        gptq = q.quantize(expert, *expert_hessians(expert, inputs, shared_gu), self.options, where)
        if gptq is None:
            return self._written(expert, NOT_PD, data_free)
        candidates = {GPTQ: q.dequantized(gptq), DATA_FREE: q.dequantized(data_free)}
        errors = expert_errors(expert, candidates, held[0][tokens], weights)
        result.errors[e] = errors
        choice = choose(errors)
        return self._written(expert, choice, gptq if choice == GPTQ else data_free)

    def _written(self, expert, reason: str, payloads: dict) -> tuple[str, dict]:
        """Put the written weights on the expert (quantizers with ``dequantized``; GpuQuantizer's GPTQ sets its
        QDQ weights itself) for the propagation pass; returns (reason, payloads)."""
        if hasattr(self.quantizer, "dequantized"):
            for proj, w in self.quantizer.dequantized(payloads).items():
                module = getattr(expert, proj + "_proj")
                module.weight.data = w.to(module.weight.device, module.weight.dtype)
        return reason, payloads


# ---------------------------------------------------------------------------------------------- GPU quantizer

class GpuQuantizer:
    """compressed-tensors pack-quantized W4A16/W8A16 (symmetric int, group `group_size`, actorder static, as
    llmcompressor's GPTQModifier resolves it), scales from llmcompressor's weight observer `observer` (None: its
    default, min-max; "mse": its MSE grid search, what ``ktconvert gpu --quant gptq`` uses). Quantizer interface
    used by LayerStream:

    quantize(expert, (H_gu, n_gu), (H_down, n_down), options, where) -> {proj: payload}  (sets the QDQ weights
        on the modules for the propagation pass)
    fallback(expert, where) -> {proj: payload}  (data-free; experts no calibration token reaches)

    payload: {"weight_packed": int32 [n, k*bits/32], "weight_scale": uint16 BF16 bits [n, k/gs],
    "weight_shape": int64 [2]} — the same dict as ktconvert.gpu.experts.quantize_expert_rtn."""

    def __init__(self, bits: int, group_size: int, actorder: str | None = "static", observer: str | None = None):
        self.bits, self.group_size, self.observer = bits, group_size, observer
        self.grid = Grid.int_sym(bits, group_size, "BF16")   # the grid `scheme` gives llmcompressor, as data
        self.scheme = scheme(bits, group_size, actorder, observer)
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

        out = {}
        for proj in ("gate", "up", "down"):
            w = getattr(expert, proj + "_proj").weight.detach().to("cpu", torch.bfloat16)
            bits = w.view(torch.int16).numpy().view(np.uint16)
            out[proj] = quantize_expert_rtn(bits, self.bits, self.group_size, where=f"{where} {proj}")
        return out
