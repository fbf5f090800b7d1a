"""State of the local hub stand-in (ktconvert.ops.hub_standin.server): repos, branches, commits and content blobs.

Everything lives under one root folder: `state.json` (repos per hub, "hf" / "ms": branch → commit id, commit id →
{path: entry}) and `blobs/<sha256>`. A blob name is exactly 64 lowercase hex characters — anything else (an LFS
oid such as "/etc/passwd" or "../../x") raises ValueError before it becomes a path — and every blob path is
resolved and must stay under the root. Repo file paths are plain relative names (safe_read.unsafe_name).
"""
from __future__ import annotations

import hashlib
import json
import re
import tempfile
import threading
from pathlib import Path

from ktconvert.util.safe_read import parse_json, unsafe_name

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".kt", ".gguf", ".zst", ".npy", ".h5", ".msgpack")
LFS_MIN_BYTES = 10 * 1024 * 1024
DEFAULT_BRANCH = {"hf": "main", "ms": "master"}
OID = re.compile(r"[0-9a-f]{64}")
MAX_STATE_BYTES = 1 << 30


def valid_oid(value) -> bool:
    """True for a sha256 hex digest as the stand-in names blobs: exactly 64 lowercase hex characters."""
    return isinstance(value, str) and OID.fullmatch(value) is not None


