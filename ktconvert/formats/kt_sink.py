"""kt-kernel CPU expert outputs (kt-format.md §2.3, §3.3, §3.4), written one MoE layer at a time.

Layouts:

* ``safetensors`` (merged): one shard per MoE layer, ``model-{i:05d}-of-{N:05d}.safetensors`` with i = the layer's
  position in the sorted MoE layer list (from 1) and N = MoE layers (+1 for the non-expert shard when
  ``include_dense``). Keys ``blk.{L}.ffn_{gate|up|down}_exps.{E}.numa.{t}.weight`` and ``.scale``, each with the
  dtype and shape the method's ``tensor_specs`` declares (AMX: I8 1-D [quant bytes], F32 1-D [n]); no
  ``__metadata__`` (as kt-kernel's converter). ``finalize`` writes
  ``model.safetensors.index.json`` with the real total_size, from the shard headers on disk.
* ``kt``: ``_layer_{L}/_numa_{t}/{PREFIX}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt`` raw bytes. Nothing at the top
  level ends in ``.safetensors`` (that would switch kt-kernel to merged mode).

Per NUMA part t of T: gate/up are [n=I/T, k=H] (rows t*I/T..), down is [n=H, k=I/T] (input columns t*I/T..).
A layer becomes visible atomically: merged by the shard's rename, kt by renaming ``_layer_{L}.partial/``.
Both layouts report tensor digests under the merged key names: a merged shard's tensors by BLAKE3
(``st_writer``), a ``.kt`` file, which holds one tensor's bytes and nothing else, by its file sha256 (the manifest's
sha256 of that file, so those bytes are hashed once, not twice; ``digests``).
``planned_files()`` is the one plan of every file and its bytes: the writers' headers, the index, the plan report
and verify all read it.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import numpy as np

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats.fileio import (FileRecord, LayerResult, fsync_dir, hash_bytes, open_dir, remove_tree,
                                      write_atomic, write_record)
from ktconvert.formats.file_plan import PlannedFile, index_bytes, planned_index, shard
from ktconvert.formats.safetensors_reader import parse_header
from ktconvert.formats.st_writer import NUMPY_DTYPES, StreamingSafetensorsWriter, tensor_nbytes
from ktconvert.layouts.naming import INDEX_NAME, PROJS, dense_key, kt_relpath, merged_key, part_shape, shard_name

LAYOUTS = ("safetensors", "kt")
COPY_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
COPY_GLOBS = ("*.tiktoken",)
KT_PARTS = {"weight": "quant", "scale": "scale"}   # stored tensor suffix -> its .kt file name's part
KT_LOADS = {"I8": ("I8", "U8")}   # planned dtype -> the labels kt-kernel's loader takes for it (it reads bytes)


class KtSink:
    """Output folder for kt-kernel CPU experts.

    out_dir:      output folder (created if absent; None: a plan only, nothing can be written)
    layout:       "safetensors" (merged shards) or "kt" (.kt tree)
    method:       CpuMethod-like: ``file_prefix`` ("INT4") and ``tensor_specs(n, k)`` declaring the ``weight`` and
                  ``scale`` tensors of one NUMA part
    numa:         NUMA parts T; moe_layers: MoE layer indices to be written; experts: E; hidden: H;
    intermediate: I (expert intermediate size); include_dense: reserve the last shard for non-expert tensors
    """

    def __init__(self, out_dir, layout: str, method, numa: int, moe_layers, experts: int, hidden: int,
                 intermediate: int, include_dense: bool = False):
        if layout not in LAYOUTS:
            raise OutputError("unknown output layout", expected=" or ".join(LAYOUTS), found=repr(layout))
        if include_dense and layout != "safetensors":
            raise OutputError("non-expert tensors can only go into the merged layout", found="layout kt",
                              hint="a top-level .safetensors file would switch kt-kernel into merged mode")
        self.out_dir = None if out_dir is None else Path(out_dir)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layout, self.method, self.numa = layout, method, int(numa)
        self.moe_layers = sorted(int(x) for x in moe_layers)
        self.experts, self.hidden, self.intermediate = int(experts), int(hidden), int(intermediate)
        self.include_dense = bool(include_dense)
        self.n_shards = len(self.moe_layers) + int(self.include_dense)
        self.shapes = {p: part_shape(p, self.hidden, self.intermediate, self.numa) for p in PROJS}   # (n, k)
        self.specs = {p: dict(method.tensor_specs(*self.shapes[p])) for p in PROJS}
        for proj, specs in self.specs.items():
            if set(specs) != set(KT_PARTS):
                raise OutputError(f"{getattr(method, 'kt_method', '') or method} declares tensors kt-kernel's "
                                  "converted layouts do not hold", tensor=proj, expected=", ".join(KT_PARTS),
                                  found=", ".join(specs))
        # {proj: {suffix: bytes}} of one NUMA part
        self.part_bytes = {p: {suffix: tensor_nbytes(*spec) for suffix, spec in self.specs[p].items()} for p in PROJS}

    def shard_for(self, layer: int) -> str:
        """Merged shard file name of MoE layer `layer`."""
        if layer not in self.moe_layers:
            raise OutputError("layer is not one of the planned MoE layers", tensor=f"layer {layer}",
                              expected=str(self.moe_layers))
        return shard_name(self.moe_layers.index(layer) + 1, self.n_shards)

    def dense_shard(self) -> str:
        return shard_name(self.n_shards, self.n_shards)

    def layer_tensors(self, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """[(key, dtype, shape)] of one layer in merged form, as the method's tensor_specs declare them."""
        return [(merged_key(layer, proj, e, t, suffix), dtype, shape) for proj in PROJS for e in range(self.experts)
                for t in range(self.numa) for suffix, (dtype, shape) in self.specs[proj].items()]

    def kt_file(self, layer: int, t: int, proj: str, expert: int, suffix: str) -> str:
        """The ``.kt`` file (relative path) holding tensor `suffix` of one NUMA part, its planned bytes in the name."""
        return kt_relpath(layer, t, self.method.file_prefix, proj, expert, self.part_bytes[proj][suffix],
                          KT_PARTS[suffix])

    def planned_shard(self, layer: int) -> PlannedFile:
        """The merged shard of MoE layer `layer`: its tensors and exact bytes."""
        return shard(self.shard_for(layer), self.layer_tensors(layer), layer)

    def planned_files(self, copy_from=None, fallback_config: dict | None = None, dense=None) -> dict[str, PlannedFile]:
        """{path: PlannedFile} of every file this sink writes, in writing order: the layer shards (their tensors
        listed) and the index, or the ``.kt`` tree; the non-expert shard when ``include_dense`` and its `dense`
        specs [(source name, dtype, shape)] are given (without them neither it nor the index is planned); the
        copies of `copy_from`'s config / tokenizer files. fallback_config: unused, as in finalize."""
        if self.layout == "safetensors":
            files = [self.planned_shard(layer) for layer in self.moe_layers]
            if self.include_dense and dense is not None:
                files.append(shard(self.dense_shard(), _dense_specs(dense)))
            if dense is not None or not self.include_dense:
                files.append(planned_index(files))
        else:
            files = [PlannedFile(self.kt_file(layer, t, proj, e, suffix), nbytes, layer=layer)
                     for layer in self.moe_layers for t in range(self.numa) for proj in PROJS
                     for e in range(self.experts) for suffix, nbytes in self.part_bytes[proj].items()]
        files += [PlannedFile(name, path.stat().st_size) for name, path in sorted(copy_sources(copy_from).items())]
        return {f.path: f for f in files}

    def layer_done(self, layer: int) -> bool:
        """True when the layer's final output exists (a shard file, or the ``_layer_{L}`` folder)."""
        if self.layout == "safetensors":
            return (self.out_dir / self.shard_for(layer)).is_file()
        return (self.out_dir / f"_layer_{layer}").is_dir()

    def begin_layer(self, layer: int) -> "LayerWriter":
        """Start writing MoE layer `layer`; nothing becomes visible until ``finish()``."""
        if layer not in self.moe_layers:
            raise OutputError("layer is not one of the planned MoE layers", tensor=f"layer {layer}",
                              expected=str(self.moe_layers))
        cls = MergedLayerWriter if self.layout == "safetensors" else KtLayerWriter
        return cls(self, layer)

    def write_dense(self, specs, read: Callable[[str], np.ndarray]) -> LayerResult:
        """Stream non-expert tensors into the last shard, one tensor in memory at a time.

        specs: [(source name, safetensors dtype, shape)]; read(source name) -> array (raw bits for BF16/F8).
        Keys are renamed with ``dense_key``.
        """
        if not self.include_dense:
            raise OutputError("sink was created without include_dense", file=self.dense_shard())
        renamed = _dense_specs(specs)
        with StreamingSafetensorsWriter(self.out_dir / self.dense_shard(), renamed) as writer:
            for (name, _, _), (key, _, _) in zip(specs, renamed):
                writer.write(key, read(name))
        return writer.layer_result(self.dense_shard())

    def missing_layers(self) -> list[int]:
        return [layer for layer in self.moe_layers if not self.layer_done(layer)]

    def finalize(self, copy_from=None, fallback_config: dict | None = None,
                 check_layers: bool = True) -> list[FileRecord]:
        """Check every layer is done (unless not `check_layers`: a part of the conversion holding other layers),
        write the index (merged) and copy config/tokenizer files from `copy_from`; returns the records of the
        files it wrote. (fallback_config: unused, kt-kernel's converted files need no config.json; the in-place
        sink's finalize takes it.)"""
        missing = self.missing_layers() if check_layers else []
        if missing:
            raise OutputError(f"{len(missing)} MoE layer(s) not written", file=str(self.out_dir),
                              found="layers " + ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else ""))
        if self.include_dense and not (self.out_dir / self.dense_shard()).is_file():
            raise OutputError("non-expert shard not written", file=self.dense_shard())
        self._remove_stale_partials()
        records = [self._write_index()] if self.layout == "safetensors" else []
        for rel, src in sorted(copy_sources(copy_from).items()):
            records.append(write_record(self.out_dir, rel, src.read_bytes()))
        return records

    def _write_index(self) -> FileRecord:
        """The index from the layer shards' planned tensors (what their headers hold: the shards need not be in
        this folder, e.g. in a part) and the dense shard's header on disk."""
        weight_map, total = {}, 0
        for layer in self.moe_layers:
            for key, dtype, shape in self.layer_tensors(layer):
                weight_map[key] = self.shard_for(layer)
                total += tensor_nbytes(dtype, shape)
        if self.include_dense:
            for key, ref in parse_header(self.out_dir / self.dense_shard()).tensors.items():
                weight_map[key] = self.dense_shard()
                total += ref.nbytes
        return write_record(self.out_dir, INDEX_NAME, index_bytes(weight_map, total))

    def _remove_stale_partials(self) -> None:
        """Delete this sink's leftovers from interrupted runs (``.*.partial`` files, ``_layer_*.partial/``)."""
        for entry in self.out_dir.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(".partial") and entry.is_file():
                entry.unlink()
            elif re.fullmatch(r"_layer_\d+\.(partial|old)", entry.name) and (entry.is_dir() or entry.is_symlink()):
                remove_tree(entry)              # a symlink there: the link itself


