"""``ktconvert verify OUT``: is a converted folder loadable by kt-kernel as the manifest says, and unchanged?

Checks, in order: manifest (``ktconvert.json`` present and parseable), structure (every expected expert tensor or
.kt file present with the byte count that the recorded method, NUMA count and model dims give, probed the way
kt-kernel's loader probes, nothing extra), hashes (``--hashes``: every file and tensor re-hashed against the
manifest), numerics (``--source``: ``ktconvert.verify.numeric_amx.check_numerics`` when installed) and remote
(``--remote``: ``ktconvert.ops.hub.verify_remote`` when installed). Returns a dict; ``render`` makes the table.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from ktconvert.errors import InputError, UnknownNameError
from ktconvert.extras import require

MAX_LINES_PER_KIND = 10
_EXPERT_KEY = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.")


class _Problems:
    """One-line problems, at most MAX_LINES_PER_KIND per kind, then a count of the rest."""

    def __init__(self):
        self.lines: list[str] = []
        self.dropped: dict[str, int] = {}
        self._kinds: dict[str, int] = {}

    def add(self, kind: str, line: str) -> None:
        self._kinds[kind] = self._kinds.get(kind, 0) + 1
        if self._kinds[kind] <= MAX_LINES_PER_KIND:
            self.lines.append(line)
        else:
            self.dropped[kind] = self.dropped.get(kind, 0) + 1

    def total(self) -> int:
        return sum(self._kinds.values())

    def all_lines(self) -> list[str]:
        return self.lines + [f"... and {n} more: {kind}" for kind, n in sorted(self.dropped.items())]


def verify(out, source=None, hashes: bool = False, tokens: int = 8, layers=None, experts="4", threshold=None,
           remote=None, hub: str = "hf", revision=None, endpoint=None) -> dict:
    """Verify output folder `out`. Returns {"ok": bool, "out", "problems": [one-line str], "checks": [{name,
    status ("ok" | "failed" | "skipped"), detail}], plus "hashes" / "numerics" / "remote" reports
    when those ran}."""
    from ktconvert.formats.out_manifest import load_manifest, verify_hashes

    result = {"ok": True, "out": str(out), "problems": [], "checks": []}
    if str(out).endswith(".tar.zst"):
        from ktconvert.ops.bundle import verify_bundle

        report = verify_bundle(out)
        result["bundle"] = report
        _add_check(result, "bundle", report["problems"], f"{report['checked']} members hashed while streaming")
        return result
    if remote == "":  # `verify REPO --remote`: OUT names a hub repo; its own ktconvert.json is the reference
        from ktconvert.ops.hub import verify_remote

        _add_report(result, "remote", verify_remote(None, str(out), hub, revision, endpoint))
        return result
    try:
        manifest = load_manifest(out)
    except InputError as exc:
        _add_check(result, "manifest", [str(exc)], "")
        return result
    _add_check(result, "manifest", [], _manifest_summary(manifest))
    if manifest.get("kind", "cpu") == "cpu":
        problems, detail = check_structure(out, manifest)
        _add_check(result, "structure", problems, detail)
    elif manifest.get("kind") == "gpu":
        require("gpu", "verify of a GPU checkpoint")
        from ktconvert.gpu.verify import check_gpu_checkpoint

        result["gpu"] = check_gpu_checkpoint(out, source=source, experts=experts)
        for check in result["gpu"]["checks"]:
            _add_check(result, check["name"], check["problems"], check["detail"])
    else:
        _skip(result, "structure", "skipped", f"no structure rules for kind {manifest.get('kind')!r}")
    if hashes:
        report = verify_hashes(out, manifest)
        result["hashes"] = report
        _add_check(result, "hashes", report["problems"],
                   f"{report['files_checked']} files, {report['tensors_checked']} tensors re-hashed")
    else:
        _skip(result, "hashes", "skipped", "use --hashes")
    if manifest.get("kind", "cpu") == "cpu" and _known_method(manifest):
        if expected_sizes(manifest) is None:
            from ktconvert.verify.numeric_inplace import check_inplace_numerics as check
        else:
            from ktconvert.verify.numeric_amx import check_numerics as check
        _add_report(result, "numerics", check(out, manifest, source, tokens, layers, experts, threshold))
    if remote is not None:
        from ktconvert.ops.hub import verify_remote

        _add_report(result, "remote", verify_remote(manifest, remote, hub, revision, endpoint))
    else:
        _skip(result, "remote", "skipped", "use --remote REPO")
    return result


def _add_check(result: dict, name: str, problems: list[str], detail: str) -> None:
    result["checks"].append({"name": name, "status": "failed" if problems else "ok", "detail": detail})
    result["problems"].extend(problems)
    result["ok"] = result["ok"] and not problems


def _skip(result: dict, name: str, status: str, detail: str) -> None:
    result["checks"].append({"name": name, "status": status, "detail": detail})


def _add_report(result: dict, name: str, report: dict) -> None:
    """Record a sub-check's report ({"ok", "problems", "summary"}) as one row."""
    result[name] = report
    problems = list(report.get("problems", []))
    if not report.get("ok", False) and not problems:
        problems = [f"{name}: check failed"]
    _add_check(result, name, problems, str(report.get("summary", report.get("detail", ""))))


