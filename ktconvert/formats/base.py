"""Shared types of the pipeline: where a tensor lives on disk, and one expert's weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator

from ktconvert.errors import InputError
from ktconvert.layouts.naming import INDEX_NAME as WEIGHT_INDEX
from ktconvert.registry import Registry

if TYPE_CHECKING:
    import numpy as np

    from ktconvert.architectures.manifests import ModelInfo


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a file: dtype is the safetensors name ("BF16", "F8_E4M3", ...), offset absolute in bytes."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class ExpertWeights:
    """One routed expert in HF orientation, as BF16 bit patterns (numpy uint16).

    gate, up: uint16 [I, H]; down: uint16 [H, I]. Biases, where the family has them, are float32 [I] / [I] / [H].
    """

    gate: "np.ndarray"
    up: "np.ndarray"
    down: "np.ndarray"
    gate_bias: "np.ndarray | None" = None
    up_bias: "np.ndarray | None" = None
    down_bias: "np.ndarray | None" = None

    def projections(self) -> Iterator[tuple[str, "np.ndarray"]]:
        yield "gate", self.gate
        yield "up", self.up
        yield "down", self.down


class Source:
    """A checkpoint read lazily, one routed expert matrix at a time. Subclasses set ``name`` (+ ``aliases``) and
    register in SOURCES when defined; ``formats/sources.py`` imports every source module and opens a path with the
    first whose ``sniff`` accepts it.

    Attributes: ``info`` (architecture.ModelInfo), ``input_format`` ("bf16", "fp16", "fp32", "fp8-block",
    "ct-int4", "mxfp4", "gguf", ...), ``root`` (where the source's files are: the key of relative_name only).
    Matrices are BF16 bit patterns (uint16) in HF orientation: gate/up [I, H], down [H, I].

    The protocol: code outside ``formats/`` asks a source through these methods only, never through its container
    object (an HFSource's ``checkpoint``) or by listing ``root``:
      opening     sniff, open, describe_path, describe
      files       files, file_bytes, ensure_local, relative_name, fingerprint, header_digests, config_sha256
      side files  config_json (config.json's dict), side_files (config, tokenizer, ...: copied from these),
                  model_dir (a folder transformers can load config and tokenizer from)
      layers      all_layers, present_mtp_layers, validate
      experts     matrix_jobs, decode, stored_specs, stored_arrays, read_expert, has_expert_biases,
                  nonzero_expert_biases, kt_native_names, expert_quantization
      tensors     tensor_names, tensor, read_tensor (any stored tensor as stored), tensors_file (the file to name
                  in an error about a tensor), stored_linear / read_linear (a non-expert linear: how it is stored,
                  its weight as BF16 bits), dense_tensors
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    info: "ModelInfo"
    input_format: str
    root: Path

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            SOURCES.register(cls.name, cls.aliases)(cls)

    # -- opening and describing

    @classmethod
    def sniff(cls, path) -> bool:
        """Whether `path` looks like this kind of checkpoint (cheap: names and magic bytes only)."""
        raise NotImplementedError

    @classmethod
    def open(cls, path, expert_orientation: str | None = None) -> "Source":
        """Parse the headers of the checkpoint at `path` and resolve its family (no tensor data read).
        expert_orientation: "out" / "in" settles square fused expert tensors (formats/expert_layout.py); sources
        whose format fixes the orientation ignore it."""
        raise NotImplementedError

    @classmethod
    def describe_path(cls, path, expert_orientation: str | None = None) -> tuple[dict, "Source | None"]:
        """`inspect`'s description of the checkpoint at `path` (headers only) and the opened source (None when
        the family is not supported: the description then says why)."""
        source = cls.open(path) if expert_orientation is None else cls.open(path, expert_orientation)
        return {**source.describe(), "path": str(Path(path))}, source

    def describe(self) -> dict:
        """The keys ktconvert.run.inspection.render reads: files, bytes, dtypes, quantization, layers, experts, ..."""
        raise NotImplementedError

    # -- files

    def files(self) -> list[Path]:
        """The weight files, in the order they are read."""
        raise NotImplementedError

    def file_bytes(self) -> int:
        """Bytes of files(): what one pass reads (and hashes)."""
        return sum(Path(path).stat().st_size for path in self.files())

    def ensure_local(self, files) -> None:
        """Make `files` (of files()) readable on disk: a source opened in part downloads them here."""

    def relative_name(self, path: Path) -> str:
        """`path` relative to root (posix): the key of its fingerprint in manifests and journals."""
        return Path(path).relative_to(self.root).as_posix()

    def config_sha256(self) -> str | None:
        """sha256 of config.json, None when the source has none."""
        return None

    def fingerprint(self) -> dict:
        """{"config_sha256", "files": {relative path: {"bytes", "blake3" or "sha256"}}} of the weight files (reads
        every byte but a Hugging Face cache's: minutes for a large model): out_manifest.source_fingerprint."""
        raise NotImplementedError

    def header_digests(self) -> dict[str, dict]:
        """{relative name: {"bytes": size, "header_sha256": sha256 of its header}} per weight file: a cheap identity
        of the files (tensor names, dtypes, shapes, offsets) with no weight byte read."""
        raise self._needs_safetensors("header digests")

    # -- config and side files

    def config_json(self) -> dict | None:
        """config.json as read (the whole document: a nested text_config included), None when the source has none.
        ``info.config`` is the part the model's fields came from."""
        return None

    def side_files(self) -> dict[str, Path]:
        """{name: local path} of the files beside the weights (config.json, tokenizer, generation config, chat
        template, custom code, README, ...): every regular top-level file of the source's folder that is not hidden
        and not a weight file (WEIGHT_SUFFIXES) or the weight index. An output copies the ones it wants from here."""
        return {path.name: path for path in sorted(self.model_dir().iterdir())
                if path.is_file() and not path.name.startswith(".") and path.name != WEIGHT_INDEX
                and not path.name.endswith(WEIGHT_SUFFIXES)}

    def model_dir(self) -> Path:
        """A local folder holding config.json and the tokenizer files, for libraries that load a model from a
        folder (transformers' AutoConfig / AutoTokenizer); the folder of side_files."""
        return Path(self.root) if Path(self.root).is_dir() else Path(self.root).parent

    # -- layers and validation

    def all_layers(self, include_mtp: bool = True) -> tuple[int, ...]:
        """MoE layers, then the MTP layers whose experts are present (when include_mtp)."""
        return self.info.moe_layers + (self.present_mtp_layers() if include_mtp else ())

    def present_mtp_layers(self) -> tuple[int, ...]:
        raise NotImplementedError

    def validate(self, include_mtp: bool = False) -> None:
        """Every converted layer has every expert's weights with the config's shapes (headers only); raises
        InputError / ShapeError naming file and tensor on the first problem."""
        raise NotImplementedError

    # -- reading

    def matrix_jobs(self, layers) -> list:
        """formats.stream.MatrixJob per stored expert matrix range of `layers` (any order: the runner sorts them)."""
        raise NotImplementedError

    def decode(self, job, raw) -> dict:
        """Bytes of one MatrixJob (uint8, exactly its range) -> {proj: uint16 BF16 bits in HF orientation}."""
        raise NotImplementedError

    def stored_specs(self, layer: int, expert: int) -> dict | None:
        """{proj: {suffix: (safetensors dtype, shape)}} of one expert's matrices as the source stores them, each its
        own tensors named ``<module>.<suffix>`` (headers only); None where they are not stored that way (fused
        tensors, GGUF). An output whose tensors these already are copies them (methods' carry_over)."""
        return None

    def stored_arrays(self, job, raw) -> dict:
        """{suffix: array} of one per-expert MatrixJob's stored tensors exactly as stored (its bytes `raw` plus
        the partner tensors read here); only for sources whose stored_specs are not None."""
        raise NotImplementedError

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        """One expert, read on its own (verification): gate/up [I, H], down [H, I] + float32 biases."""
        raise NotImplementedError

    def has_expert_biases(self) -> bool:
        return False

    def nonzero_expert_biases(self, layers) -> list[str]:
        """Names of the expert bias tensors of `layers` holding a non-zero value (kt-kernel's files have none)."""
        return []

    # -- stored tensors (every tensor, not only routed experts)

    def tensor_names(self) -> list[str]:
        """Every stored tensor's name, sorted."""
        raise self._needs_safetensors()

    def tensor(self, name: str) -> TensorRef | None:
        """The header of stored tensor `name` (dtype, shape, file), None when there is none."""
        raise self._needs_safetensors()

    def read_tensor(self, name: str, index0: int | None = None) -> "np.ndarray":
        """Stored tensor `name` exactly as stored (BF16 as uint16 bits, F8 as uint8); with index0 only its slice
        [index0] along dim 0 (one expert of a fused [E, ...] tensor)."""
        raise self._needs_safetensors()

    def tensors_file(self) -> str:
        """The file to name in an error about a tensor of this source (its index, its one weight file, ...)."""
        return Path(self.root).name

    def stored_linear(self, module: str):
        """How non-expert linear `module` is stored (formats.linear_storage.StoredLinear: float, fp8-block, decoded
        by a decoder, other), headers only."""
        raise self._needs_safetensors()

    def read_linear(self, module: str) -> "np.ndarray":
        """The weight of linear `module` (or any 2-D module weight) as BF16 bits uint16 [n, k]: float rounded to
        nearest even, FP8 and other quantized storage decoded."""
        raise self._needs_safetensors()

    def _needs_safetensors(self, what: str = "reading tensors by name") -> InputError:
        return InputError(f"{what} needs a safetensors checkpoint; this input is {self.input_format}",
                          file=str(self.root))

    def dense_tensors(self):
        """(specs [(name, safetensors dtype, shape)], read(name) -> array) of every non-expert tensor, for
        ``--include-dense``; InputError where the source cannot give them."""
        raise InputError(f"--include-dense needs a safetensors checkpoint; this input is {self.input_format}",
                         file=str(self.root))

    # -- what kt-kernel can read as is (methods.CpuMethod.reads_as_is)

    def kt_native_names(self) -> bool:
        """Whether kt-kernel's HF loaders find the routed experts by their names."""
        return False

    def expert_quantization(self):
        """The quantization group (formats.decoders.QuantGroup) of the routed experts, None when unquantized."""
        return None


# suffixes of weight files (never side files): safetensors, PyTorch / TF / Flax checkpoints, GGUF
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")

# name -> Source subclass (registered by Source.__init_subclass__)
SOURCES: Registry = Registry("input format", base=Source)
