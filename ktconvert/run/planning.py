"""`ktconvert plan` of several outputs (the targets of `convert`, ``targets.Target``): each target planned on one
opening of the source, and what the one pass that writes them all needs together.

    planned, combined = plan_targets(input, targets, threads)
    planned  -> [{"name", "kind", "out", "plan": the kind's plan (CpuPlan, GpuPlan, ...)}], in target order
    combined -> {"outputs", "source_files", "source_bytes" (the weight files: read and hashed once),
                 "outputs_bytes", "peak_ram_bytes", "workers", "disk": [{"path", "free_bytes", "need_bytes",
                 "outputs", "ok"}] per filesystem}

The peak RAM of the pass: every decoded expert matrix goes to each output in turn, so one worker's working set
is the source's plus the largest output's (the CPU estimate, cpu.sizes.peak_ram, at the smallest NUMA count an
output splits a matrix into, ``OutputKind.ram_numa``: a CPU target's T, 1 for a whole matrix), not their sum.
"""
from __future__ import annotations

from ktconvert.cpu.plan import gib
from ktconvert.cpu.sizes import free_at, peak_ram
from ktconvert.errors import KtConvertError, UsageError
from ktconvert.kinds import KINDS
from ktconvert.run.targets import Target, check_disk, is_gptq


def plan_targets(input, targets: list[Target], threads: int | None = None) -> tuple[list[dict], dict]:
    """(planned, combined) as in the module docstring, for the opened source `input` (inputs.Input). Raises what
    each plan raises (named after its target), UsageError for a --quant gptq target (written alone) and
    OutputError when the outputs on one filesystem need more than its free space together."""
    for t in targets:
        input.check_output(t.out)
    planned = [{"name": t.name, "kind": t.kind, "out": str(t.out), "plan": plan_target(input, t, threads)}
               for t in targets]
    reports = [entry["plan"].report for entry in planned]
    disk = check_disk([(t.out, report["total_bytes"]) for t, report in zip(targets, reports)], free_at)
    numa = min(KINDS.get(t.kind).ram_numa(report) for t, report in zip(targets, reports))
    source, info = input.source, input.source.info
    ram = peak_ram(source, info.hidden, info.intermediate, numa, threads)
    combined = {"outputs": len(targets), "source_files": len(source.files()), "source_bytes": source.file_bytes(),
                "outputs_bytes": sum(r["total_bytes"] for r in reports), "peak_ram_bytes": ram["peak_ram_bytes"],
                "workers": ram["workers"], "disk": disk}
    return planned, combined


def plan_target(input, target: Target, threads: int | None,
                gptq_hint: str = "plan it with --method / --experts"):
    """The plan of `target` by its kind on the opened source `input` (errors name the target); UsageError with
    `gptq_hint` for a --quant gptq target (written alone, never in a shared pass)."""
    try:
        if is_gptq(target):
            raise UsageError("--quant gptq writes one output at a time", hint=gptq_hint)
        kind = KINDS.get(target.kind)
        return kind.plan(input, kind.options.make(**target.values), out=target.out, threads=threads)
    except KtConvertError as exc:
        raise exc.within(target.name) from None


def render_combined(source: str, planned: list[dict], combined: dict) -> str:
    """The combined figures as text (after each target's own plan)."""
    lines = [f"one pass over {source}: {combined['outputs']} outputs",
             f"  source read once: {combined['source_bytes']} bytes ({gib(combined['source_bytes'])}) in "
             f"{combined['source_files']} files"]
    lines += [f"  {entry['name']}: {entry['plan'].report['total_bytes']} bytes" for entry in planned]
    lines += [f"  outputs together: {combined['outputs_bytes']} bytes ({gib(combined['outputs_bytes'])})",
              f"  peak RAM (estimate): {gib(combined['peak_ram_bytes'])} with {combined['workers']} workers "
              f"(each decoded matrix goes to the outputs in turn)"]
    lines += [f"  [{'ok' if d['ok'] else 'FAIL'}] disk at {d['path']}: need {d['need_bytes']} bytes for "
              f"{len(d['outputs'])} output(s), free {d['free_bytes']}" for d in combined["disk"]]
    return "\n".join(lines)
