"""The parts the commands of ``ktconvert.cli`` share: the option groups (``--method`` / ``--numa`` / ``--layout`` of
a CPU output, ``--experts`` / ``--linears`` of the GPU checkpoint, run and progress options, ``--json``), the
case-insensitive choices (``RegistryChoice`` asks the registries only when a value is converted or the help is
shown), the deprecated spellings' warning and the printing of a result. Importing it loads click and nothing heavy.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import click

from ktconvert.errors import KtConvertError

LAYOUTS = ["safetensors", "kt"]
GPU_GROUP_SIZES = ["32", "64", "128"]
LINEARS = ["fp8", "bf16", "keep"]


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
    from ktconvert import profile

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


def orientation_option(fn):
    """--expert-orientation: how SRC's fused 3-D experts are stored where their shapes cannot tell."""
    return click.option("--expert-orientation", type=choice(["out", "in"]), default=None,
                        help="SRC's fused 3-D experts where their shape cannot tell (H == I): out = [E, out, in] "
                             "(transformers), in = [E, in, out].")(fn)


def source_arg(src: str, expert_orientation: str | None):
    """SRC as given, or opened with --expert-orientation (an inputs.Input, which every conversion and plan takes)."""
    if expert_orientation is None:
        return src
    from ktconvert.inputs import open_input

    return open_input(src, expert_orientation)


def cpu_options(fn):
    """--method / --numa / --layout: what a CPU output is (shared by plan, cpu, convert)."""
    fn = click.option("--layout", type=choice(LAYOUTS), default="safetensors", show_default=True,
                      help="safetensors: one merged shard per MoE layer; kt: the _layer_L/_numa_t/*.kt tree.")(fn)
    fn = click.option("--numa", type=int, default=1, show_default=True,
                      help="NUMA parts T; must equal SGLang's --kt-threadpool-count at run time.")(fn)
    return click.option("--method", type=RegistryChoice("method"), default=None,
                        help="kt-kernel method of the CPU output (`ktconvert methods` describes them).")(fn)


def gpu_options(fn):
    """--experts / --linears: what a GPU checkpoint is (shared by plan, gpu, convert)."""
    fn = click.option("--linears", type=choice(LINEARS), default="fp8", show_default=True,
                      help="Attention / dense / shared-expert linears of the GPU checkpoint: fp8 = 128x128 block FP8 + "
                           "linear_fp8_config, bf16 = BF16 (for transformers / vLLM), keep = as stored.")(fn)
    return click.option("--experts", type=RegistryChoice("experts"), default=None,
                        help="compressed-tensors scheme of the GPU checkpoint's routed experts.")(fn)
