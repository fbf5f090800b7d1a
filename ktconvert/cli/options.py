"""What the commands of ``ktconvert.cli.main`` share: the option groups (an output kind's options, ``--method`` /
``--numa`` / ``--layout`` ... of a CPU output, ``--experts`` / ``--linears`` ... of the GPU checkpoint, generated
from the kind's options dataclass: ``kind_options``; run and progress options, ``--json``), the case-insensitive
choices (``RegistryChoice`` asks the registries only when a value is converted or the help is
shown), the deprecated spellings' warning and the printing of a result. Importing it loads click and nothing heavy.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from contextlib import contextmanager

import click

from ktconvert.errors import InputError, KtConvertError
from ktconvert.kinds import KINDS
from ktconvert.kinds.base import toml_type


def load_api():
    """ktconvert.api, imported on first use (it brings numpy and the converters)."""
    from ktconvert import api

    return api


class RegistryChoice(click.ParamType):
    """A case-insensitive choice among the names a registry holds (``ktconvert.api.choices(kind)``), looked up
    when a value is converted or the help is shown: importing the command line loads no registry."""

    def __init__(self, kind: str):
        self.kind, self.name = kind, kind

    def _choices(self) -> list[str]:
        return load_api().choices(self.kind)

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self._choices()) + "]"

    def convert(self, value, param, ctx):
        try:
            return load_api().choose(self.kind, value)
        except KtConvertError as exc:
            self.fail(str(exc), param, ctx)


class InputPath(click.Path):
    """A path the command reads (SRC, OUT of verify / publish / bundle, a bundle, a job file, --source,
    --calibration...): one that does not exist, or is a file where a folder is expected (or the reverse), is bad
    input: InputError (exit 3) naming it, the same in every command."""

    def __init__(self, file_okay: bool = True, dir_okay: bool = True, hub_ok: bool = False):
        super().__init__(exists=True, file_okay=file_okay, dir_okay=dir_okay)
        self.hub_ok = hub_ok        # hf://ORG/NAME[@REV] / ms://... pass through as given (verify --source)

    def convert(self, value, param, ctx):
        if self.hub_ok and str(value).startswith(("hf://", "ms://")):
            return str(value)
        what = "path" if param is None else (max(param.opts, key=len) if getattr(param, "opts", None) and
                                              param.opts[0].startswith("-") else param.human_readable_name)
        if "://" in str(value) and not os.path.lexists(value):
            raise InputError(f"{what} must be a local path here (hub sources: cpu, gpu, convert, verify --source)",
                             file=value)
        if not os.path.lexists(value):
            raise InputError(f"{what} does not exist", file=value)
        if not self.dir_okay and os.path.isdir(value):
            raise InputError(f"{what} is a folder", file=value, expected="a file")
        if not self.file_okay and not os.path.isdir(value):
            raise InputError(f"{what} is not a folder", file=value, expected="a folder")
        return super().convert(value, param, ctx)


def choice(values: list[str]) -> click.Choice:
    """A fixed, case-insensitive choice."""
    return click.Choice(values, case_sensitive=False)


def prefer(new, old, old_flag: str, new_flag: str):
    """`new` unless the deprecated spelling `old` was given (then a one-line warning on stderr)."""
    if old is None:
        return new
    click.echo(f"warning: {old_flag} is deprecated, use {new_flag}", err=True)
    return old


def emit(result, as_json: bool, text: str | None = None, profile: dict | None = None) -> None:
    """A result object as JSON (to_dict; with `profile`, its "profile" key added) or as text (its rendering)."""
    if as_json:
        data = result.to_dict() if hasattr(result, "to_dict") else dict(result)
        click.echo(json.dumps({**data, "profile": profile} if profile else data, indent=2, sort_keys=True))
    else:
        click.echo(text if text is not None else load_api().render(result))


@contextmanager
def profiling(enabled: bool):
    """--profile: collect where the time goes while the body runs; yields a dict that holds the report ("report")
    afterwards, whose table is printed on stderr (also when the body fails)."""
    holder: dict = {}
    if not enabled:
        yield holder
        return
    from ktconvert.util import profile
    profile.enable()
    try:
        with profile.span("import"):
            load_api()     # usually loaded already by the option parser: then counted in "startup"
        yield holder
    finally:
        holder["report"] = profile.disable()
        click.echo(profile.render(holder["report"]), err=True)


def json_option(fn):
    """--json: the result as one JSON object."""
    return click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")(fn)


def progress_options(fn):
    """--quiet / --json-progress: how make_progress reports."""
    fn = click.option("--json-progress", is_flag=True, help="Progress as JSON lines on stderr.")(fn)
    return click.option("--quiet", is_flag=True, help="No progress output.")(fn)


def run_options(fn):
    """--threads / --resume / --force / --profile of a conversion."""
    for option in reversed([
            click.option("--threads", type=int, default=None, help="Worker threads (default: all cores). Bytes never "
                                                                   "depend on it."),
            click.option("--resume", is_flag=True, help="Continue an interrupted conversion in OUT."),
            click.option("--force", is_flag=True, help="Delete an existing OUT and start over."),
            click.option("--profile", is_flag=True, help="Print where wall and core time went (read, decode, "
                                                         "quantize, write, hashes, fsync, waits) on stderr.")]):
        fn = option(fn)
    return fn


def source_hash_option(fn):
    """--verify-source-hash: hash source files whose sha256 a Hugging Face cache blob name already gives."""
    return click.option("--verify-source-hash", is_flag=True,
                        help="Hash every source file, also an LFS shard of a Hugging Face cache snapshot whose "
                             "blob name gives its sha256, and stop if the two differ.")(fn)


def orientation_option(fn):
    """--expert-orientation: how SRC's fused 3-D experts are stored where their shapes cannot tell."""
    return click.option("--expert-orientation", type=choice(["out", "in"]), default=None,
                        help="SRC's fused 3-D experts where their shape cannot tell (H == I): out = [E, out, in] "
                             "(transformers), in = [E, in, out].")(fn)


