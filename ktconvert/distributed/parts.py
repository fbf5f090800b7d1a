"""Parts of one conversion, by MoE layer range: what ``--layers A-B`` selects, the part manifest a part folder
holds when it is complete, and how a run is split into ranges of about equal source bytes.

A part folder holds exactly the files a single run would write for its layers, under the same names, plus
``ktconvert-part.json``::

    {"format": "ktconvert-part", "format_version": 1, "layers": [the part's MoE layers], "all_layers": [every MoE
     layer of the conversion], "writes_rest": bool, "options": {the journal options of the conversion},
     "manifest": {the ktconvert.json a single run writes, restricted to this part: its files, its tensors, the
     source files it read}, "source_sample": {"files": {every source weight file: {"bytes", "sample_sha256"}}}
     or, for a hub source read in part, {"listing": {path: the hub's hash}}}

``source_sample`` lets merge refuse parts of two checkpoints that share a config.json even where no source file
was read by both: ``sample_sha256`` is the sha256 of SAMPLE_WINDOWS windows of SAMPLE_BYTES spread evenly over
the file (the whole file when it is smaller): cheap, a sample and not a proof (a file two parts read is compared
by its full sha256). ``load_part`` checks every field's type and that the part names only plain relative output
names (``output_name_problem``): InputError (exit 3), one line, for anything else.

The part holding the first MoE layer ``writes_rest``: it also writes the files that belong to no MoE layer (index,
config.json, copies, the non-expert shard) and reads the source files that hold no MoE layer. ``merge`` joins the
parts' files and the unions of their manifests (ktconvert.distributed.merge).

Parts a Ray task writes (ktconvert.distributed.ray_convert) also have a task record,
``PARTS/.ktconvert-tasks/<OUT name>/layers-A-B.json``: {"format": "ktconvert-part-task", "packages": {ktconvert
and numpy versions of the node}, "host", "pid", "node_id", "task_id"} of the task that last started on the part.
It names the holder of the part's lock (``lock_state``: a holder on another host is named as such; one Ray has
given up on, an earlier attempt of the same task or a task on a dead node, or a dead pid on this host, is taken
over), and lets the driver tell a part another ktconvert version started from one to resume (``stale_reason``:
such a part is converted again, as is a finished part of another version or of other options).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
from pathlib import Path

from ktconvert.errors import InputError, KtConvertError, UsageError
from ktconvert.formats.digests import is_digest
from ktconvert.formats.fileio import open_lock, write_atomic
from ktconvert.formats.out_manifest import JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME, manifest_bytes, package_versions
from ktconvert.run.journal import option_name
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, open_regular, read_json, unsafe_name

PART_NAME = "ktconvert-part.json"
PART_FORMAT = "ktconvert-part"
PART_FORMAT_VERSION = 1
PART_KEYS = {"layers": list, "all_layers": list, "writes_rest": bool, "options": dict, "manifest": dict,
             "source_sample": dict}
TASK_FORMAT = "ktconvert-part-task"
TASKS_DIR = ".ktconvert-tasks"
SAMPLE_WINDOWS, SAMPLE_BYTES = 8, 64 << 10      # source_sample: 512 KiB read per source file
_HEX = {64: re.compile(r"[0-9a-f]{64}"), 40: re.compile(r"[0-9a-f]{40}")}


def parse_range(text: str) -> tuple[int, int]:
    """'A-B' (inclusive decoder layer numbers) or 'A' -> (A, B); UsageError for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text or "")
    if not match:
        raise UsageError("--layers takes a range of decoder layer numbers", expected="A-B (e.g. 3-17) or A",
                         found=repr(text))
    first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
    if last < first:
        raise UsageError("--layers range is empty", expected="A-B with A <= B", found=text)
    return first, last


LAYERS_SYNTAX = "decoder layer numbers: ranges and lists, e.g. 3-17, 1,3,5 or 1-3,7"


def parse_layers(text: str) -> list[int]:
    """'1-3,7' -> [1, 2, 3, 7]: the one --layers syntax of conversions and verify (comma-separated numbers and
    inclusive ranges A-B, sorted, duplicates once); UsageError for anything else."""
    chosen: set[int] = set()
    for item in str(text or "").split(","):
        if not item.strip():
            raise UsageError("--layers is not usable", expected=LAYERS_SYNTAX, found=repr(text))
        try:
            first, last = parse_range(item)
        except UsageError as exc:
            raise UsageError("--layers is not usable", expected=LAYERS_SYNTAX, found=repr(text)) from exc
        chosen.update(range(first, last + 1))
    return sorted(chosen)


