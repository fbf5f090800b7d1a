"""The `ktconvert` command line. Thin: every command imports its implementation inside the function, so
`ktconvert --help` loads click and nothing else. Only this module prints results and exits."""
from __future__ import annotations

import json
import os
import sys

import click

from ktconvert.errors import EXIT_INTERRUPTED, KtConvertError
from ktconvert.extras import require

CPU_METHODS = ["amxint4", "amxint8", "bf16", "rawint4", "fp8"]


def _given(**options) -> dict:
    """The options given on the command line (None: not given, the API's default applies)."""
    return {k: v for k, v in options.items() if v is not None}


def _emit(result: dict, as_json: bool, render) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        click.echo(render(result))


class _Group(click.Group):
    """Turns library errors into one line on stderr and the documented exit code (also under CliRunner)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KtConvertError as exc:
            if os.environ.get("KTCONVERT_DEBUG"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="ktconvert")
def cli() -> None:
    """Convert Mixture-of-Experts checkpoints for KTransformers (kt-kernel CPU experts, SGLang-KT GPU weights).

    \b
    Typical flow:
      ktconvert inspect MODEL                 what the checkpoint is (reads headers only)
      ktconvert plan MODEL --method amxint4 --numa 2
      ktconvert cpu MODEL OUT --method amxint4 --numa 2
      ktconvert verify OUT --source MODEL     how far the converted experts are from the source

    Exit codes: 0 ok, 1 error, 2 usage, 3 bad input, 4 verification failed, 5 remote failure, 130 interrupted.
    Set KTCONVERT_DEBUG=1 for tracebacks.
    """


@cli.command()
@click.argument("src", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(src: str, as_json: bool) -> None:
    """Describe checkpoint SRC without reading weights: family, layers, experts, dims, dtypes, bytes per component."""
    from ktconvert.inspect import inspect as run, render

    _emit(run(src), as_json, render)


@cli.command()
@click.argument("src", type=click.Path(exists=True))
@click.option("--method", type=click.Choice(CPU_METHODS, case_sensitive=False), default=None,
              help="kt-kernel method of the CPU output to plan.")
@click.option("--numa", type=int, default=1, show_default=True,
              help="NUMA parts T (= SGLang --kt-threadpool-count). Gate/up split by rows, down by input columns.")
@click.option("--layout", type=click.Choice(["safetensors", "kt"]), default="safetensors", show_default=True)
@click.option("--group-size", type=int, default=None, help="Group size for --method rawint4 (32, 64 or 128; default 128).")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers' experts.")
@click.option("--gpu", "gpu_experts", type=click.Choice(["w4a16", "w8a16"]), default=None,
              help="Also plan the GPU checkpoint with these experts (`ktconvert gpu`).")
@click.option("--linears", type=click.Choice(["fp8", "bf16", "keep"]), default="fp8", show_default=True,
              help="GPU linears, with --gpu.")
@click.option("--gpu-experts-ratio", "gpu_ratio", type=float, default=None,
              help="Which experts SGLang-KT puts on the GPU with --kt-gpu-experts-ratio R, and their VRAM.")
@click.option("--gpu-experts", "gpu_count", type=int, default=None,
              help="The same with --kt-num-gpu-experts N (per MoE layer).")
@click.option("--expert-stats", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Activation counts (ktconvert expert-stats): frequency placement; without: SGLang's uniform.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.argument("out", required=False, type=click.Path())
def plan(src, method, numa, layout, group_size, include_mtp, gpu_experts, linears, gpu_ratio, gpu_count,
         expert_stats, as_json, out) -> None:
    """What a conversion of SRC would write: files, bytes, peak RAM, disk, and the alignment checks — for the
    CPU output (--method) and/or the GPU checkpoint (--gpu: sizes per component, VRAM per GPU expert), and which
    experts SGLang-KT would put on the GPU (--gpu-experts-ratio / --gpu-experts, with --expert-stats FILE.pt).

    No weights are read. A NUMA count that cannot work fails here and lists the ones that would.
    """
    placing = gpu_ratio is not None or gpu_count is not None
    if method is None and gpu_experts is None and not placing:
        raise click.UsageError("give --method (CPU output), --gpu (GPU checkpoint), --gpu-experts-ratio / "
                               "--gpu-experts (GPU expert placement), or several")
    if expert_stats and not placing:
        raise click.UsageError("--expert-stats needs --gpu-experts-ratio R or --gpu-experts N")
    from ktconvert.cpu.plan import render
    from ktconvert.gpu.plan import render_gpu

    results, renders = {}, {"cpu": render, "gpu": render_gpu}
    if method is not None or gpu_experts is not None:
        from ktconvert import api

        cpu = None if method is None else dict(method=method, numa=numa, layout=layout, group_size=group_size,
                                               include_mtp=include_mtp)
        gpu = None if gpu_experts is None else dict(experts=gpu_experts, group_size=group_size or 128,
                                                    linears=linears, include_mtp=include_mtp)
        result = api.plan(src, cpu, gpu, out=out)
        results = {k: v for k, v in result.to_dict().items() if k != "source" and v is not None}
    if placing:
        from ktconvert.activation.placement import plan_placement, render_placement

        results["placement"], renders["placement"] = plan_placement(
            src, ratio=gpu_ratio, per_layer=gpu_count, stats=expert_stats, gpu_experts=gpu_experts or "w4a16",
            group_size=group_size or 128), render_placement
    if as_json:
        click.echo(json.dumps(results if len(results) > 1 else next(iter(results.values())), indent=2, sort_keys=True))
    else:
        click.echo("\n\n".join(renders[k](results[k]) for k in results))


@cli.command("tiny-model")
@click.argument("out", type=click.Path())
@click.option("--arch", required=True, help="Family or model_type (ktconvert families lists them).")
@click.option("--layers", type=int, default=None, help="Decoder layers (default: family's tiny default).")
@click.option("--experts", type=int, default=None, help="Routed experts per MoE layer.")
@click.option("--hidden", type=int, default=None, help="Hidden size H.")
@click.option("--intermediate", type=int, default=None, help="Expert intermediate size I.")
@click.option("--dtype", default="bf16", show_default=True, help="bf16, fp16, fp32, fp8 (block), ct-int4, mxfp4.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite a non-empty OUT.")
def tiny_model(out, arch, layers, experts, hidden, intermediate, dtype, seed, force) -> None:
    """Write a small seeded random checkpoint of family ARCH with the real hub layout, names and config.json.

    Weights are heavy-tailed like trained checkpoints. Defaults satisfy kt-kernel's alignment for T=1 and T=2.
    """
    from ktconvert.testing.tiny import make_tiny_model

    path = make_tiny_model(out, arch=arch, layers=layers, experts=experts, hidden=hidden,
                           intermediate=intermediate, dtype=dtype, seed=seed, force=force)
    click.echo(f"wrote {path}")


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@click.option("--method", type=click.Choice(CPU_METHODS, case_sensitive=False), required=True,
              help="amxint4/amxint8: kt-kernel AMX tiles; bf16/rawint4/fp8: kt-kernel's in-place native formats.")
@click.option("--numa", type=int, default=1, show_default=True,
              help="NUMA parts T; must equal SGLang's --kt-threadpool-count at run time.")
@click.option("--layout", type=click.Choice(["safetensors", "kt"]), default="safetensors", show_default=True,
              help="safetensors: one merged shard per MoE layer; kt: the _layer_L/_numa_t/*.kt tree.")
@click.option("--quant", type=click.Choice(["rtn", "mse", "gptq"]), default="rtn", show_default=True,
              help="rtn: byte-identical to kt-kernel's converter; mse: each row's scale searched for the least "
                   "error (same files, kt-kernel runs them unchanged); gptq: calibrated, needs --calibration.")
@click.option("--group-size", type=int, default=None, help="Group size for --method rawint4 (32, 64 or 128; default 128).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For --quant gptq: JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--dampening", type=float, help="For --quant gptq: Hessian dampening, relative (default 0.1).")
@click.option("--min-tokens", type=int, help="For --quant gptq: routed tokens an expert needs for GPTQ (default 64).")
@click.option("--threads", type=int, default=None, help="Worker threads (default: all cores). Bytes never depend on it.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion in OUT.")
@click.option("--force", is_flag=True, help="Delete an existing OUT and start over.")
@click.option("--include-dense", is_flag=True, help="Also write non-expert tensors (blk.-renamed) into OUT.")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers' experts.")
@click.option("--allow-drop-bias", is_flag=True, help="Convert even though non-zero expert biases are dropped.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.option("--json-progress", is_flag=True, help="Progress as JSON lines on stderr.")
def cpu(src, out, method, numa, layout, quant, group_size, calibration, dampening, min_tokens, threads, resume,
        force, include_dense, include_mtp, allow_drop_bias, quiet, json_progress) -> None:
    """Convert the routed experts of SRC into kt-kernel CPU expert files in OUT (streaming, resumable)."""
    if quant == "gptq":
        require("gpu", "--quant gptq")
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.progress import make_progress

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = convert_cpu(src, out, method=method, numa=numa, layout=layout, quant=quant,
                             group_size=group_size, threads=threads, resume=resume, force=force,
                             include_dense=include_dense, include_mtp=include_mtp,
                             allow_drop_bias=allow_drop_bias, calibration=calibration, progress=progress,
                             **_given(dampening=dampening, min_tokens=min_tokens))
    click.echo(result.summary())


@cli.command()
@click.argument("out")
@click.option("--source", type=click.Path(exists=True), help="Compare with the source weights.")
@click.option("--hashes", is_flag=True, help="Re-hash every file and tensor against ktconvert.json.")
@click.option("--tokens", type=int, default=8, show_default=True, help="Random activations per check.")
@click.option("--layers", default=None, help="Comma-separated layer indices (default: sample).")
@click.option("--experts", default="4", show_default=True, help="'all' or how many experts per layer.")
@click.option("--threshold", type=float, default=None, help="Max relative L2 error vs source (default per method).")
@click.option("--remote", default=None, is_flag=False, flag_value="", help="Compare with a hub repo's file hashes.")
@click.option("--hub", type=click.Choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None)
@click.option("--endpoint", default=None, help="Hub endpoint URL.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), help="Numerics on these tokens' hidden states.")
@click.option("--compare", type=click.Path(exists=True, file_okay=False), help="With --calibration: OUT2 side by side.")
@click.option("--json", "as_json", is_flag=True)
def verify(out, source, hashes, tokens, layers, experts, threshold, remote, hub, revision, endpoint, calibration,
           compare, as_json) -> None:
    """Check a converted output OUT: structure, hashes, numerics (native kernels) and error against the source."""
    if calibration is not None:
        require("gpu", "verify --calibration")
    from ktconvert.verify.run import render, verify as run

    result = run(out, source=source, hashes=hashes, tokens=tokens, layers=layers, experts=experts,
                 threshold=threshold, remote=remote, hub=hub, revision=revision, endpoint=endpoint,
                 calibration=calibration, compare=compare)
    _emit(result, as_json, render)
    if not result.get("ok", False):
        sys.exit(4)


@cli.command()
@click.argument("workdir", type=click.Path(), default="ktconvert-demo")
@click.option("--arch", default="qwen3_moe", show_default=True, help="Family of the generated tiny model.")
@click.option("--method", type=click.Choice(["amxint4", "amxint8"]), default="amxint4", show_default=True)
@click.option("--numa", type=int, default=2, show_default=True)
def demo(workdir, arch, method, numa) -> None:
    """The main job on an embedded example: generate a tiny ARCH model in WORKDIR/model, convert it to
    WORKDIR/out, and verify the output against the model (hashes and numerics)."""
    from pathlib import Path

    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.progress import make_progress
    from ktconvert.testing.tiny import make_tiny_model
    from ktconvert.verify.run import render, verify as run_verify

    root = Path(workdir)
    model = make_tiny_model(root / "model", arch=arch, force=True)
    click.echo(f"tiny model: {model}")
    with make_progress() as progress:
        click.echo(convert_cpu(model, root / "out", method=method, numa=numa, force=True, progress=progress).summary())
    result = run_verify(str(root / "out"), source=str(model), hashes=True)
    click.echo(render(result))
    if not result.get("ok", False):
        sys.exit(4)


@cli.command()
def env() -> None:
    """Versions, CPU features and the native implementation in use."""
    from ktconvert.envinfo import env_info

    click.echo(json.dumps(env_info(), indent=2, sort_keys=True))


@cli.command()
def families() -> None:
    """List the architecture families (manifests) and the config model_type values they cover."""
    from ktconvert.architecture import load_manifests

    for name, man in sorted(load_manifests().items()):
        click.echo(f"{name:14s} {', '.join(man.model_types)}")

def _progress_options(fn):
    fn = click.option("--json-progress", is_flag=True, help="Progress as JSON lines on stderr.")(fn)
    return click.option("--quiet", is_flag=True, help="No progress output.")(fn)


@cli.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("repo")
@click.option("--hub", type=click.Choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None, help="Branch to upload to (default: the hub's main branch).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--endpoint", default=None, help="Hub endpoint URL (default: HF_ENDPOINT / MODELSCOPE_ENDPOINT).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@_progress_options
def publish(out, repo, hub, revision, private, endpoint, as_json, quiet, json_progress) -> None:
    """Upload output folder OUT to hub repo REPO, then check the remote hashes.

    OUT is first re-hashed against its ktconvert.json (a damaged folder is refused). The upload is resumable: run the
    same command again after an interruption and only what the hub lacks is sent. A README.md model card states the
    kt-kernel / SGLang flags. Token: HF_TOKEN / MODELSCOPE_API_TOKEN (or a stored login); never printed.
    """
    from ktconvert.ops.hub import publish as run, render_remote
    from ktconvert.progress import make_progress

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = run(out, repo, hub=hub, revision=revision, private=private, endpoint=endpoint, progress=progress)
    _emit(result, as_json, lambda r: render_remote(r) + f"\n{r['url']}")


@cli.command()
@click.argument("jobs", type=click.Path(exists=True, dir_okay=False))
@click.option("--keep-going", is_flag=True, help="Run the remaining jobs after one fails.")
@click.option("--dry-run", is_flag=True, help="Print every job's plan; read no weights.")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False), default=None,
              help="Write the per-job summary JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
@_progress_options
def batch(jobs, keep_going, dry_run, summary_path, as_json, quiet, json_progress) -> None:
    """Run the conversion / bundle / publish jobs of JOBS (TOML, see examples/jobs.toml) in order, resumably.

    Exits non-zero if any job failed (with the first failed job's exit code).
    """
    from ktconvert.ops import batch as mod
    from ktconvert.progress import make_progress

    job_list = mod.load_jobs(jobs)
    if dry_run:
        plans = mod.plan_jobs(job_list)
        click.echo(json.dumps(plans, indent=2, sort_keys=True) if as_json else mod.render_plans(plans))
        return
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        summary = mod.run_jobs(job_list, keep_going=keep_going, progress=progress)
    if summary_path:
        with open(summary_path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    _emit(summary, as_json, mod.render_summary)
    if not summary["ok"]:
        sys.exit(summary["exit_code"])


@cli.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--level", type=int, default=3, show_default=True, help="zstd level (1-22).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@_progress_options
def bundle(out, dest, level, as_json, quiet, json_progress) -> None:
    """Pack output folder OUT into one deterministic zstd tar DEST (.tar.zst), ktconvert.json first."""
    from ktconvert.ops.bundle import bundle as run
    from ktconvert.progress import make_progress

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = run(out, dest, level=level, progress=progress)
    _emit(result, as_json, lambda r: f"wrote {r['path']}: {r['files']} files, {r['bytes_in']} -> {r['bytes_out']} "
                                     f"bytes (ratio {r['ratio']:.3f})")


@cli.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@_progress_options
def unbundle(src, dest, as_json, quiet, json_progress) -> None:
    """Restore bundle SRC into new folder DEST, verifying every file (nothing is left behind on failure)."""
    from ktconvert.ops.bundle import unbundle as run
    from ktconvert.progress import make_progress

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = run(src, dest, progress=progress)
    _emit(result, as_json, lambda r: f"restored {r['checked']} files + ktconvert.json into {r['dest']}")


@cli.command("hub-server")
@click.option("--port", type=int, default=8765, show_default=True)
@click.option("--root", type=click.Path(file_okay=False), required=True, help="Folder holding the repos.")
def hub_server(port, root) -> None:
    """Run a local stand-in for the HF Hub and ModelScope on 127.0.0.1 (for trying publish / hub sources).

    \b
    HF:         HF_ENDPOINT=http://127.0.0.1:PORT HF_TOKEN=x ktconvert publish OUT me/repo
    ModelScope: ktconvert publish OUT me/repo --hub modelscope --endpoint http://127.0.0.1:PORT
    """
    from ktconvert.testing.hubserver import HubServer

    server = HubServer(root, port)
    click.echo(f"hub stand-in on {server.url} (root {root}); Ctrl-C to stop", err=True)
    try:
        server.serve_forever()
    finally:
        server.stop()


GPU_EXPERTS = ["w4a16", "w8a16"]
GPU_LINEARS = ["fp8", "bf16", "keep"]


def _gpu_options(fn):
    fn = click.option("--linears", type=click.Choice(GPU_LINEARS), default="fp8", show_default=True,
                      help="Attention / dense / shared-expert linears: fp8 = 128x128 block FP8 + linear_fp8_config "
                           "(FP8 sources copied), bf16 = BF16 (Kimi style), keep = as stored.")(fn)
    fn = click.option("--group-size", "gpu_group_size", type=click.Choice(["32", "64", "128"]), default="128",
                      show_default=True, help="GPU expert quantization group size.")(fn)
    return click.option("--experts", type=click.Choice(GPU_EXPERTS, case_sensitive=False), default="w4a16",
                        show_default=True, help="compressed-tensors scheme of the routed experts.")(fn)


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@_gpu_options
@click.option("--algo", type=click.Choice(["rtn", "gptq"]), default="rtn", show_default=True,
              help="rtn: round-to-nearest, bytes equal llmcompressor model_free_ptq; gptq needs --calibration.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For --algo gptq: JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers (else they are left out).")
@click.option("--threads", type=int, default=None, help="Worker threads (default: all cores).")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion in OUT.")
@click.option("--force", is_flag=True, help="Delete an existing OUT and start over.")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, bytes per component, VRAM per expert) only.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable --dry-run output.")
@_progress_options
def gpu(src, out, experts, gpu_group_size, linears, algo, calibration, include_mtp, threads, resume, force, dry_run,
        as_json, quiet, json_progress) -> None:
    """Write the SGLang-KT GPU checkpoint (--model) of SRC into OUT: compressed-tensors W4A16/W8A16 routed experts,
    FP8-block or BF16 linears, config.json with the minimal quantization_config (streaming, resumable)."""
    from ktconvert import api
    from ktconvert.progress import make_progress

    if dry_run:
        from ktconvert.gpu.plan import render_gpu

        gpu_plan = api.plan(src, gpu=dict(experts=experts, group_size=int(gpu_group_size), linears=linears,
                                          include_mtp=include_mtp)).gpu
        _emit(gpu_plan.report, as_json, render_gpu)
        return
    require("gpu", "ktconvert gpu")
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = api.convert_gpu(src, out, experts=experts, quant=algo, group_size=int(gpu_group_size),
                                 linears=linears, include_mtp=include_mtp, threads=threads, resume=resume,
                                 force=force, calibration=calibration, progress=progress)
    click.echo(result.summary())


@cli.command()
@click.argument("src")
@click.option("--cpu", "cpu_out", type=click.Path(), required=True, help="CPU (kt-kernel) output directory.")
@click.option("--method", type=click.Choice(CPU_METHODS, case_sensitive=False), required=True,
              help="kt-kernel method of the CPU output.")
@click.option("--numa", type=int, default=1, show_default=True, help="NUMA parts T of the CPU output.")
@click.option("--layout", type=click.Choice(["safetensors", "kt"]), default="safetensors", show_default=True)
@click.option("--gpu", "gpu_out", type=click.Path(), required=True, help="GPU (SGLang --model) output directory.")
@_gpu_options
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers, on both sides.")
@click.option("--allow-drop-bias", is_flag=True, help="Convert even though non-zero expert biases are dropped.")
@click.option("--threads", type=int, default=None, help="Worker threads (default: all cores).")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion.")
@click.option("--force", is_flag=True, help="Delete existing outputs and start over.")
@_progress_options
def convert(src, cpu_out, method, numa, layout, gpu_out, experts, gpu_group_size, linears, include_mtp,
            allow_drop_bias, threads, resume, force, quiet, json_progress) -> None:
    """Write the CPU and the GPU outputs of SRC in one pass (every source expert read once, RTN on both sides).
    Each output is byte-identical to what `ktconvert cpu` / `ktconvert gpu` write."""
    require("gpu", "ktconvert convert")
    from ktconvert import api
    from ktconvert.progress import make_progress

    cpu = api.CpuOptions.make(method=method, numa=numa, layout=layout, include_mtp=include_mtp,
                              allow_drop_bias=allow_drop_bias)
    gpu = api.GpuOptions.make(experts=experts, group_size=int(gpu_group_size), linears=linears,
                              include_mtp=include_mtp)
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        results = api.convert(src, [(cpu_out, cpu), (gpu_out, gpu)], threads=threads, resume=resume, force=force,
                              progress=progress)
    click.echo("\n".join(r.summary() for r in results))


@cli.command("expert-stats")
@click.argument("src", type=click.Path(exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), required=True,
              help="JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--max-length", type=int, default=2048, show_default=True, help="Tokens per sample at most.")
@click.option("--num-samples", type=int, default=None, help="Use the first N samples (default: all).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of the forward (bfloat16 halves a layer's memory).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Also write an HTML page: layer x expert heat map, top-N coverage.")
@click.option("--force", is_flag=True, help="Overwrite existing OUT / report files.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@_progress_options
def expert_stats(src, out, calibration, max_length, num_samples, dtype, report, force, as_json, quiet,
                 json_progress) -> None:
    """Count the calibration tokens each routed expert of SRC receives (the model's own router, float forward,
    one decoder layer in memory at a time) into OUT (.pt), the file SGLang-KT's frequency placement reads:
    --init-expert-location OUT --kt-expert-placement-strategy frequency. Needs the [gpu] extra."""
    from ktconvert.activation.stats import expert_stats as run, render
    from ktconvert.progress import make_progress

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = run(src, out, calibration, max_length=max_length, num_samples=num_samples, dtype=dtype,
                     report=report, force=force, progress=progress)
    _emit(result, as_json, render)



def main() -> None:
    cli()


if __name__ == "__main__":
    main()
