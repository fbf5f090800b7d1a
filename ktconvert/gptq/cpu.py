"""GPTQ for kt-kernel's AMXINT4 / AMXINT8 CPU files (``ktconvert cpu --quant gptq``).

The AMX formats keep one fp32 scale per row of each NUMA part (kt-format.md §2.0-2.2), so GPTQ runs with scales
that map 1:1 onto them:

* gate / up [I, H]: one scale per row (group = the whole row); a NUMA part is a block of rows.
* down [H, I]: group size I/T, so each row has T scales — exactly one per NUMA part (part t = columns t*I/T..).

Scales come from kt-kernel's own per-row rule on the (part of the) row (``ktconvert.quant.amx_rows``): INT4 stored
d = amax/112 and the step 16·d = amax/7, codes -7..7 (never -8: nibble 0x8 breaks kt-kernel's forward,
kt-format.md §2.1); INT8 d = amax·fp32(1/127), codes -127..127. llmcompressor's ``quantize_weight`` runs with
those scales (actorder "weight", so every column uses its own part's scale); GPTQ's error feedback can push a
value one step past the range, which is clamped (counted in ``AmxQuantizer.clamped``). Rows whose d flushes to 0
get codes 0, as kt-kernel stores them.

Experts no calibration token reaches (routed-only calibration) are quantized data-free with the ``mse`` row
quantizer when ``ktconvert.quant.mse`` provides one, else kt-kernel's RTN (``AmxQuantizer.fallback_quant``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from ktconvert.activation.stats import write_gptq_activation
from ktconvert.errors import InputError, ShapeError, UsageError
from ktconvert.formats.fileio import hash_file
from ktconvert.formats.hf_source import HFSource
from ktconvert.gptq.loop import GptqOptions, LayerResult, LayerStream, gptq_module
from ktconvert.gptq.calibration import load_samples
from ktconvert.layouts.naming import PROJS
from ktconvert.layouts.numa import numa_slices
from ktconvert.methods import METHODS
from ktconvert.quant import amx_rows
from ktconvert.onepass import write_in_layer_order
from ktconvert.quant.row_quant import ROW_QUANT
from ktconvert.results import ConvertResult


def _row_quantizer(bits: int):
    return amx_rows.quantize_int4_rows if bits == 4 else amx_rows.quantize_int8_rows


def part_scales(w_bf16: np.ndarray, bits: int, numa: int, proj: str, where: str = "") -> np.ndarray:
    """kt-kernel's stored scales d, float32 [n, groups]: gate/up one per row ([I, 1]); down one per row and
    NUMA part ([H, T]). w_bf16: uint16 BF16 bits [n, k]."""
    quantize_rows = _row_quantizer(bits)
    if proj != "down":
        return quantize_rows(w_bf16, where=where)[1][:, None]
    cols = numa_slices(w_bf16.shape[1], numa)
    return np.stack([quantize_rows(np.ascontiguousarray(w_bf16[:, sl]), where=where)[1] for sl in cols], axis=1)


def split_parts(codes: np.ndarray, d: np.ndarray, numa: int, proj: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(codes int8 [n, k], d float32 [n, groups]) -> per NUMA part (codes [n_t, k_t], d [n_t]) as kt-kernel
    splits the matrix (gate/up rows, down input columns)."""
    if proj != "down":
        return [(np.ascontiguousarray(codes[sl]), np.ascontiguousarray(d[sl, 0]))
                for sl in numa_slices(codes.shape[0], numa)]
    return [(np.ascontiguousarray(codes[:, sl]), np.ascontiguousarray(d[:, t]))
            for t, sl in enumerate(numa_slices(codes.shape[1], numa))]


