"""Where every source tensor goes in the GPU checkpoint, decided from headers and config only.

Shards: ``model-00001-of-N.safetensors`` holds everything outside the converted MoE layers (embeddings, lm_head,
final norm, dense layers); shard i+1 holds MoE layer ``layers[i-1]`` entire: attention, norms, router, shared
experts and every routed expert (``<expert>.weight_packed`` / ``weight_scale`` / ``weight_shape``). MTP layers
are converted with ``include_mtp`` and otherwise left out (SGLang's main model does not load them; llmcompressor's
``oneshot`` output lacks them too).

Each shard is a list of items ``(specs, produce)``: specs [(name, dtype, shape)], produce(source) ->
{name: array} reading one source tensor (formats.base.Source's tensor methods); routed experts are not items: they
come from the pipeline's stream. Which non-expert modules are SGLang LinearBase layers: the family manifest's
``[linears]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ktconvert.errors import InputError
from ktconvert.gpu import linears
from ktconvert.formats.linear_storage import SCALE_SUFFIXES
from ktconvert.gpu.experts import expert_specs
from ktconvert.layouts.naming import PROJS, shard_name


@dataclass
class Item:
    specs: list
    produce: Callable


@dataclass
class Shard:
    name: str
    layer: int | None                       # None: the non-MoE shard
    items: list = field(default_factory=list)
    experts: list = field(default_factory=list)     # (expert, proj, base, n, k)

    def specs(self, bits: int, group_size: int) -> list:
        out = [s for item in self.items for s in item.specs]
        for _, _, base, n, k in self.experts:
            out += expert_specs(base, n, k, bits, group_size)
        return out


def _copy(ref) -> Item:
    name = ref.name
    return Item([(name, ref.dtype, tuple(ref.shape))], lambda src: {name: src.read_tensor(name)})


def _to_bf16(module: str, shape) -> Item:
    name = module + ".weight"
    return Item([(name, "BF16", tuple(shape))], lambda src: {name: src.read_linear(module)})


class GpuLayout:
    """The GPU checkpoint of `source` (an HFSource) for `layers` (MoE layers, plus MTP layers when included)."""

    def __init__(self, source, layers, linear_mode: str, bits: int, group_size: int):
        info = source.info
        self.source, self.layers, self.mode = source, list(layers), linear_mode
        self.bits, self.group_size = bits, group_size
        # routed experts are written per expert under the family's per-expert names, whatever the source layout
        self.expert_bases = {(layer, e, p): info.expert_names(layer, e)[p][: -len(".weight")]
                             for layer in self.layers for e in range(info.n_experts) for p in PROJS}
        self.expert_modules = set(self.expert_bases.values())
        routed = source.routed_tensor_names(info.moe_layers + info.mtp_layers)
        dropped = set(info.mtp_layers) - set(self.layers)
        total = len(self.layers) + 1
        self.shards = {None: Shard(shard_name(1, total), None)}
        for i, layer in enumerate(self.layers):
            self.shards[layer] = Shard(shard_name(i + 2, total), layer)
            self.shards[layer].items += self._expert_biases(layer)
        self.linear_modules: set[str] = set()
        self.other_linears: set[str] = set()
        for name in source.tensor_names():
            layer = info.layer_of(name)
            if layer in dropped or name in routed:
                continue        # routed expert weights come from the stream, their biases from _expert_biases
            self._place(self.shards[layer if layer in self.shards else None], name)
        shapes = {"gate": (info.intermediate, info.hidden), "up": (info.intermediate, info.hidden),
                  "down": (info.hidden, info.intermediate)}
        for (layer, e, p), base in sorted(self.expert_bases.items()):
            self.shards[layer].experts.append((e, p, base, *shapes[p]))
        self._check_fp8_config()

    def _expert_biases(self, layer: int) -> list[Item]:
        """Per-expert ``<expert>.bias`` items of `layer` (as stored: copied, or sliced out of a fused bias)."""
        source = self.source
        layout = source.required_layout(layer)
        if layout.kind == "per_expert":
            return [_copy(source.tensor(n)) for e in range(source.info.n_experts)
                    for k, n in source.expert_weight_names(layer, e).items() if k.endswith("_bias")]
        items = []
        for t in (t for t in layout.tensors if t.bias):
            ref = source.tensor(t.bias)
            rows = ref.shape[1] // len(t.projs)
            for e in range(source.info.n_experts):
                names = {p: self.expert_bases[(layer, e, p)] + ".bias" for p in t.projs}
                items.append(Item([(names[p], ref.dtype, (rows,)) for p in t.projs],
                                  lambda src, t=t, e=e, names=names: {
                                      names[p]: np.ascontiguousarray(b) for p, b in
                                      source.split_role(t, src.read_tensor(t.bias, e)).items()}))
        return items

    def _place(self, shard: Shard, name: str) -> None:
        ref = self.source.tensor(name)
        module = linears.module_of(name)
        stored = self.source.stored_linear(module)
        if stored.kind == "decoded":
            self._place_decoded(shard, name, module, stored.refs)
            return
        is_weight = name == module + ".weight"
        suffix = name[len(module) + 1:]
        if self._linear_base(module):
            if is_weight:
                plan = linears.plan_linear(self.source, module, self.mode)
                shard.items.append(Item(plan.specs, plan.produce))
                self.linear_modules.add(module)
            elif suffix not in SCALE_SUFFIXES:
                shard.items.append(_copy(ref))
            return
        if stored.kind == "fp8-block":
            if is_weight:
                shard.items.append(_to_bf16(module, ref.shape))
            elif suffix not in SCALE_SUFFIXES:
                shard.items.append(_copy(ref))
        else:
            shard.items.append(_copy(ref))
        if is_weight and len(ref.shape) == 2 and not _is_embedding(module):
            self.other_linears.add(module)

    def _place_decoded(self, shard: Shard, name: str, module: str, refs) -> None:
        """A linear stored in a quantized form a decoder reads (Source.stored_linear "decoded"): its primary tensor
        becomes the module's weight (LinearBase: as --linears says; others BF16), its partners (scales, zeros, g_idx,
        activation scales) go, anything else (a bias) is copied."""
        if name == refs.primary:
            if self._linear_base(module):
                plan = linears.plan_linear(self.source, module, self.mode)
                shard.items.append(Item(plan.specs, plan.produce))
                self.linear_modules.add(module)
            else:
                shard.items.append(_to_bf16(module, refs.shape))
                self.other_linears.add(module)
        elif name not in refs.partners.values():
            shard.items.append(_copy(self.source.tensor(name)))

    def _linear_base(self, module: str) -> bool:
        return linears.is_linear_base(module, self.source.info.manifest)

    def _check_fp8_config(self) -> None:
        """`keep` needs all linears FP8 or all float (linear_fp8_config covers every LinearBase or none)."""
        if self.mode != "keep":
            return
        kinds = {self.source.stored_linear(m).kind for m in self.linear_modules} - {"decoded"}
        if len(kinds) > 1:
            raise InputError("--linears keep: the source mixes FP8 and float linears, which SGLang cannot load "
                             "(linear_fp8_config applies to every linear)", expected="all FP8 or all BF16",
                             found=", ".join(sorted(kinds)), hint="use --linears fp8 or --linears bf16")

    @property
    def linear_fp8(self) -> bool:
        """Whether the output's linears are FP8 (so config.json needs linear_fp8_config)."""
        if self.mode == "fp8":
            return True
        if self.mode == "bf16":
            return False
        return any(self.source.stored_linear(m).kind == "fp8-block" for m in self.linear_modules)

    def ignore_modules(self) -> tuple[set[str], set[str]]:
        """(HF module names, SGLang module names) of every non-expert linear the ignore list must cover."""
        hf = self.linear_modules | self.other_linears
        sgl = set(linears.sglang_names(self.linear_modules).values()) | self.other_linears
        return hf, sgl

    def expert_check_names(self) -> set[str]:
        """Expert module names (HF and SGLang's FusedMoE probe `<moe>.experts.0.{gate,up,down}_proj`)."""
        names = set(self.expert_modules)
        for layer in self.layers:
            base = self.expert_bases[(layer, 0, "gate")]
            moe = base[: base.index(".experts.") + len(".experts.")]
            names.update(f"{moe}0.{p}_proj" for p in PROJS)
        return names


def _is_embedding(module: str) -> bool:
    return module.endswith("embed_tokens") or module.endswith("embeddings") or module.endswith("wte")
