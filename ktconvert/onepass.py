"""Writing outputs from one read of the source: ``write_outputs([CpuOutput, GpuOutput, ...])``.

Every output is opened (OUT prepared and locked, journal started) before the first byte is read; the source is
then read once, front to back, and each decoded matrix goes to every output that still needs its layer
(``runner.run_jobs``); each output is finalized (its manifest last). An output ``resume`` finds complete is left
alone. If one output refuses to open, those opened before it are undone (nothing was written yet) and the error
propagates. Each output's bytes equal what it would be written alone.
"""
from __future__ import annotations

import os
import time

from ktconvert import profile
from ktconvert.errors import OutputError
from ktconvert.formats.out_manifest import load_manifest, sglang_args
from ktconvert.progress import Progress
from ktconvert.results import ConvertResult
from ktconvert.runner import JointJournal, run_jobs


def open_outputs(outputs: list) -> list:
    """open() every output in order; the ones with work to do. On a failure the opened ones are discarded."""
    opened = []
    try:
        for output in outputs:
            if output.open():
                opened.append(output)
            else:
                output.close()
    except BaseException:
        for output in opened:
            output.discard()
        raise
    return opened


def write_outputs(outputs: list, *, threads: int | None = None, progress=None,
                  timings: dict | None = None) -> list[ConvertResult]:
    """Write `outputs` (output.Output subclasses sharing one source and one list of layers) in one pass.
    timings: seconds already spent (e.g. planning), completed with open / convert / finalize / total."""
    progress = progress or Progress()
    timings = dict(timings or {})
    layers = outputs[0].layers
    for other in outputs[1:]:
        if other.layers != layers:
            raise OutputError("outputs of one pass disagree on the MoE layers", expected=str(layers),
                              found=str(other.layers), hint="use the same --include-mtp for both")
    t0 = time.monotonic()
    todo = open_outputs(outputs)
    timings["open"] = time.monotonic() - t0
    try:
        if todo:
            _run(todo, threads, progress)
        timings["convert"] = time.monotonic() - t0 - timings["open"]
        t1 = time.monotonic()
        with profile.span("finalize"):
            manifests = {id(o): o.finalize() for o in todo}
        timings["finalize"] = time.monotonic() - t1
    finally:
        for output in todo:
            output.close()
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    return [result_of(o, manifests.get(id(o)), timings) for o in outputs]


def _run(outputs: list, threads: int | None, progress) -> None:
    source = outputs[0].source
    layers = outputs[0].layers
    journal = JointJournal([o.journal for o in outputs])
    jobs = source.matrix_jobs(layers)
    done = [layer for layer in layers if journal.layer_done(layer)]
    if done:
        progress.message(f"resuming: {len(done)} of {len(layers)} layers already done")
    progress.start(sum(j.nbytes for j in jobs if not journal.layer_done(j.layer)), len(layers) - len(done),
                   " + ".join(o.label() for o in outputs))
    run_jobs(jobs, source, outputs, journal, threads or os.cpu_count() or 1, progress)


def write_in_layer_order(output, write, timings: dict | None = None) -> ConvertResult:
    """One output whose layers are not produced by the streaming read (GPTQ: each layer needs the previous
    layer's outputs): open it, let ``write(output)`` write and journal every layer, finalize, close."""
    timings = dict(timings or {})
    if not output.open():
        output.close()
        return result_of(output, None, timings)
    try:
        t0 = time.monotonic()
        write(output)
        timings["convert"] = time.monotonic() - t0
        manifest = output.finalize()
    finally:
        output.close()
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    return result_of(output, manifest, timings)


def result_of(output, manifest: dict | None, timings: dict) -> ConvertResult:
    """The ConvertResult of a finalized output (manifest None: it was complete before; its manifest is read)."""
    complete_before = manifest is None
    manifest = load_manifest(output.out_dir) if complete_before else manifest
    return ConvertResult(out=str(output.out_dir), kind=manifest.get("kind", "cpu"), method=manifest["method"],
                         files=len(manifest["files"]), bytes=sum(int(f["bytes"]) for f in manifest["files"].values()),
                         flags=dict(manifest["flags"]), sglang_args=sglang_args(manifest, str(output.out_dir)),
                         timings={k: round(v, 3) for k, v in timings.items()}, complete_before=complete_before,
                         notes=tuple(output.notes()), details=output.details())
