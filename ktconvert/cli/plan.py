"""``ktconvert plan``: what a conversion would write, from headers and config only. Either the targets of one
`convert` pass (``--cpu OUT`` / ``--gpu OUT`` with each output's options after it, or ``--targets FILE.toml``):
each target's plan and the pass's combined figures; or, as before, one CPU output (``--method``) and / or one GPU
checkpoint (``--experts``; the old ``--gpu SCHEME`` is read as ``--experts SCHEME`` with a deprecation line) with an
optional OUT whose free disk is checked. Either way also the GPU expert placement (``--gpu-experts-ratio`` /
``--gpu-experts``), and with ``--executor ray`` what the Ray run asks of the cluster (``distributed.ray_plan``:
the live one's nodes, ``--nodes`` / ``--node-cpus`` / ``--node-memory`` described ones, or none). Light: loads
click only; the API is imported when the command runs.
"""
from __future__ import annotations

import click

from ktconvert.cli.options import (InputPath, emit, json_option, load_api, orientation_option, ray_plan_options,
                                   sampling_options, source_arg)
from ktconvert.cli.targets import META_KEY, TargetCommand, given_targets, kind_fields, kind_flags, starts_target, \
    target_options


class PlanCommand(TargetCommand):
    """plan's arguments: targets as `convert` reads them when a --cpu / --gpu names an output folder; otherwise
    click's own parsing of the options of one output each side."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = _old_gpu_scheme(args)
        if any(starts_target(arg.partition("=")[0]) for arg in args):
            return super().parse_args(ctx, args)
        return click.Command.parse_args(self, ctx, args)


def _old_gpu_scheme(args: list[str]) -> list[str]:
    """`args` with the old `--gpu SCHEME` (a GPU expert scheme's name, not a folder) as `--experts SCHEME`, and a
    deprecation line on stderr when there was one. A folder named like a scheme: write it `--gpu ./w4a16`."""
    if not any(arg.partition("=")[0] == "--gpu" for arg in args):
        return args
    schemes = {name.lower() for name in load_api().choices("experts")}
    out, i = [], 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        if flag == "--gpu" and value is not None and value.lower() in schemes:
            click.echo("warning: --gpu is deprecated, use --experts", err=True)
            out += ["--experts", value]
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    return out


@click.command(cls=PlanCommand)
@click.argument("src", type=InputPath())
@target_options
@click.option("--targets", "targets_file", type=InputPath(dir_okay=False), default=None,
              help="A TOML file of [[targets]] tables, as `convert --targets` reads it.")
@click.option("--gpu-experts-ratio", "gpu_ratio", type=float, default=None,
              help="Which experts SGLang-KT puts on the GPU with --kt-gpu-experts-ratio R, and their VRAM (the "
                   "--experts scheme, default w4a16).")
@click.option("--gpu-experts", "gpu_count", type=int, default=None,
              help="The same with --kt-num-gpu-experts N (per MoE layer).")
@click.option("--expert-stats", type=InputPath(dir_okay=False), default=None,
              help="Activation counts (ktconvert expert-stats): frequency placement; without: SGLang's uniform.")
@click.option("--calibration", type=InputPath(dir_okay=False), default=None,
              help="With --quant gptq: the calibration file `cpu` / `gpu` would read (its tokens size the Ray "
                   "steps).")
@sampling_options
@ray_plan_options
@json_option
@orientation_option
@click.argument("out", required=False, type=click.Path())
def plan(src, targets_file, gpu_ratio, gpu_count, expert_stats, as_json, expert_orientation, out, calibration,
         max_length, num_samples, executor, ray_address, parts, workers, threads, nodes, node_cpus, node_memory,
         node_rate, **given) -> None:
    """What a conversion of SRC would write: files, bytes, peak RAM, disk, and the alignment checks. For the
    outputs of one `convert` pass (--cpu OUT / --gpu OUT, each followed by its options, or --targets FILE):
    each output's plan, then the pass's figures (source bytes read once, the outputs' bytes together, peak RAM,
    the disk each filesystem needs). Or for one CPU output (--method) and/or one GPU checkpoint (--experts:
    sizes per component, VRAM per GPU expert), OUT being where the CPU output would go. And which experts
    SGLang-KT would put on the GPU (--gpu-experts-ratio / --gpu-experts, with --expert-stats FILE.pt).

    \b
      ktconvert plan SRC --method amxint4 --numa 2 [OUT]
      ktconvert plan SRC --cpu OUT1 --method amxint4 --numa 2 --cpu OUT2 --method amxint8 --gpu OUT3 --experts w4a16

    No weights are read. A NUMA count that cannot work fails here and lists the ones that would.

    With --executor ray, also what the Ray run of the same options asks of the cluster, before anything runs:
    per layer-range part (or per GPTQ step with --quant gptq --calibration FILE) the CPUs and memory each task
    declares, per node how many run at once and what bounds it (CPUs or memory), the --parts / --workers the run
    would take and why, the source bytes each part reads and writes (GPTQ: bytes shipped per MoE layer), and the
    storage bandwidth the nodes need at --node-rate GB/s each. The nodes: the live cluster (--ray-address, or
    RAY_ADDRESS; its nodes are read, no task started), or N alike nodes described with --nodes N --node-cpus C
    --node-memory SIZE, or none (figures per task). All computed from the plan and the model's dims.

    \b
      ktconvert plan SRC --method amxint4 --numa 2 --executor ray --nodes 8 --node-cpus 64 --node-memory 512G
      ktconvert plan SRC --method amxint4 --quant gptq --calibration C.jsonl --executor ray --ray-address HEAD:6379
    """
    placing = gpu_ratio is not None or gpu_count is not None
    if expert_stats and not placing:
        raise click.UsageError("--expert-stats needs --gpu-experts-ratio R or --gpu-experts N")
    placement = dict(ratio=gpu_ratio, per_layer=gpu_count, stats=expert_stats) if placing else None
    ctx = click.get_current_context()
    options = {key: value for key, value in given.items() if value not in (None, ())}
    ray = dict(executor=executor, ray_address=ray_address, parts=parts, workers=workers, threads=threads,
               nodes=nodes, node_cpus=node_cpus, node_memory=node_memory, node_rate=node_rate)
    sampling = {key: value for key, value in (("calibration", calibration), ("max_length", max_length),
                                              ("num_samples", num_samples)) if value is not None}
    src = source_arg(src, expert_orientation)
    if targets_file or ctx.meta.get(META_KEY):
        if options or sampling:
            first = next(iter({**options, **sampling}))
            raise click.UsageError(f"--{first.replace('_', '-')} applies to no target: give it after "
                                   f"a {kind_flags()} OUT" if first in options else
                                   f"--{first.replace('_', '-')} is for --quant gptq, which targets do not take")
        if out is not None:
            raise click.UsageError("with --cpu / --gpu / --targets each output names its folder: drop OUT")
        emit(load_api().plan(src, targets=given_targets(ctx, targets_file), placement=placement, **ray), as_json)
        return
    cpu, gpu = _one_output_each(options, placing)
    cpu, gpu = ({**side, **sampling} if side is not None else None for side in (cpu, gpu))
    if placement is not None and gpu is None:
        placement.update(experts="w4a16", group_size=options.get("group_size") or 128)
    emit(load_api().plan(src, cpu, gpu, out=out, placement=placement, **ray), as_json)


def _one_output_each(options: dict, placing: bool) -> tuple[dict | None, dict | None]:
    """The CPU options (with --method) and the GPU options (with --experts) of the old spelling; UsageError when
    there is nothing to plan."""
    method, experts = options.get("method"), options.get("experts")
    if method is None and experts is None and not placing:
        raise click.UsageError("give --method (CPU output), --experts (GPU checkpoint), --gpu-experts-ratio / "
                               "--gpu-experts (GPU expert placement), --cpu / --gpu OUT targets, or several")
    cpu = None if method is None else kind_fields("cpu", options)
    gpu = None if experts is None else kind_fields("gpu", options)
    return cpu, gpu

