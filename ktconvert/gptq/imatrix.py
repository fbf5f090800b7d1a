"""``ktconvert cpu SRC OUT --method llamafile --calibration FILE``: the importance matrix llama.cpp's
``llama-imatrix`` would compute for the routed experts, computed from the calibration tokens, written into OUT and
used to quantize the experts exactly as ``--imatrix FILE`` (llama-quantize's path, ``quant.imatrix``) does.

What is accumulated (llama.cpp tools/imatrix/imatrix.cpp, ``collect_imatrix`` for a MUL_MAT_ID tensor): per
expert e of ``blk.L.ffn_{gate,up,down}_exps.weight``, over the calibration tokens routed to e (its top-k choice),
``in_sum2[e, j]`` the sum of the squared input activation of column j, ``in_sum[e, j]`` the sum of the activation
(llama-imatrix's statistics; llama-quantize does not read it) and ``counts[e]`` the number of such tokens. gate and
up read the MoE block's input hidden state of the token (one accumulator serves both), down reads the expert's
``act(gate) * up``. The values llama-quantize then uses are ``in_sum2 / counts`` (1 where no token reached the
expert: quant.imatrix).

The forward is the calibration stream's (``gptq.stream.DecoderStream``: transformers' own layer code, one
decoder layer's weights at a time, each layer's output the next one's input), hooked at every expert's gate/up
and down Linear. Like llama-imatrix, which runs the unquantized model, it propagates through the **float source**
(float32 weights and activations, no quantization: unlike ``--quant gptq``, whose stream propagates through the
quantized layers); sums are accumulated in float64 and stored as float32. Like the GPTQ stream it runs on CUDA
when torch sees a GPU (the sums then differ from a CPU run's in float rounding), else on CPU at one thread.

The file (``IMATRIX_NAME`` in OUT) is llama-imatrix's GGUF: keys ``general.type`` = "imatrix",
``imatrix.datasets`` (the calibration file's name), ``imatrix.chunk_count`` (samples), ``imatrix.chunk_size``
(--max-length); per tensor ``NAME.in_sum2`` [n_expert, n_per_row], ``NAME.counts`` [n_expert, 1] and
``NAME.in_sum``, F32, through gguf-py's GGUFWriter (header first, then each layer's tensors as the stream produces
them), created with ``fileio.NewFile`` (temporary name, renamed when complete). Memory: the stream's (one layer's
weights in float32, the calibration activations T x H per sample) plus one layer's sums, E x (2H + I) float64
values twice; nothing of the earlier layers is kept. MTP layers (``--include-mtp``) are calibrated as the GPTQ
stream calibrates them: on the last decoder layer's output hidden states. It is named without the ``.gguf``
suffix: kt-kernel merges every ``*.gguf`` of the folder into the model, and verify holds a LLAMAFILE folder's
``*.gguf`` to the sink's plan. ``llama-quantize --imatrix`` and ``ktconvert cpu --imatrix`` read it (both tell
GGUF by its magic).

Then the experts are written by the ordinary streaming read with that file as the method's importance matrix
(``quant.imatrix.load``): the same bytes ``--imatrix OUT/calibration.imatrix`` writes. Resume: the journal records
the calibration file's sha256 (cpu.options), so a resume with other calibration is refused; a resumed run reuses
the finished file and computes it again only when it is missing. The calibration forward runs every layer in
order, so neither ``--layers`` parts nor ``--executor ray`` run it (refused).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, Keys
from gguf.gguf_writer import WriterState

from ktconvert.activation.counts import file_sha256
from ktconvert.errors import UsageError
from ktconvert.formats.fileio import NewFile, record_for
from ktconvert.formats.gguf_shard import PROJ_TENSORS
from ktconvert.gptq.calibration import load_samples
from ktconvert.gptq.skeleton import routed_experts
from ktconvert.gptq.stream import DecoderStream
from ktconvert.quant.imatrix import IMATRIX_NAME
from ktconvert.run.outputs import _run, write_in_layer_order

HIDDEN_STATES = "float32 forward of the source (no quantization), as llama-imatrix runs the unquantized model"


def refuse_part(output) -> None:
    """The calibration forward runs every layer in order on the previous layers' outputs: no part alone."""
    if output.part:
        raise UsageError("--layers (parts) is not available with --method llamafile --calibration",
                         hint="the importance matrix's calibration forward needs every layer in order: convert in "
                              "one run")