def select_layers(all_layers, layer_range) -> list[int] | None:
    """The MoE layers of `all_layers` that `layer_range` names ((A, B), a list of numbers, '1-3,7' as
    parse_layers reads it, or None: no part -> None); UsageError when it names none."""
    if layer_range is None:
        return None
    if isinstance(layer_range, str):
        wanted = set(parse_layers(layer_range))
    elif isinstance(layer_range, tuple) and len(layer_range) == 2:
        wanted = set(range(int(layer_range[0]), int(layer_range[1]) + 1))
    else:
        wanted = {int(x) for x in layer_range}
    chosen = [layer for layer in all_layers if layer in wanted]
    if not chosen:
        raise UsageError(f"--layers {layer_range if isinstance(layer_range, str) else sorted(wanted)} holds no MoE "
                         f"layer of this conversion", expected=f"some of layers {list(all_layers)}")
    return chosen


def balanced_ranges(layer_bytes: dict[int, int], parts: int) -> list[tuple[int, int]]:
    """Split the layers (keys, decoder layer numbers) into `parts` contiguous ranges of about equal source bytes:
    a range ends at the first layer where the running total reaches k/parts of all bytes. Every range holds at
    least one layer; UsageError when there are fewer layers than parts. Returns [(first, last)] in order."""
    layers = sorted(layer_bytes)
    if parts < 1 or parts > len(layers):
        raise UsageError("--parts must be between 1 and the number of MoE layers", expected=f"1..{len(layers)}",
                         found=str(parts))
    total = sum(layer_bytes.values()) or 1
    ranges, start, running = [], 0, 0
    for i, layer in enumerate(layers):
        running += layer_bytes[layer]
        left_layers, left_parts = len(layers) - i - 1, parts - len(ranges) - 1
        due = running * parts >= (len(ranges) + 1) * total
        if left_parts and (due or left_layers == left_parts) or i == len(layers) - 1:
            ranges.append((layers[start], layer))
            start = i + 1
    return ranges


def write_part(folder, layers: list[int], all_layers: list[int], writes_rest: bool, options: dict,
               manifest: dict, source_sample: dict) -> dict:
    """Write ``folder/ktconvert-part.json`` (atomically, sorted keys: the same part gives the same bytes)."""
    record = {"format": PART_FORMAT, "format_version": PART_FORMAT_VERSION, "layers": list(layers),
              "all_layers": list(all_layers), "writes_rest": bool(writes_rest), "options": options,
              "manifest": manifest, "source_sample": source_sample}
    write_atomic(Path(folder) / PART_NAME, manifest_bytes(record))
    return record


def source_sample(source, listing: dict) -> dict:
    """The part manifest's ``source_sample`` of `source` (formats.base.Source): the hub `listing` of a hub
    source read in part, else {"files": {name: {"bytes", "sample_sha256"}}} of every weight file."""
    if listing:
        return {"listing": dict(sorted(listing.items()))}
    return {"files": {source.relative_name(path): _sample(path) for path in sorted(source.files())}}


def _sample(path) -> dict:
    """{"bytes", "sample_sha256"} of one file: SAMPLE_WINDOWS windows of SAMPLE_BYTES spread evenly over it."""
    fd = open_regular(path, "source file")
    try:
        size = os.fstat(fd).st_size
        if size <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            windows = [(0, size)]
        else:
            windows = [((size - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1), SAMPLE_BYTES)
                       for i in range(SAMPLE_WINDOWS)]
        digest = hashlib.sha256()
        for offset, count in windows:
            while count:
                data = os.pread(fd, min(count, 8 << 20), offset)
                if not data:
                    raise InputError("source file changed while it was sampled", file=str(path))
                digest.update(data)
                offset, count = offset + len(data), count - len(data)
    finally:
        os.close(fd)
    return {"bytes": size, "sample_sha256": digest.hexdigest()}


def output_name_problem(name) -> str | None:
    """Why `name` (a part manifest's file name) is no plain relative output name merge may write, or None:
    ``safe_read.unsafe_name``'s reasons (absolute, "..", empty components such as "sub//x", ...), or a name
    ktconvert keeps for its own files (ktconvert.json, ktconvert-part.json, .ktconvert*, .NAME.partial)."""
    reason = unsafe_name(name)
    if reason:
        return reason
    for part in name.split("/"):
        if part in (MANIFEST_NAME, PART_NAME) or part.startswith(".ktconvert") \
                or (part.startswith(".") and part.endswith(".partial")):
            return f"{part!r} is a name ktconvert keeps for its own files"
    return None