class AmxQuantizer:
    """LayerStream quantizer for the AMX formats; payload per proj: list over NUMA parts of
    (codes int8 [n_t, k_t] in -7..7 / -127..127, d float32 [n_t]) with w ~= codes * (16 if INT4 else 1) * d."""

    def __init__(self, bits: int, numa: int, fallback_quant: str | None = None):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        self.bits, self.numa = bits, numa
        self.limit = 7 if bits == 4 else 127
        self.step_factor = 16.0 if bits == 4 else 1.0
        self.fallback_quant = fallback_quant or default_fallback()
        self.clamped = 0          # codes GPTQ pushed one step past the range

    def _args(self, group_size: int):
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(num_bits=self.bits, type="int", symmetric=True, strategy="group",
                                group_size=group_size, actorder="weight")

    def quantize(self, expert, gate_up, down, options: GptqOptions, where: str) -> dict:
        out = {}
        for proj, (H, n) in (("gate", gate_up), ("up", gate_up), ("down", down)):
            out[proj] = self._quantize_proj(getattr(expert, proj + "_proj"), proj, H, n, options, f"{where} {proj}")
        return out

    def _quantize_proj(self, module, proj: str, H, n, options: GptqOptions, where: str) -> list:
        import torch

        w = _bf16_bits(module.weight)
        rows, k = w.shape
        if proj == "down" and k % self.numa:
            raise ShapeError("expert intermediate size does not split into NUMA parts", tensor=where,
                             expected=f"I % {self.numa} == 0", found=f"I = {k}")
        d = part_scales(w, self.bits, self.numa, proj, where)               # [n, groups]
        step = d.astype(np.float32) * np.float32(self.step_factor)
        gptq_step = np.where(step > 0, step, np.float32(1.0)).astype(np.float32)
        device = module.weight.device
        qparams = {"scale": torch.from_numpy(gptq_step).to(device),
                   "zero_point": torch.zeros(gptq_step.shape, dtype=torch.int8, device=device),
                   "global_scale": None}
        group = k // d.shape[1]
        quantized = gptq_module(module, self._args(group), H, n, options, qparams=qparams)[0][0]
        codes = self._codes(quantized.to("cpu", torch.float32).numpy(), gptq_step, step, group)
        module.weight.data = torch.from_numpy(codes.astype(np.float32) * np.repeat(step, group, axis=1)
                                              ).to(module.weight.dtype).to(device)
        return split_parts(codes, d, self.numa, proj)

    def _codes(self, qdq: np.ndarray, gptq_step: np.ndarray, step: np.ndarray, group: int) -> np.ndarray:
        """GPTQ's dequantized float32 values -> integer codes on the part grids, clamped to +-limit."""
        q = np.rint(qdq / np.repeat(gptq_step, group, axis=1))
        self.clamped += int(np.count_nonzero(np.abs(q) > self.limit))
        q = np.clip(q, -self.limit, self.limit)
        q[np.repeat(step, group, axis=1) == 0] = 0
        return q.astype(np.int8)

    def fallback(self, expert, where: str) -> dict:
        """Data-free per-row quantization of every NUMA part (``fallback_quant``: "mse" or "rtn")."""
        quantize_rows = ROW_QUANT.get(self.fallback_quant)
        out = {}
        for proj in PROJS:
            w = _bf16_bits(getattr(expert, proj + "_proj").weight)
            rows = proj != "down"
            parts = [w[sl] if rows else w[:, sl] for sl in numa_slices(w.shape[0] if rows else w.shape[1],
                                                                        self.numa)]
            out[proj] = [tuple(quantize_rows(np.ascontiguousarray(p), self.bits, f"{where} {proj}"))
                         for p in parts]
        return out


def default_fallback() -> str:
    """"mse" when the ``--quant mse`` row quantizer is registered, else "rtn"."""
    return "mse" if "mse" in ROW_QUANT else "rtn"


def _bf16_bits(weight) -> np.ndarray:
    import torch

    return weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


# ---------------------------------------------------------------------------------------------- entry points

def gptq_amx_codes(src, calibration, method_bits: int, numa: int, *, max_length: int = 2048,
                   num_samples: int | None = None, options: GptqOptions = GptqOptions(),
                   fallback_quant: str | None = None) -> Iterator[LayerResult]:
    """GPTQ codes for every MoE layer of checkpoint `src`, in layer order, one layer in memory at a time.

    calibration: a jsonl path (ktconvert.gptq.calibration) or a list of 1-D int64 token tensors.
    Yields LayerResult with payloads[(expert, proj)] = [(codes int8 [n_t, k_t], d float32 [n_t]) per NUMA part]
    (tile with ktconvert.layouts.tiles.pack_int4 / pack_int8, or write_layer()), tokens (routed calibration
    tokens per expert) and fallback (experts quantized data-free; quantizer name in
    ``result.fallback_quant``)."""
    source = src if isinstance(src, HFSource) else HFSource.open(src)
    samples = calibration
    if isinstance(calibration, (str, Path)):
        samples = load_samples(calibration, source.root, max_length=max_length, num_samples=num_samples,
                               vocab_size=source.info.config.get("vocab_size"))
    quantizer = AmxQuantizer(method_bits, numa, fallback_quant)
    stream = LayerStream(source, samples, quantizer, options)
    for result in stream.layers_results():
        result.fallback_quant = quantizer.fallback_quant
        result.clamped = quantizer.clamped
        yield result


