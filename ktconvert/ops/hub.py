"""Hugging Face Hub and ModelScope: publish an output folder, verify a repo against a manifest, download a source.

Both hubs sit behind one small interface (`HubClient`, registered by name in `HUBS`: "hf" and "modelscope", alias
"ms") built on the real clients: huggingface_hub's `HfApi` (create_repo, upload_folder — resumable, Xet or LFS —,
list_repo_tree, snapshot_download) and modelscope-hub's `HubApi` (create_repo, upload_folder with its resume tracker
kept outside the folder, list_repo_files, download_repo).

Remote hashes (docs publish.md §2, §3): HF gives `lfs.sha256` for LFS/Xet files and only the git blob SHA-1
(`blob_id`) for small files; ModelScope gives `Sha256`. A manifest entry carries both `sha256` and `git_sha1`, so
every remote file is compared with whatever hash the hub has, keyed by its full path. No weight bytes are downloaded
to verify. Tokens come from the clients' usual sources (HF_TOKEN, MODELSCOPE_API_TOKEN, stored logins) and are never
printed or written; error messages are scrubbed of them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import InputError, KtConvertError, RemoteError, VerifyError
from ktconvert.registry import Registry

MANIFEST_NAME = "ktconvert.json"
CARD_NAME = "README.md"
EXEMPT_EXTRA = (MANIFEST_NAME, CARD_NAME, ".gitattributes")   # published alongside the manifest's files
UPLOAD_IGNORE = [".ktconvert-journal.json", "*.partial"]
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.gguf"]
SOURCE_RE = re.compile(r"^(hf|ms)://([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")

HUBS: Registry[type] = Registry("hub")


@dataclass(frozen=True)
class RemoteFile:
    """One file on a hub: size, and the hashes the hub reports (sha256 for LFS/Xet/ModelScope, git SHA-1 else)."""

    path: str
    size: int
    sha256: str | None
    git_sha1: str | None


class HubClient:
    """What ktconvert needs from a hub. Subclasses wrap one real client; `endpoint`/`token` None = its defaults."""

    name = ""
    default_revision = ""

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        self.endpoint = endpoint
        self.token = token

    def repo_url(self, repo: str) -> str:
        return f"{self.endpoint.rstrip('/')}/{repo}"

    def create(self, repo: str, private: bool) -> None:
        raise NotImplementedError

    def upload(self, folder: Path, repo: str, revision: str, message: str, progress, fresh: bool = False) -> None:
        raise NotImplementedError

    def put_bytes(self, repo: str, revision: str, path: str, data: bytes, message: str) -> None:
        raise NotImplementedError

    def list_remote(self, repo: str, revision: str) -> dict[str, RemoteFile]:
        raise NotImplementedError

    def read_small(self, repo: str, revision: str, path: str) -> bytes:
        raise NotImplementedError

    def snapshot(self, repo: str, revision: str, cache_dir, patterns: list[str], progress) -> tuple[Path, str]:
        """Download (resumably, into the hub's cache) the files matching `patterns`; (local root, pinned revision)."""
        raise NotImplementedError


@HUBS.register("hf", aliases=["huggingface"])
class HFHub(HubClient):
    name = "hf"
    default_revision = "main"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        from huggingface_hub import HfApi

        endpoint = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        super().__init__(endpoint.rstrip("/"), token)
        self.api = HfApi(endpoint=self.endpoint, token=token)

    def create(self, repo, private):
        self.api.create_repo(repo, repo_type="model", exist_ok=True, private=private)

    def _ensure_branch(self, repo, revision):
        if revision != self.default_revision:
            self.api.create_branch(repo, branch=revision, exist_ok=True)

    def upload(self, folder, repo, revision, message, progress, fresh=False):
        self._ensure_branch(repo, revision)
        with _hf_bars(getattr(progress, "draws_bars", False)):
            self.api.upload_folder(repo_id=repo, folder_path=str(folder), revision=revision, commit_message=message,
                                   ignore_patterns=UPLOAD_IGNORE)

    def put_bytes(self, repo, revision, path, data, message):
        self._ensure_branch(repo, revision)
        self.api.upload_file(path_or_fileobj=data, path_in_repo=path, repo_id=repo, revision=revision,
                             commit_message=message)

    def list_remote(self, repo, revision):
        from huggingface_hub.hf_api import RepoFile

        out = {}
        for item in self.api.list_repo_tree(repo, recursive=True, revision=revision):
            if isinstance(item, RepoFile):
                lfs = item.lfs
                out[item.path] = RemoteFile(item.path, int(item.size), lfs.sha256 if lfs else None,
                                            None if lfs else item.blob_id)
        return out

    def read_small(self, repo, revision, path):
        with tempfile.TemporaryDirectory(prefix="ktconvert-hub-") as tmp:
            local = self.api.hf_hub_download(repo, path, revision=revision, local_dir=tmp)
            return Path(local).read_bytes()

    def snapshot(self, repo, revision, cache_dir, patterns, progress):
        commit = self.api.repo_info(repo, revision=revision).sha
        with _hf_bars(getattr(progress, "draws_bars", False)):
            root = self.api.snapshot_download(repo, revision=commit, cache_dir=cache_dir, allow_patterns=patterns)
        return Path(root), commit


@HUBS.register("modelscope", aliases=["ms"])
class ModelScopeHub(HubClient):
    name = "modelscope"
    default_revision = "master"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        try:
            import modelscope_hub
        except ImportError as exc:
            raise RemoteError("the ModelScope client is not installed", hint="pip install modelscope-hub") from exc
        endpoint = endpoint or os.environ.get("MODELSCOPE_ENDPOINT") or "https://modelscope.cn"
        super().__init__(endpoint.rstrip("/"), token)
        self.api = modelscope_hub.HubApi(endpoint=self.endpoint, token=token)

    def create(self, repo, private):
        from modelscope_hub.errors import AlreadyExistsError

        try:
            self.api.create_repo(repo, "model", visibility="private" if private else None)
        except AlreadyExistsError:
            pass

    def upload(self, folder, repo, revision, message, progress, fresh=False):
        def on_batch(event: dict) -> None:
            if event.get("event") == "batch_committed":
                progress.advance(int(event.get("batch_bytes") or 0), int(event.get("batch_files") or 0),
                                 f"batch {event.get('batch_index')}/{event.get('num_batches')}")

        bars = getattr(progress, "draws_bars", False)
        with _ms_quiet(bars), open(os.devnull, "w") as devnull, \
                contextlib.redirect_stdout(sys.stderr if bars else devnull):  # its report is printed to stdout
            self.api.upload_folder(repo, "model", folder, revision=revision, commit_message=message,
                                   ignore_patterns=UPLOAD_IGNORE, use_cache=not fresh,
                                   tracker_path=_ms_tracker(folder, self.endpoint, repo, revision),
                                   disable_tqdm=not bars, progress_callback=on_batch)

    def put_bytes(self, repo, revision, path, data, message):
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # it prints "Committing ..."
            self.api.upload_file(repo, "model", data, path, commit_message=message, revision=revision,
                                 disable_tqdm=True)

    def list_remote(self, repo, revision):
        out = {}
        for info in self.api.list_repo_files(repo, "model", revision=revision, recursive=True):
            if info.type in ("tree", "dir", "directory"):
                continue
            sha256 = info.sha256 or None
            blob = info.blob_id if info.blob_id and len(info.blob_id) == 40 else None
            out[info.path] = RemoteFile(info.path, int(info.size), sha256, blob)
        return out

    def read_small(self, repo, revision, path):
        with tempfile.TemporaryDirectory(prefix="ktconvert-hub-") as tmp:
            return Path(self.api.download_file(repo, "model", path, revision=revision, local_dir=tmp)).read_bytes()

    def snapshot(self, repo, revision, cache_dir, patterns, progress):
        root = self.api.download_repo(repo, "model", revision=revision, cache_dir=cache_dir, allow_patterns=patterns)
        return Path(root), revision


# helpers -----------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _hf_bars(enabled: bool):
    """huggingface_hub's own progress bars on only when our reporter draws bars (a terminal)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


@contextlib.contextmanager
def _ms_quiet(bars: bool):
    """modelscope_hub logs every upload step at INFO; keep that off CI logs and JSON-lines output."""
    import logging

    logger = logging.getLogger("modelscope_hub")
    level = logger.level
    if not bars:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _cache_root() -> Path:
    base = os.environ.get("KTCONVERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ktconvert")
    return Path(base)


def _ms_tracker(folder, endpoint: str, repo: str, revision: str) -> Path:
    """ModelScope's resume tracker, kept outside the output folder (which must hold only the manifest's files)."""
    key = hashlib.sha256(f"{Path(folder).resolve()}|{endpoint}|{repo}|{revision}".encode()).hexdigest()[:24]
    path = _cache_root() / "ms-upload" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _remote_errors() -> tuple:
    """Exception types the hub clients raise for API / network failures."""
    types: list[type] = [OSError, RuntimeError]
    with contextlib.suppress(ImportError):
        import httpx
        types.append(httpx.HTTPError)
    with contextlib.suppress(ImportError):
        import requests
        types.append(requests.RequestException)
    with contextlib.suppress(ImportError):
        from modelscope_hub.errors import HubError
        types.append(HubError)
    return tuple(types)


def _scrub(text: str, token: str | None) -> str:
    for secret in {token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN"),
                   os.environ.get("MODELSCOPE_API_TOKEN")}:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text.splitlines()[0] if text else text


@contextlib.contextmanager
def remote_call(client: HubClient, action: str, repo: str):
    """Turn the clients' API/network exceptions into RemoteError (exit 5) naming the hub, repo and action."""
    try:
        yield
    except KtConvertError:
        raise
    except _remote_errors() as exc:
        raise RemoteError(f"{client.name}: {action} failed: {type(exc).__name__}: "
                          f"{_scrub(str(exc), client.token)}", file=repo) from None


