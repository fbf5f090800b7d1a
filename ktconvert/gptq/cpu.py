"""GPTQ for kt-kernel's AMXINT4 / AMXINT8 CPU files (``ktconvert cpu --quant gptq``).

The AMX formats keep one fp32 scale per row of each NUMA part (kt-format.md §2.0-2.2):

* gate / up [I, H]: one scale per row (a NUMA part is a block of rows);
* down [H, I]: one scale per row and NUMA part (part t = columns t*I/T..), i.e. T groups of I/T columns.

Scales searched, then GPTQ: every row (part) first gets the data-free row quantizer's scale (``scale_quant``,
default "mse": the ``--quant mse`` search of ktconvert.quant.mse, per NUMA part as ``--quant mse`` writes it),
then GPTQ's error compensation (``grid.solve``) chooses the codes on that fixed grid, -7..7 (INT4, never -8:
nibble 0x8 breaks kt-kernel's forward, kt-format.md §2.1) or -127..127 (INT8). Stored d is the searched scale, so
the files keep kt-kernel's format byte for byte: w ~= codes * 16 * d (INT4), codes * d (INT8).

With a ``selection`` (holdout.SelectionOptions, on by default) the stream judges each expert on held-out
calibration tokens and writes the data-free codes (exactly what ``--quant scale_quant`` writes for that expert)
where GPTQ does not beat them (loop.LayerStream, holdout.py).

The writer (``write_gptq_layers``) serves every method with a GPTQ grid: the AMX methods (``bits``) through
``AmxQuantizer``, in-place methods declaring ``gptq_grid`` (GPTQ_INT4) through gptq.groups' ``GroupQuantizer``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from ktconvert.activation.stats import write_gptq_activation
from ktconvert.errors import InputError, ShapeError
from ktconvert.formats.hf_source import HFSource
from ktconvert.formats.out_manifest import source_file_entry
from ktconvert.gptq import grid
from ktconvert.gptq.calibration import load_samples
from ktconvert.gptq.determinism import deterministic_cpu, pin_process
from ktconvert.gptq.groups import GroupQuantizer, bf16_bits
from ktconvert.gptq.groups import write_layer as write_group_layer
from ktconvert.gptq.holdout import REASONS, SelectionOptions
from ktconvert.gptq.loop import GptqOptions, LayerResult, LayerStream
from ktconvert.gptq.resume import restore_for, samples_digest
from ktconvert.layouts.naming import PROJS
from ktconvert.layouts.numa import numa_slices
from ktconvert.methods import METHODS
from ktconvert.run.outputs import layer_source_bytes, write_in_layer_order
from ktconvert.util.progress import Progress
from ktconvert.quant import mse  # noqa: F401  (registers the "mse" row quantizer)
from ktconvert.quant.row_quant import ROW_QUANT
from ktconvert.results import ConvertResult


def split_parts(codes: np.ndarray, d: np.ndarray, numa: int, proj: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(codes int8 [n, k], d float32 [n, groups]) -> per NUMA part (codes [n_t, k_t], d [n_t]) as kt-kernel
    splits the matrix (gate/up rows, down input columns)."""
    from ktconvert.layouts.numa import numa_slices

    if proj != "down":
        return [(np.ascontiguousarray(codes[sl]), np.ascontiguousarray(d[sl, 0]))
                for sl in numa_slices(codes.shape[0], numa)]
    return [(np.ascontiguousarray(codes[:, sl]), np.ascontiguousarray(d[:, t]))
            for t, sl in enumerate(numa_slices(codes.shape[1], numa))]


def part_scales(parts: list, proj: str) -> np.ndarray:
    """Stored scales d float32 [n, groups] of one projection from its NUMA parts [(codes, d [n_t])]: gate/up
    [I, 1] (parts stacked by rows), down [H, T] (one column per part)."""
    if proj != "down":
        return np.concatenate([d for _, d in parts])[:, None].astype(np.float32)
    return np.stack([d for _, d in parts], axis=1).astype(np.float32)