def _dense_specs(specs) -> list[tuple[str, str, tuple[int, ...]]]:
    """The non-expert shard's tensors: the source's [(name, dtype, shape)] under ``dense_key`` names."""
    return [(dense_key(name), dtype, tuple(shape)) for name, dtype, shape in specs]


def copy_sources(copy_from) -> dict[str, Path]:
    """{name: path} of the config / tokenizer files among `copy_from`: a source's side files
    (``Source.side_files()``), or the files of a folder (of a file: its folder)."""
    if copy_from is None:
        return {}
    if not isinstance(copy_from, Mapping):
        folder = Path(copy_from) if Path(copy_from).is_dir() else Path(copy_from).parent
        copy_from = {path.name: path for path in sorted(folder.iterdir()) if path.is_file()}
    return {name: Path(path) for name, path in copy_from.items()
            if name in COPY_NAMES or any(fnmatch.fnmatch(name, pattern) for pattern in COPY_GLOBS)}


class LayerWriter:
    """Common checks of one layer's puts: projection, expert and part in range, byte counts as planned."""

    def __init__(self, sink: KtSink, layer: int):
        self.sink, self.layer = sink, layer
        self.tensors: dict[str, str] = {}

    def _checked(self, proj: str, expert: int, t: int, blob, scale) -> tuple[np.ndarray, np.ndarray]:
        """(blob, scale) in the planned dtypes and shapes (AMX: int8 1-D, float32 1-D) after checking them against
        the plan: the planned bytes, the planned dtype (an integer array of its width for an integer one)."""
        where = merged_key(self.layer, proj, expert, t, "weight")
        if proj not in PROJS or not 0 <= expert < self.sink.experts or not 0 <= t < self.sink.numa:
            raise OutputError("expert part out of range", tensor=where,
                              expected=f"proj in {PROJS}, expert < {self.sink.experts}, numa < {self.sink.numa}")
        if where in self.tensors:
            raise OutputError("expert part written twice", tensor=where)
        specs = self.sink.specs[proj]
        return (_as_planned(blob, specs["weight"], "wrong quant blob", where),
                _as_planned(scale, specs["scale"], "wrong scale", merged_key(self.layer, proj, expert, t, "scale")))

    def _missing(self) -> list[str]:
        expected = {key for key, _, _ in self.sink.layer_tensors(self.layer) if key.endswith(".weight")}
        return sorted(expected - set(self.tensors))


