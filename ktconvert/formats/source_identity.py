"""``--resume``: is SRC still the source the unfinished OUT was being written from?

config.json is compared as one of the options (``source_config_sha256``); a checkpoint of the same shapes with other
weights has the same config.json, so the weight files are compared too, before anything is converted:

* every source file the interrupted run read to its end (the journal holds its size and digest, the sha256 of its
  first ``stream.HEAD_BYTES`` and its stat identity) must still be in SRC. A file of the same stat identity (device,
  inode, size, mtime, ctime: the very file that was hashed, not written since) is trusted without a read; any other
  is checked by size and head sha256 (cheap: a different checkpoint fails here) and then read and hashed whole,
  before any output is written (its recorded identity is then updated, so a later resume does not read it again).
  Reading it whole is what it takes to trust the finished layers made from it: hashing costs the read of those files
  once, no conversion, and only when SRC is not the same files (moved, copied, another checkpoint), or when the
  journal records the digest in another algorithm than this run gives the file (an interrupted run of a release
  that recorded sha256, or a file that is now / no longer a Hugging Face cache blob): then the same read checks the
  recorded digest and records the one this run's read gives (``stream.HashingFileReader``), which the run compares.
* a finished layer that holds bytes of a file the interrupted run had not read to its end (no digest vouches for
  them) is forgotten and converted again: at most the layers of the files being read when the run stopped.
* a source file not on disk (a hub shard not downloaded yet) is not checked here: the hub repo is pinned by the
  journal's options (repo and revision) and every download is checked against the hub's sha256.

So every layer of OUT comes from bytes whose digest is the one ktconvert.json records. A mismatch is a
ResumeMismatchError (exit 2) naming OUT and the file; nothing is changed.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.digests import SHA256
from ktconvert.formats.fileio import digest_file_in
from ktconvert.formats.stream import (HEAD_BYTES, entry_algorithm, head_sha256, known_sha256, source_algorithm,
                                      stat_identity)
from ktconvert.run.journal import digest_mismatch, source_mismatch
from ktconvert.util.safe_read import open_regular

HASH_THREADS = 4


def check_resumed_source(journals: list, source, jobs: list, progress=None) -> None:
    """Check SRC (`source`) against what each resumed journal in `journals` recorded, then forget the finished
    layers that no digest vouches for (module doc). `jobs`: the run's MatrixJobs (which file holds which layer)."""
    present = {source.relative_name(path): Path(path) for path in source.files()}
    hashed: dict[str, dict] = {}                    # a file recorded by several outputs' journals is read once
    for journal in journals:
        to_hash = [name for name in sorted(journal.sources) if _needs_hash(journal, name, present)]
        wanted = {name: _wanted(journal.sources[name], present[name]) for name in to_hash}
        todo = [name for name in to_hash if not wanted[name] <= hashed.get(name, {}).keys()]
        if todo and progress is not None:
            progress.message(f"resuming: hashing {len(todo)} source file(s) the interrupted run read, which are not "
                             "the files it read (moved, copied or changed?) or were hashed by another release")
        with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(todo)))) as pool:
            found = pool.map(lambda name: _digests(present[name], wanted[name]), todo)
            for name, digests in zip(todo, found):
                hashed[name] = {**hashed.get(name, {}), **digests}
        for name in to_hash:
            recorded = journal.sources[name]
            algorithm = entry_algorithm(recorded) or SHA256
            if hashed[name][algorithm] != recorded.get(algorithm):
                raise digest_mismatch(journal.out_dir, name, recorded,
                                      {**recorded, algorithm: hashed[name][algorithm]})
            run_algorithm = _run_algorithm(present[name])
            if run_algorithm != algorithm:      # what this run's read of the file will record and compare
                journal.sources[name] = {"bytes": recorded["bytes"], run_algorithm: hashed[name][run_algorithm]}
            journal.seen[name] = {**journal.seen.get(name, {}), "stat": list(stat_identity(os.stat(present[name])))}
        unverified = {job.layer for job in jobs
                      if journal.layer_done(job.layer) and source.relative_name(job.file) not in journal.sources}
        journal.forget_layers(sorted(unverified))
        if to_hash:
            journal.save()


def _needs_hash(journal, name: str, present: dict) -> bool:
    """Whether recorded source file `name` must be hashed again; ResumeMismatchError when SRC lacks it or its size
    or first bytes differ."""
    recorded, seen = journal.sources[name], journal.seen.get(name, {})
    path = present.get(name)
    if path is None:
        raise source_mismatch(journal.out_dir, name, f"{recorded.get('bytes')} bytes", "no such file in SRC")
    if not os.path.lexists(path):
        return False                     # a hub shard not downloaded (again) yet: see the module doc
    fd = open_regular(path, f"source file {name}")
    try:
        st = os.fstat(fd)
        if list(stat_identity(st)) == seen.get("stat") and entry_algorithm(recorded) == _run_algorithm(path):
            return False
        if st.st_size != recorded.get("bytes"):
            raise digest_mismatch(journal.out_dir, name, recorded, {"bytes": st.st_size})
        head = seen.get("head_sha256")
        if head and head_sha256(fd, st.st_size) != head:
            size = min(st.st_size, HEAD_BYTES)
            raise source_mismatch(journal.out_dir, name, f"sha256 of its first {size} bytes {head}",
                                  f"sha256 of its first {size} bytes {head_sha256(fd, st.st_size)}")
    finally:
        os.close(fd)
    return True


def _run_algorithm(path: Path) -> str:
    """The algorithm of the digest a conversion's read records for `path` (``stream.HashingFileReader``)."""
    return source_algorithm(known_sha256(path))


def _wanted(recorded: dict, path: Path) -> set[str]:
    """The algorithms to hash `path` in: the recorded digest's, and the one this run records when another."""
    return {entry_algorithm(recorded) or SHA256, _run_algorithm(path)}


def _digests(path: Path, algorithms: set[str]) -> dict[str, str]:
    """{algorithm: hex} of a source file in one read; a sha256 the Hugging Face cache blob name tells is taken
    from it (as the conversion does)."""
    known = known_sha256(path)
    out = {SHA256: known} if known is not None and SHA256 in algorithms else {}
    rest = sorted(algorithms - out.keys())
    if not rest:
        return out
    try:
        return {**out, **digest_file_in(path, rest, kind="read")[1]}
    except OSError as exc:
        raise InputError(f"cannot read source file ({exc.strerror})", file=str(path)) from None
