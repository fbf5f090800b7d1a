"""One conversion of a source into its targets, run in this process: every output planned on one opening of the
source, then written from one read of it (``onepass.write_outputs``). ``api.convert`` runs it for
``executor="local"``, and every Ray task of ``ray_executor`` runs it for its layer range.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from ktconvert.cpu.sizes import free_at
from ktconvert.errors import KtConvertError, UsageError
from ktconvert.kinds import KINDS, kind_of
from ktconvert.util.extras import require
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
    MissingExtraError (exit 2) for a target whose kind needs an extra not installed (a GPU target: [gpu]). With
    `layers` (a part) a hub source is opened in part: only the shards the part reads are downloaded
    (ops.hub_shards)."""
    wanted = target_list(targets)
    for extra in dict.fromkeys(KINDS.get(t.kind).extra for t in wanted if KINDS.get(t.kind).extra):
        require(extra, "ktconvert convert")
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
    """Target number `index` from an (out, options) pair: options an instance of a kind's options class
    (CpuOptions, GpuOptions, ...) or a dict of its fields (the first kind, by name, whose options have every key:
    one with "experts" is a GPU checkpoint, one with "method" a CPU output)."""
    out, options = pair
    kind = kind_of(options)
    if kind is not None:
        values = dataclasses.asdict(options)
    elif isinstance(options, dict):
        kind = next((k for _, k in KINDS.items() if set(options) <= {f.name for f in dataclasses.fields(k.options)}),
                    None)
        values = dict(options)
    if kind is None:
        raise UsageError(f"target {index}: expected the options of an output kind ("
                         f"{', '.join(k.options.__name__ for _, k in KINDS.items())}) or a dict of their fields",
                         found=type(options).__name__)
    return Target(kind.name, Path(out), values, f"target {index} ({kind.name} {out})")


def target_output(kind, out, plan, *, resume: bool = False, force: bool = False, layers=None):
    """The Output of `kind` (kinds.OutputKind) writing `plan` into `out`, not yet opened; with `layers` ("A-B")
    the part of those MoE layers: every conversion goes from plan to Output here."""
    kind.check_writable(plan)
    return kind.output_class()(out, plan, resume=resume, force=force, part=select_layers(plan.layers, layers))


def _target_output(input, target: Target, threads, resume: bool, force: bool, layers=None):
    """The Output of `target`, planned (errors name the target); with `layers` ("A-B") the part of those MoE
    layers."""
    plan = plan_target(input, target, threads, gptq_hint="convert each output on its own")
    try:
        return target_output(KINDS.get(target.kind), target.out, plan, resume=resume, force=force, layers=layers)
    except KtConvertError as exc:
        raise exc.within(target.name) from None
