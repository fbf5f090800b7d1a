"""Expert source for HF safetensors checkpoints: one routed expert at a time, as BF16 bits in HF orientation.

Layouts (from the family manifest, ktconvert/architecture.py):
  per_expert  2-D tensors gate/up [I, H], down [H, I] per expert (optionally with .bias next to .weight)
  fused       3-D per layer: gate_up [E, 2I, H] or [E, H, 2I], down [E, H, I] or [E, I, H]; the orientation is
              detected from the shapes and config H/I. gate_up is first-half gate, or interleaved (gpt-oss: even
              rows gate, odd rows up, in the [2I, H] orientation). A fused tensor is only ever read one expert
              slice at a time.

Float inputs (BF16/F16/F32) decode here; quantized inputs (fp8 block, compressed-tensors int4, mxfp4, ...) plug
in through DECODERS, keyed by input format. Until a decoder for a format is registered, validate() and reads
raise InputError naming the checkpoint's quant_method.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.formats.base import SOURCES, ExpertWeights
from ktconvert.formats.safetensors_reader import DTYPES, Checkpoint
from ktconvert.registry import Registry

FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
# suffixes under which quantized formats store a weight named by the manifest pattern (CT int4, gpt-oss MXFP4)
QUANT_SUFFIXES = ("_packed", "_blocks")


# ---------------------------------------------------------------- decoders (input format -> BF16 bits)

def to_bf16_bits(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Raw array as read (BF16 uint16 / F16 float16 / F32 float32) -> uint16 BF16 bits, same shape.

    F16 widens exactly to F32; F32 rounds to BF16 nearest-even (ktconvert.quant.bf16.f32_to_bf16_bits).
    """
    if dtype == "BF16":
        return arr
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    return f32_to_bf16_bits(arr.astype(np.float32, copy=False))


@dataclass(frozen=True)
class MatrixDecoder:
    """How one input format turns a stored weight into BF16 bits.

    shape(ckpt, name) -> logical shape of the weight `name` (as the manifest names it), after decoding:
        [n, k] for a 2-D weight, [E, a, b] for a fused tensor; raises InputError/ShapeError on bad storage.
    decode(ckpt, name, index0, raw) -> uint16 BF16 bits of that weight (slice [index0] of a fused tensor when
        index0 is not None) in the stored orientation; raw, when given, holds the primary tensor's bytes
        (uint8, exactly that range) already read by the caller.
    primary(name) -> the stored tensor holding the bulk of the weight (`name` itself for float inputs,
        `name + "_packed"` for compressed-tensors, `name + "_blocks"` for MXFP4); streaming jobs read its
        bytes (one slice of it for a fused tensor) and pass them to decode as raw.
    """

    shape: Callable[[Checkpoint, str], tuple[int, ...]]
    decode: Callable[[Checkpoint, str, "int | None", "np.ndarray | None"], np.ndarray]
    primary: Callable[[str], str] = lambda name: name


DECODERS: Registry = Registry("input format decoder")


def _float_shape(ckpt: Checkpoint, name: str) -> tuple[int, ...]:
    ref = ckpt.ref(name)
    if ref.dtype not in FLOAT_FORMATS:
        raise InputError("expert weight dtype is not a float format", file=ref.file.name, tensor=name,
                         expected="BF16, F16 or F32", found=ref.dtype)
    return ref.shape


def _float_decode(ckpt: Checkpoint, name: str, index0: int | None, raw: np.ndarray | None) -> np.ndarray:
    ref = ckpt.ref(name)
    shape = ref.shape if index0 is None else ref.shape[1:]
    if raw is not None:
        arr = np.asarray(raw).view(np.dtype(DTYPES[ref.dtype][1])).reshape(shape)
    elif index0 is None:
        arr = ckpt.read(name)
    else:
        arr = ckpt.read_slice(name, index0)
    return to_bf16_bits(arr, ref.dtype)


for _fmt in FLOAT_FORMATS.values():
    DECODERS.register(_fmt)(MatrixDecoder(shape=_float_shape, decode=_float_decode))


