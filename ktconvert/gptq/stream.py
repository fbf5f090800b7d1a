"""Calibration tokens through a checkpoint's decoder layers, one layer in memory at a time.

``DecoderStream`` holds the meta skeleton (skeleton.py), the hidden states entering the next layer per sample
(inputs.py records layer 0's and every layer's keyword arguments), and runs layer after layer:

    load     the layer's weights read from safetensors (experts through ``HFSource``, so FP8 / int4 / MXFP4
             sources arrive as BF16) and assigned into the skeleton layer, in the dtype from_pretrained gives
             them (``_keep_in_fp32_modules_strict`` tensors stay float32) or the stream's dtype
    process  ``process_layer(L, layer)``: by default the layer's own forward over every sample, whose outputs
             become the next layer's inputs; subclasses do their work here (GPTQ: loop.LayerStream; routed-token
             counts: ktconvert.activation)
    free     the layer is replaced by Identity and the heap trimmed

On CPU every forward runs at one torch thread with oneDNN off (``determinism.deterministic_cpu``): oneDNN's BF16
matmul rounds differently with the thread count (measured: 1-11 of the 4.2 M outputs of a [2048, 1024] x [1024,
2048] product differ between 1 and 3, 5, 6, 7, 12 or 24 threads) and with the instruction set it picks (AMX,
AVX512_BF16), which would make routing, Hessians and codes depend on the host; ATen's and MKL's own kernels are
pinned per process by the GPTQ entry points (``determinism.pin_process``).

A stream built with ``inputs=(hidden, kwargs)`` instead of samples records nothing: it runs the given hidden
states (a slice of the calibration samples, gptq.distributed). ``fresh_layer(L)`` / ``load_layer(L, module,
experts=, others=)`` load a copy of a layer, or part of one (some routed experts, or none), leaving the skeleton
as it is.

MTP (next-n) layers, when asked for (``mtp_layers``), run after the last decoder layer, in order, each on the
hidden states the layer before it produced (the last decoder layer's output for the first one), with that decoder
layer's keyword arguments (mask, rotary embeddings). Their module is a copy of the last decoder layer whose tensor
names the MTP layer's checkpoint tensors match (an MTP layer is a decoder layer: DeepSeek / GLM's
``model.layers.{num_hidden_layers}``, Qwen3-Next / Qwen3.5's full-attention ``mtp.layers.{k}``). The MTP head's own
input projection (``eh_proj`` / ``mtp.fc`` over the next token's embedding and the hidden states) is not run: the
layer is calibrated on the decoder's hidden states themselves.

Memory: one layer's weights + the calibration activations (T x H per sample, x2 while a layer runs).
"""
from __future__ import annotations

import contextlib
import copy
import re

from ktconvert.errors import InputError
from ktconvert.formats.hf_source import HFSource
from ktconvert.gptq.determinism import deterministic_cpu
from ktconvert.gptq.hessians import StopForward
from ktconvert.gptq.inputs import record_inputs
from ktconvert.gptq.skeleton import (bits_to_torch, build_skeleton, malloc_trim, pick_device, to_device,
                                     torch_dtype_of)

EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


