"""``verify``'s structure check of a CPU output: every expert tensor (or .kt file) the manifest's method, NUMA
count and model dims call for is present with the right dtype and byte count, found the way kt-kernel's loader
finds it, and nothing else is there. Works on the one walk of the folder (``verification.folder.OutputFolder``).

Two shapes of output: kt-kernel's converted tiles (``check_tiles``: merged shards or the ``.kt`` tree) and HF
tensors kt-kernel reads in place (``check_hf_tensors``). Each returns (problem lines, detail). What is expected is
the writing sink's own plan (``planned_files`` / ``layer_tensors``, from the method's ``tensor_specs``), built from
the manifest without touching the folder.
"""
from __future__ import annotations

import re

from ktconvert.errors import InputError
from ktconvert.formats.inplace_sink import InplaceSink
from ktconvert.formats.kt_sink import KT_LOADS, KtSink
from ktconvert.formats.st_writer import tensor_nbytes
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.util.safe_read import read_json
from ktconvert.verification.folder import OutputFolder

_EXPERT_KEY = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.")


class Problems:
    """One-line problems, every one of them (verify --json lists them all; the text rendering shortens)."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, kind: str, line: str) -> None:
        self.lines.append(line)

    def all_lines(self) -> list[str]:
        return list(self.lines)


def tile_plan(method, manifest: dict) -> KtSink:
    """The plan of the manifest's converted output (`method`, layout, NUMA count, model dims): the sink that wrote
    it, as a plan only."""
    layers, experts = _model(manifest)
    model, layout = manifest["model"], manifest["layout"]
    dense = layout == "safetensors" and bool(manifest.get("include_dense"))
    return KtSink(None, layout, method, int(manifest["numa"]), layers, experts, int(model["hidden"]),
                  int(model["intermediate"]), include_dense=dense)


def _model(manifest: dict) -> tuple[list[int], int]:
    model = manifest["model"]
    return [int(x) for x in model["layers"]], int(model["experts"])


def check_tiles(folder: OutputFolder, manifest: dict, method) -> tuple[list[str], str]:
    """Converted tiles (AMX methods) in the manifest's layout: merged shards or the ``.kt`` tree."""
    if manifest["layout"] not in ("safetensors", "kt"):
        return [f"ktconvert.json: unknown layout {manifest['layout']!r}"], ""
    plan = tile_plan(method, manifest)
    problems = Problems()
    if manifest["layout"] == "safetensors":
        detail = _check_merged(folder, manifest, plan, problems)
    else:
        detail = _check_kt_tree(folder, plan, problems)
    return problems.all_lines(), detail


def check_hf_tensors(folder: OutputFolder, manifest: dict, method) -> tuple[list[str], str]:
    """In-place outputs (HF tensors): every expert tensor present with the method's dtype and shape, the index
    agreeing with the shards."""
    layers, experts = _model(manifest)
    model = manifest["model"]
    problems = Problems()
    entries = _entries(folder, problems)
    sink = InplaceSink(None, method, layers, experts, int(model["hidden"]), int(model["intermediate"]))
    expected = {name: (dtype, shape) for layer in layers for name, dtype, shape in sink.layer_tensors(layer)}
    for name, (dtype, shape) in expected.items():
        if name not in entries:
            problems.add("missing", f"{name}: missing")
        elif entries[name][1] != dtype:
            problems.add("dtype", f"{name}: expected {dtype}, found {entries[name][1]}")
        elif entries[name][2] != tensor_nbytes(dtype, shape):
            problems.add("size", f"{name}: expected {tensor_nbytes(dtype, shape)} bytes for "
                                 f"{dtype} {list(shape)}, found {entries[name][2]}")
    for name in sorted(set(entries) - set(expected)):
        problems.add("extra", f"{entries[name][0]}: {name}: not an expected expert tensor")
    _check_index(folder, entries, problems)
    return problems.all_lines(), f"{len(expected)} expert tensors expected, {len(entries)} found"


def _entries(folder: OutputFolder, problems: Problems) -> dict[str, tuple[str, str, int]]:
    """{key: (shard relative path, dtype, bytes)} of every shard, with the walk's findings as problems."""
    for rel, first in folder.duplicate_names:
        problems.add("duplicate", f"{rel}: same file name as {first} (kt-kernel keys by name)")
    for rel, message in sorted(folder.header_errors.items()):
        problems.add("header", f"{rel}: unreadable safetensors header ({message})")
    for key, rel, first in folder.duplicate_keys:
        problems.add("duplicate", f"{rel}: {key}: also in {first}")
    return {key: (rel, ref.dtype, ref.nbytes) for key, (rel, ref) in folder.entries.items()}


def _probe_count(entries: dict, fmt: str) -> int:
    """kt-kernel's loader probe: count i = 0, 1, ... while fmt.format(i) is a key."""
    i = 0
    while fmt.format(i) in entries:
        i += 1
    return i