class LayerSums:
    """One MoE layer's accumulators: per expert, for the gate/up input ("in", [E, H]) and the down input ("down",
    [E, I]), the sum of squares and the sum of the activations (float64), and the routed-token count per expert."""

    def __init__(self, n_experts: int, hidden: int, inter: int):
        self.sum2 = {"in": np.zeros((n_experts, hidden)), "down": np.zeros((n_experts, inter))}
        self.sum = {"in": np.zeros((n_experts, hidden)), "down": np.zeros((n_experts, inter))}
        self.counts = np.zeros(n_experts, np.int64)

    def add(self, which: str, expert: int, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to("cpu").double()
        self.sum2[which][expert] += (x * x).sum(0).numpy()
        self.sum[which][expert] += x.sum(0).numpy()
        if which == "in":
            self.counts[expert] += x.shape[0]

    def tensors(self, layer: int) -> list[tuple[str, np.ndarray]]:
        """(GGUF name, float32 array) of the layer's imatrix tensors, in the file's order (tensor_plan)."""
        out = []
        for proj, stem in PROJ_TENSORS.items():
            which = "down" if proj == "down" else "in"
            name = f"blk.{layer}.{stem}.weight"
            out += [(name + ".in_sum2", self.sum2[which].astype(np.float32)),
                    (name + ".counts", self.counts.astype(np.float32)[:, None]),
                    (name + ".in_sum", self.sum[which].astype(np.float32))]
        return out


def tensor_plan(layers, n_experts: int, hidden: int, inter: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, numpy shape) of every tensor of the file, in order: per layer, per projection, in_sum2, counts,
    in_sum (LayerSums.tensors)."""
    out = []
    for layer in layers:
        for proj, stem in PROJ_TENSORS.items():
            n = inter if proj == "down" else hidden
            name = f"blk.{layer}.{stem}.weight"
            out += [(name + ".in_sum2", (n_experts, n)), (name + ".counts", (n_experts, 1)),
                    (name + ".in_sum", (n_experts, n))]
    return out


class ImatrixStream(DecoderStream):
    """The calibration stream in float32 with every MoE layer's expert inputs summed on the way (process_layer
    returns a LayerSums for layers with routed experts, None for the others); the layer's float output becomes the
    next layer's input."""

    def __init__(self, src, samples: list, *, device: str | None = None, mtp_layers=()):
        import torch

        super().__init__(src, samples, dtype=torch.float32, device=device, mtp_layers=mtp_layers)

    def process_layer(self, L: int, layer):
        if not self.has_experts(L):
            self.propagate(L, layer)
            return None
        experts = routed_experts(layer, L, self.info.n_experts)
        sums = LayerSums(self.info.n_experts, self.info.hidden, self.info.intermediate)
        handles = []
        for e in range(experts.num_experts):      # routed-only forward: each expert sees its own tokens
            expert = experts[e]
            first = getattr(expert, "gate_proj", None) or expert.up_proj
            handles.append(first.register_forward_pre_hook(lambda _m, args, e=e: sums.add("in", e, args[0])))
            handles.append(expert.down_proj.register_forward_pre_hook(lambda _m, args, e=e: sums.add("down", e,
                                                                                                      args[0])))
        try:
            self.propagate(L, layer)
        finally:
            for handle in handles:
                handle.remove()
        return sums