def decoder_for(input_format: str, quant_method: str | None = None, file: str | None = None) -> MatrixDecoder:
    """The decoder registered for input_format; InputError naming the quant_method when there is none yet."""
    import ktconvert.formats.quantized  # noqa: F401  (registers fp8-block, ct-fp8, ct-int4, mxfp4)

    if input_format in DECODERS:
        return DECODERS.get(input_format)
    raise InputError(f"quantized input ({input_format}, quantization_config.quant_method="
                     f"{quant_method!r}) is not supported yet", file=file,
                     expected="one of " + ", ".join(DECODERS.names()),
                     hint="dequantize the experts to BF16 first")


def decode_matrix(checkpoint: Checkpoint, name: str, info, index0: int | None = None,
                  raw: np.ndarray | None = None) -> np.ndarray:
    """BF16 bits (uint16) of expert weight `name` (slice index0 of a fused tensor), in stored orientation.

    The decoder is chosen by the checkpoint's input format (detect_input_format).
    """
    fmt, qm = detect_input_format(checkpoint, info, name)
    return decoder_for(fmt, qm, checkpoint.root.name).decode(checkpoint, name, index0, raw)


def quant_method_of(config: dict) -> str | None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        for value in config.values():
            if isinstance(value, dict) and isinstance(value.get("quantization_config"), dict):
                qc = value["quantization_config"]
                break
    return str(qc.get("quant_method")) if isinstance(qc, dict) and qc.get("quant_method") else None


def _quantized_format(config: dict, quant_method: str | None) -> str:
    qc = config.get("quantization_config") or {}
    if quant_method == "fp8":
        return "fp8-block" if qc.get("weight_block_size") else "fp8-perchannel"
    if quant_method == "compressed-tensors":
        fmt = str(qc.get("format", ""))
        return {"pack-quantized": "ct-int4", "float-quantized": "ct-fp8"}.get(fmt, "ct-" + (fmt or "unknown"))
    return quant_method or "unknown-quantized"


def detect_input_format(checkpoint: Checkpoint, info, name: str) -> tuple[str, str | None]:
    """(input format, quant_method or None) for the expert weight `name` as the manifest names it.

    A float tensor under that exact name is "bf16"/"fp16"/"fp32", whatever the config says; anything else
    (F8 bytes, `_packed`/`_blocks` storage) is named after config.json's quantization_config.
    """
    quant_method = quant_method_of(checkpoint.config)
    ref = checkpoint.tensors.get(name)
    if ref is not None and ref.dtype in FLOAT_FORMATS:
        return FLOAT_FORMATS[ref.dtype], quant_method
    if quant_method is None:
        found = ref.dtype if ref is not None else "no float tensor of that name"
        raise InputError("expert weight is neither a float tensor nor described by a quantization_config",
                         file=ref.file.name if ref else checkpoint.root.name, tensor=name,
                         expected="BF16/F16/F32, or quantization_config in config.json", found=found)
    return _quantized_format(checkpoint.config, quant_method), quant_method


# ---------------------------------------------------------------- fused orientation

def fused_orientation(shape: tuple[int, ...], rows: int, cols: int, default_transposed: bool
                      ) -> tuple[bool, bool] | None:
    """Orientation of one fused tensor [E, a, b] whose per-expert matrix should be [rows, cols].

    Returns (transposed, ambiguous): transposed when stored as [E, cols, rows]; ambiguous when rows == cols
    (then default_transposed decides). None when the shape fits neither orientation.
    """
    if len(shape) != 3:
        return None
    a, b = shape[1:]
    if rows == cols and (a, b) == (rows, cols):
        return default_transposed, True
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
    ambiguous: tuple[str, ...]  # "gate_up" / "down" when H == 2I / H == I and the default was used
    gate_up_bias: str | None = None
    down_bias: str | None = None


# ---------------------------------------------------------------- the source

