"""The `ktconvert` command line. Thin: each command calls the Python API (``ktconvert.api``, imported on first use
so that `ktconvert --help` loads click and nothing else) and prints its result. Only this module prints results
and exits.

Vocabulary, the same in every command: ``--method`` the CPU (kt-kernel) method; ``--quant`` the quantization
algorithm (rtn | mse | gptq on `cpu`, rtn | gptq on `gpu`); ``--experts`` the GPU expert scheme (w4a16 | w8a16);
``--group-size`` the group size of grouped outputs; ``--sample-experts`` how many experts `verify` runs; ``--cpu``
/ ``--gpu`` of `convert` the output folders. An output kind's options (``kinds``) are generated from its options
dataclass: ``cli.options.kind_options`` for `cpu` / `gpu`, ``cli.targets.target_options`` for `convert` / `plan`.
Choices are case-insensitive. Old spellings (``gpu --algo``,
``plan --gpu SCHEME``, ``verify --experts N``) still work for one release and print a deprecation line.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ktconvert.errors import EXIT_INTERRUPTED, KtConvertError
from ktconvert.cli.check import check
from ktconvert.cli.options import (InputPath, RegistryChoice, batch_executor_options, choice, conversion_options,
                                   emit, json_option, kind_options, load_api, orientation_option, pop_distribution,
                                   prefer, profiling, progress_options, sampling_options, source_arg)
from ktconvert.cli.plan import plan
from ktconvert.cli.targets import TargetCommand, given_targets, target_options
from ktconvert.util.progress import make_progress


def _usage_line(exc: click.UsageError):
    """click's own usage errors as the one `error:` line every error gets (not click's four lines), exit 2."""
    if os.environ.get("KTCONVERT_DEBUG"):
        raise exc
    command = exc.ctx.command_path if exc.ctx is not None else "ktconvert"
    click.echo(f"error: {exc.format_message()} (see '{command} --help')", err=True)
    raise click.exceptions.Exit(exc.exit_code)


class _Group(click.Group):
    """Turns library errors into one line on stderr and the documented exit code (also under CliRunner); so are
    click's usage errors of the group and of every command."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            _usage_line(exc)
        ctx.meta["ktconvert.argv"] = given          # what Ctrl-C's line repeats with --resume
        return ctx

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_line(exc)
        except KtConvertError as exc:
            if os.environ.get("KTCONVERT_DEBUG"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo(_interrupted_line(self, ctx.meta.get("ktconvert.argv", [])), err=True)
            ctx.exit(EXIT_INTERRUPTED)


def _interrupted_line(group: click.Group, argv: list[str]) -> str:
    """'interrupted', and for a command that can resume (it has --resume) the command that continues."""
    import shlex

    command = group.commands.get(argv[0]) if argv else None
    if command is None or not any(p.name == "resume" for p in command.params):
        return "interrupted"
    again = [a for a in argv if a not in ("--force", "--resume")] + ["--resume"]
    return f"interrupted; to continue: ktconvert {shlex.join(again)}"


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
      ktconvert check OUT -- LAUNCH COMMAND   the flags kt-kernel would turn into garbage (reads headers only)

    Exit codes: 0 ok, 1 error, 2 usage, 3 bad input, 4 verification failed, 5 remote failure, 130 interrupted.
    Set KTCONVERT_DEBUG=1 for tracebacks.
    """


@cli.command()
@click.argument("src", type=InputPath())
@json_option
@orientation_option
def inspect(src: str, as_json: bool, expert_orientation) -> None:
    """Describe checkpoint SRC without reading weights: family, layers, experts, dims, dtypes, bytes per component,
    how the routed experts are stored (layout, orientation and why) and what each kt-kernel method can do with it."""
    emit(load_api().inspect(src, expert_orientation), as_json)


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@kind_options("cpu")
@click.option("--calibration", type=InputPath(dir_okay=False), default=None,
              help="For --quant gptq, or --method llamafile (an importance matrix computed from it, as "
                   "llama-imatrix): JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--dampening", type=float, default=None,
              help="For --quant gptq: GPTQ's relative Hessian dampening (default 0.1; llm-compressor's "
                   "dampening_frac defaults to 0.01: 0.1 is KTransformers' GPTQ converter's value, for expert "
                   "Hessians built from the few tokens routed to each expert).")
@click.option("--min-tokens", type=int, default=None,
              help="For --quant gptq: routed calibration tokens an expert needs before GPTQ is tried (default 64).")
@sampling_options
@click.option("--dry-run", is_flag=True, help="Print what `ktconvert plan` prints for these options (files, bytes, "
                                              "checks) and write nothing.")
@conversion_options
def cpu(src, out, threads, resume, force, profile, verify_source_hash, dry_run, quiet, json_progress, as_json,
        expert_orientation, **options) -> None:
    """Convert the routed experts of SRC into kt-kernel CPU expert files in OUT (streaming, resumable).

    SRC may be a folder, a .safetensors or .gguf file, hf://ORG/NAME[@REV] or ms://ORG/NAME.
    """
    distribution = pop_distribution(options)
    options = {k: v for k, v in options.items()
               if v is not None or k not in ("dampening", "min_tokens", "max_length", "num_samples")}
    src = source_arg(src, expert_orientation)
    if dry_run:
        emit(load_api().plan(src, cpu=options, out=out), as_json)
        return
    with profiling(profile) as prof, make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = load_api().convert_cpu(src, out, threads=threads, resume=resume, force=force, progress=progress,
                                        verify_source_hash=verify_source_hash, **distribution, **options)
    emit(result, as_json, profile=prof.get("report"))


@cli.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@kind_options("gpu")
@click.option("--algo", "algo_deprecated", type=RegistryChoice("gpu-quant"), default=None, hidden=True)
@click.option("--calibration", type=InputPath(dir_okay=False), default=None,
              help="For --quant gptq: JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@sampling_options
@click.option("--ignore", "ignore", multiple=True, metavar="PATTERN",
              help="Add to config.json's ignore list, as llm-compressor's ignore (repeatable): re:REGEX matches "
                   "module names from the start, a plain name exactly. A linear it matches stays unquantized; "
                   "refused where it matches a routed expert, or an FP8 linear (use --linears bf16).")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, bytes per component, VRAM per expert) only.")
@conversion_options
def gpu(src, out, experts, linears, group_size, quant, algo_deprecated, calibration, max_length, num_samples,
        ignore, include_mtp, threads, resume, force, profile, verify_source_hash, dry_run, quiet, json_progress,
        as_json, expert_orientation, **distribution) -> None:
    """Write the SGLang-KT GPU checkpoint (--model) of SRC into OUT: compressed-tensors W4A16/W8A16 routed experts,
    FP8-block or BF16 linears, config.json with the minimal quantization_config (streaming, resumable)."""
    quant = prefer(quant, algo_deprecated, "--algo", "--quant")
    options = dict(experts=experts, group_size=group_size, quant=quant, linears=linears, include_mtp=include_mtp,
                   calibration=calibration)
    options.update({k: v for k, v in (("max_length", max_length), ("num_samples", num_samples)) if v is not None})
    if ignore:
        options["ignore"] = ignore
    api, src = load_api(), source_arg(src, expert_orientation)
    if dry_run:
        emit(api.plan(src, gpu=options), as_json)
        return
    with profiling(profile) as prof, make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = api.convert_gpu(src, out, threads=threads, resume=resume, force=force, progress=progress,
                                 verify_source_hash=verify_source_hash, **distribution, **options)
    emit(result, as_json, profile=prof.get("report"))


@cli.command(cls=TargetCommand)
@click.argument("src")
@target_options
@click.option("--targets", "targets_file", type=InputPath(dir_okay=False), default=None,
              help="A TOML file of [[targets]] tables ({cpu = OUT, method = ...} / {gpu = OUT, experts = ...}), "
                   "written with (before) the command line's targets.")
@click.option("--dry-run", is_flag=True, help="Print what `ktconvert plan` prints for these options (files, bytes, "
                                              "checks) and write nothing.")
@conversion_options
def convert(src, targets_file, threads, resume, force, profile, verify_source_hash, dry_run, quiet, json_progress,
            as_json, expert_orientation, **given) -> None:
    """Write every output of SRC from one read of the source: each --cpu OUT / --gpu OUT starts an output, and
    the options after it are that output's (options before the first one are shared by every output that has
    them). Each output is byte-identical to what `ktconvert cpu` / `ktconvert gpu` write alone; every plan is
    checked before any OUT is written; with --resume each output continues from its own journal.

    \b
      ktconvert convert SRC --cpu OUT1 --method amxint4 --numa 2 --cpu OUT2 --method amxint8 \\
                            --gpu OUT3 --experts w4a16
      ktconvert convert SRC --targets variants.toml
    """
    distribution = pop_distribution(given)      # the rest of `given`: the targets' options, read by TargetCommand
    targets = given_targets(click.get_current_context(), targets_file)
    src = source_arg(src, expert_orientation)
    if dry_run:
        emit(load_api().plan(src, targets=targets), as_json)
        return
    with profiling(profile) as prof, make_progress(quiet=quiet, json_lines=json_progress) as progress:
        results = load_api().convert(src, targets, threads=threads, resume=resume, force=force, progress=progress,
                                     verify_source_hash=verify_source_hash, **distribution)
    emit({"outputs": [r.to_dict() for r in results]}, as_json, "\n".join(r.summary() for r in results),
         profile=prof.get("report"))


@cli.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("parts", nargs=-1, required=True, type=InputPath(file_okay=False))
@click.option("--verify", is_flag=True, help="Also hash every part file (one more read of every byte) against "
                                             "its part manifest before anything is written.")
@json_option
def merge(out, parts, verify, as_json) -> None:
    """Join the part folders PARTS (written with --layers A-B, in any order) into OUT: hard links (copies across
    filesystems) and the ktconvert.json a single run writes. Refuses parts of other conversions or of another
    source checkpoint, overlapping parts, missing layers, malformed part manifests, symlinks inside a part
    (exit 3).

    Every part file is hashed as it is linked or copied (one read) and checked against its part manifest, the
    sha256 of each tensor in it included (exit 4 on a difference). Run again after an interruption: the same
    merge finishes OUT without hashing again what it already checked.
    """
    result = load_api().merge(out, parts, verify=verify)
    emit(result, as_json, result.summary())


@cli.command("expert-stats")
@click.argument("src", type=InputPath())
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--calibration", type=InputPath(dir_okay=False), required=True,
              help="JSON lines of {\"text\": ...} or {\"input_ids\": [...]} (nothing is downloaded).")
@click.option("--max-length", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens per sample at most.")
@click.option("--num-samples", type=click.IntRange(min=1), default=None, help="Use the first N samples (default: all).")
@click.option("--dtype", type=choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of the forward (bfloat16 halves a layer's memory).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Also write an HTML page: layer x expert heat map, top-N coverage.")
@click.option("--force", is_flag=True, help="Overwrite existing OUT / report files.")
@progress_options
@json_option
def expert_stats(src, out, calibration, max_length, num_samples, dtype, report, force, quiet, json_progress,
                 as_json) -> None:
    """Count the calibration tokens each routed expert of SRC receives (the model's own router, float forward,
    one decoder layer in memory at a time) into OUT (.pt), the file SGLang-KT's frequency placement reads:
    --init-expert-location OUT --kt-expert-placement-strategy frequency. Needs the [gpu] extra."""
    api = load_api()
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = api.expert_stats(src, out, calibration, max_length=max_length, num_samples=num_samples, dtype=dtype,
                                  report=report, force=force, progress=progress)
    emit(result, as_json, api.render(result, "expert-stats"))


@cli.command()
@click.argument("out")
@click.option("--source", type=InputPath(hub_ok=True), help="Compare with the source weights (a folder, or "
                                                                "hf://ORG/NAME[@REV] / ms://... as cpu / gpu take).")
@click.option("--hashes", is_flag=True, help="Re-hash every file and tensor against ktconvert.json.")
@click.option("--tokens", type=int, default=8, show_default=True, help="Random activations per check.")
@click.option("--layers", default=None, help="Layers to run: ranges and lists (1-3, 1,3,5, 1-3,7, as the conversions "
                                             "take them) or 'all' (default: first, middle, last).")
@click.option("--sample-experts", default=None, help="'all' or how many experts per layer to run (default 4).")
@click.option("--experts", "experts_deprecated", default=None, hidden=True)
@click.option("--threshold", type=float, default=None, help="Max relative L2 error vs source (default per method).")
@click.option("--remote", default=None, is_flag=False, flag_value="", help="Compare with a hub repo's file hashes.")
@click.option("--hub", type=choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None)
@click.option("--endpoint", default=None, help="Hub endpoint URL.")
@click.option("--calibration", type=InputPath(dir_okay=False), default=None,
              help="Numerics on the hidden states these calibration tokens produce in --source (the model's own "
                   "routing, streamed layer by layer) instead of random probes.")
@sampling_options
@click.option("--compare", type=InputPath(file_okay=False), default=None,
              help="With --calibration: a second output OUT2, side by side.")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Also write an HTML page (outside OUT): error per layer, layer x expert heat map, worst experts, "
                   "thresholds; written for a failed verification too.")
@json_option
def verify(out, source, hashes, tokens, layers, sample_experts, experts_deprecated, threshold, remote, hub, revision,
           endpoint, calibration, max_length, num_samples, compare, report, as_json) -> None:
    """Check a converted output OUT: structure, hashes, numerics (native kernels) and error against the source."""
    sample = prefer(sample_experts, experts_deprecated, "--experts", "--sample-experts") or "4"
    result = load_api().verify(out, source=source, hashes=hashes, tokens=tokens, layers=layers, sample_experts=sample,
                               threshold=threshold, remote=remote, hub=hub, revision=revision, endpoint=endpoint,
                               calibration=calibration, compare=compare, report=report,
                               **{k: v for k, v in (("max_length", max_length), ("num_samples", num_samples))
                                  if v is not None})
    emit(result, as_json)
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
    api = load_api()
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
@click.option("--dtype", default="bf16", show_default=True,
              help="bf16, fp16, fp32, fp8 (block), ct-int4, mxfp4, gptq-int4, gptq-int8, gptq-int4-asym, "
                   "gptq-int4-actorder, gptq-v2-int4-asym, awq-int4, fp8-channel, mxfp8, nvfp4.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite a non-empty OUT.")
def tiny_model(out, **options) -> None:
    """Write a small seeded random checkpoint of family ARCH with the real hub layout, names and config.json.

    Weights are heavy-tailed like trained checkpoints. Defaults satisfy kt-kernel's alignment for T=1 and T=2.
    Its tokenizer (with the `tokenizers` package) is a word-level one that reads only the words tok4, tok5, ...
    tok{V-1} split at whitespace (<unk>, <s>, </s>, <pad> are ids 0-3): give its --calibration as such text or
    as {"input_ids": [...]}; other text is all <unk>, which expert-stats and --quant gptq refuse.
    """
    click.echo(f"wrote {load_api().make_tiny_model(out, **options)}")


@cli.command()
def env() -> None:
    """Versions, CPU features and the native implementation in use."""
    click.echo(json.dumps(load_api().env_info(), indent=2, sort_keys=True))


@cli.command()
@json_option
def families(as_json: bool) -> None:
    """List the architecture families (manifests) and the config model_type values they cover."""
    result = load_api().families()
    emit(result, as_json, "\n".join(f"{name:14s} {', '.join(types)}" for name, types in result["families"].items()))


@cli.command()
@json_option
def methods(as_json: bool) -> None:
    """List the CPU methods: kt-kernel's name, what ktconvert writes, the layouts, group sizes and NUMA rules, and
    what kt-kernel needs to run them."""
    result = load_api().methods()
    lines = []
    for m in result["methods"]:
        rules = (f"layouts {'/'.join(m['layouts'])}" if m["writable"] else "read as is, not written") + \
            (f", group sizes {'/'.join(map(str, m['group_sizes']))}" if m["group_sizes"] else "") + \
            (", kt-kernel needs AMX" if m["needs_amx"] else "") + \
            (", kt-kernel needs AVX-512 (no AVX2 kernel)" if m.get("needs_avx512") else "")
        lines.append(f"{m['name']:14s} {m['kt_method']:14s} {m['description']}\n{'':29s} {rules}")
    emit(result, as_json, "\n".join(lines))


@cli.command()
@click.argument("out", type=InputPath(file_okay=False))
@click.argument("repo")
@click.option("--hub", type=choice(["hf", "modelscope"]), default="hf", show_default=True)
@click.option("--revision", default=None, help="Branch to upload to (default: the hub's main branch).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--endpoint", default=None, help="Hub endpoint URL (default: HF_ENDPOINT / MODELSCOPE_ENDPOINT).")
@click.option("--base-model", default=None, metavar="REPO",
              help="The Hugging Face repo OUT was converted from, for the card's base_model (default: the hf:// "
                   "source ktconvert.json records; none for a local source).")
@json_option
@progress_options
def publish(out, repo, hub, revision, private, endpoint, base_model, as_json, quiet, json_progress) -> None:
    """Upload output folder OUT to hub repo REPO, then check the remote hashes.

    OUT is first re-hashed against its ktconvert.json (a damaged folder is refused). The upload is resumable: run the
    same command again after an interruption and only what the hub lacks is sent. A README.md model card (Hub
    metadata: library_name, tags, base_model, base_model_relation) states the launch command and its flags. Token:
    HF_TOKEN / MODELSCOPE_API_TOKEN (or a stored login); never printed.
    """
    api = load_api()
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        result = api.publish(out, repo, hub=hub, revision=revision, private=private, endpoint=endpoint,
                             progress=progress, base_model=base_model)
    emit(result, as_json, api.render(result, "publish"))


@cli.command()
@click.argument("jobs", type=InputPath(dir_okay=False))
@click.option("--keep-going", is_flag=True, help="Run the remaining jobs after one fails.")
@click.option("--dry-run", is_flag=True, help="Print every job's plan; read no weights.")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False), default=None,
              help="Write the per-job summary JSON here.")
@batch_executor_options
@json_option
@progress_options
def batch(jobs, keep_going, dry_run, summary_path, executor, ray_address, as_json, quiet, json_progress) -> None:
    """Run the conversion / bundle / publish jobs of JOBS (TOML, see examples/jobs.toml) in order, resumably.

    Exits non-zero if any job failed (with the first failed job's exit code).
    """
    api = load_api()
    job_list = api.load_jobs(jobs)
    if dry_run:
        plans = api.batch(job_list, dry_run=True)
        emit(plans, as_json, api.render(plans, "batch-plan"))
        return
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        summary = api.batch(job_list, keep_going=keep_going, progress=progress, executor=executor,
                            ray_address=ray_address, summary=summary_path or None)
    emit(summary, as_json, api.render(summary, "batch"))
    if not summary["ok"]:
        sys.exit(summary["exit_code"])


@cli.command()
@click.argument("out", type=InputPath(file_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--level", type=int, default=3, show_default=True, help="zstd level (1-22).")
@click.option("--force", is_flag=True, help="Replace an existing DEST (renamed over it, never written through).")
@json_option
@progress_options
def bundle(out, dest, level, force, as_json, quiet, json_progress) -> None:
    """Pack output folder OUT into one deterministic zstd tar DEST (.tar.zst), ktconvert.json first. An existing
    DEST is refused unless --force."""
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        r = load_api().bundle(out, dest, level=level, progress=progress, force=force)
    emit(r, as_json, f"wrote {r['path']}: {r['files']} files, {r['bytes_in']} -> {r['bytes_out']} bytes "
                      f"(ratio {r['ratio']:.3f})")


@cli.command()
@click.argument("src", type=InputPath(dir_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@json_option
@progress_options
def unbundle(src, dest, as_json, quiet, json_progress) -> None:
    """Restore bundle SRC into new folder DEST, verifying every file (nothing is left behind on failure)."""
    with make_progress(quiet=quiet, json_lines=json_progress) as progress:
        r = load_api().unbundle(src, dest, progress=progress)
    emit(r, as_json, f"restored {r['checked']} files + ktconvert.json into {r['dest']}")


@cli.command("hub-server")
@click.option("--port", type=int, default=8765, show_default=True)
@click.option("--root", type=click.Path(file_okay=False), required=True, help="Folder holding the repos.")
def hub_server(port, root) -> None:
    """Run a local stand-in for the HF Hub and ModelScope on 127.0.0.1 (for trying publish / hub sources).

    \b
    HF:         HF_ENDPOINT=http://127.0.0.1:PORT HF_TOKEN=x ktconvert publish OUT me/repo
    ModelScope: ktconvert publish OUT me/repo --hub modelscope --endpoint http://127.0.0.1:PORT
    """
    from ktconvert.ops.hub_standin.server import HubServer

    server = HubServer(root, port)
    click.echo(f"hub stand-in on {server.url} (root {root}); Ctrl-C to stop", err=True)
    try:
        server.serve_forever()
    finally:
        server.stop()


cli.add_command(plan)
cli.add_command(check)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