def write_imatrix(path: Path, stream: ImatrixStream, layers: list[int], dataset: str, chunk_size: int,
                  progress=None) -> None:
    """Run `stream` over every layer and write llama-imatrix's GGUF of `layers` (its MoE layers, in order) to
    `path`: header and tensor infos first, each layer's tensors as soon as the stream has run it."""
    info = stream.info
    writer = GGUFWriter(None, arch="")
    writer.kv_data[0].pop(Keys.General.ARCHITECTURE, None)    # llama-imatrix's file has no architecture
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [dataset])
    writer.add_uint32("imatrix.chunk_count", len(stream.hidden))
    writer.add_uint32("imatrix.chunk_size", int(chunk_size))
    for name, shape in tensor_plan(layers, info.n_experts, info.hidden, info.intermediate):
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0] * shape[1])
    new = NewFile(path)
    try:
        with os.fdopen(new.fd, "wb", closefd=False) as fh:
            writer.fout, writer.state = [fh], WriterState.EMPTY     # the NewFile's temporary, not a path of its own
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            pending = list(layers)
            for L, sums in stream.run_all():
                if progress is not None:
                    progress.advance(0, items=1, detail=f"imatrix layer {L}")
                if sums is None or L not in pending:
                    continue
                if L != pending[0]:
                    raise ValueError(f"imatrix layers out of order: {L} before {pending[0]}")
                pending.pop(0)
                for _, tensor in sums.tensors(L):
                    writer.write_tensor_data(np.ascontiguousarray(tensor))
            if pending:
                raise ValueError(f"the calibration stream ran no experts for layers {pending}")
            fh.flush()
        writer.fout = None
        new.commit()
    except BaseException:
        writer.fout = None
        new.discard()
        raise


def convert_llamafile_calibrated(output, progress, timings: dict | None = None, *, threads: int | None = None,
                                 verify_source_hash: bool = False, max_length: int = 2048,
                                 num_samples: int | None = None, device: str | None = None):
    """``--method llamafile --calibration FILE`` for an unopened CPU output (cpu.output.CpuOutput of a validated
    plan, options checked by cpu.options): read the calibration samples (InputError before OUT is touched), open
    OUT, compute and write ``IMATRIX_NAME`` (kept from an interrupted run on --resume), then write every layer by
    the streaming read with it as the method's importance matrix; finalize (the file in the manifest's files, an
    "imatrix_calibration" record: calibration sha256, samples, tokens, hidden states). Returns the ConvertResult."""
    refuse_part(output)
    opts, source = output.options, output.source
    samples = load_samples(opts.calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                           vocab_size=source.info.config.get("vocab_size"))
    mtp = [layer for layer in output.layers if layer in source.info.mtp_layers]

    def write(output) -> None:
        path = output.out_dir / IMATRIX_NAME
        t0 = time.monotonic()
        if not (output.resume and path.is_file()):
            stream = ImatrixStream(source, samples, device=device, mtp_layers=mtp)
            progress.start(0, stream.n_total, "imatrix (calibration forward)", unit="layers")
            write_imatrix(path, stream, output.layers, Path(opts.calibration).name, max_length, progress)
            del stream
        output.run_details["imatrix_seconds"] = round(time.monotonic() - t0, 3)
        output.method = output.method.with_imatrix(path)
        output.method.importance.check(output.method.importance_entries(output.layers, source.info))
        output.side_records.append(record_for(output.out_dir, IMATRIX_NAME))
        output.manifest_extra["imatrix_calibration"] = {
            "file": IMATRIX_NAME, "calibration_sha256": file_sha256(opts.calibration),
            "samples": len(samples), "tokens": int(sum(len(s) for s in samples)), "max_length": max_length,
            "hidden_states": HIDDEN_STATES}
        output.run_notes.append(f"importance matrix computed from {len(samples)} calibration samples into "
                                f"{IMATRIX_NAME} (llama-imatrix's GGUF: llama-quantize --imatrix reads it)")
        _run([output], threads, progress, verify_source_hash)

    return write_in_layer_order(output, write, timings)