def load_part(folder) -> dict:
    """The part manifest of `folder`; InputError naming the file when it is absent, a symlink, unreadable or
    malformed (``check_record``)."""
    path = Path(folder) / PART_NAME
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        is_link = False
    if is_link:
        raise InputError("part manifest is a symlink; a part holds only regular files", file=str(path),
                         hint="convert the part again")
    if not path.is_file():
        raise InputError("not a finished ktconvert part (no part manifest)", file=str(path),
                         hint="run or resume its `--layers` conversion first")
    record = read_json(path, what="part manifest", max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(record, dict) or record.get("format") != PART_FORMAT:
        raise InputError("not a ktconvert part manifest", file=str(path), expected=f'"format": "{PART_FORMAT}"')
    if record.get("format_version") != PART_FORMAT_VERSION:
        raise InputError("unsupported part manifest format_version", file=str(path),
                         expected=str(PART_FORMAT_VERSION), found=repr(record.get("format_version")))
    for key, kind in PART_KEYS.items():
        if not isinstance(record.get(key), kind):
            raise InputError(f"part manifest field {key!r} missing or not a {kind.__name__}", file=str(path))
    check_record(path, record)
    return record


def check_record(path, record: dict) -> None:
    """InputError (one line naming `path` and the field) unless the part manifest's fields that merge reads have
    their types: layer lists of distinct numbers; manifest.files {plain output name: {bytes, sha256, git_sha1}},
    manifest.tensors {name: digest}, manifest.source {config_sha256, files {name: {bytes, sha256 or blake3}}}; the
    source_sample {"files": {name: {bytes, sample_sha256}}} or {"listing": {name: hash}}."""
    def fail(field: str, what: str) -> InputError:
        return InputError(f"malformed part manifest: {field} {what}", file=str(path))

    for key in ("layers", "all_layers"):
        values = record[key]
        if not values or not all(_count(v) for v in values) or len(set(values)) != len(values):
            raise fail(key, "is not a list of distinct layer numbers")
    manifest = record["manifest"]
    for key in ("files", "tensors", "source"):
        if not isinstance(manifest.get(key), dict):
            raise fail(f"manifest.{key}", "is missing or not an object")
    for name, entry in manifest["files"].items():
        problem = output_name_problem(name)
        if problem:
            raise InputError(f"part manifest names a file merge will not write ({problem})", file=str(path),
                             tensor=repr(name)[1:-1])
        if not _entry(entry, sha256=64, git_sha1=40):
            raise fail(f"manifest.files[{name!r}]", "is not {bytes, sha256, git_sha1}")
    bad = next((name for name, digest in manifest["tensors"].items() if not is_digest(digest)), None)
    if bad is not None:
        raise fail(f"manifest.tensors[{bad!r}]", "is not a digest (sha256 or blake3)")
    source = manifest["source"]
    config = source.get("config_sha256")
    if not isinstance(source.get("files"), dict) or not (config is None or _hex(config, 64)):
        raise fail("manifest.source", "is not {config_sha256, files}")
    bad = next((name for name, entry in source["files"].items()
                if not (_entry(entry, sha256=64) or _entry(entry, blake3=64))), None)
    if bad is not None:
        raise fail(f"manifest.source.files[{bad!r}]", "is not {bytes, sha256 or blake3}")
    identity = record["source_sample"]
    files, listing = identity.get("files"), identity.get("listing")
    if len(identity) != 1 or not (isinstance(files, dict) and all(_entry(e, sample_sha256=64) for e in files.values())
                                  or isinstance(listing, dict) and all(isinstance(h, str) for h in listing.values())):
        raise fail("source_sample", "is not {files: {name: {bytes, sample_sha256}}} or {listing: {name: hash}}")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _hex(value, digits: int) -> bool:
    return isinstance(value, str) and _HEX[digits].fullmatch(value) is not None


def _entry(entry, **digests: int) -> bool:
    """Whether `entry` is {"bytes": a count, key: hex of that many digits for each of `digests`} (more keys too)."""
    return isinstance(entry, dict) and _count(entry.get("bytes")) \
        and all(_hex(entry.get(key), digits) for key, digits in digests.items())


# ---------------------------------------------------------------- the task record, the lock's holder, stale parts

def task_record_path(folder) -> Path:
    """Where the task record of part folder `folder` (PARTS/<OUT name>/layers-A-B) is:
    PARTS/.ktconvert-tasks/<OUT name>/layers-A-B.json (never inside the part: it holds only what a single run
    writes; nor beside it: PARTS/<OUT name> holds only parts)."""
    folder = Path(folder)
    return folder.parent.parent / TASKS_DIR / folder.parent.name / f"{folder.name}.json"


def write_task_record(folder, holder: dict) -> dict:
    """Record `holder` ({"host", "pid", "node_id", "task_id"}) and this process's package versions as the task
    that works on part `folder` (atomically; its parent folder created)."""
    record = {"format": TASK_FORMAT, "packages": package_versions(), **holder}
    path = task_record_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, manifest_bytes(record))
    return record


def read_task_record(folder) -> dict:
    """The task record of part `folder`, or {} when there is none or it is not one (it only ever informs)."""
    path = task_record_path(folder)
    if not path.is_file():
        return {}
    try:
        record = read_json(path, what="part task record")
    except KtConvertError:
        return {}
    return record if isinstance(record, dict) and record.get("format") == TASK_FORMAT else {}