def write_layer(writer, method, result: LayerResult) -> None:
    """Tile one layer's codes and hand them to a KtSink LayerWriter: writer.put(proj, e, t, blob, scale)."""
    for (e, proj), parts in sorted(result.payloads.items()):
        for t, (codes, d) in enumerate(parts):
            method.check_shape(*codes.shape, where=f"layer {result.layer} expert {e} {proj} part {t}")
            writer.put(proj, e, t, method.pack(codes), np.asarray(d, np.float32))


def write_gptq_layers(output, progress=None, *, max_length: int = 2048, num_samples: int | None = None,
                      options: GptqOptions = GptqOptions()) -> dict:
    """Write every layer of an opened CPU output (cpu.output.CpuOutput, quant "gptq": its options hold method,
    numa and calibration) from gptq_amx_codes, then record the source files' digests in its journal. Returns
    {"tokens" {layer: [per expert]}, "fallback" {layer: [experts]}, "fallback_quant", "clamped"}."""
    method, source = output.method, output.source
    if not hasattr(method, "bits"):
        tiled = [name for name, m in METHODS.items() if hasattr(m, "bits")]
        raise InputError("--quant gptq needs a method with per-row tiles", expected=" or ".join(tiled),
                         found=method.name)
    summary = {"tokens": {}, "fallback": {}, "fallback_quant": None, "clamped": 0}
    for result in gptq_amx_codes(source, output.options.calibration, method.bits, output.options.numa,
                                 max_length=max_length, num_samples=num_samples, options=options):
        consumer = output.begin_layer(result.layer)
        try:
            write_layer(consumer.writer, method, result)
            output.layer_finished(result.layer, consumer.finish())
        except BaseException:
            consumer.abort()
            raise
        summary["tokens"][result.layer] = result.tokens
        summary["fallback"][result.layer] = result.fallback
        summary["fallback_quant"], summary["clamped"] = result.fallback_quant, result.clamped
        if progress is not None:
            progress.advance(0, items=1, detail=f"layer {result.layer}")
    for path in source.files():
        size, sha256, _ = hash_file(path)
        output.journal.finish_source(source.relative_name(path), {"bytes": size, "sha256": sha256})
    return summary


def convert_cpu_gptq(output, progress=None, timings: dict | None = None, *, options: GptqOptions = GptqOptions(),
                     max_length: int = 2048, num_samples: int | None = None) -> ConvertResult:
    """``ktconvert cpu SRC OUT --method amxint4|amxint8 --quant gptq --calibration FILE`` for an unopened CPU
    output (cpu.output.CpuOutput of a validated plan): open OUT, write every layer, finalize (ktconvert.json with
    quant "gptq"). No resume of a partial run. Returns the ConvertResult (details: tokens per expert, fallback
    experts, fallback_quant, clamped codes). OUT also gets expert_activation.pt, the routed-token counts of the
    calibration (activation.stats.write_gptq_activation), recorded in the manifest and its SGLang flags."""
    if output.resume:
        raise UsageError("not available with --quant gptq", found="--resume")

    def write(output) -> None:
        summary = write_gptq_layers(output, progress, max_length=max_length, num_samples=num_samples,
                                    options=options)
        output.expert_activation = write_gptq_activation(output.out_dir, output.source, summary["tokens"],
                                                         output.options.calibration, max_length=max_length,
                                                         num_samples=num_samples)
        fallback = sum(len(v) for v in summary["fallback"].values())
        output.run_notes.append(f"GPTQ: {fallback} experts without calibration tokens used "
                                f"{summary['fallback_quant']}, {summary['clamped']} codes clamped")
        output.run_details.update(summary)

    return write_in_layer_order(output, write, timings)
