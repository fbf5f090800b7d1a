"""Writing outputs from one read of the source: ``write_outputs([CpuOutput, GpuOutput, ...])``.

Every output is opened (OUT prepared and locked, journal started) before the first byte is read; the source is
then read once, front to back, and each decoded matrix goes to every output that still needs its layer
(``runner.run_jobs``: with ``resume`` each output continues from its own journal); each output is finalized (its
manifest last). An output ``resume`` finds complete is left alone. If one output refuses to open, those opened
before it are undone (nothing was written yet) and the error propagates. Each output's bytes equal what it would
be written alone.
"""
from __future__ import annotations

import os
import time

from ktconvert.util import profile
from ktconvert.errors import KtConvertError, OutputError, UsageError
from ktconvert.formats.out_manifest import sglang_args
from ktconvert.util.progress import Progress
from ktconvert.results import ConvertResult
from ktconvert.run.read_loop import JointJournal, run_jobs
from ktconvert.formats.source_identity import check_resumed_source


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


def write_outputs(outputs: list, *, threads: int | None = None, progress=None, timings: dict | None = None,
                  verify_source_hash: bool = False) -> list[ConvertResult]:
    """Write `outputs` (output.Output subclasses sharing one source and one list of layers) in one pass.
    timings: seconds already spent (e.g. planning), completed with open / convert / finalize / total.
    verify_source_hash: see runner.run_jobs."""
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
            _run(todo, threads, progress, verify_source_hash)
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


def _run(outputs: list, threads: int | None, progress, verify_source_hash: bool) -> None:
    source = outputs[0].source
    layers = outputs[0].layers
    journal = JointJournal([o.journal for o in outputs])
    jobs = source.matrix_jobs(layers)
    files = part_files(outputs[0], jobs) if outputs[0].part else None
    check_resumed_source(journal.journals, source, jobs, progress)    # SRC still the files OUT was made from
    for output in outputs:
        finished = sum(output.journal.layer_done(layer) for layer in layers)
        if finished:
            where = f" ({output.out_dir})" if len(outputs) > 1 else ""
            progress.message(f"resuming{where}: {finished} of {len(layers)} layers already done")
    todo = [j for j in jobs if not journal.layer_done(j.layer)]
    progress.start(sum(j.nbytes for j in todo), len(todo), " + ".join(o.label() for o in outputs), unit="matrices")
    run_jobs(jobs, source, outputs, journal, threads or os.cpu_count() or 1, progress, files,
             verify_source_hash=verify_source_hash)


def part_files(output, jobs: list) -> set:
    """The source files a part reads: those holding its layers' experts (`jobs`), and, for the part that writes
    the rest, those holding no MoE layer's experts (so every source file is fingerprinted by some part)."""
    files = {job.file for job in jobs}
    if output.writes_rest:
        layer_files = {job.file for job in output.source.matrix_jobs(output.all_layers)}
        files |= {path for path in output.source.files() if path not in layer_files}
    return files


def refuse_gptq_part(output) -> None:
    """GPTQ runs every layer in order on the previous layers' outputs: a part of it cannot run alone."""
    if output.part:
        raise UsageError("--layers (parts) is not available with --quant gptq",
                         hint="GPTQ needs every layer in order: convert it in one run")


def write_in_layer_order(output, write, timings: dict | None = None) -> ConvertResult:
    """One output whose layers are not produced by the streaming read (GPTQ: each layer needs the previous
    layer's outputs): open it, let ``write(output)`` write and journal every layer, finalize, close. A run that
    fails before its first layer is journalled leaves no OUT (output.discard); a later failure keeps the finished
    layers and its error says that --resume continues and --force starts over."""
    timings = dict(timings or {})
    if not output.open():
        output.close()
        return result_of(output, None, timings)
    try:
        t0 = time.monotonic()
        write(output)
        timings["convert"] = time.monotonic() - t0
        manifest = output.finalize()
    except BaseException as exc:
        if not output.journal.layers:
            output.discard()
        elif isinstance(exc, KtConvertError):
            exc.add_hint(f"{output.out_dir} keeps the layers finished so far: --resume continues, --force starts "
                         f"over")
        raise
    finally:
        output.close()
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    return result_of(output, manifest, timings)


def layer_source_bytes(source, layers) -> dict[int, int]:
    """{layer: bytes of its stored expert matrices in `source`} for `layers`, in their order (the progress of
    writers that go layer by layer)."""
    sizes = dict.fromkeys(layers, 0)
    for job in source.matrix_jobs(layers):
        sizes[job.layer] += job.nbytes
    return sizes


def result_of(output, manifest: dict | None, timings: dict) -> ConvertResult:
    """The ConvertResult of a finalized output (manifest None: it was complete before; its manifest is read)."""
    complete_before = manifest is None
    manifest = output.finished_manifest() if complete_before else manifest
    part = tuple(output.layers) if output.part else ()
    return ConvertResult(out=str(output.out_dir), kind=manifest.get("kind", "cpu"), method=manifest["method"],
                         files=sorted(manifest["files"]), file_count=len(manifest["files"]),
                         bytes=sum(int(f["bytes"]) for f in manifest["files"].values()), flags=dict(manifest["flags"]),
                         sglang_args="" if part else sglang_args(manifest, os.path.abspath(output.out_dir)), part=part,
                         timings={k: round(v, 3) for k, v in timings.items()}, complete_before=complete_before,
                         notes=tuple(output.notes()), details=output.details())
