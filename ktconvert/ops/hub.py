"""Hugging Face Hub and ModelScope: publish an output folder, verify a repo against a manifest, download a source.

The clients sit behind `hub_clients.HubClient` ("hf", "modelscope"); names and ids are checked first
(`remote_names`): a repo id the hub would refuse, a token that cannot be sent, or a repo listing a file name that
would leave the download folder stop the command before any request (files) or any download (listings).

Remote hashes (docs publish.md §2, §3): HF gives `lfs.sha256` for LFS/Xet files and only the git blob SHA-1
(`blob_id`) for small files; ModelScope gives `Sha256`. A manifest entry carries both `sha256` and `git_sha1`, so
every remote file is compared with whatever hash the hub has, keyed by its full path. No weight bytes are downloaded
to verify. Tokens are never printed or written; error messages are scrubbed of them.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ktconvert.errors import InputError, RemoteError, VerifyError
from ktconvert.ops.hub_clients import HUBS, HubClient, RemoteFile, client_for, remote_call  # noqa: F401  (API)
from ktconvert.ops.remote_names import check_remote_names, check_repo_id
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, parse_json
from ktconvert.verification.identity import check_integrity
from ktconvert.verification.launch import check_launch

MANIFEST_NAME = "ktconvert.json"
CARD_NAME = "README.md"
EXEMPT_EXTRA = (MANIFEST_NAME, CARD_NAME, ".gitattributes")   # published alongside the manifest's files
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.gguf"]
SOURCE_RE = re.compile(r"^(hf|ms)://([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")


def files_digest(files: dict) -> str:
    """sha256 over the sorted "path sha256" lines of a manifest's files: one id for a whole output folder."""
    lines = "".join(f"{path} {files[path]['sha256']}\n" for path in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


# verification ------------------------------------------------------------------------------------------------------
def compare_file(entry: dict, remote: RemoteFile) -> str:
    """"ok", "mismatch" or "unverified" for a manifest entry ({bytes, sha256, git_sha1}) vs a remote file."""
    if int(entry.get("bytes", -1)) != remote.size:
        return "mismatch"
    if remote.sha256:
        return "ok" if remote.sha256 == entry.get("sha256") else "mismatch"
    if remote.git_sha1 and entry.get("git_sha1"):
        return "ok" if remote.git_sha1 == entry["git_sha1"] else "mismatch"
    return "unverified"


def compare_listing(expected: dict, remote: dict[str, RemoteFile]) -> dict:
    """Compare manifest files {path: entry} with a remote listing; lists of full paths."""
    report = {"checked": 0, "missing": [], "extra": [], "mismatched": [], "unverified": []}
    for path in sorted(expected):
        if path not in remote:
            report["missing"].append(path)
            continue
        verdict = compare_file(expected[path], remote[path])
        report["checked"] += 1
        if verdict != "ok":
            report["mismatched" if verdict == "mismatch" else "unverified"].append(path)
    report["extra"] = sorted(p for p in remote if p not in expected and p not in EXEMPT_EXTRA)
    return report


def fetch_manifest(client: HubClient, repo: str, revision: str) -> dict:
    with remote_call(client, f"download {MANIFEST_NAME}", repo):
        data = client.read_small(repo, revision, MANIFEST_NAME)
    manifest = parse_json(data, what=f"remote {MANIFEST_NAME}", file=f"{repo}/{MANIFEST_NAME}",
                          max_bytes=MAX_MANIFEST_BYTES, error=VerifyError)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise VerifyError(f"remote {MANIFEST_NAME} has no files table", file=f"{repo}/{MANIFEST_NAME}")
    return manifest


def verify_remote(manifest: dict | None, repo: str, hub: str = "hf", revision: str | None = None,
                  endpoint: str | None = None, *, client: HubClient | None = None) -> dict:
    """Compare repo@revision's file list and hashes with `manifest` (None: the repo's own ktconvert.json).

    Returns {"ok", "hub", "repo", "revision", "url", "checked", "missing", "extra", "mismatched", "unverified",
    "problems"}: lists of full repo paths; "ok" is False on any missing, extra or mismatched file (a remote
    ktconvert.json different from `manifest` counts as mismatched). Downloads only ktconvert.json.
    """
    check_repo_id(repo, client.name if client else HUBS.get(hub).name)
    client = client or client_for(hub, endpoint)
    revision = revision or client.default_revision
    with remote_call(client, "list files", repo):
        remote = client.list_remote(repo, revision)
    if manifest is None:
        manifest = fetch_manifest(client, repo, revision)
        remote_manifest = manifest
    else:
        remote_manifest = fetch_manifest(client, repo, revision) if MANIFEST_NAME in remote else None
    report = compare_listing(manifest["files"], remote)
    if MANIFEST_NAME not in remote:
        report["missing"].insert(0, MANIFEST_NAME)
    elif remote_manifest != manifest:
        report["mismatched"].insert(0, MANIFEST_NAME)
    problems = [f"{p}: missing on the hub" for p in report["missing"]]
    problems += [f"{p}: hash or size differs from ktconvert.json" for p in report["mismatched"]]
    problems += [f"{p}: extra file not in ktconvert.json" for p in report["extra"]]
    result = {"ok": not problems, "hub": client.name, "repo": repo, "revision": revision,
              "url": client.repo_url(repo), "files_root": files_digest(manifest["files"]), **report,
              "problems": problems}
    result["summary"] = render_remote(result).splitlines()[0]
    return result


def render_remote(result: dict) -> str:
    head = (f"{result['hub']} {result['repo']}@{result['revision']}: {result['checked']} files checked, "
            f"{len(result['missing'])} missing, {len(result['extra'])} extra, {len(result['mismatched'])} mismatched")
    if result["unverified"]:
        head += f", {len(result['unverified'])} without a hub hash"
    return "\n".join([head + (" -- OK" if result["ok"] else " -- FAILED")] + ["  " + p for p in result["problems"]])


# publish -----------------------------------------------------------------------------------------------------------
def publish(out, repo: str, hub: str = "hf", revision: str | None = None, private: bool = False,
            endpoint: str | None = None, progress=None, token: str | None = None,
            base_model: str | None = None) -> dict:
    """Verify folder `out` against its ktconvert.json (every hash, the launch flags it records:
    verification.launch, and the manifest's own integrity: verification.identity), create `repo` if needed, upload (resumable: rerunning uploads
    only what the hub lacks), add a model card (ops.model_card; `base_model`: the Hugging Face repo converted,
    default the recorded hf:// source), then verify the remote. Returns verify_remote's dict + "bytes",
    "files". VerifyError if the local folder or the remote does not match; RemoteError on hub failures."""
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.verification.hashes import verify_hashes
    from ktconvert.util.progress import Progress

    progress = progress or Progress()
    out = Path(out)
    check_repo_id(repo, HUBS.get(hub).name)
    client = client_for(hub, endpoint, token)      # refuses an unusable token before the long local check
    manifest = load_manifest(out)
    wrong_flags = check_launch(manifest)[0] + check_integrity(manifest)[0]    # the card carries both
    if wrong_flags:
        raise VerifyError(f"refusing to publish: {len(wrong_flags)} problem(s); first: {wrong_flags[0]}",
                          file=str(out), hint="the model card would carry these flags; re-run the conversion")
    files = manifest["files"]
    total = sum(int(e["bytes"]) for e in files.values())
    progress.message(f"checking {len(files)} local files against {MANIFEST_NAME}")
    local = verify_hashes(out, manifest)
    if not local["ok"]:
        raise VerifyError(f"refusing to publish: {len(local['problems'])} problem(s); first: {local['problems'][0]}",
                          file=str(out), hint="re-run the conversion (--resume) or `ktconvert verify OUT --hashes`")
    revision = revision or client.default_revision
    with remote_call(client, "create repo", repo):
        client.create(repo, private)
    _upload_missing(client, out, repo, revision, manifest, progress)
    from ktconvert.ops.model_card import model_card

    if base_model is not None:
        check_repo_id(base_model, "hf")
    verified = f"Before the upload all {len(files)} files were hashed again and matched `ktconvert.json`."
    card = model_card(manifest, repo, base_model=base_model, verified=verified, files_root=files_digest(files))
    _put_card(client, repo, revision, str(card).encode())
    result = verify_remote(manifest, repo, hub, revision, client=client)
    if not result["ok"] and client.name == "modelscope":
        progress.message("remote differs after upload; uploading again without the resume cache")
        _upload_missing(client, out, repo, revision, manifest, progress, fresh=True)
        result = verify_remote(manifest, repo, hub, revision, client=client)
    if not result["ok"]:
        raise VerifyError(f"published files do not match: {result['problems'][0]}", file=result["url"],
                          hint="re-run the same publish command to resume")
    return {**result, "bytes": total, "files": len(files)}


def _put_card(client: HubClient, repo: str, revision: str, card: bytes) -> None:
    """Upload README.md unless the hub already holds these exact bytes (no empty commit on a rerun)."""
    from ktconvert.formats.fileio import hash_bytes

    size, sha256, git_sha1 = hash_bytes(card)
    with remote_call(client, f"upload {CARD_NAME}", repo):
        remote = client.list_remote(repo, revision).get(CARD_NAME)
        if remote is None or compare_file({"bytes": size, "sha256": sha256, "git_sha1": git_sha1}, remote) != "ok":
            client.put_bytes(repo, revision, CARD_NAME, card, "ktconvert: model card")


def _upload_missing(client, out: Path, repo: str, revision: str, manifest: dict, progress, fresh=False) -> None:
    """Report what the hub already holds, then run the hub's resumable folder upload."""
    files = manifest["files"]
    try:
        with remote_call(client, "list files", repo):
            remote = client.list_remote(repo, revision)
    except RemoteError:
        remote = {}   # a new repo or branch: nothing there yet
    todo = [p for p in sorted(files) if p not in remote or compare_file(files[p], remote[p]) != "ok"]
    todo_bytes = sum(int(files[p]["bytes"]) for p in todo) + (out / MANIFEST_NAME).stat().st_size
    todo.append(MANIFEST_NAME)
    if len(todo) <= len(files):
        progress.message(f"{len(files) + 1 - len(todo)} of {len(files)} files already on the hub; "
                         f"uploading {len(todo) - 1} + {MANIFEST_NAME}")
    progress.start(todo_bytes, len(todo), f"upload {client.name}:{repo}", unit="files")
    message = f"ktconvert: {manifest.get('method')} NUMA {manifest.get('numa')} ({len(files)} files)"
    with remote_call(client, "upload", repo):
        client.upload(out, repo, revision, message, progress, fresh=fresh)
    # the clients report per batch at best; settle the counters on what was uploaded
    progress.advance(max(0, todo_bytes - progress.bytes_done), max(0, len(todo) - progress.items_done),
                     "uploaded")
    progress.close()


# hub sources -------------------------------------------------------------------------------------------------------
def parse_source(src: str) -> tuple[str, str, str | None]:
    """"hf://ORG/NAME[@REV]" → ("hf", "ORG/NAME", REV); "ms://" → "modelscope". InputError if malformed."""
    match = SOURCE_RE.match(src)
    if not match:
        raise InputError("not a hub source", file=src, expected="hf://ORG/NAME[@REVISION] or ms://ORG/NAME[@REVISION]")
    scheme, repo, rev = match.groups()
    return ("hf" if scheme == "hf" else "modelscope"), repo, rev


def resolve_source(src: str, revision: str | None = None, endpoint: str | None = None, *, cache_dir=None,
                   progress=None) -> tuple[Path, dict]:
    """Download hub source `src` (hf://ORG/NAME[@REV], ms://...) with the client's resumable snapshot download into
    its cache, check every downloaded file against the hub's hashes, and return (local snapshot folder,
    {"hub", "repo", "revision"}) — revision pinned to the commit for HF. `revision` overrides an @REV in `src`.

    The repo's listing is read first and every name in it checked (remote_names.check_remote_names): a repo naming
    a file outside the download folder is refused (RemoteError) before any file is requested; then exactly the
    listed *.json / *.safetensors / *.gguf files are downloaded."""
    from ktconvert.util.progress import Progress

    progress = progress or Progress()
    client, repo, pinned, remote, cache_dir = list_source(src, revision, endpoint, cache_dir)
    wanted = source_files(remote)
    return download_checked(client, src, pinned, cache_dir, wanted, progress), source_record(client, repo, pinned)


def source_files(remote: dict[str, RemoteFile]) -> dict[str, RemoteFile]:
    """The files of a repo listing a conversion reads: *.json, *.safetensors, *.gguf."""
    return {p: f for p, f in remote.items() if any(_match(p, pat) for pat in SOURCE_PATTERNS)}


def list_source(src: str, revision: str | None, endpoint: str | None, cache_dir) -> tuple:
    """(client, repo, pinned revision, {path: RemoteFile} with every name checked, cache folder or None) of hub
    source `src`."""
    hub, repo, rev_in_src = parse_source(src)
    client = client_for(hub, endpoint)
    revision = revision or rev_in_src or client.default_revision
    cache_dir = cache_dir or os.environ.get("KTCONVERT_HUB_CACHE") or None
    with remote_call(client, "list files", repo):
        pinned = client.pin(repo, revision)
        remote = client.list_remote(repo, pinned)
    check_remote_names(remote, src)
    return client, repo, pinned, remote, cache_dir


def source_record(client: HubClient, repo: str, pinned: str) -> dict:
    """What the output manifests record of a hub source: {"hub", "repo", "revision"}."""
    return {"hub": client.name, "repo": repo, "revision": pinned}


def download_checked(client: HubClient, src: str, pinned: str, cache_dir, wanted: dict[str, RemoteFile],
                     progress) -> Path:
    """Download `wanted` ({path: RemoteFile}) of `src` at commit `pinned` into the hub's cache (resumable) and check
    each against the hub's hash; the local snapshot folder. RemoteError when a file did not arrive, VerifyError
    when one differs."""
    from ktconvert.formats.fileio import hash_file

    repo = parse_source(src)[1]
    with remote_call(client, "download", repo, downloads=True):
        root = client.snapshot(repo, pinned, cache_dir, wanted, progress)
    missing = sorted(rel for rel in wanted if not (root / rel).is_file())
    if missing:
        raise RemoteError(f"download incomplete: {len(missing)} file(s) missing, first {missing[0]}", file=src,
                          hint="run the same command again to resume the download")
    progress.start(sum(f.size for f in wanted.values()), len(wanted), f"verify {src}", unit="files")
    for rel in sorted(wanted):
        size, sha256, git_sha1 = hash_file(root / rel)
        entry = {"bytes": size, "sha256": sha256, "git_sha1": git_sha1}
        if compare_file(entry, wanted[rel]) == "mismatch":
            raise VerifyError("downloaded file differs from the hub's hash", file=f"{src}/{rel}",
                              **_listed_vs_downloaded(wanted[rel], entry))
        progress.advance(size, 1, rel)
    progress.close()
    return root


def _listed_vs_downloaded(remote: RemoteFile, entry: dict) -> dict:
    """{"expected", "found"} of a downloaded file unlike its listing: the size where the sizes differ, else the
    hash the hub lists (sha256, or the git blob SHA-1 of a small file) and the same hash of the download."""
    if remote.size != entry["bytes"]:
        return {"expected": f"{remote.size} bytes", "found": f"{entry['bytes']} bytes"}
    if remote.sha256:
        return {"expected": f"sha256 {remote.sha256}", "found": f"sha256 {entry['sha256']}"}
    return {"expected": f"git blob {remote.git_sha1}", "found": f"git blob {entry['git_sha1']}"}


def _match(path: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(path, pattern)
