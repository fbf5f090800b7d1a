"""Identify kt-kernel's converted formats (kt-format.md §2.0-2.4, §3.3-3.4): merged safetensors
``blk.L.ffn_{gate,up,down}_exps.E.numa.T.{weight,scale}`` and the ``_layer_L/_numa_T/{PREFIX}_*_{bytes}Byte_*_.kt``
tree, with or without a ktconvert.json.

Nothing in these files names the method or the NUMA count; both follow from the byte counts. For NUMA part t of
T, gate/up hold [n = I/T, k = H] and down [n = H, k = I/T], each weight blob n*k*bits/8 bytes and each scale 4n
bytes (F32 per row). So a gate scale gives I/T, a down scale H, and the gate blob's bytes per weight the bits: 4
is AMXINT4, 8 AMXINT8. MOE_INT4 / MOE_INT8 (AOCL / KML builds) use the same names and cannot be told apart in
merged files: said, not guessed. The ``.kt`` prefix names the method; the byte counts are checked against it and
every file's size against the size in its name (a truncated file is exit 3).
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.launchcheck.identity import Identity, LayerSummary, consolidate, expert_range
from ktconvert.layouts.naming import PROJS, parse_kt_relpath
from ktconvert.methods import all_methods

MERGED_KEY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)(_bwd)?_exps\.(\d+)(?:\.numa\.(\d+))?\."
                        r"(weight|scale|qzeros)$")
GENERAL_PREFIX = "MOE_"      # MOE_INT4 / MOE_INT8: kt-kernel's general kernel (AOCL-BLIS / ARM KML builds)


def converted_methods() -> dict[int, type]:
    """{bits: registered method} of the converted (tiled) methods, from the registry."""
    return {int(m.bits): m for m in all_methods() if m.needs_conversion and getattr(m, "bits", 0)}


def general_name(bits: int) -> str:
    return f"{GENERAL_PREFIX}INT{bits}"


def merged_entries(headers) -> dict:
    """{layer: {(proj, expert, t, part): TensorRef}} of every blk.* expert tensor in the shard headers (backward
    SFT tensors and AWQ's qzeros kept apart under proj + "_bwd" / part "qzeros")."""
    found: dict = defaultdict(dict)
    for header in headers:
        for name, ref in header.tensors.items():
            m = MERGED_KEY.match(name)
            if m:
                layer, proj, bwd, expert, t, part = m.groups()
                found[int(layer)][(proj + (bwd or ""), int(expert), None if t is None else int(t), part)] = ref
    return dict(found)


def identify_merged(folder: Path, entries: dict) -> Identity:
    """Identity of merged blk.* tensors (entries: merged_entries)."""
    summaries = []
    awq = False
    for layer in sorted(entries):
        tensors = {k: v for k, v in entries[layer].items() if not k[0].endswith("_bwd")}
        if tensors and all(k[2] is None for k in tensors):
            awq = True
            summaries.append(_awq_layer(layer, tensors, folder))
            continue
        sizes = {(proj, e, t, part): ref.nbytes for (proj, e, t, part), ref in tensors.items() if t is not None}
        dtypes = {ref.dtype for (_, _, t, part), ref in tensors.items() if part == "weight" and t is not None}
        summaries.append(_tile_layer(layer, sizes, folder, f"blk.{layer}.ffn_*_exps.E.numa.T", dtypes))
    common = consolidate(str(folder), summaries)
    if awq:
        return Identity(str(folder), "merged safetensors (no NUMA parts)", None, sorted(entries), common.experts,
                        common.intermediate, common.hidden, how=common.how,
                        problems=["blk.*.ffn_*_exps.E.{weight,scale,qzeros} without .numa.: kt-kernel's AWQ "
                                  "converter output, which no kt-kernel method reads"])
    identity = _tile_identity(folder, "merged safetensors", sorted(entries), common, bwd=any(
        k[0].endswith("_bwd") for layer in entries.values() for k in layer))
    identity.source = ("merged", entries)
    return identity


def identify_tree(folder: Path) -> Identity | None:
    """Identity of the _layer_L/_numa_T/*.kt tree under `folder` (None if there is none); stats only."""
    layer_dirs = sorted(d for d in os.listdir(folder) if d.startswith("_layer_") and (folder / d).is_dir())
    if not layer_dirs:
        return None
    by_layer: dict = defaultdict(dict)
    prefixes: dict[str, str] = {}
    for name in layer_dirs:
        for dirpath, dirnames, filenames in os.walk(folder / name):
            dirnames.sort()
            for fname in sorted(filenames):
                path = Path(dirpath) / fname
                rel = path.relative_to(folder).as_posix()
                f = parse_kt_relpath(rel)
                if f is None:
                    raise InputError("not a kt-kernel .kt file name (kt-kernel 0.7.2 opens "
                                     "{NAME}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt)", file=rel,
                                     hint="legacy names without _NByte_ are not loadable by current kt-kernel")
                size = path.stat().st_size
                if size != f["bytes"]:
                    raise InputError("file size differs from the size in its name (truncated?)", file=rel,
                                     expected=f"{f['bytes']} bytes", found=f"{size}")
                prefixes.setdefault(f["prefix"], rel)
                by_layer[f["layer"]][(f["proj"], f["expert"], f["t"], "weight" if f["part"] == "quant" else
                                      "scale")] = size
    if len(prefixes) > 1:
        (a, ra), (b, rb) = sorted(prefixes.items())[:2]
        raise InputError("mixed methods in the .kt tree", file=str(folder), expected=f"one file prefix ({a}: {ra})",
                         found=f"{b}: {rb}")
    prefix = next(iter(prefixes))
    summaries = [_tile_layer(layer, {k: v for k, v in sizes.items() if not k[0].endswith("_bwd")}, folder,
                             f"_layer_{layer}/_numa_T/{prefix}_*") for layer, sizes in sorted(by_layer.items())]
    common = consolidate(str(folder), summaries)
    identity = _tile_identity(folder, ".kt tree", sorted(by_layer), common, bwd=False)
    named = _prefix_method(prefix)
    identity.notes = [n for n in identity.notes if not n.startswith(GENERAL_PREFIX)]    # the prefix tells
    if prefix.startswith(GENERAL_PREFIX):
        identity.method, identity.registered = named, None
    elif named != identity.method:
        raise InputError(f"the .kt files are named {prefix}_* but their sizes are {identity.method}'s",
                         file=str(folder), expected=f"{prefix} byte counts", found=identity.how.get("method", ""))
    identity.alternatives = ()
    identity.source = ("tree", prefix, dict(by_layer))
    identity.how["method"] = f"{named}: file prefix {prefix}_, " + identity.how["method"]
    return identity


def _prefix_method(prefix: str) -> str:
    if prefix.startswith(GENERAL_PREFIX):
        return prefix
    by_prefix = {m.file_prefix: m.kt_method for m in converted_methods().values()}
    return by_prefix.get(prefix, prefix)


def _tile_layer(layer: int, sizes: dict, folder: Path, where: str, dtypes=frozenset()) -> LayerSummary:
    """One layer's LayerSummary from {(proj, expert, t, part): bytes}; InputError on a missing or odd tensor."""
    experts = expert_range({k[1] for k in sizes}, layer, str(folder))
    numa = expert_range({k[2] for k in sizes}, layer, str(folder), "NUMA part")
    for e in range(experts):
        for t in range(numa):
            for proj in PROJS:
                for part in ("weight", "scale"):
                    if (proj, e, t, part) not in sizes:
                        raise InputError(f"layer {layer}: expert {e} NUMA part {t} has no {proj} {part}",
                                         file=str(folder), expected=f"{where}: every expert in every NUMA part",
                                         hint="an incomplete copy or conversion")
    part_i, hidden = sizes[("gate", 0, 0, "scale")] // 4, sizes[("down", 0, 0, "scale")] // 4
    blob = sizes[("gate", 0, 0, "weight")]
    if part_i <= 0 or hidden <= 0 or (8 * blob) % (part_i * hidden):
        raise InputError(f"layer {layer}: gate weight bytes are not a whole number of bits per weight",
                         file=str(folder), found=f"{blob} bytes for [n={part_i}, k={hidden}]")
    bits = 8 * blob // (part_i * hidden)
    want = {"gate": (blob, 4 * part_i), "up": (blob, 4 * part_i), "down": (blob, 4 * hidden)}
    for (proj, e, t, part), nbytes in sizes.items():
        if nbytes != want[proj][part == "scale"]:
            raise InputError(f"layer {layer}: expert {e} NUMA part {t} {proj} {part} has another size than expert 0's",
                             file=str(folder), expected=f"{want[proj][part == 'scale']} bytes", found=str(nbytes))
    label = converted_methods()[bits].kt_method if bits in converted_methods() else f"{bits}-bit tiles"
    bad = sorted(d for d in dtypes if d not in ("I8", "U8"))
    how = {"method": f"{bits} bits per weight (gate's blob: {blob} bytes for n={part_i} rows, its F32 scale's, "
                     f"x k={hidden}, down's scale rows)",
           "numa": f"{numa}: numa.0..{numa - 1} of every expert" if where.startswith("blk.") else
                   f"{numa}: _numa_0.._numa_{numa - 1} of every expert",
           "experts": f"{experts} per layer: expert ids 0..{experts - 1}",
           "intermediate": f"{numa * part_i} = {numa} NUMA part{'s' if numa > 1 else ''} x {part_i} rows (gate's F32 "
                           "scale)",
           "hidden": f"{hidden}: rows of down's F32 scale"}
    if bad:
        how["dtype"] = f"weight dtype {bad[0]}: kt-kernel reads it with numpy (I8 / U8 expected)"
    return LayerSummary(layer, label, experts, hidden, numa * part_i, numa, None, how)


def _tile_identity(folder: Path, layout: str, layers: list[int], s: LayerSummary, bwd: bool) -> Identity:
    methods = converted_methods()
    bits = next((b for b, m in methods.items() if m.kt_method == s.label), None)
    identity = Identity(str(folder), layout, s.label if bits else None, layers, s.experts, s.intermediate,
                        s.hidden, numa=s.numa, how=dict(s.how), registered=methods.get(bits))
    identity.how["layers"] = f"{len(layers)} MoE layers: " + _ranges(layers)
    identity.facts["evidence"] = s.how["method"].split(" (")[0]
    if bits is None:
        identity.problems.append(f"{s.label}: not the byte counts of any converted kt-kernel method (no kt-kernel "
                                 "method reads them)")
        return identity
    identity.alternatives = (general_name(bits),)
    identity.notes.append(f"{general_name(bits)} files (kt-kernel's AOCL-BLIS / KML builds) have the same names and "
                          f"sizes; they are taken as {s.label}, which every AVX-512 build of the kt-kernel wheel runs")
    if "dtype" in s.how:
        identity.problems.append(s.how["dtype"])
    if bwd:
        identity.notes.append("ffn_*_bwd_exps tensors (SFT backward weights) are present; inference ignores them")
    return identity


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _awq_layer(layer: int, tensors: dict, folder: Path) -> LayerSummary:
    experts = expert_range({k[1] for k in tensors}, layer, str(folder))
    gate = tensors.get(("gate", 0, None, "weight"))
    n, k8 = (gate.shape + (0, 0))[:2] if gate is not None else (0, 0)
    return LayerSummary(layer, "AWQ column-major", experts, 8 * k8, n, None, None,
                        {"experts": f"{experts} per layer", "intermediate": f"{n}: rows of gate's weight",
                         "hidden": f"{8 * k8}: 8 x int32 columns of gate's weight"})
