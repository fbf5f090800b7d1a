"""Writer for kt-kernel's LLAMAFILE method: routed experts as GGUF tensors, one GGUF file per MoE layer.

Layout: ``experts-{i:05d}-of-{n:05d}.gguf`` (i = position of the layer among the converted layers, from 1: the
naming of a llama.cpp split set, so ktconvert's GGUF source and gguf-py open the folder as one model) holding
``blk.L.ffn_{gate,up,down}_exps.weight``, each of the method's ggml type (a mix: the type llama-quantize picks for
that tensor, ``tensor_type``), ggml shape ne = [cols, rows, E] (numpy [E, I, H] for gate / up, [E, H, I] for
down), expert e at byte e * slice bytes of its tensor. Each file carries the metadata kt-kernel's GGUFLoader and
ktconvert's GGUF source read (``general.architecture`` and ``{arch}.block_count / expert_count /
expert_used_count / embedding_length / expert_feed_forward_length``), ``general.quantization_version`` and
llama.cpp's ``split.no / split.count / split.tensors.count``. kt-kernel reads a folder of ``*.gguf`` files (its
GGUFLoader merges every file's tensors).

Why not ``gguf.GGUFWriter`` for the data: it keeps every added tensor in memory (or, with ``use_temp_file``, copies
it once more on disk) and writes tensors only in the order they were declared, while experts arrive one at a time
in any order. So GGUFWriter builds each file's header only (its KV and tensor-info encoding, written into a private
temporary folder and read back), and the data go straight to their offsets (``os.pwrite``) in a file created with
``fileio.NewFile`` (temporary name, never through a symlink, renamed when complete). The file hash is fed as pieces
are written (``OrderedFileHash``); each tensor's sha256 is taken at ``finish`` by reading its range back (from the
page cache: the layer was just written). Memory: one expert matrix.

Use::

    sink = GgufSink(out_dir, method, layers, info)
    w = sink.begin_layer(L); w.put_matrix(proj, e, w_bf16) ...; files, tensors = w.finish()
    records = sink.finalize()

The interface (begin_layer / finish -> LayerResult / finalize -> FileRecords / planned_files) is InplaceSink's.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

import gguf

from ktconvert.architectures.manifests import gguf_architectures
from ktconvert.errors import OutputError, ShapeError
from ktconvert.formats.file_plan import PlannedFile
from ktconvert.formats.fileio import HASH_CHUNK, FileRecord, LayerResult, NewFile
from ktconvert.formats.ordered_hash import OrderedFileHash

PROJ_TENSORS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
FILE_STEM = "experts"
QUANTIZATION_VERSION = 2      # GGML_QNT_VERSION: the K-quant / Q*_0 block layouts of current llama.cpp


def gguf_architecture(model_type: str) -> str:
    """llama.cpp's ``general.architecture`` for a model_type (the manifests' gguf_architectures, inverted; Mixtral is
    "llama"); the model_type itself when no manifest names one."""
    names = {mt: arch for arch, mt in sorted(gguf_architectures().items())}
    return names.get(model_type, model_type)


def file_name(index: int, count: int) -> str:
    """The file of the index-th converted layer (from 1) of count."""
    return f"{FILE_STEM}-{index:05d}-of-{count:05d}.gguf"


class GgufSink:
    """Output directory for the LLAMAFILE method (out_dir None: a plan only). layers: MoE layer indices in output
    order; info: the source's ModelInfo."""

    def __init__(self, out_dir, method, layers, info, numa: int = 1):
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
        self._headers: dict[int, tuple[bytes, dict[str, int]]] = {}

    # ---------------------------------------------------------------- the plan

    @property
    def files_format(self) -> str:
        """What the plan says of the files."""
        return (f"one GGUF per MoE layer, {self.method.ggml_type} experts; kt-kernel's {self.method.kt_method} "
                "reads the folder's *.gguf")

    def file_of(self, layer: int) -> str:
        return file_name(self.layers.index(layer) + 1, len(self.layers))

    def tensor_type(self, layer: int, proj: str) -> str:
        """The ggml type of the layer's `proj` tensor (the method's type, or its mix's choice for that tensor)."""
        return self.method.expert_type(proj, layer, self.n_layer_all)

    def slice_bytes(self, layer: int, proj: str) -> int:
        """Bytes of one expert's matrix of `proj` in `layer`."""
        return sum(self.method.matrix_bytes(*self.shapes[proj], self.tensor_type(layer, proj)).values())

    def layer_tensors(self, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, ggml type, numpy-order shape [E, rows, cols]) of every tensor in the layer's file."""
        return [(f"blk.{layer}.{PROJ_TENSORS[proj]}.weight", self.tensor_type(layer, proj), (self.n_experts, n, k))
                for proj, (n, k) in self.shapes.items()]

    def header(self, layer: int) -> tuple[bytes, dict[str, int]]:
        """(the layer file's header padded to the data alignment, {tensor name: offset of its data in the file})."""
        if layer not in self._headers:
            self._headers[layer] = self._build_header(layer)
        return self._headers[layer]

    def file_bytes(self, layer: int) -> int:
        offsets = self.header(layer)[1]
        last = self.layer_tensors(layer)[-1][0]          # down: the last tensor of the file
        return offsets[last] + _pad(self.n_experts * self.slice_bytes(layer, "down"))

    def planned_files(self, copy_from=None, fallback_config: dict | None = None, dense=None) -> dict[str, PlannedFile]:
        """{path: PlannedFile} of every file this sink writes: one GGUF per layer (no config, index or copies)."""
        return {self.file_of(L): PlannedFile(self.file_of(L), self.file_bytes(L), (), L) for L in self.layers}

    def _build_header(self, layer: int) -> tuple[bytes, dict[str, int]]:
        tensors = self.layer_tensors(layer)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "header.gguf"
            w = gguf.GGUFWriter(path, self.arch)
            w.add_name("ktconvert routed experts")
            w.add_quantization_version(QUANTIZATION_VERSION)
            w.add_block_count(max(self.layers) + 1)
            w.add_embedding_length(self.hidden)
            w.add_expert_count(self.n_experts)
            w.add_expert_used_count(self.info.experts_per_tok)
            w.add_expert_feed_forward_length(self.intermediate)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, self.layers.index(layer))
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, len(self.layers))
            w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(self.layers) * len(tensors))
            offsets, at = {}, 0
            for name, kind, (e, n, k) in tensors:
                nbytes = e * sum(self.method.matrix_bytes(n, k, kind).values())
                w.add_tensor_info(name, (e, n, k), None, nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
                offsets[name], at = at, at + _pad(nbytes)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            head = path.read_bytes()
        head += bytes(_pad(len(head)) - len(head))
        return head, {name: len(head) + off for name, off in offsets.items()}

    # ---------------------------------------------------------------- writing

    def begin_layer(self, layer: int) -> "GgufLayerWriter":
        if layer not in self.layers:
            raise OutputError("layer not in this output's plan", file=self.out_dir, found=str(layer))
        return GgufLayerWriter(self, layer)

    def finalize(self, copy_from=None, fallback_config: dict | None = None,
                 check_layers: bool = True) -> list[FileRecord]:
        """Nothing beyond the layer files: kt-kernel reads the GGUF tensors and their metadata only."""
        return []

    def write_dense(self, *args, **kwargs):
        raise OutputError("the LLAMAFILE output holds the routed experts only (--include-dense is not available)")


class GgufLayerWriter:
    """One layer's GGUF file; experts may arrive in any order. finish() -> (files, tensor sha256s)."""

    def __init__(self, sink: GgufSink, layer: int):
        self.sink, self.layer = sink, layer
        self.path = sink.out_dir / sink.file_of(layer)
        self.size = sink.file_bytes(layer)
        head, self.offsets = sink.header(layer)
        self.names = {proj: f"blk.{layer}.{t}.weight" for proj, t in PROJ_TENSORS.items()}
        self.written: set[tuple[str, int]] = set()
        self._lock = threading.Lock()       # put_matrix may run on several threads at once
        sink.out_dir.mkdir(parents=True, exist_ok=True)
        self._new = NewFile(self.path, os.O_RDWR)
        self._fd = self._new.fd
        try:
            os.ftruncate(self._fd, self.size)
            if hasattr(os, "posix_fallocate"):             # a full disk fails here, not half-way through the layer
                os.posix_fallocate(self._fd, 0, self.size)
            self._hash = OrderedFileHash(self._fd, self.size)
            self._pwrite(head, 0)
            for proj in PROJ_TENSORS:                  # zero padding after each tensor, hashed as written
                end = self.offsets[self.names[proj]] + sink.n_experts * sink.slice_bytes(layer, proj)
                if _pad(end) > end:
                    self._pwrite(bytes(_pad(end) - end), end)
        except OSError as exc:
            self.abort()
            raise OutputError(f"cannot create output file ({exc.strerror})", file=str(self.path),
                              expected=f"{self.size} bytes of space") from None

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._hash.wrote(offset, view)

    def put_matrix(self, proj: str, expert: int, w_bf16) -> None:
        """Quantize one expert matrix (uint16 BF16 bits in HF orientation) and write it at its place."""
        want = self.sink.shapes[proj]
        name = self.names[proj]
        if tuple(w_bf16.shape) != want:
            raise ShapeError("expert matrix has the wrong shape", tensor=f"{name}[{expert}]", expected=str(list(want)),
                             found=str(list(w_bf16.shape)))
        self.put_stored(proj, expert, self.sink.method.encode(w_bf16, where=f"{name}[{expert}]",
                                                              ggml_type=self.sink.tensor_type(self.layer, proj)))

    def put_stored(self, proj: str, expert: int, tensors: dict) -> None:
        """Write one expert matrix's bytes as given ({"weight": uint8 blocks}, already this method's type)."""
        name = self.names[proj]
        data = tensors["weight"]
        nbytes = self.sink.slice_bytes(self.layer, proj)
        if data.nbytes != nbytes:
            raise OutputError("wrong byte count", file=self.path.name, tensor=f"{name}[{expert}]",
                              expected=str(nbytes), found=str(data.nbytes))
        with self._lock:
            if not 0 <= expert < self.sink.n_experts or (proj, expert) in self.written:
                raise OutputError("expert out of range or written twice", file=self.path.name,
                                  tensor=f"{name}[{expert}]")
            self.written.add((proj, expert))
        try:
            self._pwrite(data.reshape(-1).view("u1"), self.offsets[name] + expert * nbytes)
        except OSError as exc:
            raise OutputError(f"write failed ({exc.strerror})", file=str(self.path), tensor=name) from None

    def finish(self) -> LayerResult:
        missing = [(p, e) for p in PROJ_TENSORS for e in range(self.sink.n_experts) if (p, e) not in self.written]
        if missing:
            self.abort()
            raise OutputError(f"layer file incomplete: {len(missing)} expert matrices never written",
                              file=self.path.name, tensor=f"{self.names[missing[0][0]]}[{missing[0][1]}]")
        try:
            tensors = {self.names[p]: self._tensor_sha256(self.offsets[self.names[p]],
                                                          self.sink.n_experts * self.sink.slice_bytes(self.layer, p))
                       for p in PROJ_TENSORS}
            sha256, git_sha1 = self._hash.hexdigests()
            os.fsync(self._fd)
            if hasattr(os, "posix_fadvise"):               # written and synced: let the page cache drop it
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._fd = None
            self._new.commit(durable=True, synced=True)
        except OSError as exc:
            self.abort()
            raise OutputError(f"cannot finish output file ({exc.strerror})", file=str(self.path)) from None
        return LayerResult([FileRecord(self.path.name, self.size, sha256, git_sha1)], tensors)

    def _tensor_sha256(self, offset: int, nbytes: int) -> str:
        h = hashlib.sha256()
        for at in range(offset, offset + nbytes, HASH_CHUNK):
            h.update(os.pread(self._fd, min(HASH_CHUNK, offset + nbytes - at), at))
        return h.hexdigest()

    def abort(self) -> None:
        self._fd = None
        self._new.discard()


def _pad(n: int, align: int = 32) -> int:
    """n rounded up to GGUF's default data alignment (general.alignment absent: 32)."""
    return (n + align - 1) // align * align
