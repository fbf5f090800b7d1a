"""The SGLang-KT GPU checkpoint being written (gpu-format.md §8), one MoE layer's shard at a time.

    first matrix of MoE layer L: open L's output shard (header first), write its non-expert tensors (FP8-block /
    BF16 linears, copies) -> each routed expert matrix: RTN W4A16/W8A16 through compressed-tensors (or GPTQ's
    tensors, ``put_tensors``) -> last matrix: the shard is renamed into place and journalled (--resume skips it)
    -> non-MoE shard, index, config.json (quantization_config, linear_fp8_config last), copies, ktconvert.json

``GpuOutput`` is an ``output.Output``, so one pass (``onepass.write_outputs``) can feed it the same decoded
matrices as a CPU output. Memory: one expert matrix per worker plus one non-expert tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats.fileio import LayerResult, write_record
from ktconvert.formats.out_manifest import BYTE_PACKAGES, GPU_FLAGS, MANIFEST_NAME, package_versions
from ktconvert.formats.st_writer import StreamingSafetensorsWriter, tensor_nbytes
from ktconvert.gpu import config as gpu_config
from ktconvert.gpu.experts import SUFFIXES as EXPERT_SUFFIXES, quantize_expert_rtn
from ktconvert.gpu.plan import GpuPlan
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.run.output import Output

NO_COPY_NAMES = ("config.json", INDEX_NAME, MANIFEST_NAME, "README.md")


class GpuLayerWriter:
    """One MoE layer's shard: non-expert tensors and every expert's weight_shape ([n, k], known from the plan)
    written on open, then routed experts as they arrive. The weight_shape tensors come first in the file (I64
    sorts first), so writing them up front lets the file hash follow the experts as they go out."""

    def __init__(self, output: "GpuOutput", shard):
        self.output, self.shard, self.layer = output, shard, shard.layer
        opts = output.options
        self.writer = StreamingSafetensorsWriter(output.out_dir / shard.name, shard.specs(opts.bits, opts.group_size))
        self.bases = {(e, p): base for e, p, base, _, _ in shard.experts}
        self.shapes = {(e, p): (n, k) for e, p, _, n, k in shard.experts}
        try:
            _write_items(self.writer, shard.items, output.source)
            for e, p, base, n, k in shard.experts:
                self.writer.write(f"{base}.weight_shape", np.array([n, k], np.int64))
        except BaseException:
            self.writer.abort()
            raise

    def put_matrix(self, proj: str, expert: int, w, where: str, stored=None) -> None:
        """RTN-quantize one routed expert matrix (uint16 BF16 bits, HF orientation) and write its tensors."""
        opts = self.output.options
        with profile.span("quantize.gpu", w.nbytes):
            tensors = quantize_expert_rtn(w, opts.bits, opts.group_size, where=where)
        self.put_tensors(expert, proj, tensors)

    def put_tensors(self, expert: int, proj: str, tensors: dict) -> None:
        """Write an already quantized expert matrix {weight_packed, weight_scale, weight_shape} (GPTQ's emit)."""
        base = self.bases[(expert, proj)]
        shape = [int(x) for x in np.asarray(tensors["weight_shape"]).reshape(-1)]
        if shape != list(self.shapes[(expert, proj)]):
            raise OutputError("expert matrix has the wrong shape", tensor=f"{base}.weight_shape",
                              expected=str(list(self.shapes[(expert, proj)])), found=str(shape))
        for suffix in EXPERT_SUFFIXES:
            if suffix != "weight_shape":            # written on open
                self.writer.write(f"{base}.{suffix}", tensors[suffix])

    def finish(self) -> LayerResult:
        self.writer.close()
        return self.writer.layer_result(self.shard.name)

    def abort(self) -> None:
        self.writer.abort()


def _write_items(writer, items, source) -> None:
    for item in items:
        with profile.span("linears"):
            tensors = item.produce(source)
        for name, array in tensors.items():
            writer.write(name, array)


class GpuOutput(Output):
    """The GPU checkpoint of `plan` (gpu.plan.GpuPlan) in `out_dir`."""

    kind, flags = "gpu", GPU_FLAGS      # flags: SGLang's --model, the folder itself
    option_of = {"method": "--experts", "gpu.bits": "--experts", "gpu.algo": "--quant", "gpu.linear_fp8": "--linears"}

    def __init__(self, out_dir, plan: GpuPlan, *, resume: bool = False, force: bool = False,
                 part: list[int] | None = None):
        super().__init__(out_dir, plan, resume=resume, force=force, part=part)
        self.options, self.layout = plan.options, plan.layout

    def journal_options(self) -> dict:
        return self.plan.journal_options()

    def label(self) -> str:
        return f"gpu {self.options.experts.upper()} linears={self.options.linears}"

    def begin_layer(self, layer: int) -> GpuLayerWriter:
        return GpuLayerWriter(self, self.layout.shards[layer])

    def finish_files(self) -> LayerResult:
        """The non-MoE shard, the index, config.json and the copied non-weight files."""
        shard = self.layout.shards[None]
        opts = self.options
        with StreamingSafetensorsWriter(self.out_dir / shard.name, shard.specs(opts.bits, opts.group_size)) as w:
            _write_items(w, shard.items, self.source)
        records = [w.record(shard.name), write_record(self.out_dir, INDEX_NAME, self._index_bytes()),
                   write_record(self.out_dir, "config.json", self._config_bytes())]
        records += [write_record(self.out_dir, rel, src.read_bytes()) for rel, src in self._copies()]
        return LayerResult(records, dict(w.tensor_sha256))

    def _index_bytes(self) -> bytes:
        weight_map, total = {}, 0
        opts = self.options
        for shard in self.layout.shards.values():
            for name, dtype, shape in shard.specs(opts.bits, opts.group_size):
                weight_map[name] = shard.name
                total += tensor_nbytes(dtype, shape)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()

    def _config_bytes(self) -> bytes:
        hf, sgl = self.layout.ignore_modules()
        ignore = gpu_config.build_ignore(hf, sgl, self.layout.expert_check_names())
        ignore += self.options.ignore       # --ignore: appended as given, as llm-compressor's model_free_ptq does
        gptq = self.options.quant == "gptq"
        qc = gpu_config.quantization_config(self.options.bits, self.options.group_size, ignore,
                                            "static" if gptq else None, linear_fp8=self.layout.linear_fp8,
                                            observer=gpu_config.GPTQ_OBSERVER if gptq else "minmax")
        config = gpu_config.output_config(self.source.config_json(), qc)
        return (json.dumps(config, indent=2) + "\n").encode()

    def _copies(self) -> list[tuple[str, Path]]:
        """Top-level non-weight files of the source: tokenizer, generation_config, chat template, custom code."""
        return [(name, path) for name, path in sorted(self.source.side_files().items()) if name not in NO_COPY_NAMES]

    def manifest_fields(self) -> dict:
        opts = self.options
        gpu = {"experts": opts.experts, "bits": opts.bits, "group_size": opts.group_size, "linears": opts.linears,
               "linear_fp8": self.layout.linear_fp8, "algo": opts.quant, "include_mtp": opts.include_mtp}
        if opts.ignore:
            gpu["ignore"] = list(opts.ignore)       # only when given: other manifests stay as they were
        return {"method": opts.experts.upper(), "numa": 1, "layout": "compressed-tensors", "quant": opts.quant,
                "kind": "gpu", "flags": dict(self.flags),
                "packages": package_versions(BYTE_PACKAGES + ("torch", "compressed-tensors")), "extra": {"gpu": gpu}}