def _check_merged(folder: OutputFolder, manifest: dict, plan: KtSink, problems: Problems) -> str:
    entries = _entries(folder, problems)
    numa, experts = plan.numa, plan.experts
    expected = set()
    for layer in plan.moe_layers:
        found_e = _probe_count(entries, f"blk.{layer}.ffn_up_exps.{{}}.numa.0.weight")
        found_t = _probe_count(entries, f"blk.{layer}.ffn_up_exps.0.numa.{{}}.weight")
        if found_e < experts:
            problems.add("probe", f"layer {layer}: kt-kernel's probe finds {found_e} experts, expected {experts}")
        if found_t != numa:
            problems.add("probe", f"layer {layer}: kt-kernel's probe finds {found_t} NUMA parts, expected numa "
                                  f"{numa} (= --kt-threadpool-count)")
        for key, dtype, shape in plan.layer_tensors(layer):
            expected.add(key)
            _check_entry(key, entries.get(key), KT_LOADS.get(dtype, (dtype,)), tensor_nbytes(dtype, shape), problems)
    for key in sorted(set(entries) - expected):
        if _EXPERT_KEY.match(key) or not manifest.get("include_dense", False):
            problems.add("extra", f"{entries[key][0]}: {key}: unexpected tensor")
    _check_index(folder, entries, problems)
    shards = len({rel for rel, _, _ in entries.values()})
    return f"{shards} shards, {len(entries)} tensors, {len(expected)} expert tensors expected"


def _check_entry(key: str, entry, dtypes: tuple[str, ...], nbytes: int, problems: Problems) -> None:
    if entry is None:
        problems.add("missing", f"{key}: missing")
        return
    rel, dtype, found = entry
    if dtype not in dtypes:
        problems.add("dtype", f"{rel}: {key}: dtype {dtype}, expected {' or '.join(dtypes)}")
    if found != nbytes:
        problems.add("size", f"{rel}: {key}: {found} bytes, expected {nbytes}")


def _check_index(folder: OutputFolder, entries: dict, problems: Problems) -> None:
    path = folder.root / INDEX_NAME
    if not path.is_file():
        problems.add("index", f"{INDEX_NAME}: missing")
        return
    try:
        index = read_json(path)
        weight_map, total = index["weight_map"], index["metadata"]["total_size"]
    except (InputError, KeyError, TypeError) as exc:
        problems.add("index", f"{INDEX_NAME}: unreadable ({exc})")
        return
    want_map = {key: rel.rsplit("/", 1)[-1] for key, (rel, _, _) in entries.items()}
    if weight_map != want_map:
        diff = sorted(set(weight_map.items()) ^ set(want_map.items()))
        problems.add("index", f"{INDEX_NAME}: weight_map differs from the shards ({len(diff)} entries, first "
                              f"{diff[0][0]})")
    want_total = sum(n for _, _, n in entries.values())
    if total != want_total:
        problems.add("index", f"{INDEX_NAME}: total_size {total}, shards hold {want_total} tensor bytes")


def _check_kt_tree(folder: OutputFolder, plan: KtSink, problems: Problems) -> str:
    for rel in folder.top_level_shards():
        problems.add("extra", f"{rel}: top-level .safetensors switches kt-kernel into merged mode")
    present = {layer for layer in plan.moe_layers if _kt_layer_folder_ok(folder, layer, plan.numa, problems)}
    expected = {path: f.nbytes for path, f in plan.planned_files().items() if f.layer in present}
    found = folder.tree
    for rel, nbytes in sorted(expected.items()):
        if rel not in found:
            problems.add("missing", f"{rel}: missing")
        elif found[rel] != nbytes:
            problems.add("size", f"{rel}: {found[rel]} bytes, expected {nbytes}")
    for rel in sorted(set(found) - set(expected)):
        problems.add("extra", f"{rel}: unexpected file in the .kt tree")
    return f"{len(plan.moe_layers)} layer folders, {len(found)} .kt-tree files, {len(expected)} expected"


def _kt_layer_folder_ok(folder: OutputFolder, layer: int, numa: int, problems: Problems) -> bool:
    """False (and one problem) when ``_layer_{L}`` is missing; also reports a ``_numa_*`` count != numa."""
    path = folder.root / f"_layer_{layer}"
    if not path.is_dir():
        problems.add("missing layer", f"_layer_{layer}: missing layer folder")
        return False
    parts = sorted(p.name for p in path.iterdir() if p.is_dir() and re.fullmatch(r"_numa_\d+", p.name))
    if parts != [f"_numa_{t}" for t in range(numa)]:
        problems.add("numa", f"_layer_{layer}: NUMA folders {', '.join(parts) or 'none'}, expected _numa_0.."
                             f"_numa_{numa - 1} (numa {numa} = --kt-threadpool-count)")
    return True
