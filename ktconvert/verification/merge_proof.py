"""What ``merge`` proves about every part file it uses, and the record that spares a rerun proving it again.

Every part file reaches OUT through ``merge._place``: hard-linked (the part's inode itself) or copied across
filesystems. Either way its bytes are hashed once and compared with its part manifest: the file's size, sha256
and git blob id, and the digest of every tensor it holds, in the algorithm the part manifest names (a .safetensors
file's tensors from its header, a .kt file is one tensor: ``verification.hashes.file_hashes``, what
``verify --hashes`` runs); per part, the tensors found in its files are exactly those its manifest lists. A copy is
hashed while it is copied (``fileio.copy_hashed``) and renamed to its name only once it matched. A hard link is
hashed through its name in OUT right after it was made (the inode is the part's: one read), by a pool of threads
while the next files are linked; one that differs is removed again. Any difference is a VerifyError (exit 4)
naming the part file (and tensor); a file that changes while it is hashed, or is no regular file, an InputError
(exit 3).

``Proofs`` is the record, kept in the merge journal: {part manifest sha256: {OUT name: the stat key (device,
inode, size, mtime_ns, ctime_ns) of OUT's file once proven}}. A file still carrying its key is not hashed again
when the merge runs again (after an interruption). Writing the file, renaming over it, a chmod or another hard
link of its inode all change its ctime, which only root can set back: the key no longer matches and the file is
proven again. The record is as trusted as OUT itself (it lives there, written under OUT's lock).
"""
from __future__ import annotations

import hashlib
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ktconvert.errors import InputError, VerifyError
from ktconvert.formats.digests import TensorHasher, digest_algorithm
from ktconvert.formats.fileio import copy_hashed, remove_name, write_atomic
from ktconvert.formats.out_manifest import manifest_bytes
from ktconvert.formats.safetensors_reader import parse_header
from ktconvert.layouts.naming import key_for_kt_path
from ktconvert.distributed.parts import PART_NAME
from ktconvert.verification.hashes import file_hashes

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))    # linked files hashed at once
FLUSH_SECONDS = 10.0                                  # the journal's proofs rewritten at most this often
HINT = "convert that part again (--force), then merge again"


def stat_key(st: os.stat_result) -> list[int]:
    """What must not change for a proven file to stay proven: device, inode, size, mtime_ns, ctime_ns."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="merge-hash")


class Proofs:
    """The proofs of one merge (module docstring), written into `journal` with `head` (its other fields) by
    ``flush``; journal None: nothing is written (a finished OUT checked again)."""

    def __init__(self, journal: Path | None, head: dict, proven=None):
        self.journal, self.head = journal, head
        self.proven: dict[str, dict[str, list[int]]] = _valid_proofs(proven)
        self.flushed, self.dirty = time.monotonic(), False

    def known(self, part: str, rel: str, st: os.stat_result) -> bool:
        return self.proven.get(part, {}).get(rel) == stat_key(st)

    def add(self, part: str, rel: str, st: os.stat_result) -> None:
        self.proven.setdefault(part, {})[rel] = stat_key(st)
        self.dirty = True
        if time.monotonic() - self.flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.journal is not None and self.dirty:
            write_atomic(self.journal, manifest_bytes({**self.head, "proven": self.proven}))
        self.flushed, self.dirty = time.monotonic(), False


def _valid_proofs(proven) -> dict:
    """`proven` when it has the record's shape, else {} (everything is then proven again)."""
    if not isinstance(proven, dict) or not all(isinstance(files, dict) and all(map(_is_key, files.values()))
                                               for files in proven.values()):
        return {}
    return proven


def _is_key(key) -> bool:
    return isinstance(key, list) and len(key) == 5 and all(type(v) is int for v in key)


