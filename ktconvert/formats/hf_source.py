"""Expert source for HF safetensors checkpoints: one routed expert at a time, as BF16 bits in HF orientation.

Layouts (from the family manifest, ktconvert/architecture.py):
  per_expert  2-D tensors gate/up [I, H], down [H, I] per expert (optionally with .bias next to .weight)
  fused       3-D per layer: gate_up [E, 2I, H] or [E, H, 2I], down [E, H, I] or [E, I, H]; the orientation is
              detected from the shapes and config H/I. gate_up is first-half gate, or interleaved (gpt-oss: even
              rows gate, odd rows up, in the [2I, H] orientation). A fused tensor is only ever read one expert
              slice at a time.

Weights are decoded by ``formats.decoders`` (float, FP8 block, compressed-tensors int, MXFP4, ...), chosen per
matrix from config.json's quantization_config (parsed once per source) and the tensors present.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ktconvert.architecture import resolve
from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.formats import decoders, hf_describe
from ktconvert.formats.base import ExpertWeights, Source
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.formats.stream import MatrixJob
from ktconvert.quant.bf16 import bf16_bits_to_f32

PROJS = ("gate", "up", "down")


def fused_orientation(shape: tuple[int, ...], rows: int, cols: int) -> tuple[bool, bool] | None:
    """Orientation of one fused tensor [E, a, b] whose per-expert matrix should be [rows, cols].

    Returns (transposed, ambiguous): transposed when stored as [E, cols, rows]; ambiguous when rows == cols (then
    the untransposed [E, rows, cols], transformers' in-memory form, is assumed). None when the shape fits neither.
    """
    if len(shape) != 3:
        return None
    a, b = shape[1:]
    if rows == cols and (a, b) == (rows, cols):
        return False, True
    if (a, b) == (rows, cols):
        return False, False
    if (a, b) == (cols, rows):
        return True, False
    return None


@dataclass(frozen=True)
class FusedLayer:
    """One fused layer's tensors and orientation: transposed means stored [E, H, 2I] / [E, I, H]."""

    gate_up: str
    down: str
    gate_up_transposed: bool
    down_transposed: bool
    ambiguous: tuple[str, ...]  # "gate_up" / "down" when H == 2I / H == I and the other tensor's convention was used
    gate_up_bias: str | None = None
    down_bias: str | None = None


class HFSource(Source):
    """Lazily read HF safetensors checkpoint with a resolved ModelInfo (ktconvert.architecture.resolve).

    input_format: "bf16" | "fp16" | "fp32" | a quantized format ("fp8-block", "ct-int4", "mxfp4", ...), or the
    config's quant_method when no decoder reads it (then validate() and reads raise the decoders' InputError).
    """

    name, aliases = "hf-safetensors", ("safetensors", "hf")

    def __init__(self, checkpoint: Checkpoint, info):
        self.checkpoint = checkpoint
        self.info = info
        self._fused: dict[int, FusedLayer] = {}
        self.input_format = self._detect_format()

    # -- opening

    @classmethod
    def sniff(cls, path) -> bool:
        p = Path(path)
        return p.suffix == ".safetensors" if p.is_file() else any(p.glob("*.safetensors"))

    @classmethod
    def open(cls, path) -> "HFSource":
        """Open directory/file `path`: parse every header, resolve config.json against the manifests."""
        return cls.open_checkpoint(Checkpoint.open(path))

    @classmethod
    def open_checkpoint(cls, checkpoint: Checkpoint) -> "HFSource":
        """HFSource over an opened Checkpoint (its config.json resolved against the manifests)."""
        if checkpoint.config_file is None:
            raise InputError("config.json not found next to the safetensors files", file=str(checkpoint.root))
        return cls(checkpoint, resolve(checkpoint.config, checkpoint.tensors.keys()))

    @classmethod
    def describe_path(cls, path) -> tuple[dict, "HFSource | None"]:
        return hf_describe.describe_path(cls, path)

    def describe(self) -> dict:
        return hf_describe.describe(self)

    @property
    def root(self) -> Path:
        """The checkpoint directory (config.json, tokenizer files)."""
        return self.checkpoint.root

    def files(self) -> list[Path]:
        return self.checkpoint.files()

    def config_sha256(self) -> str | None:
        cf = self.checkpoint.config_file
        return hashlib.sha256(cf.read_bytes()).hexdigest() if cf else None

    @cached_property
    def scheme(self):
        """config.json's quantization_config parsed (formats.decoders.QuantScheme), None when not quantized;
        InputError on first use when no decoder reads it."""
        return decoders.detect_scheme(self.checkpoint.config)

    # -- names

    @property
    def fused(self) -> bool:
        return self.info.manifest.experts.form == "fused"

    def expert_tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """Per-expert: {"gate", "up", "down"} (+ "*_bias" where present); fused: the layer's fused tensors."""
        if self.fused:
            return dict(self.info.fused_names(layer))
        names = self.info.expert_names(layer, expert)
        for proj in PROJS:
            bias = _bias_name(names[proj])
            if bias in self.checkpoint.tensors:
                names[proj + "_bias"] = bias
        return names

    def present_mtp_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in self.info.mtp_layers
                     if decoders.has_weight(self.checkpoint, _base_of(self._probe_name(layer))))

    def _probe_name(self, layer: int) -> str:
        return self.info.fused_names(layer)["gate_up"] if self.fused else self.info.expert_names(layer, 0)["gate"]

    def _detect_format(self) -> str:
        layers = self.info.moe_layers or self.info.mtp_layers
        if not layers:
            raise InputError("config describes no MoE layers", file=self.checkpoint.config_file.name
                             if self.checkpoint.config_file else None)
        base = _base_of(self._probe_name(layers[0]))
        if not decoders.has_weight(self.checkpoint, base):
            raise InputError("routed expert weight not found", file=self._index_or_root(),
                             tensor=self._probe_name(layers[0]),
                             expected=f"{self.info.family} layout ({self.info.manifest.experts.form})",
                             hint="is this the right model_type / a complete download?")
        if decoders.base.plain_name(self.checkpoint, base, 0 if self.fused else None) is None:
            qc = decoders.base.quantization_config_of(self.checkpoint.config)
            try:
                self.scheme
            except InputError:     # no decoder reads it: name it after its quant_method, fail on first use
                return str(qc.get("quant_method")) if isinstance(qc, dict) else "unknown-quantized"
        refs = self._locate(base, 0 if self.fused else None)
        return decoders.input_format(self.checkpoint, refs)

    def _index_or_root(self) -> str:
        ck = self.checkpoint
        return (ck.index_file or (ck.shards[0].path if len(ck.shards) == 1 else ck.root)).name

    def _locate(self, base: str, index0: int | None):
        return decoders.locate(self.checkpoint, base, self.scheme, index0)

    # -- validation

    def validate(self, include_mtp: bool = False) -> None:
        """Every MoE layer has every expert's weights with the config's shapes (I, H, E); raises on the first
        problem (InputError: missing / wrong dtype / unsupported format; ShapeError: wrong shape)."""
        for layer in self.all_layers(include_mtp):
            if self.fused:
                self.fused_layer(layer)
            else:
                for e in range(self.info.n_experts):
                    self._check_expert(layer, e)

    def _check_expert(self, layer: int, e: int) -> None:
        I, H = self.info.intermediate, self.info.hidden
        names = self.info.expert_names(layer, e)
        for proj, want in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = names[proj]
            if not decoders.has_weight(self.checkpoint, _base_of(name)):
                raise InputError(f"missing weight of expert {e} in layer {layer}", file=self._index_or_root(),
                                 tensor=name)
            decoders.validate_matrix(self.checkpoint, _base_of(name), self.scheme, want,
                                     note=f" ([I, H] for gate/up, [H, I] for down; I={I}, H={H})")
            bias = self.checkpoint.tensors.get(_bias_name(name))
            if bias is not None and bias.shape != want[:1]:
                raise ShapeError(f"expert {proj} bias shape disagrees with config.json", file=bias.file.name,
                                 tensor=bias.name, expected=str(list(want[:1])), found=str(list(bias.shape)))

    def fused_layer(self, layer: int) -> FusedLayer:
        """Validated names and orientation of one fused layer (cached)."""
        if layer in self._fused:
            return self._fused[layer]
        names = self.info.fused_names(layer)
        E, I, H = self.info.n_experts, self.info.intermediate, self.info.hidden
        gu = self._orient(names["gate_up"], (E, 2 * I, H), "[E, 2I, H] or [E, H, 2I]")
        dn = self._orient(names["down"], (E, H, I), "[E, H, I] or [E, I, H]")
        if gu[1] and not dn[1]:     # an ambiguous tensor follows the other one's convention: both [E, out, in]
            gu = (dn[0], True)      # (Qwen3.5) or both [E, in, out] (gpt-oss)
        if dn[1] and not gu[1]:
            dn = (gu[0], True)
        ambiguous = tuple(k for k, o in (("gate_up", gu), ("down", dn)) if o[1])
        biases = {k: names.get(k) if names.get(k) in self.checkpoint.tensors else None
                  for k in ("gate_up_bias", "down_bias")}
        self._check_bias(biases["gate_up_bias"], (E, 2 * I))
        self._check_bias(biases["down_bias"], (E, H))
        fl = FusedLayer(names["gate_up"], names["down"], gu[0], dn[0], ambiguous, **biases)
        self._fused[layer] = fl
        return fl

    def _orient(self, name: str, dims: tuple[int, int, int], want: str) -> tuple[bool, bool]:
        """(transposed, ambiguous) of fused tensor `name`, whose expert matrix must be [rows, cols]."""
        E, rows, cols = dims
        if not decoders.has_weight(self.checkpoint, name):
            raise InputError("missing fused expert tensor", file=self._index_or_root(), tensor=name)
        refs = self._locate(name, 0)
        primary = self.checkpoint.tensors[refs.primary]
        shape = (primary.shape[0], *refs.shape)
        got = fused_orientation(shape, rows, cols) if shape[0] == E else None
        if got is None:
            raise ShapeError("fused expert tensor shape disagrees with config.json", file=primary.file.name,
                             tensor=name, expected=f"{want} = [{E}, {rows}, {cols}] or [{E}, {cols}, {rows}]",
                             found=str(list(shape)))
        return got

    def _check_bias(self, name: str | None, want: tuple[int, int]) -> None:
        if name is not None and self.checkpoint.tensors[name].shape != want:
            ref = self.checkpoint.tensors[name]
            raise ShapeError("fused expert bias shape disagrees with config.json", file=ref.file.name, tensor=name,
                             expected=str(list(want)), found=str(list(ref.shape)))

    # -- reading

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        """Expert `expert` of `layer`: gate/up uint16 [I, H], down uint16 [H, I] (BF16 bits); biases float32."""
        if not 0 <= expert < self.info.n_experts:
            raise InputError(f"expert index out of range in layer {layer}", expected=f"0..{self.info.n_experts - 1}",
                             found=str(expert))
        if self.fused:
            return self._read_fused(layer, expert)
        names = self.expert_tensor_names(layer, expert)
        mats = {p: decoders.decode_matrix(self.checkpoint, _base_of(names[p]), self.scheme) for p in PROJS}
        biases = {p + "_bias": self._bias_f32(names.get(p + "_bias")) for p in PROJS}
        return ExpertWeights(**mats, **biases)

    def _read_fused(self, layer: int, e: int) -> ExpertWeights:
        fl = self.fused_layer(layer)
        gate, up = self._split_gate_up(self._oriented(fl.gate_up, e, fl.gate_up_transposed))
        down = self._oriented(fl.down, e, fl.down_transposed)
        gate_bias = up_bias = down_bias = None
        if fl.gate_up_bias:
            gate_bias, up_bias = self._split_gate_up(self._bias_f32(fl.gate_up_bias, e))
        if fl.down_bias:
            down_bias = self._bias_f32(fl.down_bias, e)
        return ExpertWeights(gate, up, down, gate_bias, up_bias, down_bias)

    def _oriented(self, name: str, e: int, transposed: bool, raw=None, refs=None) -> np.ndarray:
        m = decoders.decode_matrix(self.checkpoint, name, self.scheme, e, refs=refs, raw=raw)
        return np.ascontiguousarray(m.T) if transposed else m

    def _split_gate_up(self, gu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[2I, ...] -> ([I, ...] gate, [I, ...] up): even/odd rows when interleaved, else halves."""
        if self.info.manifest.experts.gate_up_interleaved:
            return np.ascontiguousarray(gu[0::2]), np.ascontiguousarray(gu[1::2])
        half = gu.shape[0] // 2
        return gu[:half], gu[half:]

    def _bias_f32(self, name: str | None, index0: int | None = None) -> np.ndarray | None:
        if name is None:
            return None
        ref = self.checkpoint.ref(name)
        arr = self.checkpoint.read(name) if index0 is None else self.checkpoint.read_slice(name, index0)
        return bf16_bits_to_f32(arr) if ref.dtype == "BF16" else arr.astype(np.float32)

    def nonzero_expert_biases(self, layers) -> list[str]:
        """Names of expert bias tensors (in `layers`) holding any non-zero value (reads only the biases)."""
        found = []
        for layer in layers:
            if self.fused:
                fl = self.fused_layer(layer)
                names = [n for n in (fl.gate_up_bias, fl.down_bias) if n]
            else:
                names = [n for e in range(self.info.n_experts)
                         for k, n in self.expert_tensor_names(layer, e).items() if k.endswith("_bias")]
            found += [n for n in names if np.any(self._bias_f32(n) != 0)]
        return found

    def has_expert_biases(self) -> bool:
        layer = self.all_layers()[0]
        if self.fused:
            fl = self.fused_layer(layer)
            return bool(fl.gate_up_bias or fl.down_bias)
        return any(k.endswith("_bias") for k in self.expert_tensor_names(layer, 0))

    def dense_tensors(self):
        """(specs, read) of every tensor that is not a routed expert's (weights and biases of every converted and
        MTP layer)."""
        expert = {n for layer in self.info.moe_layers + self.info.mtp_layers for e in range(self.info.n_experts)
                  for n in self.expert_tensor_names(layer, e).values()}
        specs = [(name, ref.dtype, ref.shape) for name, ref in sorted(self.checkpoint.tensors.items())
                 if name not in expert]
        return specs, self.checkpoint.read

    # -- what kt-kernel reads as is

    def kt_native_names(self) -> bool:
        """Whether kt-kernel's HF loaders (BF16 / FP8 / RAWINT4) find the routed experts by name: per-expert
        ``mlp.experts.E.{gate,up,down}_proj`` / ``experts.E.{w1,w3,w2}``, or the packed gate_up [E, 2I, H]."""
        lay = self.info.manifest.experts
        if lay.form == "fused":
            if lay.gate_up_interleaved or not lay.gate_up.endswith("mlp.experts.gate_up_proj"):
                return False
            try:
                fl = self.fused_layer(self.all_layers()[0])
            except KtConvertError:
                return False
            return not fl.gate_up_transposed and not fl.down_transposed
        projs = (lay.proj.get("gate"), lay.proj.get("up"), lay.proj.get("down"))
        return (("mlp.experts.{E}" in lay.pattern and projs == ("gate_proj", "up_proj", "down_proj"))
                or ("experts.{E}" in lay.pattern and projs == ("w1", "w3", "w2")))

    def expert_quantization(self):
        """The quantization group (formats.decoders.QuantGroup) of the routed experts, None when unquantized."""
        if self.scheme is None:
            return None
        return self.scheme.group_for(_base_of(self._probe_name(self.all_layers()[0])))

    # -- streaming jobs (the runner reads files front to back and hands the bytes back to decode)

    def matrix_jobs(self, layers) -> list[MatrixJob]:
        """One MatrixJob per stored expert matrix (a fused gate_up slice yields gate and up together).

        job.key = (weight name as the manifest names it, slice index or None, MatrixRefs); the job's byte range is
        the decoder's primary tensor (or its slice)."""
        jobs = []
        for layer in layers:
            for e in range(self.info.n_experts):
                for name, index0, projs in self._job_keys(layer, e):
                    refs = self._locate(_base_of(name) if index0 is None else name, index0)
                    ref = self.checkpoint.ref(refs.primary)
                    step = ref.nbytes // ref.shape[0] if index0 is not None else ref.nbytes
                    offset = ref.offset + (index0 or 0) * step
                    jobs.append(MatrixJob(ref.file, offset, step, layer, e, projs, key=(name, index0, refs)))
        return jobs

    def _job_keys(self, layer: int, e: int) -> list[tuple[str, int | None, tuple[str, ...]]]:
        if self.fused:
            fl = self.fused_layer(layer)
            return [(fl.gate_up, e, ("gate", "up")), (fl.down, e, ("down",))]
        names = self.info.expert_names(layer, e)
        return [(names[p], None, (p,)) for p in PROJS]

    def decode(self, job, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Bytes of one MatrixJob -> {proj: uint16 BF16 bits in HF orientation}."""
        name, index0, refs = job.key
        if not self.fused:
            return {job.projs[0]: decoders.decode_matrix(self.checkpoint, _base_of(name), self.scheme, refs=refs,
                                                         raw=raw)}
        fl = self.fused_layer(job.layer)
        if job.projs == ("down",):
            return {"down": self._oriented(name, index0, fl.down_transposed, raw, refs)}
        gate, up = self._split_gate_up(self._oriented(name, index0, fl.gate_up_transposed, raw, refs))
        return {"gate": gate, "up": up}


def _base_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _bias_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith("weight") else weight_name + "_bias"
