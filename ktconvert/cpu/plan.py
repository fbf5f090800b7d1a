"""`ktconvert plan` and the first step of every CPU conversion: everything checked before any weight is read.

    options = CpuOptions.make(method="amxint4", numa=2)          # cpu.options: one frozen set, validated
    plan = plan_cpu(open_input(src), options, out="OUT")         # CpuPlan: holds the opened source
    plan.report -> {method, kt_method, numa, layout, layers, experts, hidden, intermediate, files [{path, bytes}],
                    total_bytes, peak_ram_bytes, disk_free_bytes, checks, notes, ...}; render(plan.report) -> text

plan_cpu raises on every problem: a NUMA count that cannot work (listing the ones that do), a group size or
layout the method does not have, missing or misshapen expert tensors, too little disk at OUT. The method class
(``ktconvert.methods``) supplies every rule and size.
"""
from __future__ import annotations

from pathlib import Path

from ktconvert.cpu import sizes
from ktconvert.cpu.options import CpuOptions
from ktconvert.util.envinfo import cpu_flags
from ktconvert.errors import InputError, OutputError
from ktconvert.formats.out_manifest import sglang_args
from ktconvert.run.inputs import Input, open_input
from ktconvert.methods.base import CpuMethod, check
from ktconvert.quant.imatrix import IMATRIX_NAME
from ktconvert.run.options import Plan


class CpuPlan(Plan):
    """A validated CPU conversion: input (inputs.Input: the opened source), options, method (configured class),
    layers (MoE layers + MTP layers when included), report (the JSON-ready figures; plan[key] reads them)."""

    def __init__(self, input: Input, options: CpuOptions, method: type[CpuMethod], layers: list[int],
                 report: dict):
        self.input, self.options, self.method, self.layers, self.report = input, options, method, layers, report

    def refuse_dropped_biases(self) -> None:
        """kt-kernel's CPU formats carry no bias: InputError for non-zero expert biases unless allow_drop_bias
        (reads the bias tensors only)."""
        if self.options.allow_drop_bias:
            return
        nonzero = self.input.source.nonzero_expert_biases(self.layers)
        if nonzero:
            raise InputError(f"{len(nonzero)} expert bias tensors are non-zero and kt-kernel's "
                             f"{self.method.kt_method} files carry no bias", tensor=nonzero[0],
                             hint="pass --allow-drop-bias to convert anyway (outputs will differ from the source)")

    def journal_options(self) -> dict:
        """What a resumed run must have been started with."""
        return {**self.options.journalled(), "method": self.method.name, "layers": self.layers,
                "source_config_sha256": self.report["source_config_sha256"], "source": self.input.hub}


def plan_cpu(src, options: CpuOptions, out=None, threads: int | None = None) -> CpuPlan:
    """Plan converting the routed experts of `src` (a path, hf:// / ms:// source or an opened inputs.Input) with
    `options`. Raises ShapeError (bad T: lists the valid ones; bad expert shapes), InputError (missing or
    unsupported tensors), OutputError (less free disk at `out` than the output needs), UsageError (an option the
    method does not have). Reads headers, config and nothing else."""
    input = open_input(src)
    source, method = input.source, options.method_class()
    info = source.info
    H, I, E, T = info.hidden, info.intermediate, info.n_experts, options.numa
    checks = method.check_numa(H, I, T)
    source.validate(include_mtp=options.include_mtp)
    if options.include_dense:
        source.dense_tensors()                # InputError where the source has none to give
    layers = list(source.all_layers(options.include_mtp))
    checks.append(check("every expert tensor present with config shapes", True, f"{len(layers)} layers x {E} experts"))
    report = {
        "source": input.spec, "family": info.family, "model_type": info.model_type,
        "input_format": source.input_format, "method": method.name, "kt_method": method.kt_method, "numa": T,
        "layout": options.layout, "group_size": method.group_size, "layers": layers,
        "mtp_layers": [layer for layer in layers if layer >= info.n_layers], "experts": E, "hidden": H,
        "intermediate": I, "expert_bytes": method.expert_bytes(H, I, T),
        "source_config_sha256": source.config_sha256(), "notes": [], "checks": checks, "flags": method.flags(T),
    }
    sizes.output_files(report, source, layers, method, options)
    report.update(sizes.peak_ram(source, H, I, T, threads))
    if out:
        input.check_output(out)
    _add_disk(report, source, out)
    report["notes"] += _notes(source, method, info, options, report)
    return CpuPlan(input, options, method, layers, report)