@SOURCES.register("hf-safetensors", aliases=["safetensors", "hf"])
class HFSource:
    """Lazily read HF safetensors checkpoint with a resolved ModelInfo (ktconvert.architecture.resolve).

    input_format: "bf16" | "fp16" | "fp32" | a quantized format name ("fp8-block", "ct-int4", "mxfp4", ...).
    """

    def __init__(self, checkpoint: Checkpoint, info):
        self.checkpoint = checkpoint
        self.info = info
        self.quant_method = quant_method_of(checkpoint.config)
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
        from ktconvert.architecture import resolve

        if checkpoint.config_file is None:
            raise InputError("config.json not found next to the safetensors files", file=str(checkpoint.root))
        return cls(checkpoint, resolve(checkpoint.config, checkpoint.tensors.keys()))

    @property
    def root(self) -> Path:
        """The checkpoint directory (config.json, tokenizer files)."""
        return self.checkpoint.root

    def files(self) -> list[Path]:
        return self.checkpoint.files()

    def relative_name(self, path: Path) -> str:
        return Path(path).relative_to(self.checkpoint.root).as_posix()

    def config_sha256(self) -> str | None:
        cf = self.checkpoint.config_file
        return hashlib.sha256(cf.read_bytes()).hexdigest() if cf else None

    # -- names

    @property
    def fused(self) -> bool:
        return self.info.manifest.experts.form == "fused"

    def expert_tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """Per-expert: {"gate", "up", "down"} (+ "*_bias" where present); fused: the layer's fused tensors."""
        if self.fused:
            return dict(self.info.fused_names(layer))
        names = self.info.expert_names(layer, expert)
        for proj in ("gate", "up", "down"):
            bias = _bias_name(names[proj])
            if bias in self.checkpoint.tensors:
                names[proj + "_bias"] = bias
        return names

    def all_layers(self, include_mtp: bool = True) -> tuple[int, ...]:
        """MoE layers, then the MTP layers whose experts are present in the checkpoint (when include_mtp)."""
        return self.info.moe_layers + (self.present_mtp_layers() if include_mtp else ())

    def present_mtp_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in self.info.mtp_layers if self._has_weight(self._probe_name(layer)))

    def _probe_name(self, layer: int) -> str:
        return self.info.fused_names(layer)["gate_up"] if self.fused else self.info.expert_names(layer, 0)["gate"]

    def _has_weight(self, name: str) -> bool:
        tensors = self.checkpoint.tensors
        return name in tensors or any(name + s in tensors for s in QUANT_SUFFIXES)

    def _detect_format(self) -> str:
        layers = self.info.moe_layers or self.info.mtp_layers
        if not layers:
            raise InputError("config describes no MoE layers", file=self.checkpoint.config_file.name
                             if self.checkpoint.config_file else None)
        name = self._probe_name(layers[0])
        if not self._has_weight(name):
            raise InputError("routed expert weight not found", file=self._index_or_root(), tensor=name,
                             expected=f"{self.info.family} layout ({self.info.manifest.experts.form})",
                             hint="is this the right model_type / a complete download?")
        return detect_input_format(self.checkpoint, self.info, name)[0]

    def _index_or_root(self) -> str:
        ck = self.checkpoint
        return (ck.index_file or (ck.shards[0].path if len(ck.shards) == 1 else ck.root)).name

    def decoder(self) -> MatrixDecoder:
        return decoder_for(self.input_format, self.quant_method, self._index_or_root())

    # -- validation

    def validate(self, include_mtp: bool = False) -> None:
        """Every MoE layer has every expert's weights with the config's shapes (I, H, E); raises on the first
        problem (InputError: missing / wrong dtype / unsupported format; ShapeError: wrong shape)."""
        decoder = self.decoder()
        for layer in self.all_layers(include_mtp):
            if self.fused:
                self.fused_layer(layer, decoder)
            else:
                for e in range(self.info.n_experts):
                    self._check_expert(layer, e, decoder)

    def _check_expert(self, layer: int, e: int, decoder: MatrixDecoder) -> None:
        I, H = self.info.intermediate, self.info.hidden
        names = self.info.expert_names(layer, e)
        for proj, want in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = names[proj]
            if not self._has_weight(name):
                raise InputError(f"missing weight of expert {e} in layer {layer}", file=self._index_or_root(),
                                 tensor=name)
            found = tuple(decoder.shape(self.checkpoint, name))
            if found != want:
                raise ShapeError(f"expert {proj} shape disagrees with config.json", file=self._file_of(name),
                                 tensor=name, expected=f"{list(want)} ([I, H] for gate/up, [H, I] for down; "
                                 f"I={I}, H={H})", found=str(list(found)))
            bias = self.checkpoint.tensors.get(_bias_name(name))
            if bias is not None and bias.shape != want[:1]:
                raise ShapeError(f"expert {proj} bias shape disagrees with config.json", file=bias.file.name,
                                 tensor=bias.name, expected=str(list(want[:1])), found=str(list(bias.shape)))

    def _file_of(self, name: str) -> str | None:
        for candidate in (name, *(name + s for s in QUANT_SUFFIXES)):
            ref = self.checkpoint.tensors.get(candidate)
            if ref is not None:
                return ref.file.name
        return None

    def fused_layer(self, layer: int, decoder: MatrixDecoder | None = None) -> FusedLayer:
        """Validated names and orientation of one fused layer (cached)."""
        if layer in self._fused:
            return self._fused[layer]
        decoder = decoder or self.decoder()
        names = self.info.fused_names(layer)
        E, I, H = self.info.n_experts, self.info.intermediate, self.info.hidden
        gu = self._orient(names["gate_up"], decoder, (E, 2 * I, H), "[E, 2I, H] or [E, H, 2I]", is_down=False)
        dn = self._orient(names["down"], decoder, (E, H, I), "[E, H, I] or [E, I, H]", is_down=True)
        gu, dn = _resolve_ambiguity(self.info.manifest.experts, gu, dn)
        ambiguous = tuple(k for k, o in (("gate_up", gu), ("down", dn)) if o[1])
        biases = {k: names.get(k) if names.get(k) in self.checkpoint.tensors else None
                  for k in ("gate_up_bias", "down_bias")}
        self._check_bias(biases["gate_up_bias"], (E, 2 * I))
        self._check_bias(biases["down_bias"], (E, H))
        fl = FusedLayer(names["gate_up"], names["down"], gu[0], dn[0], ambiguous, **biases)
        self._fused[layer] = fl
        return fl

    def _orient(self, name: str, decoder: MatrixDecoder, dims: tuple[int, int, int], want: str, is_down: bool):
        """(transposed, ambiguous) of fused tensor `name`, whose expert matrix must be [rows, cols]."""
        E, rows, cols = dims
        if not self._has_weight(name):
            raise InputError("missing fused expert tensor", file=self._index_or_root(), tensor=name)
        shape = tuple(decoder.shape(self.checkpoint, name))
        default = _default_transposed(self.info.manifest.experts, is_down)
        got = fused_orientation(shape, rows, cols, default) if len(shape) == 3 and shape[0] == E else None
        if got is None:
            raise ShapeError("fused expert tensor shape disagrees with config.json", file=self._file_of(name),
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
        decoder = self.decoder()
        if self.fused:
            return self._read_fused(layer, expert, decoder)
        names = self.expert_tensor_names(layer, expert)
        mats = {p: decoder.decode(self.checkpoint, names[p], None, None) for p in ("gate", "up", "down")}
        biases = {p + "_bias": self._bias_f32(names.get(p + "_bias")) for p in ("gate", "up", "down")}
        return ExpertWeights(**mats, **biases)

    def _read_fused(self, layer: int, e: int, decoder: MatrixDecoder) -> ExpertWeights:
        fl = self.fused_layer(layer, decoder)
        gate, up = self._split_gate_up(self._oriented(decoder, fl.gate_up, e, fl.gate_up_transposed))
        down = self._oriented(decoder, fl.down, e, fl.down_transposed)
        gate_bias = up_bias = down_bias = None
        if fl.gate_up_bias:
            gate_bias, up_bias = self._split_gate_up(self._bias_f32(fl.gate_up_bias, e))
        if fl.down_bias:
            down_bias = self._bias_f32(fl.down_bias, e)
        return ExpertWeights(gate, up, down, gate_bias, up_bias, down_bias)

    def _oriented(self, decoder: MatrixDecoder, name: str, e: int, transposed: bool, raw=None) -> np.ndarray:
        m = decoder.decode(self.checkpoint, name, e, raw)
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
        if ref.dtype == "BF16":
            from ktconvert.quant.bf16 import bf16_bits_to_f32

            return bf16_bits_to_f32(arr)
        return arr.astype(np.float32)

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
        """The quantization config group (formats.quantized.QuantGroup) of the routed experts, or None."""
        from ktconvert.formats.quantized import detect_scheme

        scheme = detect_scheme(self.checkpoint.config)
        if scheme is None:
            return None
        return scheme.group_for(_base_of(self._probe_name(self.all_layers()[0])))

    def has_expert_biases(self) -> bool:
        layer = self.all_layers()[0]
        if self.fused:
            fl = self.fused_layer(layer)
            return bool(fl.gate_up_bias or fl.down_bias)
        return any(k.endswith("_bias") for k in self.expert_tensor_names(layer, 0))

    # -- streaming jobs (pipeline.py reads files front to back and hands the bytes back to decode)

    def matrix_jobs(self, layers, include_dense: bool = False) -> list:
        """One MatrixJob per stored expert matrix (a fused gate_up slice yields gate and up together).

        job.key = (weight name as the manifest names it, slice index or None); the job's byte range is the
        decoder's primary tensor (or its slice)."""
        from ktconvert.formats.stream import MatrixJob

        decoder, jobs = self.decoder(), []
        for layer in layers:
            for e in range(self.info.n_experts):
                for name, index0, projs in self._job_keys(layer, e):
                    ref = self.checkpoint.ref(decoder.primary(name))
                    step = ref.nbytes // ref.shape[0] if index0 is not None else ref.nbytes
                    offset = ref.offset + (index0 or 0) * step
                    jobs.append(MatrixJob(ref.file, offset, step, layer, e, projs, key=(name, index0)))
        return jobs

    def _job_keys(self, layer: int, e: int) -> list[tuple[str, int | None, tuple[str, ...]]]:
        if self.fused:
            fl = self.fused_layer(layer)
            return [(fl.gate_up, e, ("gate", "up")), (fl.down, e, ("down",))]
        names = self.info.expert_names(layer, e)
        return [(names[p], None, (p,)) for p in ("gate", "up", "down")]

    def decode(self, job, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Bytes of one MatrixJob -> {proj: uint16 BF16 bits in HF orientation}."""
        name, index0 = job.key
        decoder = self.decoder()
        if not self.fused:
            return {job.projs[0]: decoder.decode(self.checkpoint, name, None, raw)}
        fl = self.fused_layer(job.layer)
        if job.projs == ("down",):
            return {"down": self._oriented(decoder, name, index0, fl.down_transposed, raw)}
        gate, up = self._split_gate_up(self._oriented(decoder, name, index0, fl.gate_up_transposed, raw))
        return {"gate": gate, "up": up}


def _base_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _bias_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith("weight") else weight_name + "_bias"


def _declared_orientation(layout, is_down: bool) -> bool | None:
    """The manifest's declared orientation (True = transposed) for the ambiguous case, or None.

    Manifests may declare `gate_up_orientation = "E,H,2I"` / `down_orientation = "E,I,H"` (or the standard
    "E,2I,H" / "E,H,I").
    """
    key = "down_orientation" if is_down else "gate_up_orientation"
    declared = str(getattr(layout, key, "") or "").replace(" ", "").upper()
    return None if not declared else declared in ("E,H,2I", "E,I,H")


def _default_transposed(layout, is_down: bool) -> bool:
    """Declared orientation, else [E, 2I, H] / [E, H, I] (HF nn.Linear orientation, transformers' in-memory form)."""
    return bool(_declared_orientation(layout, is_down))


def _resolve_ambiguity(layout, gu: tuple[bool, bool], dn: tuple[bool, bool]):
    """When one fused tensor's orientation is ambiguous (H == 2I or H == I) and the manifest declares none, it
    follows the other tensor's convention: both stored [E, out, in] (Qwen3.5) or both [E, in, out] (gpt-oss)."""
    if gu[1] and not dn[1] and _declared_orientation(layout, False) is None:
        return (dn[0], True), dn
    if dn[1] and not gu[1] and _declared_orientation(layout, True) is None:
        return gu, (gu[0], True)
    return gu, dn
