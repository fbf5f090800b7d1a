"""``ktconvert.json``: what an output folder is for, where it came from, and a hash of every byte in it.

Schema (docs/architecture.md "Output manifest"): format, format_version, tool, tool_version, kind, method (kt-kernel
name, e.g. "AMXINT4"), numa, layout, quant, include_dense, flags (the kt-kernel / SGLang options the folder needs) and
sglang_args (the same as one string), model (family, model_type, layers, experts, hidden, intermediate), source
(config_sha256; bytes + a digest per source file), files (bytes, sha256, git_sha1 per output file, keyed by relative
posix path), tensors (a digest per expert/dense tensor, keyed by its merged-safetensors name in both layouts),
packages (versions of the packages that affect output bytes) and self_sha256 (sha256 of the file written without
that key: an edit that does not recompute it shows). Written with sorted keys, indent 2 and a trailing newline, no
timestamps and no host names: the same conversion gives the same bytes.

Both hashes per file: hubs report sha256 for LFS files and a git blob SHA-1 for the others (publish.md §2).
``git_sha1`` is the git blob id a hub lists for the file: since format_version 2, for a file of at least
``fileio.LFS_THRESHOLD`` (10 MiB) bytes that is the blob of its LFS pointer (derived from size + sha256, no SHA-1 pass over
the content); format_version 1 recorded the content's blob for every file.

Digests (format_version 3): a tensor's is ``digests.digest``'s "blake3:<64 hex>", or the bare 64-hex sha256 of a
tensor that is a whole file of its own (a ``.kt`` file: its file sha256, not hashed twice) or of a GGUF tensor; a
source file's entry is {"bytes", "blake3": hex}, or {"bytes", "sha256": hex} where a Hugging Face cache blob name
gave it (``stream.known_sha256``). Before version 3 every tensor and source digest was a sha256 (bare hex, key
"sha256"): the form of each value names its algorithm, so ``verify`` reads versions 1, 2 and 3 (and a resumed
output whose earlier layers recorded sha256s) by re-hashing each value in its own algorithm.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from ktconvert import __version__
from ktconvert.architectures.config_checks import MAX_DIM, MAX_EXPERTS, MAX_LAYERS
from ktconvert.errors import InputError, OutputError
from ktconvert.formats.fileio import FileRecord, digest_file, git_blob_id, hash_file, write_atomic
from ktconvert.formats.stream import known_sha256, source_algorithm
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, read_json

MANIFEST_NAME = "ktconvert.json"
JOURNAL_NAME = ".ktconvert-journal.json"
STREAM_STATE_NAME = ".ktconvert-journal.stream.pt"   # a calibrated run's stream state (gptq/resume.py)
LOCK_NAME = ".ktconvert.lock"
FORMAT = "ktconvert-manifest"
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)   # 1: git_sha1 of the content for every file; 2: of the LFS pointer from LFS_THRESHOLD on;
                            # 3: as 2, tensor and source digests BLAKE3 where not a file's sha256 (module doc)
BYTE_PACKAGES = ("ktconvert", "numpy")  # the packages whose version can change output bytes (we write the files)
MODEL_KEYS = ("layers", "experts", "hidden", "intermediate")
SELF_KEY = "self_sha256"   # sha256 of the manifest without this key (``self_sha256``)


def source_fingerprint(root, files: Iterable) -> dict:
    """{"config_sha256": hex or None, "files": {relative posix path: {"bytes", "blake3" or "sha256"}}} of a source
    checkpoint (``stream.FileDigest.entry``: sha256 where a Hugging Face cache blob name gives it).

    root: the source folder (or single file); files: the weight files read. Reads every other file once (BLAKE3 of
    the whole source: a minute or more for a large model).
    """
    root = Path(root)
    base = root if root.is_dir() else root.parent
    config = base / "config.json"
    entries = {}
    for path in sorted(Path(f) for f in files):
        try:
            rel = path.resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            rel = path.name
        entries[rel] = source_file_entry(path)
    return {"config_sha256": hash_file(config)[1] if config.is_file() else None, "files": entries}


def source_file_entry(path) -> dict:
    """The manifest's entry of one source file, as a conversion's read records it (``stream.FileDigest.entry``):
    {"bytes", "sha256"} where a Hugging Face cache blob name gives it (``stream.known_sha256``), else
    {"bytes", "blake3"} from one read."""
    path = Path(path)
    known = known_sha256(path)
    size, hexdigest = (path.stat().st_size, known) if known is not None else digest_file(path)
    return {"bytes": size, source_algorithm(known): hexdigest}


def kt_flags(kt_method: str, numa: int) -> dict:
    """The kt-kernel / SGLang options a folder needs; the weight path "." means the folder holding ktconvert.json."""
    return {"kt-method": kt_method, "kt-weight-path": ".", "kt-threadpool-count": int(numa)}


GPU_FLAGS = {"model": "."}                   # SGLang's --model: the GPU checkpoint is the folder itself


def launch_fields(flags: dict, expert_activation: str | None) -> dict:
    """The launch fields of a ktconvert.json whose folder needs `flags` and holds the expert activation counts
    file `expert_activation` (None: none): {"flags", "sglang_args", "expert_activation"}."""
    manifest = {"flags": dict(flags), "expert_activation": expert_activation}
    return {**manifest, "sglang_args": sglang_args(manifest)}


FLAG_ORDER = ("model", "kt-method", "kt-weight-path", "kt-threadpool-count")
PATH_FLAGS = ("model", "kt-weight-path")     # flags naming the output folder ("." in the manifest)


def sglang_args(manifest: dict, weight_path: str | None = None) -> str:
    """The manifest's flags as SGLang arguments, e.g. ``--kt-method M --kt-weight-path P --kt-threadpool-count T``
    or ``--model P`` (P = weight_path, else the manifest's "."), and ``--init-expert-location P/FILE
    --kt-expert-placement-strategy frequency`` when the output holds expert activation counts (manifest key
    ``expert_activation``)."""
    flags = dict(manifest["flags"])
    if weight_path is not None:
        flags.update({k: str(weight_path) for k in PATH_FLAGS if k in flags})
    order = [k for k in FLAG_ORDER if k in flags] + sorted(k for k in flags if k not in FLAG_ORDER)
    folder = next((flags[k] for k in PATH_FLAGS if k in flags), "." if weight_path is None else weight_path)
    return " ".join(f"--{k} {flags[k]}" for k in order) + placement_args(manifest, folder)


def placement_args(manifest: dict, folder) -> str:
    """`` --init-expert-location FOLDER/FILE --kt-expert-placement-strategy frequency`` for an output whose
    manifest records expert activation counts, else ""."""
    name = manifest.get("expert_activation")
    return " " + placement_flags(f"{folder}/{name}") if name else ""


def placement_flags(counts_path) -> str:
    """SGLang-KT's flags for GPU expert placement by the activation counts in `counts_path` (a .pt file); the
    GPU expert budget (--kt-gpu-experts-ratio R or --kt-num-gpu-experts N) is given besides."""
    return f"--init-expert-location {counts_path} --kt-expert-placement-strategy frequency"


def package_versions(names: Iterable[str] = BYTE_PACKAGES) -> dict[str, str]:
    """{package: installed version} via importlib.metadata ("unknown" when not installed as a distribution)."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def build_manifest(*, method: str, numa: int, layout: str, model: dict, source: dict, files, tensors: dict,
                   quant: str = "rtn", kind: str = "cpu", include_dense: bool = False,
                   packages: dict | None = None, flags: dict | None = None,
                   expert_activation: str | None = None) -> dict:
    """The ktconvert.json dict. method: kt-kernel method name ("AMXINT4"); files: FileRecords or
    {path: {"bytes", "sha256", "git_sha1"}}; tensors: {name: digest (``digests.digest``)}; model must hold layers,
    experts, hidden, intermediate (family and model_type recommended); flags: the options the output needs
    (default: kt-kernel's kt_flags(method, numa)); expert_activation: the output's expert activation counts file
    (relative path), recorded and added to the SGLang flags."""
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        raise OutputError("model summary incomplete", file=MANIFEST_NAME, expected=", ".join(MODEL_KEYS),
                          found="missing " + ", ".join(missing))
    if not isinstance(files, dict):
        files = {rec.path: rec for rec in files}
    file_entries = {str(p): file_entry(r) for p, r in files.items()}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tool": "ktconvert", "tool_version": __version__,
        "kind": kind, "method": method, "numa": int(numa), "layout": layout, "quant": quant,
        "include_dense": bool(include_dense), "flags": kt_flags(method, numa) if flags is None else dict(flags),
        "model": {**model, "layers": sorted(int(x) for x in model["layers"])},
        "source": source, "files": file_entries, "tensors": dict(tensors),
        "packages": package_versions() if packages is None else dict(packages),
    }
    if expert_activation:
        manifest["expert_activation"] = expert_activation
    manifest["sglang_args"] = sglang_args(manifest)
    return manifest


