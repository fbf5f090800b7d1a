"""Writer for kt-kernel's LLAMAFILE method: routed experts as GGUF tensors, in shards of a llama.cpp split set.

Layout: ``experts-{i:05d}-of-{n:05d}.gguf`` (``model-...`` with ``--include-dense``: llama.cpp's split naming, so
llama.cpp, ktconvert's GGUF source and gguf-py open the folder as one model) holding
``blk.L.ffn_{gate,up,down}_exps.weight``, each of the method's ggml type (a mix: the type llama-quantize picks for
that tensor, ``tensor_type``), ggml shape ne = [cols, rows, E] (numpy [E, I, H] for gate / up, [E, H, I] for
down), expert e at byte e * slice bytes of its tensor. Shards: one per MoE layer by default; with the method's
``split_max_size`` (``--split-max-size``) llama.cpp gguf-split's rule over the tensors in file order (the
non-expert tensors in llama.cpp's order, then the layers' experts): a new shard starts where the current one's
tensor data (each tensor padded to the alignment) plus the next tensor would exceed the size. The split is
computed from the tensor sizes, so ``planned_files`` names every shard before anything is written. Each shard
carries the metadata kt-kernel's GGUFLoader and ktconvert's GGUF source read (``general.architecture`` and
``{arch}.block_count / expert_count / expert_used_count / embedding_length / expert_feed_forward_length``),
``general.quantization_version`` and llama.cpp's ``split.no / split.count / split.tensors.count``
(gguf.Keys.Split); with ``--include-dense`` the first shard carries the whole model's metadata and tokenizer
instead (``formats/gguf_model.py``) and the non-expert tensors come first (one shard of their own without a split
size), written by the run or part that holds the first MoE layer. kt-kernel reads a folder of ``*.gguf`` files
(its GGUFLoader merges every file's tensors).

Why not ``gguf.GGUFWriter`` for the data: it keeps every added tensor in memory (or, with ``use_temp_file``, copies
it once more on disk) and writes tensors only in the order they were declared, while experts arrive one at a time
in any order. So GGUFWriter builds each shard's header only (its KV and tensor-info encoding, written into a
private temporary folder and read back), and the data go straight to their offsets (``os.pwrite``) in a file
created with ``fileio.NewFile`` (temporary name ``.NAME.partial``, never through a symlink, renamed when its last
tensor is written). The file hash is fed as pieces are written (``OrderedFileHash``); each tensor's sha256 is
taken when its layer finishes by reading its range back (from the page cache: the layer was just written).
Memory: one expert matrix (``write_dense``: one non-expert tensor).

A shard holding tensors of several layers stays ``.NAME.partial`` until its last layer finishes; a finished
layer's part of it is synced first, so a resumed run (which skips the journalled layers) reopens that partial
file and completes it (the file hash then read back); ``start_run`` tells the sink which layers the run writes
and which the journal holds. A part (``--layers``) must hold whole shards: a shard that continues into another
part's layers is refused when the part starts, naming the shard.

Use::

    sink = GgufSink(out_dir, method, layers, info)
    sink.start_run(layers, journalled_layers, writes_rest, source)   # optional: a resumed run or a part
    w = sink.begin_layer(L); w.put_matrix(proj, e, w_bf16) ...; files, tensors = w.finish()
    sink.write_dense(specs, read)                     # with --include-dense
    records = sink.finalize()

The interface (begin_layer / finish -> LayerResult / finalize -> FileRecords / planned_files) is InplaceSink's; the
shards being written (``ShardFile``, ``GgufLayerWriter``) are in ``formats/gguf_shard.py``.
"""
from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ktconvert.architectures.manifests import gguf_architectures
from ktconvert.errors import OutputError, UsageError
from ktconvert.formats.file_plan import PlannedFile
from ktconvert.formats.fileio import FileRecord, LayerResult
from ktconvert.formats.gguf_shard import PROJ_TENSORS, GgufLayerWriter, ShardFile, pad

FILE_STEM = "experts"
MODEL_STEM = "model"          # --include-dense: a complete model
QUANTIZATION_VERSION = 2      # GGML_QNT_VERSION: the K-quant / Q*_0 block layouts of current llama.cpp


def gguf_architecture(model_type: str) -> str:
    """llama.cpp's ``general.architecture`` for a model_type (the manifests' gguf_architectures, inverted; Mixtral is
    "llama"); the model_type itself when no manifest names one."""
    names = {mt: arch for arch, mt in sorted(gguf_architectures().items())}
    return names.get(model_type, model_type)