class PartProof:
    """The proving of one part's files (folder, its part manifest `record`) as merge places them, recorded in
    `proofs`; proofs None: the part files themselves are proven where they stand (``merge --verify``, before
    anything is written), nothing recorded or removed. `pool` hashes the files in place. ``finish`` waits for
    every hash, checks that the part's tensors were all found, and flushes the record."""

    def __init__(self, folder: Path, record: dict, pool: ThreadPoolExecutor, proofs: Proofs | None = None):
        self.folder, self.pool, self.proofs = Path(folder), pool, proofs
        self.id = hashlib.sha256(manifest_bytes(record)).hexdigest()
        self.entries, self.tensors = record["manifest"]["files"], record["manifest"]["tensors"]
        # each tensor hashed in the algorithm its part manifest names (parts of an older release: sha256)
        self.algorithms = {name: digest_algorithm(d) for name, d in self.tensors.items()}
        self.found: dict[str, str] = {}          # tensor -> the part file (relative name) holding it
        self.pending: list = []                  # (rel, path, future of _hash_in_place)

    # ---------------------------------------------------------------- files already in place

    def known(self, rel: str, st: os.stat_result, path: Path) -> bool:
        """True when OUT's file `path` (`st`: its lstat) still carries the stat key it was proven with (its
        tensors noted)."""
        if self.proofs is None or not self.proofs.known(self.id, rel, st):
            return False
        self._note(rel, _tensor_names(path, rel))
        return True

    def hash_in_place(self, root: Path, rel: str) -> None:
        """Prove the file `rel` below `root` (OUT's hard link of the part file, or the part file itself) in the
        pool."""
        self.pending.append((rel, Path(root) / rel, self.pool.submit(_hash_in_place, Path(root), rel, self.algorithms)))

    def prove_copy(self, root: Path, rel: str) -> bool:
        """Prove OUT's file `rel` below `root`, a copy an earlier run left, now: True when it holds the recorded
        bytes."""
        try:
            st, digests, tensors = _hash_in_place(Path(root), rel, self.algorithms)
            self._compare(rel, *digests, tensors)
        except (InputError, VerifyError):
            return False
        self._accept(rel, st, tensors)
        return True

    # ---------------------------------------------------------------- copies

    def copy(self, source: Path, rel: str, target: Path, out: Path) -> None:
        """Copy part file `source` to `target` (below `out`), hashed while copied: renamed only once it matched."""
        hasher, key = None, None
        if rel.endswith(".safetensors"):
            try:
                hasher = TensorHasher(parse_header(source).tensors, self.algorithms)
            except InputError:          # not a shard after all: its manifest then lists no tensor of it
                hasher = None
        else:
            key = key_for_kt_path(rel)
        found = {}

        def check(sha256: str, git_sha1: str) -> None:
            found.update(hasher.digests() if hasher is not None else {key: sha256} if key is not None else {})
            self._compare(rel, int(self.entries[rel]["bytes"]), sha256, git_sha1, found)

        copy_hashed(source, target, check=check, within=out, observe=hasher.update if hasher is not None else None)
        self._accept(rel, os.lstat(target), found)

    # ---------------------------------------------------------------- the end of the part

    def finish(self) -> None:
        """Wait for the files hashed in place; VerifyError / InputError for the first that differs (removed from
        OUT when it was linked there) or for a tensor of the part manifest found in none of its files."""
        pending, self.pending = self.pending, []
        failure = None
        for rel, path, future in pending:
            if failure is not None:
                future.cancel()         # left unproven: a later run proves it
                continue
            try:
                st, digests, tensors = future.result()
                self._compare(rel, *digests, tensors)
            except (InputError, VerifyError) as exc:
                failure = exc
                if self.proofs is not None:
                    _remove_quietly(path)
                continue
            self._accept(rel, st, tensors)
        if failure is not None:
            raise failure
        missing = sorted(set(self.tensors) - set(self.found))
        if missing:
            raise VerifyError("tensor listed in the part manifest is in none of its files",
                              file=str(self.folder / PART_NAME), tensor=missing[0],
                              found=f"{len(missing)} such tensor(s)", hint=HINT)
        if self.proofs is not None:
            self.proofs.flush()

    # ---------------------------------------------------------------- comparing

    def _compare(self, rel: str, size: int, sha256: str, git_sha1: str, tensors: dict) -> None:
        """VerifyError unless a file's digests and tensors are what the part manifest records for `rel`."""
        entry, path = self.entries[rel], str(self.folder / rel)
        for what, want, got in (("bytes", int(entry["bytes"]), size), ("sha256", entry["sha256"], sha256),
                                ("git_sha1", entry["git_sha1"], git_sha1)):
            if want != got:
                raise VerifyError("part file differs from its part manifest", file=path, expected=f"{what} {want}",
                                  found=f"{what} {got}", hint=HINT)
        for name, digest in sorted(tensors.items()):
            want = self.tensors.get(name)
            if want is None:
                raise VerifyError("part file holds a tensor its part manifest does not list", file=path,
                                  tensor=name, hint=HINT)
            if want != digest:
                raise VerifyError("tensor differs from its part manifest", file=path, tensor=name,
                                  expected=f"digest {want}", found=f"digest {digest}", hint=HINT)
            if self.found.get(name, rel) != rel:
                raise VerifyError(f"two part files hold the tensor ({self.found[name]} and {rel})",
                                  file=str(self.folder), tensor=name, hint=HINT)

    def _accept(self, rel: str, st: os.stat_result, tensors) -> None:
        self._note(rel, tensors)
        if self.proofs is not None:
            self.proofs.add(self.id, rel, st)

    def _note(self, rel: str, names) -> None:
        for name in names:
            self.found[name] = rel


def _hash_in_place(root: Path, rel: str, algorithms) -> tuple[os.stat_result, tuple[int, str, str], dict[str, str]]:
    """(stat, (size, sha256, git blob id), {tensor: digest in `algorithms`}) of the regular file `rel` below `root`;
    InputError when it is a symlink or anything but a regular file, cannot be read, or changes while it is hashed."""
    path = root / rel
    try:
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            raise InputError("part file is not a regular file (a symlink?); a part holds only regular files",
                             file=str(path), hint=HINT)
        size, sha256, git_sha1, tensors = file_hashes(root, rel, algorithms=algorithms)
        after = os.lstat(path)
    except OSError as exc:
        raise InputError(f"cannot read part file ({exc.strerror})", file=str(path)) from None
    if stat_key(after) != stat_key(before):
        raise InputError("part file changed while it was hashed", file=str(path), hint="merge again")
    return after, (size, sha256, git_sha1), tensors


def _tensor_names(path: Path, rel: str) -> list[str]:
    """The tensors a proven file holds, without reading its data: a shard's header, a .kt file's name."""
    if rel.endswith(".safetensors"):
        try:
            return list(parse_header(path).tensors)
        except InputError:
            return []
    key = key_for_kt_path(rel)
    return [key] if key is not None else []


def _remove_quietly(path: Path) -> None:
    try:
        remove_name(path)
    except Exception:       # noqa: BLE001  (the difference is what gets reported)
        pass