def _as_planned(array, spec: tuple[str, tuple[int, ...]], problem: str, where: str) -> np.ndarray:
    """`array` as the planned (dtype, shape) `spec`: OutputError `problem` unless it has the planned bytes and dtype
    (integer dtypes: any integer array of the same width, viewed as it)."""
    dtype, shape = spec
    want, array = np.dtype(NUMPY_DTYPES[dtype]), np.asarray(array)
    same_kind = array.dtype == want or (array.dtype.kind in "iu" and want.kind in "iu"
                                        and array.dtype.itemsize == want.itemsize)
    if not same_kind or array.nbytes != tensor_nbytes(dtype, shape):
        raise OutputError(problem, tensor=where, expected=f"{want} {list(shape)}",
                          found=f"{array.dtype} {list(array.shape)}")
    return np.ascontiguousarray(array).reshape(shape).view(want)


class MergedLayerWriter(LayerWriter):
    """One layer's shard, written expert part by expert part at known offsets.

    The shard holds every scale first, then the weights projection by projection (kt-kernel's converter writes it
    so), while the matrices come expert by expert: the first weight byte can be hashed only once the layer's last
    scale exists, when all its weights exist too. Holding them is the whole layer's output (Qwen3-30B-A3B:
    302 MB AMXINT4, 604 MB AMXINT8; DeepSeek-V3: 5.6 / 11.3 GB), so the file hash reads the weights back from the
    page cache instead (``ordered_hash``), and nothing is parked."""

    def __init__(self, sink: KtSink, layer: int):
        super().__init__(sink, layer)
        planned = sink.planned_shard(layer)
        self.writer = StreamingSafetensorsWriter(sink.out_dir / planned.path, planned.tensors, park_bytes=0)

    def put(self, proj: str, expert: int, t: int, blob, scale) -> None:
        """blob (uint8/int8) and scale (float32) of NUMA part t of expert `expert`'s `proj`, as planned."""
        blob, scale = self._checked(proj, expert, t, blob, scale)
        weight_key = merged_key(self.layer, proj, expert, t, "weight")
        self.tensors[weight_key] = self.writer.write(weight_key, blob)
        scale_key = merged_key(self.layer, proj, expert, t, "scale")
        self.tensors[scale_key] = self.writer.write(scale_key, scale)

    def finish(self) -> LayerResult:
        self.writer.close()
        return LayerResult([self.writer.record(self.sink.shard_for(self.layer))], dict(sorted(self.tensors.items())))

    def abort(self) -> None:
        self.writer.abort()