def file_name(index: int, count: int, stem: str = FILE_STEM) -> str:
    """Shard `index` (from 1) of `count`, as llama.cpp's split names it."""
    return f"{stem}-{index:05d}-of-{count:05d}.gguf"


@dataclass(frozen=True)
class Planned:
    """One tensor of the output: llama.cpp name, ggml type, numpy-order shape, data bytes, owner (the MoE layer;
    None: a non-expert tensor) and, for a non-expert tensor, its source (HF) name."""

    name: str
    kind: str
    shape: tuple[int, ...]
    nbytes: int
    owner: int | None
    source: str | None = None


def split_shards(tensors: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """llama.cpp gguf-split's split by size: tensors in order, a new shard where the current shard's padded tensor
    data plus the next tensor's would exceed `max_bytes`."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + pad(t.nbytes) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += pad(t.nbytes)
    return shards


class GgufSink:
    """Output directory for the LLAMAFILE method (out_dir None: a plan only). layers: MoE layer indices in output
    order; info: the source's ModelInfo; dense: with --include-dense, (the source's non-expert specs [(HF name,
    dtype, shape)], its side files {name: path}) or True (a plan whose specs planned_files receives)."""

    def __init__(self, out_dir, method, layers, info, numa: int = 1, dense=None):
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.method = method
        self.layers = list(layers)
        self.info = info
        self.n_experts, self.hidden, self.intermediate = info.n_experts, info.hidden, info.intermediate
        method.check_numa(self.hidden, self.intermediate, numa)
        self.shapes = {"gate": (self.intermediate, self.hidden), "up": (self.intermediate, self.hidden),
                       "down": (self.hidden, self.intermediate)}
        self.arch = gguf_architecture(info.model_type)
        self.n_layer_all = info.n_layers + len(info.mtp_layers)    # llama.cpp's block count (mixes depend on it)
        self.include_dense = bool(dense)
        self.split_bytes = getattr(method, "split_bytes", None)
        self._dense = dense if isinstance(dense, tuple) else None
        if self.include_dense:
            from ktconvert.formats import gguf_model

            gguf_model.model_arch(self.arch)                       # UsageError for an architecture not written
        self._shards: list[list[Planned]] | None = None
        self._where: dict[str, int] | None = None
        self._headers: dict[int, tuple[bytes, dict[str, int]]] = {}
        self._files: dict[int, ShardFile] = {}
        self._lock = threading.RLock()      # a shard failing to open (under it) removes itself (again under it)
        self._run: tuple[set[int], set[int], bool] | None = None    # start_run's (layers, journalled, dense)

    # ---------------------------------------------------------------- the plan

    @property
    def files_format(self) -> str:
        """What the plan says of the files."""
        how = f"shards of at most {self.method.split_max_size}" if self.split_bytes else "one GGUF per MoE layer"
        what = ", with the non-expert tensors, metadata and tokenizer (llama.cpp loads it)" if self.include_dense \
            else ""
        return (f"{how}, {self.method.ggml_type} experts{what}; kt-kernel's {self.method.kt_method} reads the "
                "folder's *.gguf")

    def tensor_type(self, layer: int, proj: str) -> str:
        """The ggml type of the layer's `proj` tensor (the method's type, or its mix's choice for that tensor)."""
        return self.method.expert_type(proj, layer, self.n_layer_all)

    def slice_bytes(self, layer: int, proj: str) -> int:
        """Bytes of one expert's matrix of `proj` in `layer`."""
        return sum(self.method.matrix_bytes(*self.shapes[proj], self.tensor_type(layer, proj)).values())

    def layer_tensors(self, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, ggml type, numpy-order shape [E, rows, cols]) of every expert tensor of the layer."""
        return [(f"blk.{layer}.{PROJ_TENSORS[proj]}.weight", self.tensor_type(layer, proj), (self.n_experts, n, k))
                for proj, (n, k) in self.shapes.items()]

    def expert_tensors(self) -> list[Planned]:
        return [Planned(name, kind, shape, self.n_experts * self.slice_bytes(layer, proj), layer)
                for layer in self.layers
                for (name, kind, shape), proj in zip(self.layer_tensors(layer), PROJ_TENSORS)]

    def dense_tensors(self) -> list[Planned]:
        """The non-expert tensors (--include-dense) under their llama.cpp names (formats.gguf_model)."""
        if not self.include_dense:
            return []
        if self._dense is None:
            raise OutputError("the plan of a --include-dense GGUF needs the source's non-expert tensors")
        from ktconvert.formats import gguf_model

        out = []
        for name, kind, hf, shape in gguf_model.dense_plan(self.arch, self.n_layer_all, self._dense[0]):
            nbytes = int(np.prod(shape, dtype=np.int64)) * (4 if kind == "F32" else 2)
            out.append(Planned(name, kind, shape, nbytes, None, hf))
        return out

    @property
    def shards(self) -> list[list[Planned]]:
        """The tensors of each shard, in file order."""
        if self._shards is None:
            experts, dense = self.expert_tensors(), self.dense_tensors()
            if self.split_bytes:
                largest = max(experts + dense, key=lambda t: t.nbytes)
                if largest.nbytes > self.split_bytes:
                    raise UsageError("--split-max-size is smaller than the largest tensor", tensor=largest.name,
                                     expected=f">= {largest.nbytes} bytes", found=self.method.split_max_size)
                shards = split_shards(dense + experts, self.split_bytes)
            else:
                shards = ([dense] if dense else []) + [[t for t in experts if t.owner == layer]
                                                       for layer in self.layers]
            self._shards = shards
        return self._shards

    def stem(self) -> str:
        return MODEL_STEM if self.include_dense else FILE_STEM

    def shard_name(self, index: int) -> str:
        return file_name(index + 1, len(self.shards), self.stem())

    def shard_of(self, name: str) -> int:
        """The index of the shard holding tensor `name`."""
        if self._where is None:
            self._where = {t.name: i for i, shard in enumerate(self.shards) for t in shard}
        return self._where[name]

    def file_of(self, layer: int) -> str:
        """The shard holding the layer's first expert tensor."""
        return self.shard_name(self.shard_of(self.layer_tensors(layer)[0][0]))

    def header(self, index: int) -> tuple[bytes, dict[str, int]]:
        """(shard `index`'s header padded to the data alignment, {tensor name: offset of its data in the file})."""
        if index not in self._headers:
            self._headers[index] = self._build_header(index)
        return self._headers[index]

    def shard_bytes(self, index: int) -> int:
        offsets = self.header(index)[1]
        last = self.shards[index][-1]
        return offsets[last.name] + pad(last.nbytes)

    def planned_files(self, copy_from=None, fallback_config: dict | None = None, dense=None) -> dict[str, PlannedFile]:
        """{path: PlannedFile} of every file this sink writes: the shards (no config, index or copies); `dense`,
        `copy_from`: the source's non-expert specs and side files (--include-dense)."""
        if self.include_dense and self._dense is None and dense is not None:
            self._dense = (list(dense), dict(copy_from or {}))
        out = {}
        for i, shard in enumerate(self.shards):
            owners = [t.owner for t in shard if t.owner is not None]
            out[self.shard_name(i)] = PlannedFile(self.shard_name(i), self.shard_bytes(i), (),
                                                  owners[0] if owners else None)
        return out

    def _build_header(self, index: int) -> tuple[bytes, dict[str, int]]:
        tensors = self.shards[index]
        total = sum(len(s) for s in self.shards)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "header.gguf"
            w = gguf.GGUFWriter(path, self.arch)
            if self.include_dense and index == 0:
                from ktconvert.formats import gguf_model

                w.add_name(f"ktconvert {self.info.model_type}")
                w.add_quantization_version(QUANTIZATION_VERSION)
                dense = next((t.kind for t in self.dense_tensors() if t.kind != "F32"), "F32")
                gguf_model.write_metadata(w, self.info, dense, self._dense[1])
            else:
                w.add_name("ktconvert routed experts")
                w.add_quantization_version(QUANTIZATION_VERSION)
                w.add_block_count(self.info.n_layers if self.include_dense else max(self.layers) + 1)
                w.add_embedding_length(self.hidden)
                w.add_expert_count(self.n_experts)
                w.add_expert_used_count(self.info.experts_per_tok)
                w.add_expert_feed_forward_length(self.intermediate)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, index)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, len(self.shards))
            w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, total)
            offsets, at = {}, 0
            for t in tensors:
                w.add_tensor_info(t.name, t.shape, None, t.nbytes, raw_dtype=gguf.GGMLQuantizationType[t.kind])
                offsets[t.name], at = at, at + pad(t.nbytes)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            head = path.read_bytes()
        head += bytes(pad(len(head)) - len(head))
        return head, {name: len(head) + off for name, off in offsets.items()}

    # ---------------------------------------------------------------- writing

    def start_run(self, layers, done, writes_rest: bool, source=None) -> None:
        """This run writes MoE `layers` of the output (a part's, or all) but the journalled `done` ones, and the
        non-expert tensors when `writes_rest` (--include-dense: from `source`). OutputError when a shard of these
        layers holds layers of another part (a part must hold whole shards)."""
        if self.include_dense and self._dense is None and source is not None:
            self._dense = (list(source.dense_tensors()[0]), dict(source.side_files()))
        mine = set(layers)
        self._run = (mine, set(done) & mine, bool(writes_rest and self.include_dense))
        for index, shard in enumerate(self.shards):
            owners = {t.owner for t in shard}
            held = mine | ({None} if self._run[2] else set())
            if owners & held and not owners <= held:
                cut = ", ".join(str(o) for o in sorted(owners - held, key=str) if o is not None)
                raise UsageError("a shard holds layers of another part: --layers must hold whole shards",
                                 file=self.shard_name(index),
                                 found="other layers " + (cut or "none, the non-expert tensors"),
                                 hint="choose --layers ranges that end where a shard ends (or another "
                                      "--split-max-size); with --include-dense the non-expert tensors go with the "
                                      "first MoE layer's part")

    def expected(self, index: int) -> tuple[set[str], set[str]]:
        """(tensors of shard `index` this run writes, tensors an earlier run of this folder wrote)."""
        layers, done, dense = self._run or (set(self.layers), set(), self.include_dense)
        write = {t.name for t in self.shards[index] if (t.owner is None and dense) or
                 (t.owner in layers and t.owner not in done)}
        earlier = {t.name for t in self.shards[index] if t.owner in done}
        return write, earlier

    def shard_file(self, index: int) -> "ShardFile":
        """Shard `index` being written (opened on first use; a partial file of an interrupted run is reopened)."""
        with self._lock:
            if index not in self._files:
                self._files[index] = ShardFile(self, index)
            return self._files[index]

    def begin_layer(self, layer: int) -> "GgufLayerWriter":
        if layer not in self.layers:
            raise OutputError("layer not in this output's plan", file=self.out_dir, found=str(layer))
        return GgufLayerWriter(self, layer)

    def write_dense(self, specs, read) -> LayerResult:
        """The non-expert tensors (--include-dense): read(HF name) -> array (uint16 BF16 / F16 bits or float32),
        written as their planned types, one tensor in memory at a time."""
        if not self.include_dense:
            raise OutputError("the LLAMAFILE output was opened without --include-dense")
        if self._dense is None:
            self._dense = (list(specs), {})
        from ktconvert.quant.bf16 import bf16_bits_to_f32

        dtypes = {hf: dtype for hf, dtype, _ in specs}
        tensors, records = {}, []
        for t in self.dense_tensors():
            raw = np.ascontiguousarray(read(t.source))
            dtype = dtypes[t.source]
            if dtype == "BF16":
                bits = raw.view(np.uint16)
                data = bf16_bits_to_f32(bits) if t.kind == "F32" else bits
            elif dtype == "F16":
                half = raw.view(np.float16)
                data = half.astype(np.float32) if t.kind == "F32" else half
            else:
                data = raw.astype(np.float32)
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            shard = self.shard_file(self.shard_of(t.name))
            if data.nbytes != t.nbytes:
                raise OutputError("wrong byte count", file=shard.path.name, tensor=t.name, expected=str(t.nbytes),
                                  found=str(data.nbytes))
            shard.write(data, shard.offsets[t.name])
            tensors[t.name] = shard.tensor_sha256(t.name)
            record = shard.done(t.name)
            records += [record] if record else []
        return LayerResult(records, tensors)

    def finalize(self, copy_from=None, fallback_config: dict | None = None,
                 check_layers: bool = True) -> list[FileRecord]:
        """Nothing beyond the shards: kt-kernel and llama.cpp read the GGUF tensors and their metadata only.
        OutputError for a shard left incomplete (a part whose layers end inside a shard)."""
        for index, shard in sorted(self._files.items()):
            if not shard.committed:
                owners = sorted({t.owner for t in self.shards[index] if t.owner is not None})
                raise OutputError("shard not complete: it holds layers outside this run", file=shard.path.name,
                                  found=f"layers {owners}",
                                  hint="choose --layers ranges that hold whole shards (`plan --json` lists them)")
        return []
