"""The ``cpu`` output kind: kt-kernel's CPU expert files (options: cpu.options.CpuOptions; plan: cpu.plan;
writer: cpu.output.CpuOutput; verify: cpu.verify). Light: those modules are imported when a classmethod runs.
"""
from __future__ import annotations

import shlex

from ktconvert.cpu.options import CpuOptions
from ktconvert.kinds.base import OutputKind, register


def _impl():
    """(cpu.output, cpu.plan, cpu.verify): the CPU output's writer, planner and checks (they bring numpy)."""
    from ktconvert.cpu import output, plan, verify

    return output, plan, verify


@register
class CpuKind(OutputKind):
    name, label, options, extra = "cpu", "CPU", CpuOptions, None
    help = "Start a CPU (kt-kernel) output in folder OUT; the CPU options after it are its own. Repeatable."

    @classmethod
    def plan(cls, input, options, *, out=None, threads=None):
        return _impl()[1].plan_cpu(input, options, out=out, threads=threads)

    @classmethod
    def output_class(cls) -> type:
        return _impl()[0].CpuOutput

    @classmethod
    def check_writable(cls, plan) -> None:
        plan.refuse_dropped_biases()

    @classmethod
    def render(cls, report: dict) -> str:
        return _impl()[1].render(report)

    @classmethod
    def ram_numa(cls, report: dict) -> int:
        return report["numa"]

    @classmethod
    def launch_lines(cls, sglang_args: str, out: str) -> list[str]:
        return [f"run with {sglang_args}", f"on the serving host: ktconvert check {shlex.quote(out)} -- {sglang_args}"]

    @classmethod
    def verify_structure(cls, out, manifest, folder, *, source=None, experts="4"):
        problems, detail = _impl()[2].check_structure(folder, manifest)
        return None, [("structure", problems, detail)]

    @classmethod
    def numerics(cls, out, manifest, folder, **checks):
        return _impl()[2].check_numerics(out, manifest, folder, **checks)

    @classmethod
    def launch_flags(cls, manifest: dict) -> dict:
        return _impl()[2].launch_flags(manifest)

    @classmethod
    def describe(cls, manifest: dict) -> str:
        return f"{manifest.get('method')} NUMA {manifest.get('numa')}"
