"""Expert source for HF safetensors checkpoints: one routed expert at a time, as BF16 bits in HF orientation.

The layout of each layer's routed experts is detected from the tensors present (``formats/expert_layout.py``;
names of every layout in ``ktconvert.architectures.expert_names``), whatever the family usually stores:
  per_expert      2-D tensors gate/up [I, H], down [H, I] per expert (optionally with .bias next to .weight)
  fused           3-D per layer: gate_up [E, 2I, H] or [E, H, 2I], down [E, H, I] or [E, I, H]
  fused_separate  3-D per layer: gate, up [E, I, H] or [E, H, I], down as above
The orientation of each fused role is decided once for the checkpoint (shapes, the storage format, the other
roles, ``--expert-orientation``). gate_up is first-half gate, or interleaved (gpt-oss: even rows gate, odd rows
up, in the [2I, H] orientation). A fused tensor is only ever read one expert slice at a time.

Weights are decoded by ``formats.decoders`` (float, FP8 block, compressed-tensors int, MXFP4, ...), chosen per
matrix from config.json's quantization_config (parsed once per source) and the tensors present.
"""
from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path

import numpy as np

from ktconvert.architectures.manifests import resolve
from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.formats import decoders, expert_layout, hf_describe, linear_storage
from ktconvert.formats.base import ExpertWeights, Source, TensorRef
from ktconvert.formats.expert_layout import FusedTensor, LayerLayout, Orientation
from ktconvert.formats.linear_storage import StoredLinear
from ktconvert.formats.out_manifest import source_fingerprint
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.formats.stream import MatrixJob
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.quant.bf16 import bf16_bits_to_f32

PROJS = ("gate", "up", "down")


