"""``ktconvert cpu``: the routed experts of a checkpoint as kt-kernel CPU files, streaming and resumable.

    plan (validate everything, no weights read: cpu.plan) -> open OUT (output.Output: lock, journal)
    -> one read of the source, every expert matrix written by the method (onepass / runner)
    -> index, config copies, manifest ``ktconvert.json`` (written last: its presence marks a complete output)

``--quant gptq`` runs the calibrated path (ktconvert.gptq.cpu) layer by layer instead of the streaming read.
"""
from __future__ import annotations

import time

from ktconvert.cpu.output import CpuOutput
from ktconvert.cpu.plan import CpuOptions, plan_cpu
from ktconvert.extras import require
from ktconvert.gptq import cpu as gptq_cpu
from ktconvert.inputs import open_input
from ktconvert.onepass import refuse_gptq_part, write_outputs
from ktconvert.parts import select_layers
from ktconvert.progress import Progress
from ktconvert.results import ConvertResult


def convert_cpu(src, out, options: CpuOptions | None = None, *, threads: int | None = None, resume: bool = False,
                force: bool = False, progress=None, layers=None, verify_source_hash: bool = False,
                **option_values) -> ConvertResult:
    """Convert the routed experts of checkpoint `src` (a folder, a .safetensors / .gguf file, hf://ORG/NAME[@REV]
    or ms://ORG/NAME) for kt-kernel into the folder `out`.

    options: a CpuOptions, or its fields as keywords (method, numa, layout, quant, group_size, include_dense,
    include_mtp, allow_drop_bias, calibration; see CpuOptions). threads: worker threads (default: all cores; bytes
    never depend on it). resume: continue an interrupted run in `out` (a complete one is left as is); force:
    empty `out` first. progress: a ktconvert.progress.Progress (start / advance / message are called).
    layers: a MoE layer range ("A-B" or (A, B), inclusive): `out` becomes a part holding those layers' files and
    ktconvert-part.json (ktconvert.parts; `ktconvert merge` joins the parts).
    verify_source_hash: hash also the source files whose sha256 a Hugging Face cache blob name gives (else taken
    from the name) and raise InputError where they differ.
    Raises UsageError (exit 2), MissingExtraError (2: quant "gptq" without the [gpu] extra), InputError (3),
    OutputError (1, e.g. `out` not empty or locked by another process); nothing is written before every check
    passed. Returns the ConvertResult.
    """
    t0 = time.monotonic()
    options = options or CpuOptions.make(**option_values)
    if options.quant == "gptq":
        require("gpu", "--quant gptq")
    plan = plan_cpu(open_input(src), options, out=out, threads=threads)
    plan.refuse_dropped_biases()
    output = CpuOutput(out, plan, resume=resume, force=force, part=select_layers(plan.layers, layers))
    timings = {"plan": time.monotonic() - t0}
    if options.quant == "gptq":
        refuse_gptq_part(output)
        return gptq_cpu.convert_cpu_gptq(output, progress or Progress(), timings)
    return write_outputs([output], threads=threads, progress=progress, timings=timings,
                         verify_source_hash=verify_source_hash)[0]