def client_for(hub: str = "hf", endpoint: str | None = None, token: str | None = None) -> HubClient:
    """The HubClient registered as `hub` ("hf", "modelscope"/"ms")."""
    return HUBS.get(hub)(endpoint=endpoint, token=token)


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
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise VerifyError(f"remote {MANIFEST_NAME} is not JSON ({exc})", file=f"{repo}/{MANIFEST_NAME}") from None
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
def model_card(manifest: dict, repo: str) -> str:
    """README.md for a published folder: the kt-kernel / SGLang flags it needs and where it came from."""
    from ktconvert.formats.out_manifest import sglang_args

    model, source = manifest.get("model", {}), manifest.get("source", {})
    files = manifest["files"]
    origin = {k: v for k, v in source.items() if k not in ("files", "config_sha256")}
    lines = [
        "---", "library_name: ktransformers", "tags:", "- ktransformers", "- kt-kernel", "- moe",
        f"- {str(manifest.get('method', '')).lower()}", "---", "",
        f"# {repo.split('/')[-1]}", "",
        f"kt-kernel CPU expert weights ({manifest.get('method')}, NUMA {manifest.get('numa')}, layout "
        f"{manifest.get('layout')}, quantization {manifest.get('quant', 'rtn')}) for the routed experts of a "
        f"{model.get('model_type') or model.get('family', '')} model, written by ktconvert "
        f"{manifest.get('tool_version', '')}.", "",
        "## Use with SGLang + kt-kernel", "",
        "Pass these flags (the weight path is where you download this repo; the NUMA count must match):", "",
        "```", sglang_args(manifest, "/path/to/this/repo"), "```", "",
        "## Source", "",
        f"- config.json sha256: `{source.get('config_sha256')}`",
        *[f"- {key}: `{value}`" for key, value in sorted(origin.items())],
        f"- source files: {len(source.get('files', {}))}", "",
        "## Files", "",
        f"{len(files)} files, {sum(int(e['bytes']) for e in files.values())} bytes; `ktconvert.json` lists the sha256 "
        f"and git blob SHA-1 of each (files root `{files_digest(files)}`). Check this repo without downloading "
        f"weights:", "", "```", f"ktconvert verify {repo} --remote", "```", "",
    ]
    return "\n".join(lines)


