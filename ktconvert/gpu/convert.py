"""``ktconvert convert``: CPU (kt-kernel) and GPU (SGLang-KT) outputs in one pass over the source.

Every source file is read once, front to back; each decoded expert matrix goes to both outputs
(``pipeline.convert_cpu(..., extra_outputs=[GpuOutput])``). Each output gets its own journal and ``ktconvert.json``;
their bytes equal what ``ktconvert cpu`` and ``ktconvert gpu`` write separately.
"""
from __future__ import annotations

from pathlib import Path

from ktconvert.errors import OutputError


def _complete(out: Path, resume: bool) -> bool:
    from ktconvert.formats.out_manifest import JOURNAL_NAME, MANIFEST_NAME

    return resume and (out / MANIFEST_NAME).exists() and not (out / JOURNAL_NAME).exists()


def convert_both(src, cpu_out, gpu_out, *, method: str, numa: int = 1, layout: str = "safetensors",
                 quant: str = "rtn", group_size: int | None = None, experts: str = "w4a16", gpu_group_size: int = 128,
                 linears: str = "fp8", include_mtp: bool = False, allow_drop_bias: bool = False,
                 threads: int | None = None, resume: bool = False, force: bool = False,
                 progress=None, expert_orientation: str | None = None) -> tuple[str, str]:
    """Write the CPU output `cpu_out` and the GPU output `gpu_out` of `src` reading it once (RTN experts).
    Returns (CPU summary, GPU summary)."""
    from ktconvert.gpu.writer import GpuOptions, convert_gpu, open_gpu_output, summary
    from ktconvert.cpu.convert import convert_cpu, prepare_output, resolve_source

    cpu_out, gpu_out = Path(cpu_out), Path(gpu_out)
    if cpu_out.resolve() == gpu_out.resolve():
        raise OutputError("--cpu and --gpu must be different directories", file=str(cpu_out))
    cpu_kw = dict(method=method, numa=numa, layout=layout, quant=quant, group_size=group_size, threads=threads,
                  include_mtp=include_mtp, allow_drop_bias=allow_drop_bias, progress=progress,
                  expert_orientation=expert_orientation)
    gpu_kw = dict(experts=experts, group_size=gpu_group_size, linears=linears, include_mtp=include_mtp,
                  threads=threads, progress=progress, expert_orientation=expert_orientation)
    if _complete(cpu_out, resume):
        return f"{cpu_out}: already complete", convert_gpu(src, gpu_out, resume=resume, force=force, **gpu_kw)
    if _complete(gpu_out, resume):
        return convert_cpu(src, cpu_out, resume=resume, force=force, **cpu_kw), f"{gpu_out}: already complete"
    src_path, src_extra = resolve_source(str(src))
    options = GpuOptions(experts.lower(), gpu_group_size, "rtn", linears, include_mtp,
                         expert_orientation=expert_orientation)
    prepare_output(gpu_out, src_path, resume, force)
    _, gpu_output, _ = open_gpu_output(src_path, gpu_out, options, resume, src_extra)
    try:
        cpu_summary = convert_cpu(src, cpu_out, resume=resume, force=force, extra_outputs=[gpu_output], **cpu_kw)
    except BaseException:
        _remove_if_empty(gpu_out)
        raise
    from ktconvert.formats.out_manifest import load_manifest

    return cpu_summary, summary(gpu_out, load_manifest(gpu_out))


def _remove_if_empty(out: Path) -> None:
    """Leave no stray GPU folder behind when the CPU side refused to start (journal only, nothing written)."""
    from ktconvert.formats.out_manifest import JOURNAL_NAME

    entries = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if entries <= {JOURNAL_NAME}:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
