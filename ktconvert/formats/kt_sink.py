"""kt-kernel CPU expert outputs (kt-format.md §2.3, §3.3, §3.4), written one MoE layer at a time.

Layouts:

* ``safetensors`` (merged): one shard per MoE layer, ``model-{i:05d}-of-{N:05d}.safetensors`` with i = the layer's
  position in the sorted MoE layer list (from 1) and N = MoE layers (+1 for the non-expert shard when
  ``include_dense``). Keys ``blk.{L}.ffn_{gate|up|down}_exps.{E}.numa.{t}.weight`` (I8 1-D [quant bytes]) and
  ``.scale`` (F32 1-D [n]); no ``__metadata__`` (as kt-kernel's converter). ``finalize`` writes
  ``model.safetensors.index.json`` with the real total_size, from the shard headers on disk.
* ``kt``: ``_layer_{L}/_numa_{t}/{PREFIX}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt`` raw bytes. Nothing at the top
  level ends in ``.safetensors`` (that would switch kt-kernel to merged mode).

Per NUMA part t of T: gate/up are [n=I/T, k=H] (rows t*I/T..), down is [n=H, k=I/T] (input columns t*I/T..).
A layer becomes visible atomically: merged by the shard's rename, kt by renaming ``_layer_{L}.partial/``.
Both layouts report tensor hashes under the merged key names, so the same conversion hashes the same either way.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats.fileio import (FileRecord, LayerResult, fsync_dir, hash_bytes, open_dir, remove_tree,
                                      write_atomic, write_record)
from ktconvert.formats.safetensors_reader import parse_header
from ktconvert.formats.st_writer import StreamingSafetensorsWriter, tensor_nbytes
from ktconvert.layouts.naming import INDEX_NAME, PROJS, dense_key, kt_relpath, merged_key, part_shape, shard_name

LAYOUTS = ("safetensors", "kt")
COPY_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
COPY_GLOBS = ("*.tiktoken",)


class KtSink:
    """Output folder for kt-kernel CPU experts.

    out_dir:      output folder (created if absent)
    layout:       "safetensors" (merged shards) or "kt" (.kt tree)
    method:       CpuMethod-like: ``file_prefix`` ("INT4"), ``quant_bytes(n, k)``, ``scale_bytes(n)``
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
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layout, self.method, self.numa = layout, method, int(numa)
        self.moe_layers = sorted(int(x) for x in moe_layers)
        self.experts, self.hidden, self.intermediate = int(experts), int(hidden), int(intermediate)
        self.include_dense = bool(include_dense)
        self.n_shards = len(self.moe_layers) + int(self.include_dense)
        self.sizes = {p: self._part_sizes(p) for p in PROJS}

    def _part_sizes(self, proj: str) -> tuple[int, int, int, int]:
        n, k = part_shape(proj, self.hidden, self.intermediate, self.numa)
        return n, k, int(self.method.quant_bytes(n, k)), int(self.method.scale_bytes(n))

    def shard_for(self, layer: int) -> str:
        """Merged shard file name of MoE layer `layer`."""
        if layer not in self.moe_layers:
            raise OutputError("layer is not one of the planned MoE layers", tensor=f"layer {layer}",
                              expected=str(self.moe_layers))
        return shard_name(self.moe_layers.index(layer) + 1, self.n_shards)

    def dense_shard(self) -> str:
        return shard_name(self.n_shards, self.n_shards)

    def layer_tensors(self, layer: int) -> list[tuple[str, str, tuple[int]]]:
        """[(key, dtype, shape)] of one layer in merged form: weight I8 [quant bytes], scale F32 [n]."""
        specs = []
        for proj in PROJS:
            n, _, qbytes, sbytes = self.sizes[proj]
            for e in range(self.experts):
                for t in range(self.numa):
                    specs.append((merged_key(layer, proj, e, t, "weight"), "I8", (qbytes,)))
                    specs.append((merged_key(layer, proj, e, t, "scale"), "F32", (sbytes // 4,)))
        return specs

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
        renamed = [(dense_key(name), dtype, tuple(shape)) for name, dtype, shape in specs]
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
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        return write_record(self.out_dir, INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())

    def _remove_stale_partials(self) -> None:
        """Delete this sink's leftovers from interrupted runs (``.*.partial`` files, ``_layer_*.partial/``)."""
        for entry in self.out_dir.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(".partial") and entry.is_file():
                entry.unlink()
            elif re.fullmatch(r"_layer_\d+\.(partial|old)", entry.name) and (entry.is_dir() or entry.is_symlink()):
                remove_tree(entry)              # a symlink there: the link itself


def copy_sources(copy_from) -> dict[str, Path]:
    """{name: path} of the config / tokenizer files present in the source folder."""
    if copy_from is None:
        return {}
    src = Path(copy_from)
    src = src if src.is_dir() else src.parent
    found = {name: src / name for name in COPY_NAMES if (src / name).is_file()}
    for pattern in COPY_GLOBS:
        found.update({p.name: p for p in src.glob(pattern) if p.is_file()})
    return found


class LayerWriter:
    """Common checks of one layer's puts: projection, expert and part in range, byte counts as planned."""

    def __init__(self, sink: KtSink, layer: int):
        self.sink, self.layer = sink, layer
        self.tensors: dict[str, str] = {}

    def _checked(self, proj: str, expert: int, t: int, blob, scale) -> tuple[np.ndarray, np.ndarray]:
        """(blob as int8 1-D, scale as float32 1-D) after checking them against the plan."""
        where = merged_key(self.layer, proj, expert, t, "weight")
        if proj not in PROJS or not 0 <= expert < self.sink.experts or not 0 <= t < self.sink.numa:
            raise OutputError("expert part out of range", tensor=where,
                              expected=f"proj in {PROJS}, expert < {self.sink.experts}, numa < {self.sink.numa}")
        if where in self.tensors:
            raise OutputError("expert part written twice", tensor=where)
        _, _, qbytes, sbytes = self.sink.sizes[proj]
        blob, scale = np.asarray(blob), np.asarray(scale)
        if blob.dtype not in (np.uint8, np.int8) or blob.nbytes != qbytes:
            raise OutputError("wrong quant blob", tensor=where, expected=f"uint8/int8 [{qbytes}]",
                              found=f"{blob.dtype} {list(blob.shape)}")
        if scale.dtype != np.float32 or scale.nbytes != sbytes:
            raise OutputError("wrong scale", tensor=where.replace(".weight", ".scale"),
                              expected=f"float32 [{sbytes // 4}]", found=f"{scale.dtype} {list(scale.shape)}")
        return np.ascontiguousarray(blob).reshape(-1).view(np.int8), np.ascontiguousarray(scale).reshape(-1)

    def _missing(self) -> list[str]:
        expected = {key for key, dtype, _ in self.sink.layer_tensors(self.layer) if dtype == "I8"}
        return sorted(expected - set(self.tensors))


class MergedLayerWriter(LayerWriter):
    """One layer's shard, written expert part by expert part at known offsets.

    The shard holds every scale first, then the weights projection by projection (kt-kernel's converter writes it
    so), while the matrices come expert by expert: the first weight byte can be hashed only once the layer's last
    scale exists, when all its weights exist too. Holding them is the whole layer's output (Qwen3-30B-A3B:
    302 MB AMXINT4, 604 MB AMXINT8; DeepSeek-V3: 5.6 / 11.3 GB), so the file hash reads the weights back from the
    page cache instead (``ordered_hash``), and nothing is parked."""

    def __init__(self, sink: KtSink, layer: int):
        super().__init__(sink, layer)
        self.writer = StreamingSafetensorsWriter(sink.out_dir / sink.shard_for(layer), sink.layer_tensors(layer),
                                                 park_bytes=0)

    def put(self, proj: str, expert: int, t: int, blob, scale) -> None:
        """blob: uint8/int8 [quant bytes]; scale: float32 [n] of NUMA part t of expert `expert`'s `proj`."""
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
        """blob: uint8/int8 [quant bytes]; scale: float32 [n] of NUMA part t of expert `expert`'s `proj`."""
        blob, scale = self._checked(proj, expert, t, blob, scale)
        for part, data, key_part in (("quant", blob, "weight"), ("scale", scale, "scale")):
            rel = kt_relpath(self.layer, t, self.sink.method.file_prefix, proj, expert, data.nbytes, part)
            self._write_file(rel, memoryview(data.view(np.uint8)))
            self.tensors[merged_key(self.layer, proj, expert, t, key_part)] = self.records[-1].sha256

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