class AmxQuantizer:
    """LayerStream quantizer for the AMX formats; payload per proj: list over NUMA parts of
    (codes int8 [n_t, k_t] in -7..7 / -127..127, d float32 [n_t]) with w ~= codes * (16 if INT4 else 1) * d.

    scale_quant: the ROW_QUANT entry that picks the scales (and writes the data-free experts); selection:
    holdout.SelectionOptions (None: GPTQ written for every expert with calibration tokens)."""

    def __init__(self, bits: int, numa: int, scale_quant: str | None = None,
                 selection: SelectionOptions | None = SelectionOptions()):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        self.bits, self.numa = bits, numa
        self.limit = 7 if bits == 4 else 127
        self.step_factor = 16.0 if bits == 4 else 1.0
        self.fallback_quant = scale_quant or default_fallback()
        self.selection = selection

    def quantize(self, expert, gate_up, down, options: GptqOptions, where: str) -> dict | None:
        """GPTQ payloads of one expert on the data-free quantizer's scales; None when a damped Hessian is not
        positive definite (the caller writes the data-free payloads)."""
        weights = {p: getattr(expert, p + "_proj").weight.detach().to("cpu") for p in PROJS}
        if weights["down"].shape[1] % self.numa:
            raise ShapeError("expert intermediate size does not split into NUMA parts", tensor=f"{where} down",
                             expected=f"I % {self.numa} == 0", found=f"I = {weights['down'].shape[1]}")
        scales = {p: part_scales(parts, p) for p, parts in self.fallback(expert, where).items()}
        with deterministic_cpu("cpu"):
            codes = grid.solve_expert(weights, gate_up[0].to("cpu"), down[0].to("cpu"),
                                      {p: self._steps(s) for p, s in scales.items()}, options.dampening,
                                      self.limit, options.block_size)
        if codes is None:
            return None
        return {p: split_parts(codes[p], scales[p], self.numa, p) for p in PROJS}

    def _steps(self, d: np.ndarray):
        import torch

        return torch.from_numpy(d * np.float32(self.step_factor))

    def fallback(self, expert, where: str) -> dict:
        """Data-free per-row quantization of every NUMA part (``fallback_quant``: "mse" or "rtn")."""
        quantize_rows = ROW_QUANT.get(self.fallback_quant)
        out = {}
        for proj in PROJS:
            w = bf16_bits(getattr(expert, proj + "_proj").weight)
            rows = proj != "down"
            parts = [w[sl] if rows else w[:, sl] for sl in numa_slices(w.shape[0] if rows else w.shape[1],
                                                                        self.numa)]
            out[proj] = [tuple(quantize_rows(np.ascontiguousarray(p), self.bits, f"{where} {proj}"))
                         for p in parts]
        return out

    def dequantized(self, payloads: dict) -> dict:
        """{proj: float32 torch [n, k]} the weights kt-kernel computes with (codes * step, NUMA parts joined)."""
        import torch

        out = {}
        for proj, parts in payloads.items():
            mats = [codes.astype(np.float32) * (np.float32(self.step_factor) * d)[:, None] for codes, d in parts]
            out[proj] = torch.from_numpy(np.concatenate(mats, axis=0 if proj != "down" else 1))
        return out


def default_fallback() -> str:
    """"mse" when the ``--quant mse`` row quantizer is registered, else "rtn"."""
    return "mse" if "mse" in ROW_QUANT else "rtn"


# ---------------------------------------------------------------------------------------------- entry points

def amx_stream(src, calibration, method_bits: int, numa: int, *, max_length: int = 2048,
               num_samples: int | None = None, options: GptqOptions = GptqOptions(),
               fallback_quant: str | None = None, selection: SelectionOptions | None = SelectionOptions(),
               mtp_layers=(), make_stream=None, quantizer=None) -> LayerStream:
    """The GPTQ stream over checkpoint `src` (path or HFSource) with an AmxQuantizer (``stream.quantizer``) and
    the calibration samples (``stream.samples_digest``: resume.samples_digest of them). calibration: a jsonl
    path (ktconvert.gptq.calibration) or a list of 1-D int64 token tensors (file order). mtp_layers: MTP layers
    quantized after the decoder layers (gptq.stream). make_stream: the stream class, called as LayerStream is
    (None: LayerStream, this process; ray_gptq.ray_streams: on Ray, the same results). quantizer: the stream's
    quantizer (None: an AmxQuantizer of method_bits and numa; ``method_quantizer``)."""
    pin_process()                          # before torch computes anything here (gptq.determinism)
    source = src if isinstance(src, HFSource) else HFSource.open(src)
    samples = calibration
    if isinstance(calibration, (str, Path)):
        samples = load_samples(calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                               vocab_size=source.info.config.get("vocab_size"))
    quantizer = quantizer or AmxQuantizer(method_bits, numa, fallback_quant, selection)
    stream = (make_stream or LayerStream)(source, samples, quantizer, options, mtp_layers=mtp_layers)
    stream.samples_digest = samples_digest(samples)
    return stream