def git_blob_sha1(data: bytes) -> str:
    """Git blob id: sha1(b"blob <len>\\0" + data)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_lfs_path(path: str, size: int, sample: bytes = b"") -> bool:
    """The stand-in's LFS rule (HF's server decides; this mirrors its default .gitattributes + size + binary)."""
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES or b"\0" in sample


class HubStore:
    """Repos per hub ("hf" / "ms"): branch → commit id, commit id → {path: entry}. Blobs on disk by sha256."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self._real_root = self.root.resolve()
        self.lock = threading.RLock()
        state = self.root / "state.json"
        self.state = parse_json(state.read_bytes(), what="hub state", file=state, max_bytes=MAX_STATE_BYTES) \
            if state.exists() else {"hf": {}, "ms": {}}

    def _save(self) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, sort_keys=True))
        tmp.replace(self.root / "state.json")

    def inside(self, path: Path) -> Path:
        """`path` resolved; ValueError unless it lies under the root."""
        real = Path(path).resolve()
        if not real.is_relative_to(self._real_root):
            raise ValueError(f"{path} resolves outside the hub root")
        return real

    # repos --------------------------------------------------------------------------------------------------
    def repo(self, hub: str, repo_id: str) -> dict | None:
        return self.state[hub].get(repo_id)

    def create(self, hub: str, repo_id: str, private: bool = False) -> bool:
        """Create an empty repo; False if it already exists."""
        with self.lock:
            if repo_id in self.state[hub]:
                return False
            commit = hashlib.sha1(f"{hub}:{repo_id}:init".encode()).hexdigest()
            self.state[hub][repo_id] = {"private": private, "branches": {DEFAULT_BRANCH[hub]: commit},
                                        "commits": {commit: {"files": {}, "title": "initial commit"}},
                                        "xet": False}
            self._save()
            return True

    def resolve(self, hub: str, repo_id: str, rev: str | None) -> str | None:
        """Branch name or commit id → commit id (None if unknown)."""
        repo = self.repo(hub, repo_id)
        if repo is None:
            return None
        rev = rev or DEFAULT_BRANCH[hub]
        if rev in repo["branches"]:
            return repo["branches"][rev]
        return rev if rev in repo["commits"] else None

    def files(self, hub: str, repo_id: str, rev: str | None) -> dict | None:
        commit = self.resolve(hub, repo_id, rev)
        return None if commit is None else self.repo(hub, repo_id)["commits"][commit]["files"]

    # blobs --------------------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        """The blob file of `sha256`; ValueError for anything but 64 lowercase hex characters."""
        if not valid_oid(sha256):
            raise ValueError(f"blob name {sha256!r} is not 64 lowercase hex characters")
        return self.inside(self.blob_dir / sha256)

    def has_blob(self, sha256: str) -> bool:
        return valid_oid(sha256) and self.blob_path(sha256).is_file()

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha)
        if not path.exists():
            tmp = self.blob_dir / f"{sha}.{threading.get_ident()}.tmp"
            tmp.write_bytes(data)
            tmp.replace(path)
        return sha

    def adopt_blob(self, sha256: str, file: Path) -> None:
        """Move `file` (whose sha256 the caller checked) into the blob store as `sha256`."""
        Path(file).replace(self.blob_path(sha256))

    def scratch(self) -> Path:
        """A fresh temporary folder under the root (for files on their way into the blob store)."""
        return Path(tempfile.mkdtemp(dir=self.blob_dir, prefix=".scratch-"))

    # commits ------------------------------------------------------------------------------------------------
    def commit(self, hub: str, repo_id: str, rev: str | None, adds: dict, deletes=(), title: str = "") -> str:
        """Apply `adds` {path: entry} and `deletes` on top of branch `rev`; returns the new commit id."""
        with self.lock:
            repo = self.repo(hub, repo_id)
            branch = rev or DEFAULT_BRANCH[hub]
            parent = repo["branches"].get(branch) or repo["branches"][DEFAULT_BRANCH[hub]]
            files = dict(repo["commits"][parent]["files"])
            for path in deletes:
                for key in [k for k in files if k == path or k.startswith(path.rstrip("/") + "/")]:
                    del files[key]
            files.update(adds)
            body = json.dumps({"parent": parent, "files": files, "title": title, "n": len(repo["commits"])},
                              sort_keys=True)
            commit = hashlib.sha1(body.encode()).hexdigest()
            repo["commits"][commit] = {"files": files, "title": title}
            repo["branches"][branch] = commit
            self._save()
            return commit

    def entry(self, data: bytes | None, path: str, *, sha256: str | None = None, size: int | None = None,
              lfs: bool | None = None) -> dict:
        """A file entry from bytes (stored) or from a client-reported sha256/size whose blob is already stored."""
        if data is not None:
            sha256 = self.put_blob(data)
            size = len(data)
        elif not valid_oid(sha256):
            raise ValueError(f"blob name {sha256!r} is not 64 lowercase hex characters")
        lfs = is_lfs_path(path, size, (data or b"")[:512]) if lfs is None else lfs
        git_sha1 = git_blob_sha1(lfs_pointer(sha256, size)) if lfs else git_blob_sha1(data)
        return {"sha256": sha256, "size": size, "lfs": lfs, "git_sha1": git_sha1}

    def put_file(self, hub: str, repo_id: str, path: str, data: bytes, rev: str | None = None) -> str:
        """Test helper: add or replace one file in a commit of its own. The path is not checked, so that tests can
        play a hostile hub listing names such as "../x"."""
        self.create(hub, repo_id)
        return self.commit(hub, repo_id, rev, {path: self.entry(data, path)}, title=f"put {path}")

    def delete_file(self, hub: str, repo_id: str, path: str, rev: str | None = None) -> str:
        return self.commit(hub, repo_id, rev, {}, [path], title=f"delete {path}")

    def seed(self, hub: str, repo_id: str, folder: Path, rev: str | None = None) -> str:
        """Test helper: commit every file under `folder` at once."""
        self.create(hub, repo_id)
        folder = Path(folder)
        adds = {p.relative_to(folder).as_posix(): self.entry(p.read_bytes(), p.relative_to(folder).as_posix())
                for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.commit(hub, repo_id, rev, adds, title="seed")


def check_path(path) -> str:
    """A repo file path from a request: a plain relative name, else ValueError."""
    reason = unsafe_name(path) if isinstance(path, str) else "not a string"
    if reason:
        raise ValueError(f"file path {path!r}: {reason}")
    return path
