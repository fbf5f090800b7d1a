"""``ktconvert gpu``: the SGLang-KT GPU checkpoint of a source, streamed one MoE layer at a time.

    plan (validate everything, no weights read: gpu.plan) -> open OUT (lock, journal)
    -> rtn: one read of the source (onepass), every routed expert matrix RTN-quantized by compressed-tensors
       gptq: layers in increasing order through the GPTQ hook (each layer needs the previous layer's outputs)
    -> non-MoE shard, index, config.json, copies, ktconvert.json (last)

GPTQ hook: ``ktconvert.gpu.gptq.quantize_layer_gptq(source, layer, state, bits=, group_size=, emit=,
calibration=)`` with ``state`` None for the first layer; it calls ``emit(expert, proj, tensors)`` once per routed
expert matrix (tensors as ``experts.quantize_expert_rtn`` returns them) and returns the state for the next layer;
``ktconvert.gpu.gptq.write_gptq_layers`` runs it over the output's layers (resumable). config.json then says
``actorder: "static"``.
"""
from __future__ import annotations

import time

from ktconvert.activation.stats import write_gptq_activation
from ktconvert.errors import KtConvertError
from ktconvert.util.extras import require
from ktconvert.gpu.output import GpuOutput
from ktconvert.gpu.options import GpuOptions
from ktconvert.gptq.calibration import load_samples
from ktconvert.kinds import KINDS
from ktconvert.run.inputs import open_input
from ktconvert.run.local import target_output
from ktconvert.run.outputs import layer_source_bytes, refuse_gptq_part, write_in_layer_order, write_outputs
from ktconvert.util.progress import Progress
from ktconvert.results import ConvertResult


def convert_gpu(src, out, options: GpuOptions | None = None, *, threads: int | None = None, resume: bool = False,
                force: bool = False, progress=None, layers=None, verify_source_hash: bool = False,
                gptq_stream=None, **option_values) -> ConvertResult:
    """``ktconvert.api.convert_gpu`` in this process (executor "local"; its docstring gives the arguments, the
    errors and the result): plan, open `out`, then one read of the source, or GPTQ's layer loop. gptq_stream:
    as cpu.convert.convert_cpu's."""
    t0 = time.monotonic()
    options = options or GpuOptions.make(**option_values)
    require("gpu", "ktconvert gpu")
    if options.quant == "gptq":
        gptq_hook()
    kind = KINDS.get("gpu")
    plan = kind.plan(open_input(src), options)
    output = target_output(kind, out, plan, resume=resume, force=force, layers=layers)
    timings = {"plan": time.monotonic() - t0}
    if options.quant == "gptq":
        refuse_gptq_part(output)
        samples = load_samples(options.calibration, output.source.model_dir(), max_length=options.max_length,
                               num_samples=options.num_samples, vocab_size=output.source.info.config.get("vocab_size"))
        make_stream = gptq_stream(plan.input) if gptq_stream is not None else None
        return write_in_layer_order(output, lambda o: _run_gptq(o, samples, progress or Progress(), make_stream),
                                    timings)
    return write_outputs([output], threads=threads, progress=progress, timings=timings,
                         verify_source_hash=verify_source_hash)[0]


def gptq_hook():
    """ktconvert.gpu.gptq.write_gptq_layers (imported on use: it brings torch and llmcompressor), or a clear
    error where it cannot be imported."""
    try:
        from ktconvert.gpu.gptq import write_gptq_layers
    except ImportError:
        raise KtConvertError("--quant gptq is not available in this installation of ktconvert",
                             expected="ktconvert.gpu.gptq.write_gptq_layers", found="not importable",
                             hint="use --quant rtn") from None
    return write_gptq_layers


def _run_gptq(output: GpuOutput, samples: list, progress, make_stream=None) -> None:
    """Layers in order through the GPTQ hook's loop on `samples` (1-D int64 token tensors; not file order: each
    layer needs the previous layer's outputs; ``ktconvert.gpu.gptq.write_gptq_layers``, resumable); then
    OUT/expert_activation.pt from its routed-token counts of the decoder layers (set as the output's
    expert_activation). make_stream: the GPTQ stream class (None: this process's)."""
    write_gptq_layers = gptq_hook()
    opts, source = output.options, output.source
    sizes = layer_source_bytes(source, output.layers)
    progress.start(sum(sizes.values()), len(output.layers), f"gpu {opts.experts.upper()} gptq", unit="layers")
    state = write_gptq_layers(output, samples, progress, sizes, make_stream=make_stream)
    fingerprint = source.fingerprint()
    for name, entry in fingerprint["files"].items():
        output.journal.finish_source(name, entry)
    decoder = {L: tokens for L, tokens in state.tokens.items() if L < source.info.n_layers}
    if decoder:
        output.expert_activation = write_gptq_activation(output.out_dir, source, decoder, opts.calibration)