def pid_alive(pid) -> bool:
    """Whether process `pid` runs on this host (one of another user counts as running)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def lock_state(folder, me: dict, alive_nodes) -> tuple[str, str]:
    """(state, text) of part `folder`'s lock as the task `me` ({"host", "pid", "node_id", "task_id"}) finds it:
    ("free", "") when no process holds it; ("taken", why) when its holder is one Ray has given up on (an earlier
    attempt of `me`'s task, a task on a node not in `alive_nodes()`, called only then) or a pid no longer running
    on this host: the lock file is removed, so the stale holder's lock is on a file no longer there and the next
    ``lock_folder`` gets a new one; ("held", "held by pid N on host H (Ray task T, node N)") for a live holder, or
    one nothing tells dead."""
    lock = Path(folder) / LOCK_NAME
    if not os.path.lexists(lock):
        return "free", ""
    try:
        fd = open_lock(lock)
    except (OSError, KtConvertError):
        return "free", ""                    # lock_folder reports what is wrong with it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "free", ""                    # released as fd closes
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        pid, _, host = os.pread(fd, 320, 0).decode(errors="replace").strip().partition(" ")   # lock_folder's
    finally:
        os.close(fd)
    holder = read_task_record(folder)
    if str(holder.get("pid")) != pid or holder.get("host", host) != host:   # the record is of another process
        holder = {"pid": pid, "host": host}
    why = _stale(holder, me, alive_nodes)
    if why is None:
        return "held", describe_holder(holder)
    lock.unlink(missing_ok=True)
    return "taken", f"lock {describe_holder(holder)} taken over: {why}"


def _stale(holder: dict, me: dict, alive_nodes) -> str | None:
    if holder.get("task_id") and holder["task_id"] == me.get("task_id"):
        return "an earlier attempt of this task, which Ray has given up on"
    if holder.get("node_id") and holder["node_id"] not in alive_nodes():
        return "its Ray node is dead"
    if holder.get("host") == me.get("host") and holder.get("pid") and not pid_alive(holder["pid"]):
        return "that process no longer runs"
    return None


def describe_holder(holder: dict) -> str:
    """ "held by pid N on host H (Ray task T on node N)", with what the record knows."""
    text = f"held by pid {holder.get('pid') or 'unknown'}"
    text += f" on host {holder['host']}" if holder.get("host") else ""
    if "format" not in holder:                # only the lock file's pid and host: no task of ktconvert on Ray
        text += " (no task record: not a Ray task of ktconvert)"
    ray_ids = [f"{key} {str(holder[key])[:16]}" for key in ("task_id", "node_id") if holder.get(key)]
    return text + (f" (Ray {', '.join(ray_ids)})" if ray_ids else "")


def stale_reason(folder, options: dict, versions: dict | None = None) -> str | None:
    """Why part folder `folder` must be converted again rather than finished or kept, or None. `options`: the
    journal options of the conversion (its part manifest records them; its journal adds "part": the part's MoE
    layers, compared by the task itself); versions: package_versions() of the nodes (default this process's). A
    finished part must record these versions and options; an unfinished one (a journal) these options, and a task
    record of these versions (layers another version wrote are not mixed with ours)."""
    folder = Path(folder)
    versions = package_versions() if versions is None else versions
    options = json.loads(json.dumps(options))               # as a JSON file records them (tuples are lists)
    if (folder / PART_NAME).is_file():
        try:
            record = load_part(folder)
        except KtConvertError as exc:
            return f"its part manifest is not usable ({exc})"
        found, recorded = record["manifest"].get("packages"), record["options"]
    elif (folder / JOURNAL_NAME).is_file():
        try:
            journal = read_json(folder / JOURNAL_NAME, what="resume journal", max_bytes=MAX_MANIFEST_BYTES)
        except KtConvertError as exc:
            return f"its journal is not usable ({exc})"
        found = read_task_record(folder).get("packages")
        recorded = journal.get("options") if isinstance(journal, dict) else None
        recorded = {k: v for k, v in recorded.items() if k != "part"} if isinstance(recorded, dict) else {}
    else:
        return None
    if found != versions:
        return f"written by {_versions(found)}, this is {_versions(versions)}"
    if recorded != options:
        changed = sorted(k for k in set(options) | set(recorded) if options.get(k) != recorded.get(k))
        return "written with other options (" + ", ".join(dict.fromkeys(option_name(k) for k in changed)) + ")"
    return None


def _versions(packages) -> str:
    if not isinstance(packages, dict):
        return "an unknown ktconvert version"
    return ", ".join(f"{name} {version}" for name, version in sorted(packages.items()))
