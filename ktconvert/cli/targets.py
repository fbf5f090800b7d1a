"""The targets of ``ktconvert convert`` on the command line: each ``--KIND OUT`` (``--cpu OUT`` / ``--gpu OUT``: a
kind of ``kinds.KINDS``) starts an output, and the output options after it (its kind's target fields: --method,
--numa, --experts, ...) are that output's. The options and their help are generated from the kinds' options
dataclasses (``target_options``).

    convert SRC [shared options] --cpu OUT1 [CPU options] --cpu OUT2 [CPU options] --gpu OUT3 [GPU options]

Options given before the first target are shared: every command-line target of a kind that has them takes them
(a target's own value wins). ``TargetCommand`` reads the arguments in order before click parses the rest (run
options, --targets, --json, ...), and leaves the target tables (``targets`` module) in ``ctx.meta``.

The old spelling (one --cpu, one --gpu, each side's options anywhere) still works: an option after a target of
the other kind goes to the one target of its kind, with a deprecation line on stderr. Light: loads click and the
kinds' declarations only.
"""
from __future__ import annotations

import dataclasses
import typing

import click

from ktconvert.cli.options import click_type
from ktconvert.kinds import KINDS, kinds
from ktconvert.run.targets import load_targets, parse_target, refuse_shared_folders

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
            if starts_target(flag) or flag in output_params:
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
        starts = ", ".join(f"--{kind.name} OUT [--{_flag(kind.fields()[0].name)} ...]" for kind in kinds())
        raise click.UsageError(f"give one or more outputs: {starts} or --targets FILE", ctx)
    refuse_shared_folders(targets)
    return targets


def _tables(kinds: list[tuple[str, str]], events: list, ctx: click.Context) -> list[dict]:
    """One table per target, in command-line order, from the options read (see the module's rules)."""
    tables = [{kind: out} for kind, out in kinds]
    moved, narrowed = [], []
    old_spelling = len(kinds) > 1 and _one_each(kinds)
    for number, key, value, flag in events:
        if number is None:
            takers = [t for (kind, _), t in zip(kinds, tables) if key in _keys(kind)]
            if not takers:
                raise click.UsageError(f"{flag} applies to no target: give it after a {kind_flags()} of a kind "
                                       f"that has it", ctx)
            for table in takers:
                table[key] = value
            continue
        kind = kinds[number - 1][0]
        if key in _keys(kind):
            tables[number - 1][key] = value
            if old_spelling and all(key in _keys(k) for k, _ in kinds):
                narrowed.append(f"{flag} after --{kind} {kinds[number - 1][1]}")
            continue
        owner = _old_spelling_owner(kinds, key)
        if owner is None:
            raise click.UsageError(f"{flag} is not an option of a {KINDS.get(kind).label} output (it follows --{kind} "
                                   f"{kinds[number - 1][1]}): give it after the target it belongs to", ctx)
        tables[owner][key] = value
        moved.append(f"{flag} after --{kind}")
    given = " / ".join(f"--{kind}" for kind in dict.fromkeys(k for k, _ in kinds))
    if moved:
        click.echo(f"warning: {', '.join(moved)} is deprecated: give each output's options after its own "
                   f"{given}", err=True)
    if narrowed:
        click.echo(f"warning: {', '.join(narrowed)} applies to that output only (before this release it applied to "
                   f"both); give it before the first {given} for both", err=True)
    return tables


def _old_spelling_owner(kinds: list[tuple[str, str]], key: str) -> int | None:
    """The index of the one target an option of another kind goes to in the old spelling (at most one target of
    each kind), or None."""
    if not _one_each(kinds):
        return None
    owners = [index for index, (kind, _) in enumerate(kinds) if key in _keys(kind)]
    return owners[0] if len(owners) == 1 else None


def _one_each(kinds: list[tuple[str, str]]) -> bool:
    return len({kind for kind, _ in kinds}) == len(kinds)


def _keys(kind: str) -> set[str]:
    """The target keys of `kind` (its options' target fields)."""
    return {field.name for field in KINDS.get(kind).fields()}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def starts_target(flag: str) -> bool:
    """Whether `flag` is --KIND of a registered output kind (it starts a target: --cpu, --gpu)."""
    return flag.startswith("--") and flag[2:] in KINDS.names()


def kind_fields(kind: str, options: dict) -> dict:
    """The options that are target fields of `kind` (plan's old spelling: one output of that kind)."""
    return {key: value for key, value in options.items() if key in _keys(kind)}


def kind_flags() -> str:
    """'--cpu / --gpu': the flags that start a target, one per registered kind."""
    return " / ".join(f"--{name}" for name in KINDS.names())


def _option_help(owners: list, field_name: str) -> str:
    """The help of a target option: each kind's text after its label, the kinds with the same text and default
    together ("[CPU, GPU] ..."), ending in the default or "required"."""
    texts: dict[str, list[str]] = {}
    for kind in owners:
        field = next(f for f in kind.fields() if f.name == field_name)
        if field_name in kind.required():
            tail = "; required"
        elif field.default is None or field.default is False or field.default is dataclasses.MISSING:
            tail = ""        # no default to name (a default_factory's is computed when options are made)
        else:
            tail = f" (default {field.default})"
        texts.setdefault(field.metadata["help"] + tail, []).append(kind.label)
    return "; ".join(f"[{', '.join(labels)}] {text}" for text, labels in texts.items()) + "."


def target_options(fn):
    """The options of `convert`'s targets (read by TargetCommand, shown by --help), generated from the kinds'
    options: for each kind --KIND OUT, then each of its target fields not given by an earlier kind."""
    options, seen = [], []
    for kind in kinds():
        options.append(click.option(f"--{kind.name}", f"{kind.name.replace('-', '_')}_targets", metavar="OUT",
                                    multiple=True, help=kind.help))
        for field in kind.fields():
            if field.name in seen:
                continue
            seen.append(field.name)
            owners = [k for k in kinds() if field.name in _keys(k.name)]
            fields = [f for k in owners for f in k.fields() if f.name == field.name]
            kind_type = click_type(fields, typing.get_type_hints(owners[0].options)[field.name])
            extra = {"is_flag": True} if kind_type is None else {"type": kind_type}
            if kind_type is not None and field.metadata.get("metavar"):
                extra["metavar"] = field.metadata["metavar"]
            options.append(click.option(f"--{_flag(field.name)}", default=None, help=_option_help(owners, field.name),
                                        **extra))
    for option in reversed(options):
        fn = option(fn)
    return fn


_OUTPUT_KEYS = {field.name for kind in kinds() for field in kind.fields()}
