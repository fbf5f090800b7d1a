"""What ``verify`` checks of ktconvert.json itself and of the source it says the folder was made from.

* integrity (always): the manifest's self hash (``out_manifest.self_sha256``: an edit of any field, ``tool_version``
  and ``source`` included, that does not recompute it), ``tool`` / ``tool_version`` against the ``packages`` table
  written beside them, and the shape of the ``source`` record (config sha256, plain relative file names, sizes,
  digests: "blake3" and/or "sha256", 64 hex digits). What cannot be told: an edit that recomputes ``self_sha256``
  too (the hash says edited or not, not who wrote the file), or one of a manifest written before ktconvert recorded
  it (such a manifest is read as before).
* source (``--source SRC``): SRC's config.json sha256, its weight files' names and sizes against the recorded
  fingerprint; with ``--hashes`` also every digest recorded per weight file, re-hashed in its algorithm (BLAKE3, or
  sha256: manifests before format_version 3, and files whose sha256 a Hugging Face cache blob name gave, which is
  thus checked against the bytes here), reading the whole source once.

    check_integrity(manifest) -> (problems, detail)
    check_source(manifest, source, hashes) -> (problems, detail)     # InputError: SRC unreadable (exit 3)
"""
from __future__ import annotations

import re

from ktconvert.formats.fileio import digest_file_in, hash_file
from ktconvert.formats.out_manifest import MANIFEST_NAME, SELF_KEY, self_hash_problem
from ktconvert.formats.stream import entry_algorithms
from ktconvert.util.safe_read import unsafe_name

_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_integrity(manifest: dict) -> tuple[list[str], str]:
    """(problems, detail) of ktconvert.json's own consistency (module doc)."""
    problems = [p for p in [self_hash_problem(manifest)] if p]
    tool, version = manifest.get("tool"), manifest.get("tool_version")
    if tool != "ktconvert":
        problems.append(f"{MANIFEST_NAME}: tool is not ktconvert (found {tool!r:.60})")
    packages = manifest.get("packages")
    if not isinstance(version, str) or not version:
        problems.append(f"{MANIFEST_NAME}: tool_version is not a version (found {version!r:.60})")
    elif not isinstance(packages, dict):
        problems.append(f"{MANIFEST_NAME}: packages is not a table (found {packages!r:.60})")
    elif packages.get("ktconvert", "unknown") not in ("unknown", version):
        problems.append(f"{MANIFEST_NAME}: tool_version {version!r:.60} disagrees with packages.ktconvert "
                        f"{packages['ktconvert']!r:.60} (both are written from the same installation)")
    problems += _source_record_problems(manifest.get("source"))
    if problems:
        return problems, ""
    if manifest.get(SELF_KEY) is None:
        return [], f"no {SELF_KEY} (written before ktconvert recorded it): edits cannot be told"
    return [], f"{SELF_KEY} matches"


def _source_record_problems(source) -> list[str]:
    where = f"{MANIFEST_NAME}: source"
    if not isinstance(source, dict):
        return [f"{where} is not a table (found {source!r:.60})"]
    problems = []
    config = source.get("config_sha256")
    if config is not None and not (isinstance(config, str) and _SHA256.fullmatch(config)):
        problems.append(f"{where}.config_sha256 is not a sha256 (found {config!r:.80})")
    files = source.get("files", {})
    if not isinstance(files, dict):
        return problems + [f"{where}.files is not a table (found {files!r:.60})"]
    for name, entry in sorted(files.items()):
        reason = unsafe_name(name)
        algorithms = entry_algorithms(entry)
        ok = (algorithms and type(entry.get("bytes")) is int and entry["bytes"] >= 0
              and all(isinstance(entry[a], str) and _SHA256.fullmatch(entry[a]) for a in algorithms))
        if reason or not ok:
            problems.append(f"{where}.files: {name!r:.80}: " + (f"not a plain relative name ({reason})" if reason
                            else f'not {{"bytes": int >= 0, "blake3" or "sha256": 64 hex digits}} '
                                 f'(found {entry!r:.100})'))
    return problems


def check_source(manifest: dict, source, hashes: bool) -> tuple[list[str], str]:
    """(problems, detail): SRC `source` against the fingerprint ktconvert.json records (module doc). InputError when
    SRC cannot be opened (bad input)."""
    from ktconvert.formats.sources import open_recorded_source

    src = open_recorded_source(source, manifest)
    record = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    recorded = record.get("files") if isinstance(record.get("files"), dict) else {}
    problems = []
    config = src.side_files().get("config.json")
    config_sha256 = hash_file(config, kind="read")[1] if config is not None else None
    if config_sha256 != record.get("config_sha256"):
        problems.append(f"--source: config.json is not the one the folder was made from; expected sha256 "
                        f"{record.get('config_sha256')!r:.80} ({MANIFEST_NAME} source.config_sha256), found "
                        f"{config_sha256!r}")
    present = {src.relative_name(path): path for path in src.files()}
    for name in sorted(set(present) - set(recorded)):
        problems.append(f"--source: {name}: a weight file {MANIFEST_NAME}'s source.files does not record")
    checked: dict[str, int] = {}          # algorithm -> files compared
    for name, entry in sorted(recorded.items()):
        if name not in present:
            problems.append(f"--source: {name}: recorded in {MANIFEST_NAME}'s source.files, not a weight file of SRC")
            continue
        size = present[name].stat().st_size
        if not isinstance(entry, dict) or size != entry.get("bytes"):
            problems.append(f"--source: {name}: size differs from {MANIFEST_NAME}; expected "
                            f"{entry.get('bytes') if isinstance(entry, dict) else None!r} bytes, found {size} bytes")
        elif hashes:
            algorithms = entry_algorithms(entry) or ["sha256"]
            found = digest_file_in(present[name], algorithms, kind="read")[1]
            for algorithm in algorithms:
                checked[algorithm] = checked.get(algorithm, 0) + 1
                if found[algorithm] != entry.get(algorithm):
                    problems.append(f"--source: {name}: content differs from {MANIFEST_NAME}; expected {algorithm} "
                                    f"{entry.get(algorithm)!r:.80}, found {found[algorithm]!r}")
    compared = " and ".join(f"{n} {algorithm}" for algorithm, n in sorted(checked.items())) or "0 digests"
    how = f"{compared} compared" if hashes else "sizes (digests with --hashes)"
    return problems, f"config.json and {len(recorded)} files: {how}"
