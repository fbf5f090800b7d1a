"""One conversion of a source into its targets, run in this process: every output planned on one opening of the
source, then written from one read of it (``onepass.write_outputs``). ``api.convert`` runs it for
``executor="local"``, and every Ray task of ``ray_executor`` runs it for its layer range.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from ktconvert.cpu.output import CpuOutput
from ktconvert.cpu.plan import CpuOptions
from ktconvert.cpu.sizes import free_at
from ktconvert.errors import KtConvertError, UsageError
from ktconvert.util.extras import require
from ktconvert.gpu.output import GpuOutput
from ktconvert.gpu.plan import GpuOptions
from ktconvert.run.inputs import open_input
from ktconvert.run.outputs import write_outputs
from ktconvert.distributed.parts import select_layers
from ktconvert.run.planning import plan_target
from ktconvert.results import ConvertResult
from ktconvert.run.targets import Target, check_disk, load_targets, parse_target, parse_targets, refuse_shared_folders


def convert_here(src, targets, *, threads: int | None = None, resume: bool = False, force: bool = False,
                 progress=None, layers=None, verify_source_hash: bool = False) -> list[ConvertResult]:
    """api.convert with executor "local" (its arguments): plan every target, then write them in one pass."""
    t0 = time.monotonic()
    built = plan_outputs(src, targets, threads=threads, resume=resume, force=force, layers=layers)
    return write_outputs(built, threads=threads, progress=progress, timings={"plan": time.monotonic() - t0},
                         verify_source_hash=verify_source_hash)


def plan_outputs(src, targets, *, threads: int | None = None, resume: bool = False, force: bool = False,
                 layers=None) -> list:
    """The output.Output of each target (as api.convert takes them), planned on one opening of `src` and not yet
    opened; UsageError for GPTQ, two targets in one folder or too little free disk for all of them,
    MissingExtraError (exit 2) for a GPU target without the [gpu] extra. With `layers` (a part) a hub source is
    opened in part: only the shards the part reads are downloaded (ops.hub_shards)."""
    wanted = target_list(targets)
    if any(target.kind == "gpu" for target in wanted):
        require("gpu", "ktconvert convert")
    input = open_input(src, in_part=layers is not None)
    built = [_target_output(input, target, threads, resume, force, layers) for target in wanted]
    check_disk([(o.out_dir, o.plan["total_bytes"]) for o in built if not (resume and o.out_dir.exists())], free_at)
    return built


def target_list(value) -> list[Target]:
    """targets.Target list from what api.convert accepts (a targets file, or a list of tables, pairs, Targets)."""
    if isinstance(value, (str, os.PathLike)):
        return load_targets(value)
    if not isinstance(value, (list, tuple)) or not value:
        return parse_targets(value)             # the error saying what targets must be
    targets = [item if isinstance(item, Target) else _pair_target(item, index) if isinstance(item, tuple)
               else parse_target(item, index) for index, item in enumerate(value, 1)]
    refuse_shared_folders(targets)
    return targets


def _pair_target(pair: tuple, index: int) -> Target:
    """Target number `index` from an (out, CpuOptions | GpuOptions | dict of either's fields: one with "experts"
    is a GPU checkpoint) pair."""
    out, options = pair
    if isinstance(options, (CpuOptions, GpuOptions)):
        kind, values = ("cpu" if isinstance(options, CpuOptions) else "gpu"), dataclasses.asdict(options)
    elif isinstance(options, dict):
        kind, values = ("gpu" if "experts" in options else "cpu"), dict(options)
    else:
        raise UsageError(f"target {index}: expected CpuOptions, GpuOptions or a dict of their fields",
                         found=type(options).__name__)
    return Target(kind, Path(out), values, f"target {index} ({kind} {out})")


def _target_output(input, target: Target, threads, resume: bool, force: bool, layers=None):
    """The CpuOutput / GpuOutput of `target`, planned (errors name the target); with `layers` ("A-B") the part of
    those MoE layers."""
    plan = plan_target(input, target, threads, gptq_hint="convert each output on its own")
    try:
        if target.kind == "cpu":
            plan.refuse_dropped_biases()
            return CpuOutput(target.out, plan, resume=resume, force=force, part=select_layers(plan.layers, layers))
        return GpuOutput(target.out, plan, resume=resume, force=force, part=select_layers(plan.layers, layers))
    except KtConvertError as exc:
        raise exc.within(target.name) from None
