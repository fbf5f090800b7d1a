"""``ktconvert cpu``: the routed experts of a checkpoint as kt-kernel CPU files, streaming and resumable.

    plan (validate everything, no weights read: cpu.plan) -> open OUT (output.Output: lock, journal)
    -> one read of the source, every expert matrix written by the method (onepass / runner)
    -> index, config copies, manifest ``ktconvert.json`` (written last: its presence marks a complete output)

``--quant gptq`` runs the calibrated path (ktconvert.gptq.cpu) layer by layer instead of the streaming read.
"""
from __future__ import annotations

import time

from ktconvert.cpu.options import CpuOptions
from ktconvert.util.extras import require
from ktconvert.gptq import cpu as gptq_cpu
from ktconvert.gptq.imatrix import convert_llamafile_calibrated
from ktconvert.kinds import KINDS
from ktconvert.run.inputs import open_input
from ktconvert.run.local import target_output
from ktconvert.run.outputs import refuse_gptq_part, write_outputs
from ktconvert.util.progress import Progress
from ktconvert.results import ConvertResult


def convert_cpu(src, out, options: CpuOptions | None = None, *, threads: int | None = None, resume: bool = False,
                force: bool = False, progress=None, layers=None, verify_source_hash: bool = False,
                gptq_stream=None, **option_values) -> ConvertResult:
    """``ktconvert.api.convert_cpu`` in this process (executor "local"; its docstring gives the arguments, the
    errors and the result): plan, open `out`, then one read of the source, or GPTQ's layer loop. gptq_stream:
    function(inputs.Input) -> the GPTQ stream class (None: this process's; ray_gptq.ray_streams: on Ray)."""
    t0 = time.monotonic()
    options = options or CpuOptions.make(**option_values)
    if options.quant == "gptq":
        require("gpu", "--quant gptq")
    kind = KINDS.get("cpu")
    plan = kind.plan(open_input(src), options, out=out, threads=threads)
    output = target_output(kind, out, plan, resume=resume, force=force, layers=layers)
    timings = {"plan": time.monotonic() - t0}
    if options.quant == "gptq":
        refuse_gptq_part(output)
        make_stream = gptq_stream(plan.input) if gptq_stream is not None else None
        return gptq_cpu.convert_cpu_gptq(output, progress or Progress(), timings, make_stream=make_stream,
                                         max_length=options.max_length, num_samples=options.num_samples)
    if options.calibration is not None:       # --method llamafile: its importance matrix from the calibration
        require("gpu", "--method llamafile --calibration")
        return convert_llamafile_calibrated(output, progress or Progress(), timings, threads=threads,
                                            verify_source_hash=verify_source_hash, max_length=options.max_length,
                                            num_samples=options.num_samples)
    return write_outputs([output], threads=threads, progress=progress, timings=timings,
                         verify_source_hash=verify_source_hash)[0]
