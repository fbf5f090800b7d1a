"""``ktconvert gpu``: the SGLang-KT GPU checkpoint, streamed one MoE layer at a time.

    plan (headers only) → for each source file, front to back (pipeline.run_jobs, hashing every byte once):
        first matrix of MoE layer L: open L's output shard (header first), write its non-expert tensors
        (FP8-block / BF16 linears, copies) → each routed expert matrix: RTN W4A16/W8A16 through compressed-tensors
        → last matrix: the shard is renamed into place and journalled (--resume skips it)
    → non-MoE shard, index, config.json (quantization_config, linear_fp8_config last), copies, ktconvert.json

``GpuOutput`` is a pipeline output (begin_layer / layer_finished / finalize), so the one-pass ``convert`` feeds it
the same decoded matrices as the CPU output. Memory: one expert matrix per worker plus one non-expert tensor.

GPTQ hook: ``--algo gptq`` imports ``ktconvert.gpu.gptq`` and, layer by layer in order, calls

    state = quantize_layer_gptq(source, layer, state, bits=bits, group_size=group_size, emit=emit)

with ``state`` None for the first layer; the implementation calls ``emit(expert, proj, tensors)`` once per routed
expert matrix (proj "gate" | "up" | "down"; tensors as ``experts.quantize_expert_rtn`` returns them) and returns
the state for the next layer. config.json then says ``actorder: "static"``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import KtConvertError, OutputError
from ktconvert.formats.fileio import FileRecord, LayerResult
from ktconvert.layouts.naming import INDEX_NAME

NO_COPY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
NO_COPY_NAMES = ("config.json", INDEX_NAME, "ktconvert.json", "README.md")


@dataclass(frozen=True)
class GpuOptions:
    experts: str = "w4a16"
    group_size: int = 128
    algo: str = "rtn"
    linears: str = "fp8"
    include_mtp: bool = False
    calibration: str | None = None   # --algo gptq: JSON lines of texts or token ids
    expert_orientation: str | None = None   # --expert-orientation for square fused source tensors

    @property
    def bits(self) -> int:
        from ktconvert.gpu.experts import bits_of

        return bits_of(self.experts)

    def journal_options(self, layers, config_sha256) -> dict:
        return {"kind": "gpu", "experts": self.experts.lower(), "group_size": self.group_size, "algo": self.algo,
                "linears": self.linears, "include_mtp": self.include_mtp, "layers": list(layers),
                "source_config_sha256": config_sha256}


class GpuLayerWriter:
    """One MoE layer's shard: non-expert tensors written on open, then routed experts as they arrive."""

    def __init__(self, output: "GpuOutput", shard):
        from ktconvert.formats.st_writer import StreamingSafetensorsWriter

        self.output, self.shard, self.layer = output, shard, shard.layer
        opts = output.options
        self.writer = StreamingSafetensorsWriter(output.out_dir / shard.name, shard.specs(opts.bits, opts.group_size))
        self.bases = {(e, p): base for e, p, base, _, _ in shard.experts}
        try:
            _write_items(self.writer, shard.items, output.source.checkpoint)
        except BaseException:
            self.writer.abort()
            raise

    def put_matrix(self, proj: str, expert: int, w, where: str) -> None:
        """RTN-quantize one routed expert matrix (uint16 BF16 bits, HF orientation) and write its tensors."""
        from ktconvert.gpu.experts import quantize_expert_rtn

        opts = self.output.options
        self.put_tensors(expert, proj, quantize_expert_rtn(w, opts.bits, opts.group_size, where=where))

    def put_tensors(self, expert: int, proj: str, tensors: dict) -> None:
        """Write an already quantized expert matrix {weight_packed, weight_scale, weight_shape} (GPTQ's emit)."""
        base = self.bases[(expert, proj)]
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            self.writer.write(f"{base}.{suffix}", tensors[suffix])

    def finish(self) -> LayerResult:
        self.writer.close()
        w = self.writer
        return LayerResult([FileRecord(self.shard.name, w.size, w.sha256, w.git_sha1)], dict(w.tensor_sha256))

    def abort(self) -> None:
        self.writer.abort()


def _write_items(writer, items, checkpoint) -> None:
    for item in items:
        for name, array in item.produce(checkpoint).items():
            writer.write(name, array)


