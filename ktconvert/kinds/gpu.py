"""The ``gpu`` output kind: the SGLang-KT GPU checkpoint (options: gpu.options.GpuOptions; plan: gpu.plan;
writer: gpu.output.GpuOutput; verify: gpu.verify, which needs the [gpu] extra). Light: those modules are imported
when a classmethod runs.
"""
from __future__ import annotations

from ktconvert.gpu.options import GpuOptions
from ktconvert.kinds.base import OutputKind, register
from ktconvert.util.extras import require


def _impl():
    """(gpu.output, gpu.plan, gpu.verify): the GPU checkpoint's writer, planner and checks (they bring numpy)."""
    from ktconvert.gpu import output, plan, verify

    return output, plan, verify


@register
class GpuKind(OutputKind):
    name, label, options, extra = "gpu", "GPU", GpuOptions, "gpu"
    help = "Start a GPU (SGLang --model) output in folder OUT; the GPU options after it are its own. Repeatable."

    @classmethod
    def plan(cls, input, options, *, out=None, threads=None):
        return _impl()[1].plan_gpu(input, options)

    @classmethod
    def output_class(cls) -> type:
        return _impl()[0].GpuOutput

    @classmethod
    def render(cls, report: dict) -> str:
        return _impl()[1].render_gpu(report)

    @classmethod
    def launch_lines(cls, sglang_args: str, out: str) -> list[str]:
        return [f"run SGLang with {sglang_args}"]

    @classmethod
    def verify_structure(cls, out, manifest, folder, *, source=None, experts="4"):
        require("gpu", "verify of a GPU checkpoint")
        report = _impl()[2].check_gpu_checkpoint(out, source=source, experts=experts, folder=folder)
        return report, [(check["name"], check["problems"], check["detail"]) for check in report["checks"]]

    @classmethod
    def launch_flags(cls, manifest: dict) -> dict:
        return _impl()[0].GpuOutput.flags

    @classmethod
    def describe(cls, manifest: dict) -> str:
        return "a GPU checkpoint"