def file_entry(record) -> dict:
    """The manifest entry {"bytes", "sha256", "git_sha1"} of a FileRecord or an entry dict (e.g. from a resume
    journal an older version wrote), its git_sha1 as format_version 2 defines it."""
    entry = record.entry() if isinstance(record, FileRecord) else dict(record)
    entry["git_sha1"] = git_blob_id(entry["bytes"], entry["sha256"], entry.get("git_sha1"))
    return entry


def manifest_bytes(manifest: dict) -> bytes:
    """The bytes of a manifest file: sorted keys, indent 2, a trailing newline; a ktconvert.json (format FORMAT)
    gets its self hash (SELF_KEY, computed again whatever the dict held)."""
    if manifest.get("format") == FORMAT:
        body = {k: v for k, v in manifest.items() if k != SELF_KEY}
        manifest = {**body, SELF_KEY: self_sha256(body)}
    return _dumped(manifest)


def _dumped(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def self_sha256(manifest: dict) -> str:
    """sha256 of the manifest written without its SELF_KEY (sorted keys, indent 2, trailing newline): the self hash
    ktconvert.json records, so that an edit of any field (tool_version, source, flags, a file's hash) which does
    not also recompute it is seen (``self_hash_problem``). It tells edited from written, not who wrote it."""
    return hashlib.sha256(_dumped({k: v for k, v in manifest.items() if k != SELF_KEY})).hexdigest()


def self_hash_problem(manifest: dict) -> str | None:
    """One problem line when `manifest` (parsed ktconvert.json) records a self hash its content does not have, or
    one that is not a sha256; None when it matches or records none (written before ktconvert recorded it)."""
    recorded = manifest.get(SELF_KEY)
    if recorded is None:
        return None
    actual = self_sha256(manifest)
    if recorded != actual:
        return (f"{MANIFEST_NAME}: edited after it was written: its content does not have the {SELF_KEY} it "
                f"records; expected {recorded!r:.80}, found {actual!r}")
    return None


def write_manifest(out_dir, manifest: dict) -> Path:
    """Write ``out_dir/ktconvert.json`` atomically; returns its path. `manifest` gets the self hash it is written
    with (SELF_KEY), so that the dict equals what the file holds."""
    path = Path(out_dir) / MANIFEST_NAME
    if manifest.get("format") == FORMAT:
        manifest[SELF_KEY] = self_sha256(manifest)
    write_atomic(path, _dumped(manifest))
    return path


def load_manifest(out_dir) -> dict:
    """Parse and sanity-check ``out_dir/ktconvert.json``; InputError naming the file on any problem."""
    path = Path(out_dir) / MANIFEST_NAME
    if not os.path.lexists(path):
        raise InputError("no ktconvert manifest (not a ktconvert output, or the conversion did not finish)",
                         file=str(path))
    try:
        manifest = read_json(path, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    except InputError as exc:
        raise InputError(f"manifest unreadable ({exc.detail})", file=str(path)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError("not a ktconvert manifest", file=str(path), expected=f'"format": "{FORMAT}"',
                         found=repr(manifest.get("format") if isinstance(manifest, dict) else manifest)[:60])
    version = manifest.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise InputError("unsupported manifest format_version", file=str(path),
                         expected=" or ".join(map(str, READ_VERSIONS)),
                         found=repr(manifest.get("format_version")), hint="upgrade ktconvert")
    for key, kind, default in (("files", dict, None), ("tensors", dict, None), ("model", dict, None),
                               ("numa", int, None), ("layout", str, None), ("method", str, ""), ("kind", str, "")):
        if type(manifest.get(key, default)) is not kind:       # type(): true is not a NUMA count
            raise InputError(f"manifest field {key!r} missing or not a {kind.__name__}", file=str(path),
                             found=repr(manifest.get(key))[:60])
    if manifest["numa"] < 1:
        raise InputError("manifest field 'numa' is not a NUMA count", file=str(path), expected="an integer >= 1",
                         found=repr(manifest["numa"]))
    _check_model(manifest["model"], path)
    return manifest


def _check_model(model: dict, path: Path) -> None:
    """The model summary's counts are integers in the range config.json may give (architecture's bounds, which
    also bound every loop over them): layers a sorted list of distinct layer indices, experts / hidden /
    intermediate integers >= 1. InputError naming the key."""
    bounds = {"experts": MAX_EXPERTS, "hidden": MAX_DIM, "intermediate": MAX_DIM}
    for key, maximum in bounds.items():
        value = model.get(key)
        if type(value) is not int or not 1 <= value <= maximum:
            raise InputError(f"manifest field 'model.{key}' is not usable", file=str(path),
                             expected=f"an integer in [1, {maximum}]", found=repr(value)[:60])
    layers = model.get("layers")
    if not isinstance(layers, list) or not all(type(x) is int and 0 <= x < 2 * MAX_LAYERS for x in layers) \
            or layers != sorted(set(layers)):
        raise InputError("manifest field 'model.layers' is not usable", file=str(path),
                         expected=f"a sorted list of distinct layer indices in [0, {2 * MAX_LAYERS})",
                         found=repr(layers)[:60])


def output_files(out_dir) -> list[str]:
    """Every file under out_dir as a sorted relative posix path, except the manifest, the resume journal and the
    writer's lock."""
    root = Path(out_dir)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in (MANIFEST_NAME, JOURNAL_NAME, STREAM_STATE_NAME, LOCK_NAME):
                found.append(rel)
    return sorted(found)