class GpuOutput:
    """The GPU checkpoint being written into `out_dir` from `source` (HFSource) with `options` (GpuOptions)."""

    def __init__(self, out_dir, source, options: GpuOptions, journal, src_extra: dict | None = None):
        from ktconvert.gpu.layout import GpuLayout

        self.out_dir, self.source, self.options, self.journal = Path(out_dir), source, options, journal
        self.src_extra = src_extra or {}
        self.layers = list(source.all_layers(options.include_mtp))
        self.layout = GpuLayout(source, self.layers, options.linears, options.bits, options.group_size)
        self._lock = threading.Lock()

    def begin_layer(self, layer: int) -> GpuLayerWriter:
        return GpuLayerWriter(self, self.layout.shards[layer])

    def layer_finished(self, layer: int, result: LayerResult) -> None:
        files = [{"path": rec.path, **rec.entry()} for rec in result.files]
        with self._lock:
            self.journal.finish_layer(layer, files, result.tensors)

    def finalize(self) -> dict:
        """Non-MoE shard, index, config.json, copied files and ktconvert.json (last). Returns the manifest."""
        from ktconvert.formats.fileio import record_for, write_atomic
        from ktconvert.formats.out_manifest import write_manifest
        from ktconvert.formats.st_writer import StreamingSafetensorsWriter

        missing = [layer for layer in self.layers if not self.journal.layer_done(layer)]
        if missing:
            raise OutputError(f"{len(missing)} MoE layer(s) not written", file=str(self.out_dir),
                              found="layers " + ", ".join(map(str, missing[:8])))
        shard = self.layout.shards[None]
        opts = self.options
        with StreamingSafetensorsWriter(self.out_dir / shard.name, shard.specs(opts.bits, opts.group_size)) as w:
            _write_items(w, shard.items, self.source.checkpoint)
        records = {shard.name: (FileRecord(shard.name, w.size, w.sha256, w.git_sha1), dict(w.tensor_sha256))}
        write_atomic(self.out_dir / INDEX_NAME, self._index_bytes())
        write_atomic(self.out_dir / "config.json", self._config_bytes())
        extra = [INDEX_NAME, "config.json"]
        for rel, src in self._copies():
            write_atomic(self.out_dir / rel, src.read_bytes())
            extra.append(rel)
        manifest = self._manifest(records, [record_for(self.out_dir, rel) for rel in extra])
        write_manifest(self.out_dir, manifest)
        self.journal.remove()
        return manifest

    def _index_bytes(self) -> bytes:
        import json

        from ktconvert.formats.st_writer import tensor_nbytes

        weight_map, total = {}, 0
        opts = self.options
        for shard in self.layout.shards.values():
            for name, dtype, shape in shard.specs(opts.bits, opts.group_size):
                weight_map[name] = shard.name
                total += tensor_nbytes(dtype, shape)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()

    def _config_bytes(self) -> bytes:
        import json

        from ktconvert.gpu import config as gcfg

        hf, sgl = self.layout.ignore_modules()
        ignore = gcfg.build_ignore(hf, sgl, self.layout.expert_check_names())
        actorder = "static" if self.options.algo == "gptq" else None
        qc = gcfg.quantization_config(self.options.bits, self.options.group_size, ignore, actorder,
                                      linear_fp8=self.layout.linear_fp8)
        config = gcfg.output_config(self.source.checkpoint.config, qc)
        return (json.dumps(config, indent=2) + "\n").encode()

    def _copies(self) -> list[tuple[str, Path]]:
        """Top-level non-weight files of the source: tokenizer, generation_config, chat template, custom code."""
        root = Path(self.source.checkpoint.root)
        root = root if root.is_dir() else root.parent
        out = []
        for path in sorted(root.iterdir()):
            name = path.name
            if path.is_file() and not name.startswith(".") and name not in NO_COPY_NAMES \
                    and not name.endswith(NO_COPY_SUFFIXES):
                out.append((name, path))
        return out

    def _manifest(self, records: dict, extra: list) -> dict:
        from ktconvert.formats.fileio import hash_file
        from ktconvert.formats.out_manifest import build_manifest

        files = {rec.path: rec.entry() for rec in extra}
        tensors: dict[str, str] = {}
        for rec, shard_tensors in records.values():
            files[rec.path] = rec.entry()
            tensors.update(shard_tensors)
        for layer in self.layers:
            for f in self.journal.layers[layer]["files"]:
                files[f["path"]] = {k: v for k, v in f.items() if k != "path"}
            tensors.update(self.journal.layers[layer]["tensors"])
        info = self.source.info
        config = Path(self.source.checkpoint.root) / "config.json"
        src = {"config_sha256": hash_file(config)[1] if config.is_file() else None,
               "files": dict(sorted(self.journal.sources.items())), **self.src_extra}
        model = {"family": info.family, "model_type": info.model_type, "layers": self.layers,
                 "experts": info.n_experts, "hidden": info.hidden, "intermediate": info.intermediate}
        opts = self.options
        manifest = build_manifest(method=opts.experts.upper(), numa=1, layout="compressed-tensors", model=model,
                                  source=src, files=files, tensors=tensors, quant=opts.algo, kind="gpu",
                                  packages=_packages())
        manifest["gpu"] = {"experts": opts.experts.lower(), "bits": opts.bits, "group_size": opts.group_size,
                           "linears": opts.linears, "linear_fp8": self.layout.linear_fp8, "algo": opts.algo,
                           "include_mtp": opts.include_mtp}
        manifest["flags"] = {"model": "."}
        manifest["sglang_args"] = "--model ."
        return manifest


def _packages() -> dict:
    from ktconvert.formats.out_manifest import BYTE_PACKAGES, package_versions

    return package_versions(BYTE_PACKAGES + ("torch", "compressed-tensors"))


# ---------------------------------------------------------------------------------------------- entry points