def _known_method(manifest: dict) -> bool:
    from ktconvert.quant.methods import METHODS

    return manifest.get("method", "") in METHODS


def _manifest_summary(manifest: dict) -> str:
    model = manifest["model"]
    return (f"{manifest.get('method')}, numa {manifest['numa']}, layout {manifest['layout']}, "
            f"{len(model.get('layers', []))} MoE layers x {model.get('experts')} experts, "
            f"{len(manifest['files'])} files")


def expected_sizes(manifest: dict) -> dict[str, tuple[int, int]]:
    """{proj: (quant bytes, scale bytes)} per NUMA part for the manifest's method, NUMA count and model dims."""
    from ktconvert.formats.kt_sink import PROJS, part_shape
    from ktconvert.quant.methods import METHODS

    method = METHODS.get(manifest["method"])
    if not getattr(method, "needs_conversion", True):
        return None  # in-place methods: HF tensors, checked by name/dtype/shape instead
    model = manifest["model"]
    sizes = {}
    for proj in PROJS:
        n, k = part_shape(proj, int(model["hidden"]), int(model["intermediate"]), int(manifest["numa"]))
        sizes[proj] = (int(method.quant_bytes(n, k)), int(method.scale_bytes(n)))
    return sizes


def check_structure(out, manifest: dict) -> tuple[list[str], str]:
    """(problems, detail) of the folder's layout against the manifest's method / NUMA count / model."""
    from ktconvert.errors import ShapeError

    try:
        sizes = expected_sizes(manifest)
        model = manifest["model"]
        layers, experts = [int(x) for x in model["layers"]], int(model["experts"])
    except (KeyError, TypeError, ValueError, UnknownNameError, ShapeError) as exc:
        return [f"ktconvert.json: cannot derive the expected tensors ({exc})"], ""
    problems = _Problems()
    if sizes is None:
        detail = _check_inplace(Path(out), manifest, layers, experts, problems)
    elif manifest["layout"] == "safetensors":
        detail = _check_merged(Path(out), manifest, layers, experts, sizes, problems)
    elif manifest["layout"] == "kt":
        detail = _check_kt_tree(Path(out), manifest, layers, experts, sizes, problems)
    else:
        return [f"ktconvert.json: unknown layout {manifest['layout']!r}"], ""
    return problems.all_lines(), detail


def _merged_entries(root: Path, problems: _Problems) -> dict[str, tuple[str, str, int]]:
    """{key: (shard relative path, dtype, bytes)} of every *.safetensors under root (recursive, as kt-kernel)."""
    from ktconvert.formats.safetensors_reader import parse_header

    entries, basenames = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith(".safetensors")):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if name in basenames:
                problems.add("duplicate", f"{rel}: same file name as {basenames[name]} (kt-kernel keys by name)")
            basenames[name] = rel
            try:
                header = parse_header(path)
            except InputError as exc:
                problems.add("header", f"{rel}: unreadable safetensors header ({exc})")
                continue
            for key, ref in header.tensors.items():
                if key in entries:
                    problems.add("duplicate", f"{rel}: {key}: also in {entries[key][0]}")
                entries[key] = (rel, ref.dtype, ref.nbytes)
    return entries