def _notes(source, method, info, options: CpuOptions, report: dict) -> list[str]:
    notes = []
    if source.has_expert_biases():
        notes.append(f"the experts have biases: kt-kernel's {method.kt_method} files carry no bias "
                     "(`cpu` refuses non-zero biases unless --allow-drop-bias)")
    if info.mtp_layers and not options.include_mtp and source.present_mtp_layers():
        notes.append(f"MTP layers {list(source.present_mtp_layers())} not converted (--include-mtp)")
    if options.calibration is not None and options.quant != "gptq":     # llamafile's computed importance matrix
        notes.append(f"the importance matrix is computed first from --calibration {Path(options.calibration).name} "
                     f"(a float32 forward of the source through every layer in order) and kept as OUT/{IMATRIX_NAME}")
    carried = report["carried_over"] = None if options.quant == "gptq" else method.carry_over(source, report["layers"])
    if carried:
        notes.append(f"the routed experts are already {method.kt_method}'s tensors ({carried}): carried over "
                     "byte for byte, not requantized")
    return notes + method.runtime_notes(cpu_flags())


def _add_disk(report: dict, source, out) -> None:
    probe, free = sizes.free_at(Path(out) if out else source.model_dir())
    report["disk_path"], report["disk_free_bytes"] = probe, free
    enough = free >= report["total_bytes"]
    report["checks"].append(check("free disk >= output bytes" + ("" if out else " (source filesystem)"), enough,
                                  f"free {free}, need {report['total_bytes']}"))
    if out and not enough:
        raise OutputError("not enough free disk space for the output", file=str(out),
                          expected=f">= {report['total_bytes']} bytes free", found=f"{free} bytes at {probe}")


# ---------------------------------------------------------------- render

def gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB" if n >= 1 << 26 else f"{n / (1 << 20):.2f} MiB"


def render(result: dict) -> str:
    """The plan report as text."""
    lines = [f"plan: {result['source']} ({result['family']}, {result['input_format']}) -> "
             f"{result['kt_method']} T={result['numa']} layout={result['layout']}",
             f"layers: {len(result['layers'])} ({', '.join(map(str, result['layers'][:12]))}"
             f"{' ...' if len(result['layers']) > 12 else ''}), {result['experts']} experts, "
             f"H={result['hidden']}, I={result['intermediate']}",
             f"per expert: {result['expert_bytes']} bytes"]
    files = result.get("files", [])
    shown = files if len(files) <= 12 else files[:5] + [{"path": "...", "bytes": 0}] + files[-6:]
    lines.append(f"files: {result.get('file_count', len(files))}")
    for f in shown:
        lines.append(f"  {f['path']:<48} {'' if f['path'] == '...' else f['bytes']}"
                     f"{' (approx)' if f.get('approx') else ''}")
    if "summary" in result:
        lines += [f"  {k}: {v}" for k, v in result["summary"].items()]
    if "flags" in result:
        lines.append("run with: " + sglang_args({"flags": result["flags"]}, "OUT"))
    lines += [f"total: {result['total_bytes']} bytes ({gib(result['total_bytes'])})",
              f"peak RAM (estimate): {gib(result['peak_ram_bytes'])} with {result['workers']} workers",
              f"disk free at {result['disk_path']}: {gib(result['disk_free_bytes'])}",
              "checks:"]
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in result["checks"]]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