def stream_results(stream: LayerStream) -> Iterator[LayerResult]:
    """The stream's remaining MoE (and MTP) layers' LayerResults, in layer order (fallback_quant set)."""
    for result in stream.layers_results():
        result.fallback_quant = stream.quantizer.fallback_quant
        yield result


def gptq_amx_codes(src, calibration, method_bits: int, numa: int, **stream_options) -> Iterator[LayerResult]:
    """GPTQ codes for every MoE layer of checkpoint `src`, in layer order, one layer in memory at a time
    (stream_options: amx_stream's keywords).

    Yields LayerResult with payloads[(expert, proj)] = [(codes int8 [n_t, k_t], d float32 [n_t]) per NUMA part]
    (tile with ktconvert.layouts.tiles.pack_int4 / pack_int8, or write_layer()), tokens (routed calibration
    tokens per expert), fallback / reasons (experts written data-free and why; quantizer name in
    ``result.fallback_quant``) and the held-out errors (``errors``)."""
    yield from stream_results(amx_stream(src, calibration, method_bits, numa, **stream_options))


def selection_counts(result: LayerResult) -> dict:
    """How many experts of the layer took which: {"gptq": n, <data-free quantizer>: n, "because": {reason: n}}
    (reasons other than GPTQ, holdout.REASONS, only those that occur)."""
    because = {r: result.reasons.count(r) for r in REASONS[1:] if r in result.reasons}
    return {"gptq": result.reasons.count(REASONS[0]), result.fallback_quant: len(result.fallback),
            "because": because}


def method_quantizer(method, numa: int, selection: SelectionOptions | None):
    """The quantizer on `method`'s grid: a GroupQuantizer (gptq.groups) where the method declares ``gptq_grid``,
    else an AmxQuantizer of its per-row tiles (``bits``)."""
    if hasattr(method, "gptq_grid"):
        return GroupQuantizer(method, selection=selection)
    return AmxQuantizer(method.bits, numa, None, selection)


def write_layer(writer, method, result: LayerResult) -> None:
    """Tile one layer's codes and hand them to a KtSink LayerWriter: writer.put(proj, e, t, blob, scale); a grouped
    method's (``gptq_grid``) go to its in-place writer as its tensors (groups.write_layer)."""
    if hasattr(method, "gptq_grid"):
        return write_group_layer(writer, method, result)
    for (e, proj), parts in sorted(result.payloads.items()):
        for t, (codes, d) in enumerate(parts):
            method.check_shape(*codes.shape, where=f"layer {result.layer} expert {e} {proj} part {t}")
            writer.put(proj, e, t, method.pack(codes), np.asarray(d, np.float32))


def write_gptq_layers(output, samples: list, progress=None, *, options: GptqOptions = GptqOptions(),
                      selection: SelectionOptions | None = SelectionOptions(), make_stream=None) -> dict:
    """Write every layer of an opened CPU output (cpu.output.CpuOutput, quant "gptq": its options hold method and
    numa; its layers may include MTP layers) from the GPTQ stream on `samples` (1-D int64 token tensors), then
    record the source files' digests in its journal. A resumed output (``output.resume``) restores the stream
    saved with its journal (gptq.resume) and writes only the layers the journal does not record. progress: one
    phase over the layers' source bytes, advanced per layer. make_stream: as amx_stream's. Returns {"tokens"
    {layer: [per expert]}, "fallback" {layer: [experts]}, "fallback_quant", "selection" {layer: selection_counts}}."""
    method, source = output.method, output.source
    if not (hasattr(method, "bits") or hasattr(method, "gptq_grid")):
        gridded = [name for name, m in METHODS.items() if hasattr(m, "bits") or hasattr(m, "gptq_grid")]
        raise InputError("--quant gptq needs a method with a GPTQ grid", expected=" or ".join(gridded),
                         found=method.name)
    sizes = layer_source_bytes(source, output.layers)
    progress = progress or Progress()
    progress.start(sum(sizes.values()), len(output.layers), f"cpu {method.name.upper()} gptq", unit="layers")
    mtp = [layer for layer in output.layers if layer in source.info.mtp_layers]
    stream = amx_stream(source, samples, getattr(method, "bits", 0), output.options.numa, options=options,
                        selection=selection, mtp_layers=mtp, make_stream=make_stream,
                        quantizer=method_quantizer(method, output.options.numa, selection))
    saved, layers = restore_for(output, stream)
    for layer in sorted(layers):
        progress.advance(sizes.get(layer, 0), items=1, detail=f"layer {layer} (saved)")
    for result in stream_results(stream):
        if not output.journal.layer_done(result.layer):
            output.write_layer(result.layer, lambda consumer: write_layer(consumer.writer, method, result))
        layers[result.layer] = {"tokens": result.tokens, "fallback": result.fallback,
                                "selection": selection_counts(result)}
        saved.save(stream, layers)
        progress.advance(sizes.get(result.layer, 0), items=1, detail=f"layer {result.layer}")
    for path in source.files():
        output.journal.finish_source(source.relative_name(path), source_file_entry(path))
    summary = {key: {L: layers[L][key] for L in sorted(layers)} for key in ("tokens", "fallback", "selection")}
    return {**summary, "fallback_quant": stream.quantizer.fallback_quant}