def _check_inplace(root: Path, manifest: dict, layers: list[int], experts: int, problems: _Problems) -> str:
    """In-place outputs (bf16 / rawint4 / fp8): every expert tensor present with the method's dtype and shape."""
    from ktconvert.formats.inplace_sink import InplaceSink
    from ktconvert.formats.safetensors_reader import DTYPES
    from ktconvert.quant.methods import METHODS

    method = METHODS.get(manifest["method"])
    model = manifest["model"]
    group = manifest.get("group_size")
    if group and hasattr(method, "with_group_size"):
        method = method.with_group_size(int(group))
    sink = InplaceSink(root, method, layers, experts, int(model["hidden"]), int(model["intermediate"]))
    entries = _merged_entries(root, problems)
    expected = {name: (dtype, shape) for layer in layers for name, dtype, shape in sink.layer_specs(layer)}
    for name, (dtype, shape) in expected.items():
        if name not in entries:
            problems.add("missing", f"{name}: missing")
        elif entries[name][1] != dtype:
            problems.add("dtype", f"{name}: expected {dtype}, found {entries[name][1]}")
        elif entries[name][2] != DTYPES[dtype][0] * math.prod(shape):
            problems.add("size", f"{name}: expected {DTYPES[dtype][0] * math.prod(shape)} bytes for "
                                 f"{dtype} {list(shape)}, found {entries[name][2]}")
    for name in sorted(set(entries) - set(expected)):
        problems.add("extra", f"{entries[name][0]}: {name}: not an expected expert tensor")
    return f"{len(expected)} expert tensors expected, {len(entries)} found"


def _probe_count(entries: dict, fmt: str) -> int:
    """kt-kernel's loader probe: count i = 0, 1, ... while fmt.format(i) is a key."""
    i = 0
    while fmt.format(i) in entries:
        i += 1
    return i


def _check_merged(root: Path, manifest: dict, layers: list[int], experts: int, sizes: dict,
                  problems: _Problems) -> str:
    from ktconvert.formats.kt_sink import PROJS, merged_key

    entries = _merged_entries(root, problems)
    numa = int(manifest["numa"])
    expected = set()
    for layer in layers:
        found_e = _probe_count(entries, f"blk.{layer}.ffn_up_exps.{{}}.numa.0.weight")
        found_t = _probe_count(entries, f"blk.{layer}.ffn_up_exps.0.numa.{{}}.weight")
        if found_e < experts:
            problems.add("probe", f"layer {layer}: kt-kernel's probe finds {found_e} experts, expected {experts}")
        if found_t != numa:
            problems.add("probe", f"layer {layer}: kt-kernel's probe finds {found_t} NUMA parts, expected numa "
                                  f"{numa} (= --kt-threadpool-count)")
        for proj in PROJS:
            for e in range(experts):
                for t in range(numa):
                    for part, dtypes, nbytes in (("weight", ("I8", "U8"), sizes[proj][0]),
                                                 ("scale", ("F32",), sizes[proj][1])):
                        key = merged_key(layer, proj, e, t, part)
                        expected.add(key)
                        _check_entry(key, entries.get(key), dtypes, nbytes, problems)
    for key in sorted(set(entries) - expected):
        if _EXPERT_KEY.match(key) or not manifest.get("include_dense", False):
            problems.add("extra", f"{entries[key][0]}: {key}: unexpected tensor")
    _check_index(root, entries, problems)
    shards = len({rel for rel, _, _ in entries.values()})
    return f"{shards} shards, {len(entries)} tensors, {len(expected)} expert tensors expected"


def _check_entry(key: str, entry, dtypes: tuple[str, ...], nbytes: int, problems: _Problems) -> None:
    if entry is None:
        problems.add("missing", f"{key}: missing")
        return
    rel, dtype, found = entry
    if dtype not in dtypes:
        problems.add("dtype", f"{rel}: {key}: dtype {dtype}, expected {' or '.join(dtypes)}")
    if found != nbytes:
        problems.add("size", f"{rel}: {key}: {found} bytes, expected {nbytes}")