class HFSource(Source):
    """Lazily read HF safetensors checkpoint with a resolved ModelInfo (ktconvert.architectures.manifests.resolve).

    input_format: "bf16" | "fp16" | "fp32" | a quantized format ("fp8-block", "ct-int4", "mxfp4", ...), or the
    config's quant_method when no decoder reads it (then validate() and reads raise the decoders' InputError).
    expert_orientation: "out" | "in" | None, what ``--expert-orientation`` says about square fused tensors.
    """

    name, aliases = "hf-safetensors", ("safetensors", "hf")

    def __init__(self, checkpoint: Checkpoint, info, expert_orientation: str | None = None):
        self.checkpoint = checkpoint
        self.info = info
        self.expert_orientation = expert_orientation
        self._layouts: dict[int, LayerLayout | None] = {}
        self.input_format = self._detect_format()

    # -- opening

    @classmethod
    def sniff(cls, path) -> bool:
        p = Path(path)
        if p.is_file():
            return p.suffix == ".safetensors"
        return any(p.glob("*.safetensors")) or (p / INDEX_NAME).is_file()

    @classmethod
    def open(cls, path, expert_orientation: str | None = None, remote=None) -> "HFSource":
        """Open directory/file `path`: parse every header, resolve config.json against the manifests. remote: the
        shards not downloaded yet (Checkpoint.open)."""
        return cls.open_checkpoint(Checkpoint.open(path, remote), expert_orientation)

    @classmethod
    def open_checkpoint(cls, checkpoint: Checkpoint, expert_orientation: str | None = None) -> "HFSource":
        """HFSource over an opened Checkpoint (its config.json resolved against the manifests)."""
        if checkpoint.config_file is None:
            raise InputError("config.json not found next to the safetensors files", file=str(checkpoint.root))
        return cls(checkpoint, resolve(checkpoint.config, checkpoint.tensors.keys()), expert_orientation)

    @classmethod
    def describe_path(cls, path, expert_orientation: str | None = None) -> tuple[dict, "HFSource | None"]:
        return hf_describe.describe_path(cls, path, expert_orientation)

    def describe(self) -> dict:
        return hf_describe.describe(self)

    @property
    def root(self) -> Path:
        """The checkpoint directory (config.json, tokenizer files)."""
        return self.checkpoint.root

    def files(self) -> list[Path]:
        return self.checkpoint.files()

    def file_bytes(self) -> int:
        return sum(shard.file_bytes for shard in self.checkpoint.shards)    # also shards still on the hub

    def ensure_local(self, files) -> None:
        self.checkpoint.ensure_local(files)

    def config_sha256(self) -> str | None:
        cf = self.checkpoint.config_file
        return hashlib.sha256(cf.read_bytes()).hexdigest() if cf else None

    def fingerprint(self) -> dict:
        return source_fingerprint(self.root, self.files())

    def header_digests(self) -> dict[str, dict]:
        digests = {}
        for shard in self.checkpoint.shards:
            with open(shard.path, "rb") as fh:
                header = fh.read(shard.header_bytes)
            digests[self.relative_name(shard.path)] = {"bytes": int(shard.file_bytes),
                                                       "header_sha256": hashlib.sha256(header).hexdigest()}
        return digests

    def config_json(self) -> dict:
        return self.checkpoint.config

    # -- stored tensors

    def tensor_names(self) -> list[str]:
        return sorted(self.checkpoint.tensors)

    def tensor(self, name: str) -> TensorRef | None:
        return self.checkpoint.tensors.get(name)

    def read_tensor(self, name: str, index0: int | None = None) -> np.ndarray:
        return self.checkpoint.read(name) if index0 is None else self.checkpoint.read_slice(name, index0)

    def tensors_file(self) -> str:
        ck = self.checkpoint
        return (ck.index_file or (ck.shards[0].path if len(ck.shards) == 1 else ck.root)).name

    def stored_linear(self, module: str) -> StoredLinear:
        return linear_storage.stored_linear(self.checkpoint, lambda: self.scheme, module)

    def read_linear(self, module: str) -> np.ndarray:
        return linear_storage.read_bf16(self.checkpoint, lambda: self.scheme, self.stored_linear(module))

    @cached_property
    def scheme(self):
        """config.json's quantization_config parsed (formats.decoders.QuantScheme), None when not quantized;
        InputError on first use when no decoder reads it."""
        return decoders.detect_scheme(self.checkpoint.config)

    # -- layout (formats/expert_layout.py)

    def layer_layout(self, layer: int) -> LayerLayout | None:
        """How `layer` stores its routed experts (cached), None when none of its expert tensors is present."""
        if layer not in self._layouts:
            scheme = self._scheme_or_none()
            self._layouts[layer] = expert_layout.detect_layer(self.checkpoint, self.info, scheme, layer,
                                                              strict=scheme is not None or self._unquantized())
        return self._layouts[layer]

    def _scheme_or_none(self):
        try:
            return self.scheme
        except InputError:       # no decoder reads it: plain tensors still locate; the rest fails on first use
            return None

    def _unquantized(self) -> bool:
        return decoders.base.quantization_config_of(self.checkpoint.config) is None

    def required_layout(self, layer: int) -> LayerLayout:
        """layer_layout(layer), or InputError naming every tensor name tried when no layout is present."""
        layout = self.layer_layout(layer)
        if layout is None:
            tried = [next(iter(roles.values())) for _, _, roles in expert_layout.candidate_layouts(self.info, layer)]
            raise InputError(f"routed expert weights of layer {layer} not found", file=self.tensors_file(),
                             tensor=tried[0], expected=f"one of the {self.info.family} expert layouts: "
                             + ", ".join(tried), hint="is this the right model_type / a complete download?")
        return layout

    @cached_property
    def orientation(self) -> dict[str, Orientation]:
        """{fused role: Orientation} decided over every fused tensor of the model ({} when nothing is fused)."""
        layouts = [self.layer_layout(layer) for layer in self.info.moe_layers + self.info.mtp_layers]
        if any(t.stored is None for lay in layouts if lay is not None for t in lay.tensors):
            self.scheme          # raises the decoders' InputError naming the unreadable quantization
        return expert_layout.decide_orientation([lay for lay in layouts if lay is not None], self.info,
                                                self._file_of, self.expert_orientation)

    def _file_of(self, t: FusedTensor) -> str:
        refs = decoders.locate(self.checkpoint, t.name, self._scheme_or_none(), 0)
        return self.checkpoint.tensors[refs.primary].file.name

    # -- names

    def present_mtp_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in self.info.mtp_layers if self.layer_layout(layer) is not None)

    def _detect_format(self) -> str:
        layers = self.info.moe_layers or self.info.mtp_layers
        if not layers:
            raise InputError("config describes no MoE layers", file=self.checkpoint.config_file.name
                             if self.checkpoint.config_file else None)
        layout = self.required_layout(layers[0])
        base, index0 = ((layout.tensors[0].name, 0) if layout.tensors
                        else (_base_of(self.info.expert_names(layers[0], 0)["gate"]), None))
        if decoders.base.plain_name(self.checkpoint, base, index0) is None:
            qc = decoders.base.quantization_config_of(self.checkpoint.config)
            try:
                self.scheme
            except InputError:     # no decoder reads it: name it after its quant_method, fail on first use
                return str(qc.get("quant_method")) if isinstance(qc, dict) else "unknown-quantized"
        return decoders.input_format(self.checkpoint, self._locate(base, index0))

    def _locate(self, base: str, index0: int | None):
        return decoders.locate(self.checkpoint, base, self.scheme, index0)

    # -- validation

    def validate(self, include_mtp: bool = False) -> None:
        """Every converted layer has every expert's weights with the config's shapes (I, H, E) in some layout,
        and every fused tensor's orientation is decided; raises on the first problem (InputError: missing /
        wrong dtype / unsupported format / undecidable orientation; ShapeError: wrong shape)."""
        for layer in self.all_layers(include_mtp):
            layout = self.required_layout(layer)
            if layout.kind == "per_expert":
                for e in range(self.info.n_experts):
                    self._check_expert(layer, e)
                continue
            self.orientation
            for t in layout.tensors:
                decoders.validate_matrix(self.checkpoint, t.name, self.scheme, t.stored, 0)
                self._check_fused_bias(t)

    def _check_expert(self, layer: int, e: int) -> None:
        I, H = self.info.intermediate, self.info.hidden
        names = self.info.expert_names(layer, e)
        for proj, want in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = names[proj]
            if not decoders.has_weight(self.checkpoint, _base_of(name)):
                raise InputError(f"missing weight of expert {e} in layer {layer}", file=self.tensors_file(),
                                 tensor=name)
            decoders.validate_matrix(self.checkpoint, _base_of(name), self.scheme, want,
                                     note=f" ([I, H] for gate/up, [H, I] for down; I={I}, H={H})")
            bias = self.checkpoint.tensors.get(_bias_name(name))
            if bias is not None and bias.shape != want[:1]:
                raise ShapeError(f"expert {proj} bias shape disagrees with config.json", file=bias.file.name,
                                 tensor=bias.name, expected=str(list(want[:1])), found=str(list(bias.shape)))

    def _check_fused_bias(self, t: FusedTensor) -> None:
        if t.bias is None:
            return
        ref = self.checkpoint.tensors[t.bias]
        rows = {"gate_up": 2 * self.info.intermediate, "down": self.info.hidden}.get(t.role, self.info.intermediate)
        if ref.shape != (self.info.n_experts, rows):
            raise ShapeError("fused expert bias shape disagrees with config.json", file=ref.file.name, tensor=ref.name,
                             expected=str([self.info.n_experts, rows]), found=str(list(ref.shape)))

    # -- reading

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        """Expert `expert` of `layer`: gate/up uint16 [I, H], down uint16 [H, I] (BF16 bits); biases float32."""
        if not 0 <= expert < self.info.n_experts:
            raise InputError(f"expert index out of range in layer {layer}", expected=f"0..{self.info.n_experts - 1}",
                             found=str(expert))
        layout = self.required_layout(layer)
        if layout.kind == "per_expert":
            names = self.expert_weight_names(layer, expert)
            mats = {p: decoders.decode_matrix(self.checkpoint, _base_of(names[p]), self.scheme) for p in PROJS}
            biases = {p + "_bias": self._bias_f32(names.get(p + "_bias")) for p in PROJS}
            return ExpertWeights(**mats, **biases)
        mats, biases = {}, {}
        for t in layout.tensors:
            mats.update(self._decode_fused(t, expert))
            if t.bias:
                biases.update({p + "_bias": b for p, b in self.split_role(t, self._bias_f32(t.bias, expert)).items()})
        return ExpertWeights(**mats, **biases)

    def expert_weight_names(self, layer: int, expert: int) -> dict[str, str]:
        """{"gate", "up", "down"} weight names of one expert (+ "*_bias" where present)."""
        names = self.info.expert_names(layer, expert)
        for proj in PROJS:
            bias = _bias_name(names[proj])
            if bias in self.checkpoint.tensors:
                names[proj + "_bias"] = bias
        return names

    def _decode_fused(self, t: FusedTensor, e: int, raw=None, refs=None) -> dict[str, np.ndarray]:
        """Expert `e` of fused tensor `t` -> {proj: uint16 BF16 bits [out, in]}."""
        m = decoders.decode_matrix(self.checkpoint, t.name, self.scheme, e, refs=refs, raw=raw)
        if self.orientation[t.role].value == "in":
            m = np.ascontiguousarray(m.T)
        return self.split_role(t, m)

    def split_role(self, t: FusedTensor, rows: np.ndarray) -> dict[str, np.ndarray]:
        """A role's [out, ...] rows -> {proj: rows}: gate_up [2I, ...] is even/odd rows when interleaved
        (gpt-oss), else first/second half."""
        if t.role != "gate_up":
            return {t.role: rows}
        if self.info.manifest.experts.gate_up_interleaved:
            return {"gate": np.ascontiguousarray(rows[0::2]), "up": np.ascontiguousarray(rows[1::2])}
        half = rows.shape[0] // 2
        return {"gate": rows[:half], "up": rows[half:]}

    def _bias_f32(self, name: str | None, index0: int | None = None) -> np.ndarray | None:
        if name is None:
            return None
        ref = self.checkpoint.ref(name)
        arr = self.checkpoint.read(name) if index0 is None else self.checkpoint.read_slice(name, index0)
        return bf16_bits_to_f32(arr) if ref.dtype == "BF16" else arr.astype(np.float32)

    # -- biases

    def _bias_names(self, layer: int) -> list[str]:
        layout = self.required_layout(layer)
        if layout.kind != "per_expert":
            return [t.bias for t in layout.tensors if t.bias]
        return [n for e in range(self.info.n_experts)
                for k, n in self.expert_weight_names(layer, e).items() if k.endswith("_bias")]

    def nonzero_expert_biases(self, layers) -> list[str]:
        """Names of expert bias tensors (in `layers`) holding any non-zero value (reads only the biases)."""
        return [n for layer in layers for n in self._bias_names(layer) if np.any(self._bias_f32(n) != 0)]

    def has_expert_biases(self) -> bool:
        return bool(self._bias_names(self.all_layers()[0]))

    # -- the tensors that are not routed experts

    def routed_tensor_names(self, layers) -> set[str]:
        """Every tensor holding routed-expert data of `layers` (weights, scales, zero points, shapes, biases)."""
        names: set[str] = set()
        for layer in layers:
            layout = self.layer_layout(layer)
            if layout is None:
                continue
            if layout.kind == "per_expert":
                bases = [(_base_of(n), None) for e in range(self.info.n_experts)
                         for n in self.info.expert_names(layer, e).values()]
                names.update(n for e in range(self.info.n_experts) for k, n in
                             self.expert_weight_names(layer, e).items() if k.endswith("_bias"))
            else:
                bases = [(t.name, 0) for t in layout.tensors]
                names.update(t.bias for t in layout.tensors if t.bias)
            for base, index0 in bases:
                refs = self._locate(base, index0)
                names.update([refs.primary, *refs.partners.values()])
        return names

    def dense_tensors(self):
        """(specs, read) of every tensor that is not a routed expert's (weights and biases of every converted and
        MTP layer)."""
        expert = self.routed_tensor_names(self.info.moe_layers + self.info.mtp_layers)
        specs = [(name, ref.dtype, ref.shape) for name, ref in sorted(self.checkpoint.tensors.items())
                 if name not in expert]
        return specs, self.checkpoint.read

    # -- what kt-kernel reads as is

    def kt_native_names(self) -> bool:
        """Whether kt-kernel's HF loaders (BF16 / FP8 / RAWINT4) find the routed experts by name: per-expert
        ``mlp.experts.E.{gate,up,down}_proj`` / ``experts.E.{w1,w3,w2}``, or the packed ``mlp.experts.gate_up_proj``
        [E, 2I, H] + ``down_proj`` [E, H, I]."""
        lay = self.info.manifest.experts
        try:
            layout = self.required_layout(self.all_layers()[0])
            if layout.kind == "fused":
                return (not lay.gate_up_interleaved and layout.tensors[0].name.endswith("mlp.experts.gate_up_proj")
                        and all(o.value == "out" for o in self.orientation.values()))
        except KtConvertError:
            return False
        if layout.kind != "per_expert":
            return False
        projs = (lay.proj.get("gate"), lay.proj.get("up"), lay.proj.get("down"))
        return (("mlp.experts.{E}" in lay.pattern and projs == ("gate_proj", "up_proj", "down_proj"))
                or ("experts.{E}" in lay.pattern and projs == ("w1", "w3", "w2")))

    def expert_quantization(self):
        """The quantization group (formats.decoders.QuantGroup) of the routed experts, None when unquantized."""
        if self.scheme is None:
            return None
        layout = self.required_layout(self.all_layers()[0])
        base = layout.tensors[0].name if layout.tensors else _base_of(self.info.expert_names(layout.layer, 0)["gate"])
        return self.scheme.group_for(base)

    # -- streaming jobs (the runner reads files front to back and hands the bytes back to decode)

    def matrix_jobs(self, layers) -> list[MatrixJob]:
        """One MatrixJob per stored expert matrix (a fused gate_up slice yields gate and up together).

        job.tensor / job.index0: the weight name and its slice (None: a per-expert tensor); job.key = (MatrixRefs,
        fused role or None); the job's byte range is the decoder's primary tensor (or its expert slice)."""
        jobs = []
        for layer in layers:
            for e in range(self.info.n_experts):
                for name, index0, projs, role in self._job_keys(layer, e):
                    refs = self._locate(_base_of(name) if index0 is None else name, index0)
                    ref = self.checkpoint.ref(refs.primary)
                    step = ref.nbytes // ref.shape[0] if index0 is not None else ref.nbytes
                    offset = ref.offset + (index0 or 0) * step
                    jobs.append(MatrixJob(ref.file, offset, step, layer, e, projs, name, index0, key=(refs, role)))
        return jobs

    def _job_keys(self, layer: int, e: int) -> list[tuple[str, int | None, tuple[str, ...], str | None]]:
        layout = self.required_layout(layer)
        if layout.kind != "per_expert":
            return [(t.name, e, t.projs, t.role) for t in layout.tensors]
        names = self.info.expert_names(layer, e)
        return [(names[p], None, (p,), None) for p in PROJS]

    def stored_specs(self, layer: int, expert: int) -> dict | None:
        if self.required_layout(layer).kind != "per_expert":
            return None
        out = {}
        for proj, name in self.info.expert_names(layer, expert).items():
            base = _base_of(name)
            out[proj] = decoders.stored_specs(self.checkpoint, base, self._locate(base, None))
            if out[proj] is None:
                return None
        return out

    def stored_arrays(self, job, raw) -> dict:
        refs, role = job.key
        if job.index0 is not None or role is not None:
            raise InputError("a fused expert tensor is not stored per expert", tensor=job.tensor)
        return decoders.stored_arrays(self.checkpoint, _base_of(job.tensor), refs, raw)

    def decode(self, job, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Bytes of one MatrixJob -> {proj: uint16 BF16 bits in HF orientation}."""
        refs, role = job.key
        if role is None:
            return {job.projs[0]: decoders.decode_matrix(self.checkpoint, _base_of(job.tensor), self.scheme,
                                                         refs=refs, raw=raw)}
        t = next(t for t in self.required_layout(job.layer).tensors if t.role == role)
        return self._decode_fused(t, job.index0, raw, refs)


def _base_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _bias_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith("weight") else weight_name + "_bias"