def publish(out, repo: str, hub: str = "hf", revision: str | None = None, private: bool = False,
            endpoint: str | None = None, progress=None, token: str | None = None) -> dict:
    """Verify folder `out` against its ktconvert.json, create `repo` if needed, upload (resumable: rerunning uploads
    only what the hub lacks), add a model card, then verify the remote. Returns verify_remote's dict + "bytes",
    "files". VerifyError if the local folder or the remote does not match; RemoteError on hub failures."""
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.verification.hashes import verify_hashes
    from ktconvert.progress import Progress

    progress = progress or Progress()
    out = Path(out)
    manifest = load_manifest(out)
    files = manifest["files"]
    total = sum(int(e["bytes"]) for e in files.values())
    progress.message(f"checking {len(files)} local files against {MANIFEST_NAME}")
    local = verify_hashes(out, manifest)
    if not local["ok"]:
        raise VerifyError(f"refusing to publish: {len(local['problems'])} problem(s); first: {local['problems'][0]}",
                          file=str(out), hint="re-run the conversion (--resume) or `ktconvert verify OUT --hashes`")
    client = client_for(hub, endpoint, token)
    revision = revision or client.default_revision
    with remote_call(client, "create repo", repo):
        client.create(repo, private)
    _upload_missing(client, out, repo, revision, manifest, progress)
    _put_card(client, repo, revision, model_card(manifest, repo).encode())
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
    progress.start(todo_bytes, len(todo), f"upload {client.name}:{repo}")
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
    {"hub", "repo", "revision"}) — revision pinned to the commit for HF. `revision` overrides an @REV in `src`."""
    from ktconvert.formats.fileio import hash_file
    from ktconvert.progress import Progress

    progress = progress or Progress()
    hub, repo, rev_in_src = parse_source(src)
    client = client_for(hub, endpoint)
    revision = revision or rev_in_src or client.default_revision
    cache_dir = cache_dir or os.environ.get("KTCONVERT_HUB_CACHE") or None
    with remote_call(client, "download", repo):
        root, pinned = client.snapshot(repo, revision, cache_dir, SOURCE_PATTERNS, progress)
        remote = client.list_remote(repo, pinned)
    local = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    wanted = [p for p in remote if any(_match(p, pat) for pat in SOURCE_PATTERNS)]
    missing = sorted(set(wanted) - set(local))
    if missing:
        raise RemoteError(f"download incomplete: {len(missing)} file(s) missing, first {missing[0]}", file=src,
                          hint="run the same command again to resume the download")
    progress.start(sum(remote[p].size for p in wanted), len(wanted), f"verify {src}")
    for rel in sorted(wanted):
        size, sha256, git_sha1 = hash_file(root / rel)
        entry = {"bytes": size, "sha256": sha256, "git_sha1": git_sha1}
        if compare_file(entry, remote[rel]) == "mismatch":
            raise VerifyError("downloaded file differs from the hub's hash", file=f"{src}/{rel}",
                              expected=remote[rel].sha256 or remote[rel].git_sha1, found=sha256)
        progress.advance(size, 1, rel)
    progress.close()
    return root, {"hub": client.name, "repo": repo, "revision": pinned}


def _match(path: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(path, pattern)