def source_arg(src: str, expert_orientation: str | None):
    """SRC as given, or opened with --expert-orientation (an inputs.Input, which every conversion and plan takes)."""
    if expert_orientation is None:
        return src
    from ktconvert.run.inputs import open_input

    return open_input(src, expert_orientation)


def click_type(fields: list, hint):
    """The click type of an option that `fields` (the same field of one or more kinds' options) give: their
    choices (a registry's names, asked when a value is converted, or fixed values) when they agree, else the
    field's plain type; None for a flag."""
    hint = toml_type(hint)
    if hint is bool:
        return None
    found = fields[0].metadata["choices"]
    if found and all(f.metadata["choices"] == found for f in fields):
        return RegistryChoice(found) if isinstance(found, str) else choice(list(found))
    return hint


def kind_options(name: str):
    """Decorator: the options of output kind `name` (its target fields, kinds.OutputKind.fields) as a command's
    own options (`ktconvert cpu` / `gpu`): type and choices, default (a field without one is required) and help
    from the options dataclass' fields."""
    kind = KINDS.get(name)
    hints = typing.get_type_hints(kind.options)

    def deco(fn):
        for field in reversed(kind.fields()):
            kind_type = click_type([field], hints[field.name])
            default = None if field.default is dataclasses.MISSING else field.default    # a default_factory's: None
            if kind_type is None:
                settings = {"is_flag": True}
            elif field.name in kind.required():
                settings = {"type": kind_type, "required": True}
            else:
                settings = {"type": kind_type, "default": default, "show_default": default is not None}
            if field.metadata.get("metavar") and kind_type is not None:
                settings["metavar"] = field.metadata["metavar"]
            help = field.metadata.get("command_help") or field.metadata["help"]
            fn = click.option(f"--{field.name.replace('_', '-')}", help=help + ".", **settings)(fn)
        return fn

    return deco


def sampling_options(fn):
    """--max-length / --num-samples: how much of --calibration the calibrated paths read (as expert-stats)."""
    fn = click.option("--num-samples", type=click.IntRange(min=1), default=None,
                      help="With --calibration: use the first N samples (default: all).")(fn)
    return click.option("--max-length", type=click.IntRange(min=1), default=None,
                        help="With --calibration: tokens per sample at most (default 2048).")(fn)


ray_address_option = click.option("--ray-address", default=None,
                                  help="Ray cluster to join (default: a local Ray instance).")
DISTRIBUTION = ("layers", "executor", "ray_address", "parts", "parts_dir", "workers")


