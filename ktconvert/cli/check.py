"""The ``check`` command of the command line (``ktconvert check WEIGHTS -- LAUNCH COMMAND``), built on cli_options
only: importing it loads click and nothing heavy; the check itself is ``ktconvert.api.check``."""
from __future__ import annotations

import sys

import click

from ktconvert.cli.options import InputPath, emit, json_option, load_api


@click.command(context_settings={"max_content_width": 110})
@click.argument("weights", type=InputPath())
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
@click.option("--model", type=InputPath(), default=None,
              help="The model SGLang serves (its folder or config.json): its experts, hidden and intermediate sizes "
                   "are checked against the files (default: the command's --model-path, else WEIGHTS' config.json).")
@click.option("--flags-from", type=InputPath(dir_okay=False), default=None,
              help="Read the launch command from FILE (a launch script or its flags).")
@click.option("--cpu-flags", default=None,
              help="Check for another host: its CPU flags (comma-separated), a file with /proc/cpuinfo or lscpu "
                   "output, or a kt-kernel build name (amx, avx512_bf16, avx512_vbmi, avx512_vnni, avx512_base, avx2).")
@click.option("--deep", is_flag=True, help="Also read and decode sampled experts (NaN / Inf scales, corrupt codes) "
                                           "and, with a ktconvert.json, hash every file.")
@click.option("--fix", is_flag=True, help="Print the command with every mismatch corrected.")
@json_option
def check(weights, launch, model, flags_from, cpu_flags, deep, fix, as_json) -> None:
    """Check the launch flags of WEIGHTS (any kt-kernel weights folder or GGUF, with or without ktconvert.json)
    against what its files hold, the model and the CPU: every flag kt-kernel would turn into garbage, a crash or a
    refusal is one line naming the flag, what the files hold and the value that works (exit 4); exit 0 when clean.
    Reads headers only unless --deep.

    \b
      ktconvert check OUT -- python -m sglang.launch_server --model M --kt-weight-path OUT \\
                             --kt-method AMXINT4 --kt-threadpool-count 2
      ktconvert check OUT --fix -- KT_MXFP4_BACKEND=avx2 --kt-method MXFP4 --kt-threadpool-count 2
      ktconvert check OUT --flags-from launch.sh --cpu-flags avx512_vnni
    """
    result = load_api().check(weights, list(launch), model=model, flags_from=flags_from, cpu_flags=cpu_flags,
                              deep=deep)
    emit(result, as_json, result.render(fix=fix))
    if result.exit_code:
        sys.exit(result.exit_code)