class KtLayerWriter(LayerWriter):
    """One layer's ``_layer_{L}`` folder, built as ``_layer_{L}.partial/`` and renamed when complete."""

    def __init__(self, sink: KtSink, layer: int):
        super().__init__(sink, layer)
        self.final_dir = sink.out_dir / f"_layer_{layer}"
        self.partial_dir = sink.out_dir / f"_layer_{layer}.partial"
        remove_tree(self.partial_dir)           # a stale one; a symlink there: the link itself
        for t in range(sink.numa):              # made, and opened from OUT down, never through a symlink
            os.close(open_dir(self.partial_dir / f"_numa_{t}", within=sink.out_dir))
        self.records: list[FileRecord] = []

    def put(self, proj: str, expert: int, t: int, blob, scale) -> None:
        """blob (uint8/int8) and scale (float32) of NUMA part t of expert `expert`'s `proj`, as planned."""
        blob, scale = self._checked(proj, expert, t, blob, scale)
        for suffix, data in (("weight", blob), ("scale", scale)):
            self._write_file(self.sink.kt_file(self.layer, t, proj, expert, suffix),
                             memoryview(data.reshape(-1).view(np.uint8)))
            self.tensors[merged_key(self.layer, proj, expert, t, suffix)] = self.records[-1].sha256   # the file's

    def _write_file(self, rel: str, data: memoryview) -> None:
        write_atomic(self.partial_dir / Path(rel).relative_to(f"_layer_{self.layer}"), data, durable=False,
                     within=self.sink.out_dir)
        self.records.append(FileRecord(rel, *hash_bytes(data)))

    def finish(self) -> LayerResult:
        missing = self._missing()
        if missing:
            self.abort()
            raise OutputError(f"layer incomplete: {len(missing)} expert part(s) never written",
                              tensor=missing[0], file=self.final_dir.name)
        try:
            self._fsync_tree()
            self._swap_into_place()
        except OSError as exc:
            raise OutputError(f"cannot finish layer folder ({exc.strerror})", file=str(self.final_dir)) from None
        return LayerResult(sorted(self.records, key=lambda r: r.path), dict(sorted(self.tensors.items())))

    def _fsync_tree(self) -> None:
        for t in range(self.sink.numa):
            numa_dir = self.partial_dir / f"_numa_{t}"
            for name in os.listdir(numa_dir):
                fd = os.open(numa_dir / name, os.O_RDONLY)
                try:
                    with profile.span("fsync"):
                        os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(numa_dir)
        fsync_dir(self.partial_dir)

    def _swap_into_place(self) -> None:
        old = self.sink.out_dir / f"_layer_{self.layer}.old"
        if os.path.lexists(self.final_dir):     # renamed aside (a symlink: the link itself)
            remove_tree(old)
            os.replace(self.final_dir, old)
        os.replace(self.partial_dir, self.final_dir)
        fsync_dir(self.sink.out_dir)
        remove_tree(old)

    def abort(self) -> None:
        shutil.rmtree(self.partial_dir, ignore_errors=True)