def distribution_options(fn):
    """--layers (write one part) / --executor ray with --ray-address, --parts, --parts-dir, --workers (of cpu, gpu,
    convert)."""
    for option in reversed([
            click.option("--layers", "layers", default=None, metavar="LAYERS",
                         help="Write only these MoE layers (decoder layer numbers: ranges and lists, 3-17, 1,3,5 or "
                              "1-3,7, as verify takes them) as a part: their files and ktconvert-part.json; "
                              "`ktconvert merge OUT PART...` joins the parts."),
            click.option("--executor", type=choice(["local", "ray"]), default="local", show_default=True,
                         help="ray: run on a Ray cluster, OUT written on this host. The layers are split into "
                              "parts run as Ray tasks and merged; with --quant gptq the layers stay in order "
                              "and each layer's calibration forward and experts are split (--workers)."),
            ray_address_option,
            click.option("--parts", type=int, default=None,
                         help="With --executor ray: layer ranges of about equal bytes (default: as many as the live "
                              "nodes run at once by CPUs, --threads each, and memory, the plan's peak RAM each)."),
            click.option("--parts-dir", type=click.Path(file_okay=False), default=None,
                         help="With --executor ray: where the parts are written, a folder every node sees "
                              "(default: OUT.parts next to OUT)."),
            click.option("--workers", type=click.IntRange(min=1), default=None,
                         help="With --executor ray and --quant gptq: Ray tasks per layer step, each holding a "
                              "slice of the calibration samples or a range of the layer's experts (default: as many "
                              "tasks as the cluster's memory and CPUs hold); the bytes are those of a local run.")]):
        fn = option(fn)
    return fn


def conversion_options(fn):
    """The options cpu, gpu and convert share, in this order: run options (--threads, --resume, --force,
    --profile), --verify-source-hash, the distribution options (--layers, --executor ...), progress, --json,
    --expert-orientation."""
    for option in (orientation_option, json_option, progress_options, distribution_options, source_hash_option,
                   run_options):
        fn = option(fn)
    return fn


def pop_distribution(options: dict) -> dict:
    """The distribution options (--layers, --executor, --ray-address, --parts, --parts-dir, --workers) taken out of a
    command's keyword arguments, as the API's keywords (which check how they combine)."""
    return {key: options.pop(key) for key in DISTRIBUTION}


def ray_plan_options(fn):
    """plan's --executor ray with the run's --ray-address / --parts / --workers / --threads, and the cluster it is
    figured for when there is no live one (--nodes, --node-cpus, --node-memory) and --node-rate."""
    for option in reversed([
            click.option("--executor", type=choice(["local", "ray"]), default="local", show_default=True,
                         help="ray: also what a Ray run with these options asks of the cluster (computed)."),
            click.option("--ray-address", default=None, metavar="ADDR",
                         help="With --executor ray: the live cluster whose nodes are read (no task is started; "
                              "default: RAY_ADDRESS when set)."),
            click.option("--parts", type=int, default=None, help="With --executor ray: as convert's (default: "
                                                                  "what the nodes run at once)."),
            click.option("--workers", type=int, default=None,
                         help="With --executor ray and --quant gptq: as cpu's / gpu's (default: what the nodes' "
                              "memory holds)."),
            click.option("--threads", type=click.IntRange(min=1), default=None,
                         help="CPUs per part task with --executor ray (default 1, as convert's); else the workers "
                              "the peak RAM is estimated for (default: all cores)."),
            click.option("--nodes", type=int, default=None,
                         help="With --executor ray and no live cluster: N alike nodes, with --node-cpus and "
                              "--node-memory."),
            click.option("--node-cpus", type=float, default=None, help="CPUs of each --nodes node."),
            click.option("--node-memory", default=None, metavar="SIZE",
                         help="Ray's `memory` resource of each --nodes node (by default its available RAM less "
                              "the object store's 30%; 512G, 1.5T: powers of 1000; 256GiB: of 1024)."),
            click.option("--node-rate", type=float, default=None, metavar="GB/S",
                         help="With --executor ray: source GB per second one node converts, all its parts "
                              "together (default 0.87: measured on 2 cores with every hash, README Benchmarks; "
                              "time one `--layers A-B` part on a node for yours).")]):
        fn = option(fn)
    return fn


def batch_executor_options(fn):
    """--executor / --ray-address of batch."""
    fn = ray_address_option(fn)
    return click.option("--executor", type=choice(["local", "ray"]), default="local", show_default=True,
                        help="ray: every job a Ray task, run at once; the same summary.")(fn)
