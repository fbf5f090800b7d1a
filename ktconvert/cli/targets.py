"""The targets of ``ktconvert convert`` on the command line: each ``--cpu OUT`` / ``--gpu OUT`` starts an output,
and the output options after it (``targets.FIELDS``: --method, --numa, --experts, ...) are that output's.

    convert SRC [shared options] --cpu OUT1 [CPU options] --cpu OUT2 [CPU options] --gpu OUT3 [GPU options]

Options given before the first target are shared: every command-line target of a kind that has them takes them
(a target's own value wins). ``TargetCommand`` reads the arguments in order before click parses the rest (run
options, --targets, --json, ...), and leaves the target tables (``targets`` module) in ``ctx.meta``.

The old spelling (one --cpu, one --gpu, each side's options anywhere) still works: an option after a target of
the other kind goes to the one target of its kind, with a deprecation line on stderr. Light: loads click only.
"""
from __future__ import annotations

import click

from ktconvert.cli.options import LAYOUTS, LINEARS, RegistryChoice, choice
from ktconvert.run.targets import FIELDS, KINDS, load_targets, parse_target, refuse_shared_folders

META_KEY = "ktconvert.run.targets"


class TargetCommand(click.Command):
    """A click command whose --cpu / --gpu options start targets that take the output options after them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        output_params = {opt: p for p in self.params if p.name in _OUTPUT_KEYS for opt in p.opts}
        events, rest, kinds = [], [], []       # events: (target number or None = shared, param, value, flag)
        i = 0
        while i < len(args):
            flag, eq, inline = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
            if flag == "--":
                rest += args[i:]
                break
            if flag in ("--cpu", "--gpu") or flag in output_params:
                param = output_params.get(flag)
                takes_value = param is None or not param.is_flag
                if takes_value and not eq and i + 1 >= len(args):
                    raise click.UsageError(f"Option '{flag}' requires an argument.", ctx)
                value = (inline if eq else args[i + 1]) if takes_value else True
                if eq and not takes_value:
                    raise click.UsageError(f"Option '{flag}' does not take a value.", ctx)
                i += 1 if eq or not takes_value else 2
                if param is None:
                    kinds.append((flag[2:], value))
                else:
                    events.append((len(kinds) or None, param.name, param.type_cast_value(ctx, value), flag))
                continue
            rest.append(args[i])
            i += 1
        ctx.meta[META_KEY] = _tables(kinds, events, ctx)
        return super().parse_args(ctx, rest)


def given_targets(ctx: click.Context, targets_file: str | None) -> list:
    """targets.Target list: those of `targets_file` first, then the command line's (read by TargetCommand)."""
    targets = load_targets(targets_file) if targets_file else []
    targets += [parse_target(table, len(targets) + number)
                for number, table in enumerate(ctx.meta.get(META_KEY, []), 1)]
    if not targets:
        raise click.UsageError("give one or more outputs: --cpu OUT [--method ...], --gpu OUT [--experts ...] "
                               "or --targets FILE", ctx)
    refuse_shared_folders(targets)
    return targets


def _tables(kinds: list[tuple[str, str]], events: list, ctx: click.Context) -> list[dict]:
    """One table per target, in command-line order, from the options read (see the module's rules)."""
    tables = [{kind: out} for kind, out in kinds]
    moved, narrowed = [], []
    old_spelling = sorted(k for k, _ in kinds) == ["cpu", "gpu"]
    for number, key, value, flag in events:
        if number is None:
            takers = [t for (kind, _), t in zip(kinds, tables) if key in FIELDS[kind]]
            if not takers:
                raise click.UsageError(f"{flag} applies to no target: give it after a --cpu / --gpu of a kind "
                                       f"that has it", ctx)
            for table in takers:
                table[key] = value
            continue
        kind = kinds[number - 1][0]
        if key in FIELDS[kind]:
            tables[number - 1][key] = value
            if old_spelling and all(key in FIELDS[k] for k, _ in kinds):
                narrowed.append(f"{flag} after --{kind} {kinds[number - 1][1]}")
            continue
        owner = _old_spelling_owner(kinds, key)
        if owner is None:
            raise click.UsageError(f"{flag} is not an option of a {kind.upper()} output (it follows --{kind} "
                                   f"{kinds[number - 1][1]}): give it after the target it belongs to", ctx)
        tables[owner][key] = value
        moved.append(f"{flag} after --{kind}")
    if moved:
        click.echo(f"warning: {', '.join(moved)} is deprecated: give each output's options after its own "
                   f"--cpu / --gpu", err=True)
    if narrowed:
        click.echo(f"warning: {', '.join(narrowed)} applies to that output only (before this release it applied to "
                   f"both); give it before the first --cpu / --gpu for both", err=True)
    return tables


def _old_spelling_owner(kinds: list[tuple[str, str]], key: str) -> int | None:
    """The index of the one target an option of the other kind goes to in the old spelling (at most one --cpu
    and one --gpu), or None."""
    if sorted(k for k, _ in kinds) not in (["cpu", "gpu"], ["cpu"], ["gpu"]):
        return None
    owners = [index for index, (kind, _) in enumerate(kinds) if key in FIELDS[kind]]
    return owners[0] if len(owners) == 1 else None


_OUTPUT_KEYS = {key for kind in KINDS for key in FIELDS[kind]}


def target_options(fn):
    """The options of `convert`'s targets (read by TargetCommand, shown by --help)."""
    for option in reversed([
            click.option("--cpu", "cpu_targets", metavar="OUT", multiple=True,
                         help="Start a CPU (kt-kernel) output in folder OUT; the CPU options after it are its own. "
                              "Repeatable."),
            click.option("--method", type=RegistryChoice("method"), default=None,
                         help="[CPU] kt-kernel method (`ktconvert methods`); required."),
            click.option("--numa", type=int, default=None,
                         help="[CPU] NUMA parts T = SGLang's --kt-threadpool-count (default 1)."),
            click.option("--layout", type=choice(LAYOUTS), default=None,
                         help="[CPU] safetensors (default): one merged shard per MoE layer; kt: the .kt tree."),
            click.option("--include-dense", is_flag=True, default=None,
                         help="[CPU] Also write the non-expert tensors (blk.-renamed)."),
            click.option("--allow-drop-bias", is_flag=True, default=None,
                         help="[CPU] Convert even though non-zero expert biases are dropped."),
            click.option("--gpu", "gpu_targets", metavar="OUT", multiple=True,
                         help="Start a GPU (SGLang --model) output in folder OUT; the GPU options after it are its "
                              "own. Repeatable."),
            click.option("--experts", type=RegistryChoice("experts"), default=None,
                         help="[GPU] compressed-tensors scheme of the routed experts (default w4a16)."),
            click.option("--linears", type=choice(LINEARS), default=None,
                         help="[GPU] fp8 (default): 128x128 block FP8 + linear_fp8_config; bf16; keep."),
            click.option("--group-size", type=int, default=None,
                         help="[CPU, GPU] Group size: a grouped CPU method's; the GPU experts' 32, 64 or 128 "
                              "(default 128)."),
            click.option("--quant", default=None,
                         help="[CPU, GPU] rtn (default; byte-identical to kt-kernel / model_free_ptq) or, for CPU "
                              "outputs, mse. GPTQ writes one output at a time: use `cpu` / `gpu`."),
            click.option("--include-mtp", is_flag=True, default=None,
                         help="[CPU, GPU] Also the MTP (next-n) layers' experts.")]):
        fn = option(fn)
    return fn
