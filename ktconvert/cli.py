"""The `ktconvert` command line. Thin: each command calls the Python API (``ktconvert.api``, imported on first use
so that `ktconvert --help` loads click and nothing else) and prints its result. Only this module prints results
and exits.

Vocabulary, the same in every command: ``--method`` the CPU (kt-kernel) method; ``--quant`` the quantization
algorithm (rtn | mse | gptq on `cpu`, rtn | gptq on `gpu`); ``--experts`` the GPU expert scheme (w4a16 | w8a16);
``--group-size`` the group size of grouped outputs; ``--sample-experts`` how many experts `verify` runs; ``--cpu``
/ ``--gpu`` of `convert` the output folders. Choices are case-insensitive. Old spellings (``gpu --algo``,
``plan --gpu SCHEME``, ``verify --experts N``) still work for one release and print a deprecation line.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ktconvert.errors import EXIT_INTERRUPTED, KtConvertError
from ktconvert.progress import make_progress

LAYOUTS = ["safetensors", "kt"]
GPU_GROUP_SIZES = ["32", "64", "128"]
LINEARS = ["fp8", "bf16", "keep"]


def _api():
    """ktconvert.api, imported on first use (it brings numpy and the converters)."""
    from ktconvert import api

    return api


class RegistryChoice(click.ParamType):
    """A case-insensitive choice among the names a registry holds (``ktconvert.api.choices(kind)``), looked up
    when a value is converted or the help is shown: importing the command line loads no registry."""

    def __init__(self, kind: str):
        self.kind, self.name = kind, kind

    def _choices(self) -> list[str]:
        return _api().choices(self.kind)

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self._choices()) + "]"

    def convert(self, value, param, ctx):
        try:
            return _api().choose(self.kind, value)
        except KtConvertError as exc:
            self.fail(str(exc), param, ctx)


def _choice(values: list[str]) -> click.Choice:
    return click.Choice(values, case_sensitive=False)


def _prefer(new, old, old_flag: str, new_flag: str):
    """`new` unless the deprecated spelling `old` was given (then a one-line warning on stderr)."""
    if old is None:
        return new
    click.echo(f"warning: {old_flag} is deprecated, use {new_flag}", err=True)
    return old


def _emit(result, as_json: bool, text: str | None = None) -> None:
    """A result object as JSON (to_dict) or as text (its rendering)."""
    if as_json:
        click.echo(json.dumps(result.to_dict() if hasattr(result, "to_dict") else result, indent=2, sort_keys=True))
    else:
        click.echo(text if text is not None else _api().render(result))


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


def _json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")(fn)


def _progress_options(fn):
    fn = click.option("--json-progress", is_flag=True, help="Progress as JSON lines on stderr.")(fn)
    return click.option("--quiet", is_flag=True, help="No progress output.")(fn)


def _run_options(fn):
    for option in reversed([
            click.option("--threads", type=int, default=None, help="Worker threads (default: all cores). Bytes never "
                                                                   "depend on it."),
            click.option("--resume", is_flag=True, help="Continue an interrupted conversion in OUT."),
            click.option("--force", is_flag=True, help="Delete an existing OUT and start over.")]):
        fn = option(fn)
    return fn


def _cpu_options(fn):
    """--method / --numa / --layout: what a CPU output is (shared by plan, cpu, convert)."""
    fn = click.option("--layout", type=_choice(LAYOUTS), default="safetensors", show_default=True,
                      help="safetensors: one merged shard per MoE layer; kt: the _layer_L/_numa_t/*.kt tree.")(fn)
    fn = click.option("--numa", type=int, default=1, show_default=True,
                      help="NUMA parts T; must equal SGLang's --kt-threadpool-count at run time.")(fn)
    return click.option("--method", type=RegistryChoice("method"), default=None,
                        help="kt-kernel method of the CPU output (`ktconvert methods` describes them).")(fn)


def _gpu_options(fn):
    """--experts / --linears: what a GPU checkpoint is (shared by plan, gpu, convert)."""
    fn = click.option("--linears", type=_choice(LINEARS), default="fp8", show_default=True,
                      help="Attention / dense / shared-expert linears of the GPU checkpoint: fp8 = 128x128 block FP8 + "
                           "linear_fp8_config, bf16 = BF16 (for transformers / vLLM), keep = as stored.")(fn)
    return click.option("--experts", type=RegistryChoice("experts"), default=None,
                        help="compressed-tensors scheme of the GPU checkpoint's routed experts.")(fn)


@cli.command()
@click.argument("src", type=click.Path(exists=True))
@_json_option
def inspect(src: str, as_json: bool) -> None:
    """Describe checkpoint SRC without reading weights: family, layers, experts, dims, dtypes, bytes per component,
    and what each kt-kernel method can do with it."""
    _emit(_api().inspect(src), as_json)


@cli.command()
@click.argument("src", type=click.Path(exists=True))
@_cpu_options
@click.option("--group-size", type=int, default=None, help="Group size of grouped outputs: a grouped CPU method "
                                                           "(`ktconvert methods`) and the GPU experts.")
@click.option("--include-mtp", is_flag=True, help="Also the MTP (next-n) layers' experts.")
@_gpu_options
@click.option("--gpu", "gpu_deprecated", type=RegistryChoice("experts"), default=None, hidden=True)
@_json_option
@click.argument("out", required=False, type=click.Path())
def plan(src, method, numa, layout, group_size, include_mtp, experts, linears, gpu_deprecated, as_json, out) -> None:
    """What a conversion of SRC would write: files, bytes, peak RAM, disk, and the alignment checks — for the
    CPU output (--method) and/or the GPU checkpoint (--experts: sizes per component, VRAM per GPU expert).

    No weights are read. A NUMA count that cannot work fails here and lists the ones that would.
    """
    experts = _prefer(experts, gpu_deprecated, "--gpu", "--experts")
    if method is None and experts is None:
        raise click.UsageError("give --method (CPU output), --experts (GPU checkpoint), or both")
    cpu = None if method is None else dict(method=method, numa=numa, layout=layout, group_size=group_size,
                                           include_mtp=include_mtp)
    gpu = None if experts is None else dict(experts=experts, group_size=group_size or 128, linears=linears,
                                            include_mtp=include_mtp)
    _emit(_api().plan(src, cpu, gpu, out=out), as_json)


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@_cpu_options
@click.option("--quant", type=RegistryChoice("cpu-quant"), default="rtn", show_default=True,
              help="rtn: byte-identical to kt-kernel's converter; mse: each row's scale searched for the least error "
                   "(same files, kt-kernel runs them unchanged); gptq: calibrated, needs --calibration.")
@click.option("--group-size", type=int, default=None, help="Group size of a grouped method (`ktconvert methods` "
                                                           "lists each method's; default its largest).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For --quant gptq: JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--include-dense", is_flag=True, help="Also write non-expert tensors (blk.-renamed) into OUT.")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers' experts.")
@click.option("--allow-drop-bias", is_flag=True, help="Convert even though non-zero expert biases are dropped.")
@_run_options
@_progress_options
@_json_option
def cpu(src, out, threads, resume, force, quiet, json_progress, as_json, **options) -> None:
    """Convert the routed experts of SRC into kt-kernel CPU expert files in OUT (streaming, resumable).

    SRC may be a folder, a .safetensors or .gguf file, hf://ORG/NAME[@REV] or ms://ORG/NAME.
    """
    if options["method"] is None:
        raise click.UsageError("Missing option '--method'.")
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = _api().convert_cpu(src, out, threads=threads, resume=resume, force=force, progress=progress,
                                    **options)
    _emit(result, as_json)


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@_gpu_options
@click.option("--group-size", type=_choice(GPU_GROUP_SIZES), default="128", show_default=True,
              help="GPU expert quantization group size.")
@click.option("--quant", type=RegistryChoice("gpu-quant"), default=None,
              help="rtn (default): bytes equal llmcompressor's model_free_ptq; gptq: calibrated, needs --calibration.")
@click.option("--algo", "algo_deprecated", type=RegistryChoice("gpu-quant"), default=None, hidden=True)
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For --quant gptq: JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers (else they are left out).")
@_run_options
@click.option("--dry-run", is_flag=True, help="Print the plan (files, bytes per component, VRAM per expert) only.")
@_progress_options
@_json_option
def gpu(src, out, experts, linears, group_size, quant, algo_deprecated, calibration, include_mtp, threads, resume,
        force, dry_run, quiet, json_progress, as_json) -> None:
    """Write the SGLang-KT GPU checkpoint (--model) of SRC into OUT: compressed-tensors W4A16/W8A16 routed experts,
    FP8-block or BF16 linears, config.json with the minimal quantization_config (streaming, resumable)."""
    quant = _prefer(quant, algo_deprecated, "--algo", "--quant") or "rtn"
    options = dict(experts=experts or "w4a16", group_size=int(group_size), quant=quant, linears=linears,
                   include_mtp=include_mtp, calibration=calibration)
    api = _api()
    if dry_run:
        _emit(api.plan(src, gpu=options), as_json)
        return
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = api.convert_gpu(src, out, threads=threads, resume=resume, force=force, progress=progress, **options)
    _emit(result, as_json)


@cli.command()
@click.argument("src")
@click.option("--cpu", "cpu_out", type=click.Path(), required=True, help="CPU (kt-kernel) output directory.")
@click.option("--gpu", "gpu_out", type=click.Path(), required=True, help="GPU (SGLang --model) output directory.")
@_cpu_options
@_gpu_options
@click.option("--group-size", type=int, default=None, help="Group size of grouped outputs: the GPU experts (32, 64 "
                                                           "or 128; default 128) and a grouped CPU method.")
@click.option("--include-mtp", is_flag=True, help="Also convert MTP (next-n) layers, on both sides.")
@click.option("--allow-drop-bias", is_flag=True, help="Convert even though non-zero expert biases are dropped.")
@_run_options
@_progress_options
@_json_option
def convert(src, cpu_out, gpu_out, method, numa, layout, experts, linears, group_size, include_mtp, allow_drop_bias,
            threads, resume, force, quiet, json_progress, as_json) -> None:
    """Write the CPU and the GPU outputs of SRC in one pass (every source expert read once, RTN on both sides).
    Each output is byte-identical to what `ktconvert cpu` / `ktconvert gpu` write."""
    if method is None:
        raise click.UsageError("Missing option '--method'.")
    targets = [(cpu_out, dict(method=method, numa=numa, layout=layout, group_size=group_size, include_mtp=include_mtp,
                              allow_drop_bias=allow_drop_bias)),
               (gpu_out, dict(experts=experts or "w4a16", group_size=group_size or 128, linears=linears,
                              include_mtp=include_mtp))]
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        results = _api().convert(src, targets, threads=threads, resume=resume, force=force, progress=progress)
    _emit({"outputs": [r.to_dict() for r in results]}, as_json, "\n".join(r.summary() for r in results))


@cli.command()
@click.argument("out")
@click.option("--source", type=click.Path(exists=True), help="Compare with the source weights.")
@click.option("--hashes", is_flag=True, help="Re-hash every file and tensor against ktconvert.json.")
@click.option("--tokens", type=int, default=8, show_default=True, help="Random activations per check.")
@click.option("--layers", default=None, help="Comma-separated layer indices, or 'all' (default: first, middle, last).")
@click.option("--sample-experts", default=None, help="'all' or how many experts per layer to run (default 4).")
@click.option("--experts", "experts_deprecated", default=None, hidden=True)
@click.option("--threshold", type=float, default=None, help="Max relative L2 error vs source (default per method).")
@click.option("--remote", default=None, is_flag=False, flag_value="", help="Compare with a hub repo's file hashes.")
@click.option("--hub", type=_choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None)
@click.option("--endpoint", default=None, help="Hub endpoint URL.")
@_json_option
def verify(out, source, hashes, tokens, layers, sample_experts, experts_deprecated, threshold, remote, hub, revision,
           endpoint, as_json) -> None:
    """Check a converted output OUT: structure, hashes, numerics (native kernels) and error against the source."""
    sample = _prefer(sample_experts, experts_deprecated, "--experts", "--sample-experts") or "4"
    result = _api().verify(out, source=source, hashes=hashes, tokens=tokens, layers=layers, sample_experts=sample,
                           threshold=threshold, remote=remote, hub=hub, revision=revision, endpoint=endpoint)
    _emit(result, as_json)
    if not result.ok:
        sys.exit(4)


@cli.command()
@click.argument("workdir", type=click.Path(), default="ktconvert-demo")
@click.option("--arch", default="qwen3_moe", show_default=True, help="Family of the generated tiny model.")
@click.option("--method", type=RegistryChoice("method"), default=None, help="CPU method (default: the project's "
                                                                               "default method, `ktconvert methods`).")
@click.option("--numa", type=int, default=2, show_default=True)
def demo(workdir, arch, method, numa) -> None:
    """The main job on an embedded example: generate a tiny ARCH model in WORKDIR/model, convert it to
    WORKDIR/out, and verify the output against the model (hashes and numerics)."""
    api = _api()
    method = method or api.default_method()
    root = Path(workdir)
    model = api.make_tiny_model(root / "model", arch=arch, force=True)
    click.echo(f"tiny model: {model}")
    with make_progress() as progress:
        click.echo(api.convert_cpu(model, root / "out", method=method, numa=numa, force=True,
                                   progress=progress).summary())
    result = api.verify(str(root / "out"), source=str(model), hashes=True)
    click.echo(api.render(result))
    if not result.ok:
        sys.exit(4)


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
def tiny_model(out, **options) -> None:
    """Write a small seeded random checkpoint of family ARCH with the real hub layout, names and config.json.

    Weights are heavy-tailed like trained checkpoints. Defaults satisfy kt-kernel's alignment for T=1 and T=2.
    """
    click.echo(f"wrote {_api().make_tiny_model(out, **options)}")


@cli.command()
def env() -> None:
    """Versions, CPU features and the native implementation in use."""
    click.echo(json.dumps(_api().env_info(), indent=2, sort_keys=True))


@cli.command()
@_json_option
def families(as_json: bool) -> None:
    """List the architecture families (manifests) and the config model_type values they cover."""
    result = _api().families()
    _emit(result, as_json, "\n".join(f"{name:14s} {', '.join(types)}" for name, types in result["families"].items()))


@cli.command()
@_json_option
def methods(as_json: bool) -> None:
    """List the CPU methods: kt-kernel's name, what ktconvert writes, the layouts, group sizes and NUMA rules, and
    what kt-kernel needs to run them."""
    result = _api().methods()
    lines = []
    for m in result["methods"]:
        rules = (f"layouts {'/'.join(m['layouts'])}" if m["writable"] else "read as is, not written") + \
            (f", group sizes {'/'.join(map(str, m['group_sizes']))}" if m["group_sizes"] else "") + \
            (", kt-kernel needs AMX" if m["needs_amx"] else "")
        lines.append(f"{m['name']:10s} {m['kt_method']:10s} {m['description']}\n{'':21s} {rules}")
    _emit(result, as_json, "\n".join(lines))


@cli.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("repo")
@click.option("--hub", type=_choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None, help="Branch to upload to (default: the hub's main branch).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--endpoint", default=None, help="Hub endpoint URL (default: HF_ENDPOINT / MODELSCOPE_ENDPOINT).")
@_json_option
@_progress_options
def publish(out, repo, hub, revision, private, endpoint, as_json, quiet, json_progress) -> None:
    """Upload output folder OUT to hub repo REPO, then check the remote hashes.

    OUT is first re-hashed against its ktconvert.json (a damaged folder is refused). The upload is resumable: run the
    same command again after an interruption and only what the hub lacks is sent. A README.md model card states the
    kt-kernel / SGLang flags. Token: HF_TOKEN / MODELSCOPE_API_TOKEN (or a stored login); never printed.
    """
    from ktconvert.ops.hub import publish as run, render_remote

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = run(out, repo, hub=hub, revision=revision, private=private, endpoint=endpoint, progress=progress)
    _emit(result, as_json, render_remote(result) + f"\n{result['url']}")


@cli.command()
@click.argument("jobs", type=click.Path(exists=True, dir_okay=False))
@click.option("--keep-going", is_flag=True, help="Run the remaining jobs after one fails.")
@click.option("--dry-run", is_flag=True, help="Print every job's plan; read no weights.")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False), default=None,
              help="Write the per-job summary JSON here.")
@_json_option
@_progress_options
def batch(jobs, keep_going, dry_run, summary_path, as_json, quiet, json_progress) -> None:
    """Run the conversion / bundle / publish jobs of JOBS (TOML, see examples/jobs.toml) in order, resumably.

    Exits non-zero if any job failed (with the first failed job's exit code).
    """
    from ktconvert.ops import batch as mod

    job_list = mod.load_jobs(jobs)
    if dry_run:
        plans = mod.plan_jobs(job_list)
        _emit(plans, as_json, mod.render_plans(plans))
        return
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        summary = mod.run_jobs(job_list, keep_going=keep_going, progress=progress)
    if summary_path:
        with open(summary_path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    _emit(summary, as_json, mod.render_summary(summary))
    if not summary["ok"]:
        sys.exit(summary["exit_code"])


@cli.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--level", type=int, default=3, show_default=True, help="zstd level (1-22).")
@_json_option
@_progress_options
def bundle(out, dest, level, as_json, quiet, json_progress) -> None:
    """Pack output folder OUT into one deterministic zstd tar DEST (.tar.zst), ktconvert.json first."""
    from ktconvert.ops import bundle as ops_bundle

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        r = ops_bundle.bundle(out, dest, level=level, progress=progress)
    _emit(r, as_json, f"wrote {r['path']}: {r['files']} files, {r['bytes_in']} -> {r['bytes_out']} bytes "
                      f"(ratio {r['ratio']:.3f})")


@cli.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@_json_option
@_progress_options
def unbundle(src, dest, as_json, quiet, json_progress) -> None:
    """Restore bundle SRC into new folder DEST, verifying every file (nothing is left behind on failure)."""
    from ktconvert.ops import bundle as ops_bundle

    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        r = ops_bundle.unbundle(src, dest, progress=progress)
    _emit(r, as_json, f"restored {r['checked']} files + ktconvert.json into {r['dest']}")


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


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
