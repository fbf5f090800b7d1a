"""Shared types of the pipeline: where a tensor lives on disk, and one expert's weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator

from ktconvert.errors import InputError
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
    "ct-int4", "mxfp4", "gguf", ...), ``root`` (folder of the source's files: config, tokenizer).
    Matrices are BF16 bit patterns (uint16) in HF orientation: gate/up [I, H], down [H, I].
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


# name -> Source subclass (registered by Source.__init_subclass__)
SOURCES: Registry = Registry("input format", base=Source)
