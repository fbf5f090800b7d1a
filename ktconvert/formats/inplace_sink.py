"""Writers for the in-place methods (bf16, rawint4, fp8, fp8_perchannel, gptq_int4, mxfp8, nvfp4): HF-named expert
tensors kt-kernel's native loaders read.

Layout: one shard per MoE layer, ``model-{i:05d}-of-{n:05d}.safetensors`` (i = position of the layer in the list of
converted layers, from 1), holding ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.<suffix>`` for every
expert (suffixes from the method's ``tensor_specs``; a method may name its modules otherwise, see
``expert_module``). ``finalize`` writes ``model.safetensors.index.json`` and a ``config.json``: the source config
with the method's ``quantization_config`` describing the output (none for bf16).

Every shard goes through ``StreamingSafetensorsWriter`` (temp name, atomic rename); memory is one expert.
``planned_files()`` is the one plan of every file and its bytes (shards with their tensors, the index, config.json,
the copies): the writer's headers, the index, the plan report and verify read it.

Use::

    sink = InplaceSink(out_dir, METHODS.get("rawint4").configured(32), layers, n_experts, hidden, inter)
    w = sink.begin_layer(L); w.put_matrix(proj, e, w_bf16) ...; files, tensors = w.finish()
    records = sink.finalize(copy_from=source_dir)

The interface (begin_layer / finish -> LayerResult / finalize -> FileRecords) is KtSink's, so the pipeline drives
both the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

from ktconvert.errors import OutputError, ShapeError
from ktconvert.formats.file_plan import PlannedFile, index_of, planned_index, shard
from ktconvert.formats.fileio import FileRecord, LayerResult, write_record
from ktconvert.formats.kt_sink import copy_sources
from ktconvert.formats.st_writer import StreamingSafetensorsWriter
from ktconvert.layouts.naming import INDEX_NAME, shard_name
from ktconvert.util.safe_read import parse_json

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
EXPERT_PREFIX = "model.layers.{L}.mlp.experts.{E}.{proj}"


def expert_module(method, layer: int, expert: int, proj: str) -> str:
    """The module name of one expert matrix in `method`'s output: its ``expert_template`` / ``proj_names`` where it
    has them (MXFP8: kt-kernel reads ``block_sparse_moe.experts.E.{w1,w3,w2}`` only), else EXPERT_PREFIX."""
    names = getattr(method, "proj_names", None) or PROJ_NAMES
    return (getattr(method, "expert_template", None) or EXPERT_PREFIX).format(L=layer, E=expert, proj=names[proj])


class InplaceSink:
    """Output directory for one in-place method (out_dir None: a plan only). layers: MoE layer indices in output
    order."""

    def __init__(self, out_dir, method, layers, n_experts: int, hidden: int, intermediate: int, numa: int = 1):
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.method = method
        self.layers = list(layers)
        self.n_experts, self.hidden, self.intermediate = n_experts, hidden, intermediate
        method.check_numa(hidden, intermediate, numa)
        self.shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}

    def shard_of(self, layer: int) -> str:
        return shard_name(self.layers.index(layer) + 1, len(self.layers))

    def layer_tensors(self, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor in layer's shard, as the method's tensor_specs declare them."""
        specs = {proj: self.method.tensor_specs(n, k) for proj, (n, k) in self.shapes.items()}
        return [(f"{expert_module(self.method, layer, e, proj)}.{suffix}", dtype, shape)
                for e in range(self.n_experts) for proj in self.shapes
                for suffix, (dtype, shape) in specs[proj].items()]

    def planned_shard(self, layer: int) -> PlannedFile:
        """Layer `layer`'s shard: its tensors and exact bytes."""
        return shard(self.shard_of(layer), self.layer_tensors(layer), layer)

    def planned_files(self, copy_from=None, fallback_config: dict | None = None, dense=None) -> dict[str, PlannedFile]:
        """{path: PlannedFile} of every file this sink writes: the layer shards (their tensors listed), the index,
        then what finalize writes from `copy_from` / `fallback_config` (config.json, the tokenizer copies), in name
        order. dense: unused (in-place outputs hold the experts only)."""
        files = [self.planned_shard(layer) for layer in self.layers]
        files.append(planned_index(files))
        for name, data in sorted(self._side_files(copy_from, fallback_config).items()):
            files.append(PlannedFile(name, len(data) if isinstance(data, bytes) else data.stat().st_size))
        return {f.path: f for f in files}

    def begin_layer(self, layer: int) -> "InplaceLayerWriter":
        if layer not in self.layers:
            raise OutputError("layer not in this output's plan", file=self.out_dir, found=str(layer))
        return InplaceLayerWriter(self, layer)

    def finalize(self, copy_from=None, fallback_config: dict | None = None,
                 check_layers: bool = True) -> list[FileRecord]:
        """Write the index, config.json (the source's — or `fallback_config` when the source has none — with this
        method's quantization_config) and copies of the tokenizer / generation config from `copy_from`; returns
        their records. The index comes from the plan (check_layers: KtSink's; no layer file is read here)."""
        files = {INDEX_NAME: index_of([self.planned_shard(layer) for layer in self.layers])}
        for name, data in self._side_files(copy_from, fallback_config).items():
            files[name] = data if isinstance(data, bytes) else data.read_bytes()
        return [write_record(self.out_dir, name, data) for name, data in sorted(files.items())]

    def _side_files(self, copy_from, fallback_config: dict | None) -> dict[str, bytes | Path]:
        """{name: bytes written, or the source file copied as is}: config.json (the source's, or `fallback_config`,
        with this method's quantization_config) and the tokenizer / generation config copies."""
        files: dict[str, bytes | Path] = dict(copy_sources(copy_from))
        if "config.json" in files or fallback_config is not None:
            config = parse_json(files["config.json"].read_bytes(), what="config.json") if "config.json" in files \
                else fallback_config
            files["config.json"] = _json_bytes(output_config(config, self.method))
        return files