class DecoderStream:
    """Checkpoint `src` (path or HFSource) run over calibration `samples` (list of 1-D int64 token tensors, in
    the order given) one decoder layer at a time.

    dtype: torch dtype of the layers (None: what from_pretrained gives, config.json's dtype); device: "cpu" /
    "cuda" / None (CUDA when torch sees one); causal_mask False: attention_mask=None (tests only); mtp_layers: MTP
    layers (numbered n_layers + k, from ``info.mtp_layers``) run after the decoder layers (see the module doc);
    inputs: (hidden states per sample [1, S, H], keyword arguments per sample {layer: kwargs}) as ``record_inputs``
    gives them, run instead of recording `samples` (None then)."""

    def __init__(self, src, samples: list | None, *, dtype=None, device: str | None = None, causal_mask: bool = True,
                 mtp_layers=(), inputs: tuple | None = None):
        if inputs is None and not samples:
            raise InputError("no calibration samples", hint="--calibration FILE must hold at least one sample")
        self.source = src if isinstance(src, HFSource) else HFSource.open(src)
        self.info = self.source.info
        self.device = pick_device(device)
        self.dtype = torch_dtype_of(self.source.config_json()) if dtype is None else dtype
        self.model = build_skeleton(self.source.model_dir(), self.dtype)
        self.layers = self.model.model.layers
        self.fp32_keys = tuple(getattr(self.model, "_keep_in_fp32_modules_strict", None) or ())
        self.prefix = self.info.name_prefix
        if inputs is None:
            embed = self._tensor(self.prefix + "embed_tokens.weight", self.model.model.embed_tokens.weight)
            with deterministic_cpu(self.device):
                inputs = record_inputs(self.model, embed, samples, causal_mask)
        self.hidden, self.kwargs = list(inputs[0]), list(inputs[1])
        mtp_layers = sorted(mtp_layers)
        if mtp_layers != list(range(len(self.layers), len(self.layers) + len(mtp_layers))) or \
                not set(mtp_layers) <= set(self.info.mtp_layers):
            raise ValueError(f"MTP layers are numbered from {len(self.layers)} on, in order: got {mtp_layers}")
        self.mtp = {L: self._mtp_module(L) for L in mtp_layers}   # MTP layer -> (module, the layer it copies)
        self.n_total = len(self.layers) + len(self.mtp)
        self.done = -1

    def _mtp_module(self, L: int) -> tuple:
        """(meta module, decoder layer it copies) for MTP layer L: the last decoder layer whose tensor names, under
        MTP layer L's prefix, are all in the checkpoint (experts: in the source)."""
        present = set(self.source.tensor_names())
        for t in reversed(self.info.moe_layers):
            keys = [k for k in self.layers[t].state_dict(keep_vars=True) if not EXPERT_KEY.match(k)]
            if all(self._checkpoint_name(self._layer_tensor_name(L, k)) in present for k in keys):
                return copy.deepcopy(self.layers[t]), t
        raise InputError(f"MTP layer {L}: no decoder layer of the model has its tensors",
                         file=self.source.tensors_file(),
                         tensor=self._layer_tensor_name(L, ""),
                         hint="convert without --include-mtp (the MTP layer is left out)")

    def _layer_tensor_name(self, L: int, key: str) -> str:
        """Checkpoint name of layer L's tensor `key` (MTP layers under the family's MTP prefix)."""
        return self.info.layer_name("layers.{L}." + key.replace("{", "{{").replace("}", "}}"), L)

    # -- weights

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for transformers' in-memory tensor `name`: the same, or with transformers'
        renaming for this model_type undone (MiniMax / Mixtral keep `block_sparse_moe.` on disk, `mlp.` in memory)."""
        if self.source.tensor(name) is not None:
            return name
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping

        for rule in get_checkpoint_conversion_mapping(self.model.config.model_type) or ():
            if not isinstance(rule, WeightRenaming):
                continue
            for on_disk, in_memory in zip(rule.source_patterns, rule.target_patterns):
                candidate = name.replace(in_memory, on_disk)
                if candidate != name and self.source.tensor(candidate) is not None:
                    return candidate
        return name

    def _tensor(self, name: str, like):
        """Checkpoint tensor `name` as a torch tensor with `like`'s shape, in from_pretrained's dtype."""
        name = self._checkpoint_name(name)
        ref = self.source.tensor(name)
        if ref is None:
            raise InputError("tensor the model needs is missing from the checkpoint", file=self.source.tensors_file(),
                             tensor=name, expected=f"shape {list(like.shape)}")
        if ref.dtype in ("BF16", "F16", "F32"):
            t = bits_to_torch(self.source.read_tensor(name), ref.dtype)
        else:
            t = self._decode_quantized(name)
        if tuple(t.shape) != tuple(like.shape):
            raise InputError("checkpoint tensor shape disagrees with the model transformers builds from "
                             "config.json", file=ref.file.name, tensor=name, expected=str(list(like.shape)),
                             found=str(list(t.shape)))
        return t.to(self._dtype_for(name, like))

    def _decode_quantized(self, name: str):
        """FP8 / packed-int weights of non-expert modules, through ktconvert's decoders (Source.read_linear), as
        BF16."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        return bits_to_torch(self.source.read_linear(base), "BF16")

    def _dtype_for(self, name: str, like):
        import torch

        if any(key in name for key in self.fp32_keys):
            return torch.float32
        return like.dtype

    def load_layer(self, L: int, module=None, *, experts=None, others: bool = True):
        """Assign layer L's weights into the skeleton (experts via HFSource), or into `module` (a meta copy of
        layer L: ``fresh_layer``); returns the layer module on the stream's device. experts: the routed experts
        whose weights are read (None: all); others: read the layer's other tensors too. What is not read stays
        on meta."""
        layer = module if module is not None else self.module(L)
        moe = self.has_experts(L)
        wanted = None if experts is None else set(experts)
        state, cache = {}, {}
        for key, like in layer.state_dict(keep_vars=True).items():
            m = EXPERT_KEY.match(key) if moe else None
            if m is None and others:
                state[key] = self._tensor(self._layer_tensor_name(L, key), like)
            elif m is not None and (wanted is None or int(m.group(1)) in wanted):
                e = int(m.group(1))
                if e not in cache:
                    cache.clear()
                    cache[e] = self.source.read_expert(L, e)
                state[key] = self._expert_tensor(cache[e], m.group(2), m.group(3), like, L, e)
        complete = others and wanted is None
        layer.load_state_dict(state, assign=True, strict=complete)
        if complete:
            meta = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
            if meta:
                raise InputError(f"layer {L}: tensors left unloaded", found=", ".join(meta[:5]))
        return to_device_but_meta(layer, self.device)

    def view(self, hidden: list, kwargs: list) -> "DecoderStream":
        """This stream running `hidden` / `kwargs` instead (a slice of the samples, as ``inputs``): a shallow
        copy sharing the source and the skeleton; load its layers with ``fresh_layer``."""
        other = copy.copy(self)
        other.hidden, other.kwargs = list(hidden), list(kwargs)
        return other

    def fresh_layer(self, L: int):
        """A meta copy of layer L's module (the stream's own stays as it is), for ``load_layer(L, module)``."""
        return copy.deepcopy(self.module(L))

    def module(self, L: int):
        """The skeleton's module of layer L (an MTP layer's copy of a decoder layer: ``_mtp_module``)."""
        return self.mtp[L][0] if L in self.mtp else self.layers[L]

    def has_experts(self, L: int) -> bool:
        """Layer L has routed experts (MoE and MTP layers)."""
        return L in self.info.moe_layers or L in self.mtp

    def _expert_tensor(self, ew, proj: str, kind: str, like, L: int, e: int):
        import torch

        value = getattr(ew, proj if kind == "weight" else proj + "_bias")
        if value is None:
            raise InputError(f"layer {L} expert {e}: {proj} {kind} missing in the source", tensor=f"{proj}_{kind}")
        t = bits_to_torch(value, "BF16") if kind == "weight" else torch.from_numpy(value)
        return t.to(like.dtype)

    # -- the loop

    def run_layer(self, L: int):
        """Layer L (layers must be run in order): load, ``process_layer``, free. Returns what process_layer
        returns."""
        import torch

        if L != self.done + 1:
            raise ValueError(f"layers must be run in order: expected {self.done + 1}, got {L}")
        layer = self.load_layer(L)
        with torch.no_grad(), deterministic_cpu(self.device):
            result = self.process_layer(L, layer)
        self._free(L)
        del layer
        self.done = L
        malloc_trim()
        return result

    def _free(self, L: int) -> None:
        import torch

        if L in self.mtp:
            self.mtp[L] = (torch.nn.Identity(), self.mtp[L][1])
        else:
            self.layers[L] = torch.nn.Identity()

    def skip_to(self, L: int, hidden: list) -> None:
        """Continue after layer L (a resumed run): layers up to L are dropped unrun, `hidden` (per sample [1, S, H],
        what layer L produced in an earlier run) becomes the next layer's input."""
        if len(hidden) != len(self.hidden):
            raise ValueError(f"{len(hidden)} hidden states for {len(self.hidden)} calibration samples")
        for done in range(self.done + 1, L + 1):
            self._free(done)
        self.hidden, self.done = list(hidden), L
        malloc_trim()

    def run_all(self):
        """Every remaining decoder layer, then the MTP layers asked for, in order; yields (L, process_layer's
        result)."""
        while self.done + 1 < self.n_total:
            L = self.done + 1
            yield L, self.run_layer(L)

    def process_layer(self, L: int, layer):
        """The work on a loaded layer; by default the float forward that gives the next layer's inputs."""
        self.propagate(L, layer)

    def forward(self, layer, i: int, L: int):
        """Layer L's forward on sample i's hidden states [1, S, H]; returns the output hidden states."""
        template = self.mtp[L][1] if L in self.mtp else L
        out = layer(self.hidden[i].to(self.device), **to_device(self.kwargs[i][template], self.device))
        return out[0] if isinstance(out, tuple) else out

    def propagate(self, L: int, layer, context=contextlib.nullcontext) -> None:
        """Every sample through layer L (inside a fresh `context()`); outputs become the next layer's inputs."""
        with context():
            for i in range(len(self.hidden)):
                self.hidden[i] = self.forward(layer, i, L).to("cpu")

    def capture_inputs(self, L: int, layer, module) -> list:
        """Per sample: the positional arguments and the ``top_k_index`` / ``top_k_weights`` keywords reaching
        `module` (a submodule of layer L; the first three values, detached), the forward stopped there."""
        captured = []

        def hook(_module, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("top_k_index", "top_k_weights") if k in kwargs]
            captured.append(tuple(v.detach() for v in values[:3]))
            raise StopForward

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i in range(len(self.hidden)):
                try:
                    self.forward(layer, i, L)
                except StopForward:
                    pass
        finally:
            handle.remove()
        return captured


def to_device_but_meta(module, device):
    """`module` with every tensor that is not on meta moved to `device` (meta ones stay: parts not loaded)."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))
