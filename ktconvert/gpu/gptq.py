"""``ktconvert gpu --quant gptq``: the GPU writer's GPTQ hook over ktconvert.gptq.loop.LayerStream.

The writer (ktconvert/gpu/convert.py ``_run_gptq``) calls, for its MoE layers in increasing order::

    state = quantize_layer_gptq(source, layer, state, bits=bits, group_size=group_size, emit=emit,
                                calibration=FILE_OR_SAMPLES, options=GptqOptions(...))

``state`` is None on the first call and the returned ``GptqState`` afterwards (it holds the meta skeleton and the
hidden states carried from layer to layer; layers in between — dense ones — are run for propagation only).
``emit(expert, proj, tensors)`` is called once per routed expert matrix with the dict
``ktconvert.gpu.experts.quantize_expert_rtn`` returns (``weight_packed`` int32, ``weight_scale`` BF16 bits,
``weight_shape`` int64): GPTQ bytes equal llmcompressor ``oneshot`` GPTQModifier (W4A16/W8A16, group
`group_size`, actorder static, weight observer "mse" — each group's scale searched by llmcompressor's MSE
observer, ``gpu.config.GPTQ_OBSERVER``) on the same calibration data, except where oneshot is wrong (causal mask; experts
no token reaches in routed-only mode get RTN instead of all-zero weights). MTP / next-n layers asked for at
``start`` (``mtp_layers``) are calibrated after the decoder layers on the hidden states the last one produces
(gptq.stream); an MTP layer not asked for is RTN-quantized (``state.rtn_layers``).

``write_gptq_layers(output, samples, progress)`` is the GPU writer's loop over its layers, resumable like the CPU one
(gptq.resume: the stream saved with the journal).

``calibration`` is a jsonl path (ktconvert.gptq.calibration) or a list of 1-D int64 token tensors; it is
required on the first call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ktconvert.errors import InputError
from ktconvert.gptq.calibration import load_samples
from ktconvert.gpu.experts import quantize_expert_rtn
from ktconvert.gpu.config import GPTQ_OBSERVER
from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream
from ktconvert.gptq.resume import restore_for, samples_digest


@dataclass
class GptqState:
    """The stream plus what it found: tokens[layer] = routed calibration tokens per expert; fallback[layer] =
    experts RTN-quantized for want of tokens; rtn_layers = MTP layers the stream was not asked to run."""

    stream: LayerStream
    quantizer: GpuQuantizer
    tokens: dict = field(default_factory=dict)
    fallback: dict = field(default_factory=dict)
    rtn_layers: list = field(default_factory=list)


def start(source, bits: int, group_size: int, calibration, options: GptqOptions | None = None,
          max_length: int = 2048, num_samples: int | None = None, mtp_layers=(), make_stream=None) -> GptqState:
    """Open the stream: skeleton, calibration samples (tokenized with the checkpoint's tokenizer; their digest
    in ``state.stream.samples_digest``), the MTP layers it runs after the decoder layers. make_stream: the
    stream class, called as LayerStream is (None: LayerStream; ray_gptq.ray_streams: on Ray, the same results)."""
    if calibration is None:
        raise InputError("--quant gptq needs calibration data", expected="--calibration FILE (jsonl of "
                         '{"text": ...} or {"input_ids": [...]})', found="none")
    samples = calibration
    if not isinstance(calibration, list):
        samples = load_samples(calibration, source.model_dir(), max_length=max_length, num_samples=num_samples,
                               vocab_size=source.info.config.get("vocab_size"))
    quantizer = GpuQuantizer(bits, group_size, "static", GPTQ_OBSERVER)
    stream = (make_stream or LayerStream)(source, samples, quantizer, options or GptqOptions(), mtp_layers=mtp_layers)
    stream.samples_digest = samples_digest(samples)
    return GptqState(stream, quantizer)


def quantize_layer_gptq(source, layer: int, state: GptqState | None, *, bits: int, group_size: int, emit,
                        calibration=None, options: GptqOptions | None = None, max_length: int = 2048,
                        num_samples: int | None = None) -> GptqState:
    """GPTQ the routed experts of MoE layer `layer` (layers in increasing order); emit every expert matrix."""
    if state is None:
        state = start(source, bits, group_size, calibration, options, max_length, num_samples)
    stream = state.stream
    if layer >= len(stream.layers) and layer not in stream.mtp:
        _emit_rtn(source, layer, state, emit)
        return state
    result = None
    while stream.done < layer:
        result = stream.run_layer(stream.done + 1)
    if result is None or result.layer != layer:
        raise InputError(f"layer {layer} is not a MoE layer of the model transformers builds", found=str(layer))
    for (e, proj), tensors in sorted(result.payloads.items()):
        emit(e, proj, tensors)
    state.tokens[layer], state.fallback[layer] = result.tokens, result.fallback
    return state


def _emit_rtn(source, layer: int, state: GptqState, emit) -> None:
    for e in range(source.info.n_experts):
        ew = source.read_expert(layer, e)
        for proj in ("gate", "up", "down"):
            emit(e, proj, quantize_expert_rtn(getattr(ew, proj), state.quantizer.bits, state.quantizer.group_size,
                                              where=f"layer {layer} expert {e} {proj}"))
    state.rtn_layers.append(layer)


def write_gptq_layers(output, samples: list, progress, sizes: dict | None = None, make_stream=None) -> GptqState:
    """Every layer of an opened GPU output (gpu.output.GpuOutput, quant "gptq") in order through
    quantize_layer_gptq on `samples` (1-D int64 token tensors), MTP layers included where the output has them; a
    resumed output restores the stream saved with its journal and writes only the layers the journal does not
    record. progress advances per layer by sizes[layer] (its source bytes; 1 without sizes). make_stream: as
    start's. Returns the state (tokens per layer)."""
    opts, source = output.options, output.source
    mtp = [layer for layer in output.layers if layer in source.info.mtp_layers]
    state = start(source, opts.bits, opts.group_size, samples, mtp_layers=mtp, make_stream=make_stream)
    saved, summaries = restore_for(output, state.stream)
    state.tokens.update({L: s["tokens"] for L, s in summaries.items()})
    state.fallback.update({L: s["fallback"] for L, s in summaries.items()})
    for layer in output.layers:
        if layer not in summaries:
            _layer(output, layer, state)
            summaries[layer] = {"tokens": state.tokens[layer], "fallback": state.fallback[layer]}
            saved.save(state.stream, summaries)
        progress.advance((sizes or {}).get(layer, 1), items=1, detail=f"layer {layer}")
    return state


def _layer(output, layer: int, state: GptqState) -> None:
    """GPTQ layer `layer`; written and journalled unless the journal already records it (a resumed run
    recomputing the layers after its saved stream)."""
    opts = output.options

    def run(emit) -> None:
        quantize_layer_gptq(output.source, layer, state, bits=opts.bits, group_size=opts.group_size, emit=emit)

    if output.journal.layer_done(layer):
        run(lambda e, proj, tensors: None)
    else:
        output.write_layer(layer, lambda writer: run(writer.put_tensors))