class InplaceLayerWriter:
    """One layer's shard; experts may arrive in any order. finish() -> (files, tensor digests)."""

    def __init__(self, sink: InplaceSink, layer: int):
        self.sink, self.layer = sink, layer
        sink.out_dir.mkdir(parents=True, exist_ok=True)
        planned = sink.planned_shard(layer)
        self.writer = StreamingSafetensorsWriter(sink.out_dir / planned.path, planned.tensors)

    def put_matrix(self, proj: str, expert: int, w_bf16) -> None:
        """Encode one expert matrix (uint16 BF16 bits in HF orientation) and write its tensors."""
        want = self.sink.shapes[proj]
        base = expert_module(self.sink.method, self.layer, expert, proj)
        if tuple(w_bf16.shape) != want:
            raise ShapeError("expert matrix has the wrong shape", tensor=base, expected=str(list(want)),
                             found=str(list(w_bf16.shape)))
        for suffix, array in self.sink.method.encode(w_bf16, where=base).items():
            self.writer.write(f"{base}.{suffix}", array)

    def put_stored(self, proj: str, expert: int, tensors: dict) -> None:
        """Write one expert matrix's tensors as given ({suffix: array}, already this method's: a carried-over
        source's bytes)."""
        base = expert_module(self.sink.method, self.layer, expert, proj)
        for suffix, array in tensors.items():
            self.writer.write(f"{base}.{suffix}", array)

    def finish(self) -> LayerResult:
        self.writer.close()
        return self.writer.layer_result()

    def abort(self) -> None:
        self.writer.abort()


def output_config(source_config: dict, method) -> dict:
    """The source config.json with quantization_config describing `method`'s expert tensors (none for BF16)."""
    config = {k: v for k, v in source_config.items() if k != "quantization_config"}
    qc = method.quantization_config()
    if qc is not None:
        config["quantization_config"] = qc
    return config


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")