def open_gpu_output(src_path: Path, out_dir: Path, options: GpuOptions, resume: bool, src_extra: dict):
    """(HFSource, GpuOutput, journal) for OUT_GPU, prepared like the CPU output (--resume / --force rules)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.journal import Journal

    _check_options(options)
    if options.expert_orientation is not None:     # recorded: verify reopens the source the same way
        src_extra = {**src_extra, "expert_orientation": options.expert_orientation}
    source = HFSource.open(src_path, options.expert_orientation)
    source.validate(include_mtp=options.include_mtp)
    layers = list(source.all_layers(options.include_mtp))
    journal = Journal.start(out_dir, options.journal_options(layers, source.config_sha256()), resume)
    return source, GpuOutput(out_dir, source, options, journal, src_extra), journal


def _check_options(options: GpuOptions) -> None:
    from ktconvert.errors import UnknownNameError
    from ktconvert.gpu.experts import GROUP_SIZES
    from ktconvert.gpu.linears import LINEAR_MODES

    options.bits  # validates the scheme name
    if options.group_size not in GROUP_SIZES:
        raise UnknownNameError("unsupported group size for SGLang's Marlin MoE kernels",
                               expected=" or ".join(map(str, GROUP_SIZES)), found=str(options.group_size))
    if options.linears not in LINEAR_MODES:
        raise UnknownNameError("unknown --linears mode", expected=", ".join(LINEAR_MODES), found=options.linears)
    if options.algo not in ("rtn", "gptq"):
        raise UnknownNameError("unknown --algo", expected="rtn or gptq", found=options.algo)
    if options.algo == "gptq":
        gptq_hook()


def gptq_hook():
    """ktconvert.gpu.gptq.quantize_layer_gptq, or a clear error while it does not exist."""
    try:
        from ktconvert.gpu.gptq import quantize_layer_gptq
    except ImportError:
        raise KtConvertError("--algo gptq is not available in this version of ktconvert",
                             expected="ktconvert.gpu.gptq.quantize_layer_gptq", found="not installed",
                             hint="use --algo rtn") from None
    return quantize_layer_gptq


def convert_gpu(src, out, *, experts: str = "w4a16", algo: str = "rtn", group_size: int = 128,
                linears: str = "fp8", include_mtp: bool = False, threads: int | None = None, resume: bool = False,
                force: bool = False, calibration=None, progress=None, expert_orientation: str | None = None) -> str:
    """Write the SGLang-KT GPU checkpoint of `src` into `out`. Returns a summary line."""
    from ktconvert.formats.out_manifest import JOURNAL_NAME, MANIFEST_NAME
    from ktconvert.cpu.convert import _NullProgress, prepare_output, resolve_source, run_jobs

    progress = progress or _NullProgress()
    options = GpuOptions(experts.lower(), group_size, algo, linears, include_mtp,
                         str(calibration) if calibration is not None else None, expert_orientation)
    src_path, src_extra = resolve_source(str(src))
    out_dir = Path(out)
    _check_options(options)
    prepare_output(out_dir, src_path, resume, force)
    if resume and (out_dir / MANIFEST_NAME).exists() and not (out_dir / JOURNAL_NAME).exists():
        return f"{out_dir}: already complete (ktconvert.json present); nothing to do"
    source, output, journal = open_gpu_output(src_path, out_dir, options, resume, src_extra)
    layers = output.layers
    if journal.layers:
        progress.message(f"resuming: {len(journal.layers)} of {len(layers)} layers already done")
    if options.algo == "gptq":
        _run_gptq(source, output, journal, progress)
    else:
        jobs = source.matrix_jobs(layers)
        progress.start(sum(j.nbytes for j in jobs if not journal.layer_done(j.layer)),
                       len(layers) - len(journal.layers), f"gpu {options.experts.upper()} linears={linears}")
        run_jobs(jobs, source, [output], journal, threads or os.cpu_count() or 1, progress)
    manifest = output.finalize()
    return summary(out_dir, manifest)


def summary(out_dir, manifest: dict) -> str:
    total = sum(f["bytes"] for f in manifest["files"].values())
    return (f"wrote {out_dir}: {len(manifest['files'])} files, {total} bytes; run SGLang with --model {out_dir}")


def _run_gptq(source, output: GpuOutput, journal, progress) -> None:
    """Layers in order through the GPTQ hook (not file order: each layer needs the previous layer's outputs)."""
    from ktconvert.formats.out_manifest import source_fingerprint

    quantize_layer_gptq = gptq_hook()
    opts = output.options
    progress.start(len(output.layers), len(output.layers), f"gpu {opts.experts.upper()} gptq")
    state = None
    for layer in output.layers:
        writer = output.begin_layer(layer)
        try:
            state = quantize_layer_gptq(source, layer, state, bits=opts.bits, group_size=opts.group_size,
                                        emit=lambda e, proj, tensors: writer.put_tensors(e, proj, tensors),
                                        calibration=opts.calibration)
            output.layer_finished(layer, writer.finish())
        except BaseException:
            writer.abort()
            raise
        progress.advance(1, items=1, detail=f"layer {layer}")
    fingerprint = source_fingerprint(source.checkpoint.root, source.files())
    for name, entry in fingerprint["files"].items():
        journal.finish_source(name, entry)