def _check_index(root: Path, entries: dict, problems: _Problems) -> None:
    import json

    from ktconvert.formats.kt_sink import INDEX_NAME

    path = root / INDEX_NAME
    if not path.is_file():
        problems.add("index", f"{INDEX_NAME}: missing")
        return
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        weight_map, total = index["weight_map"], index["metadata"]["total_size"]
    except (ValueError, KeyError, TypeError) as exc:
        problems.add("index", f"{INDEX_NAME}: unreadable ({exc})")
        return
    want_map = {key: Path(rel).name for key, (rel, _, _) in entries.items()}
    if weight_map != want_map:
        diff = sorted(set(weight_map.items()) ^ set(want_map.items()))
        problems.add("index", f"{INDEX_NAME}: weight_map differs from the shards ({len(diff)} entries, first "
                              f"{diff[0][0]})")
    want_total = sum(n for _, _, n in entries.values())
    if total != want_total:
        problems.add("index", f"{INDEX_NAME}: total_size {total}, shards hold {want_total} tensor bytes")


def _check_kt_tree(root: Path, manifest: dict, layers: list[int], experts: int, sizes: dict,
                   problems: _Problems) -> str:
    from ktconvert.formats.kt_sink import PROJS, kt_relpath
    from ktconvert.quant.methods import METHODS

    prefix = METHODS.get(manifest["method"]).file_prefix
    numa = int(manifest["numa"])
    for name in sorted(os.listdir(root)):
        if name.endswith(".safetensors"):
            problems.add("extra", f"{name}: top-level .safetensors switches kt-kernel into merged mode")
    expected = {}
    for layer in layers:
        if not _kt_layer_folder_ok(root, layer, numa, problems):
            continue
        for proj in PROJS:
            for e in range(experts):
                for t in range(numa):
                    for part, nbytes in (("quant", sizes[proj][0]), ("scale", sizes[proj][1])):
                        expected[kt_relpath(layer, t, prefix, proj, e, nbytes, part)] = nbytes
    found = _tree_files(root)
    for rel, nbytes in sorted(expected.items()):
        if rel not in found:
            problems.add("missing", f"{rel}: missing")
        elif found[rel] != nbytes:
            problems.add("size", f"{rel}: {found[rel]} bytes, expected {nbytes}")
    for rel in sorted(set(found) - set(expected)):
        problems.add("extra", f"{rel}: unexpected file in the .kt tree")
    return f"{len(layers)} layer folders, {len(found)} .kt-tree files, {len(expected)} expected"


def _kt_layer_folder_ok(root: Path, layer: int, numa: int, problems: _Problems) -> bool:
    """False (and one problem) when ``_layer_{L}`` is missing; also reports a ``_numa_*`` count != numa."""
    folder = root / f"_layer_{layer}"
    if not folder.is_dir():
        problems.add("missing layer", f"_layer_{layer}: missing layer folder")
        return False
    parts = sorted(p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"_numa_\d+", p.name))
    if parts != [f"_numa_{t}" for t in range(numa)]:
        problems.add("numa", f"_layer_{layer}: NUMA folders {', '.join(parts) or 'none'}, expected _numa_0.."
                             f"_numa_{numa - 1} (numa {numa} = --kt-threadpool-count)")
    return True


def _tree_files(root: Path) -> dict[str, int]:
    """{relative path: size} of every file under root's ``_layer_*`` folders (including leftover .partial ones)."""
    found = {}
    for name in sorted(os.listdir(root)):
        if not name.startswith("_layer_") or not (root / name).is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames.sort()
            for fname in filenames:
                path = Path(dirpath) / fname
                found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found


def render(result: dict) -> str:
    """Human-readable summary: one row per check, then the problems."""
    rows = [("check", "status", "detail")] + [(c["name"], c["status"], c["detail"]) for c in result["checks"]]
    width = [max(len(str(r[i])) for r in rows) for i in range(2)]
    lines = [f"verify {result.get('out', '')}"]
    lines += [f"  {r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip() for r in rows]
    problems = result.get("problems", [])
    lines.append("result: OK" if result.get("ok") else f"result: FAILED ({len(problems)} problem line(s))")
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)