def convert_cpu_gptq(output, progress=None, timings: dict | None = None, *, options: GptqOptions | None = None,
                     selection: SelectionOptions | None = None, max_length: int = 2048,
                     num_samples: int | None = None, make_stream=None) -> ConvertResult:
    """``ktconvert cpu SRC OUT --method amxint4|amxint8 --quant gptq --calibration FILE`` for an unopened CPU
    output (cpu.output.CpuOutput of a validated plan): read the calibration samples (InputError before OUT is
    touched), open OUT, write every layer, finalize (ktconvert.json with quant "gptq" and a "gptq" record: the
    options and, per layer, how many experts took GPTQ / the data-free quantizer and why). options / selection:
    None = from the output's CpuOptions (dampening, min_tokens). An interrupted or failed run continues with
    --resume after its last finished layer (write_gptq_layers) or starts over with --force. Returns the
    ConvertResult (details: tokens per expert, fallback experts, fallback_quant, selection counts). OUT also gets
    expert_activation.pt, the routed-token counts of the calibration (activation.stats.write_gptq_activation),
    recorded in the manifest and its SGLang flags (decoder layers only: the MTP layers' counts are not the main
    model's). make_stream: the GPTQ stream class (amx_stream's; None: this process)."""
    pin_process()                          # before torch computes anything here (gptq.determinism)
    opts = output.options
    options = options or GptqOptions(dampening=opts.dampening)
    selection = selection or SelectionOptions(min_tokens=opts.min_tokens)
    source = output.source
    samples = load_samples(opts.calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                           vocab_size=source.info.config.get("vocab_size"))

    def write(output) -> None:
        summary = write_gptq_layers(output, samples, progress, options=options, selection=selection,
                                    make_stream=make_stream)
        decoder = {L: t for L, t in summary["tokens"].items() if L < output.source.info.n_layers}
        output.expert_activation = write_gptq_activation(output.out_dir, output.source, decoder,
                                                         output.options.calibration, max_length=max_length,
                                                         num_samples=num_samples)
        counts = summary["selection"]
        gptq = sum(c["gptq"] for c in counts.values())
        output.run_notes.append(f"GPTQ written for {gptq} experts, {summary['fallback_quant']} for "
                                f"{sum(len(v) for v in summary['fallback'].values())} (GPTQ not better on held-out "
                                f"calibration tokens, or too few tokens)")
        output.manifest_extra["gptq"] = gptq_record(options, selection, summary)
        output.run_details.update(summary)

    return write_in_layer_order(output, write, timings)


def gptq_record(options: GptqOptions, selection: SelectionOptions | None, summary: dict) -> dict:
    """The "gptq" entry of ktconvert.json: scales, dampening, Hessian inputs, held-out split, and per layer
    {"gptq": n, <data-free quantizer>: n, "because": {...}} (selection_counts)."""
    return {"scales": summary["fallback_quant"], "dampening": options.dampening, "block_size": options.block_size,
            "calibrate_all": options.calibrate_all,
            "holdout_every": selection.holdout_every if selection is not None else 0,
            "min_tokens": selection.min_tokens if selection is not None else 0,
            "layers": {str(L): counts for L, counts in sorted(summary["selection"].items())}}
