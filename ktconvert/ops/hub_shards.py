"""A hub source opened in part: its small files downloaded, its safetensors shards known by their headers only and
downloaded when first read.

    list the repo (pinned commit, names checked) -> download config.json, the index and the other *.json files
    (tokenizer, generation config) -> read each shard's header with HTTP range requests (a few KiB each; no weight
    byte) -> open the checkpoint with those headers standing for the absent shards (``Checkpoint.open(remote=)``)
    -> a conversion of some layers downloads, before reading, exactly the shards it reads (``Source.ensure_local``,
    and any tensor read from a shard not on disk fetches that shard first)

This is how ``--executor ray`` works from ``hf://``: the driver plans from the small files and the headers, and each
part's task downloads only the shards holding its layers (and, for the part writing the rest, what it reads of
the shards holding no MoE layer) into its node's cache. Every shard downloaded is checked against the hub's sha256
and against the header bytes the plan was made from; each task also checks that the hub still lists the files
and hashes the driver planned from (``expect``: HF pins a commit, ModelScope gives no commit id). Both hubs read
byte ranges (ModelScope: its file download with a Range header; a server that ignores it has the header bytes
read from the start of the file's stream, which is then closed). A repo without a
``model.safetensors.index.json`` (one file) or a GGUF repo is downloaded whole, as ``hub.resolve_source`` does.
"""
from __future__ import annotations

import struct
import threading
from pathlib import Path

from ktconvert.errors import RemoteError
from ktconvert.formats.safetensors_reader import MAX_HEADER_BYTES
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.ops.hub import download_checked, list_source, remote_call, source_files, source_record
from ktconvert.ops.hub_clients import HubClient, RemoteFile
from ktconvert.util.progress import Progress

HEAD_BYTES = 1 << 16       # the first request of a shard's header: most headers fit; a longer one takes a second


class RemoteShards:
    """The shards of a hub source not downloaded yet. headers: {shard path in the repo: (its first bytes, its
    size)}, the length field and JSON header included; fetch(path) downloads one into the snapshot folder `root`
    (thread-safe, once)."""

    def __init__(self, client: HubClient, src: str, pinned: str, cache_dir, root: Path,
                 files: dict[str, RemoteFile], headers: dict[str, tuple[bytes, int]], progress=None):
        self.client, self.src, self.pinned, self.cache_dir, self.root = client, src, pinned, cache_dir, root
        self.files, self.headers, self.progress = files, headers, progress
        self.fetched: list[str] = []          # shards downloaded by this object, in order
        self._lock = threading.Lock()

    def fetch(self, path: str) -> None:
        """Download shard `path` into place, checked against the hub's hash and the header the plan read."""
        with self._lock:
            if (self.root / path).is_file():
                return
            root = download_checked(self.client, self.src, self.pinned, self.cache_dir, {path: self.files[path]},
                                    Progress())
            if Path(root).resolve() != Path(self.root).resolve():
                raise RemoteError("the hub client put a shard in another snapshot folder", file=f"{self.src}/{path}",
                                  expected=str(self.root), found=str(root))
            head = self.headers[path][0]
            with open(self.root / path, "rb") as fh:
                if fh.read(len(head)) != head:
                    raise RemoteError("downloaded shard's header differs from the one read before",
                                      file=f"{self.src}/{path}", hint="the repo changed: run the command again")
            self.fetched.append(path)


def resolve_in_part(src: str, revision: str | None = None, endpoint: str | None = None, *, cache_dir=None,
                    progress=None, expect: dict[str, str] | None = None
                    ) -> tuple[Path, dict, RemoteShards | None, dict[str, str]]:
    """(local snapshot folder, {"hub", "repo", "revision"}, RemoteShards or None, listing) of hub source `src`:
    every *.json downloaded and checked, the shards left on the hub with their headers read. None (and everything
    downloaded, as hub.resolve_source) where the source cannot be read in part: no index, or a hub client without
    range reads. listing: {path: the hub's sha256 (else git blob SHA-1)} of the source files. expect: the listing
    a driver planned from (RemoteError when the hub now lists other files or hashes: the repo changed; it pins a
    hub without commit ids, ModelScope)."""
    progress = progress or Progress()
    client, repo, pinned, remote, cache_dir = list_source(src, revision, endpoint, cache_dir)
    wanted = source_files(remote)
    listing = {p: f.sha256 or f.git_sha1 for p, f in sorted(wanted.items())}
    _check_listing(src, listing, expect)
    shards = {p: f for p, f in wanted.items() if p.endswith(".safetensors")}
    if INDEX_NAME not in wanted or not shards or not client.reads_ranges:
        root = download_checked(client, src, pinned, cache_dir, wanted, progress)
        return root, source_record(client, repo, pinned), None, listing
    small = {p: f for p, f in wanted.items() if p not in shards}
    root = download_checked(client, src, pinned, cache_dir, small, progress)
    absent = {p: f for p, f in shards.items() if not (root / p).is_file()}
    with remote_call(client, "read shard headers", repo):
        headers = {p: (_read_head(client, repo, pinned, p, f.size), f.size) for p, f in sorted(absent.items())}
    remote_shards = RemoteShards(client, src, pinned, cache_dir, root, absent, headers, progress)
    return root, source_record(client, repo, pinned), remote_shards, listing


def _check_listing(src: str, listing: dict[str, str], expect: dict[str, str] | None) -> None:
    """RemoteError naming the first source file whose hub hash is not the expected one (or that is new or gone)."""
    if expect is None or expect == listing:
        return
    path = next(p for p in sorted(set(listing) | set(expect)) if listing.get(p) != expect.get(p))
    raise RemoteError("the hub repo changed since the conversion was planned", file=f"{src}/{path}",
                      expected=str(expect.get(path, "no such file")), found=str(listing.get(path, "no such file")),
                      hint="run the command again")


def _read_head(client: HubClient, repo: str, pinned: str, path: str, size: int) -> bytes:
    """The first bytes of shard `path` holding its 8-byte header length and its JSON header (safetensors_reader
    validates them when the checkpoint is opened)."""
    head = client.read_range(repo, pinned, path, 0, min(size, HEAD_BYTES))
    if len(head) < 8:
        return head
    need = 8 + struct.unpack("<Q", head[:8])[0]
    if len(head) < need <= min(size, 8 + MAX_HEADER_BYTES):
        head += client.read_range(repo, pinned, path, len(head), need - len(head))
    return head
