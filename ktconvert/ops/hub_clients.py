"""The two hubs behind one small interface: `HubClient`, registered by name in `HUBS` ("hf", alias "huggingface";
"modelscope", alias "ms"), built on the real clients — huggingface_hub's `HfApi` (create_repo, upload_folder —
resumable, Xet or LFS —, list_repo_tree, snapshot_download, a Range request on a file's URL) and modelscope-hub's
`HubApi` (create_repo, upload_folder with its resume tracker kept outside the folder, list_repo_files, download_repo,
its legacy client's file download stream with a Range header).

`remote_call` turns the clients' API / network exceptions into RemoteError (exit 5) with the token masked (`scrub`).
Tokens come from the clients' usual sources (HF_TOKEN, MODELSCOPE_API_TOKEN, stored logins); a token that cannot
travel in an HTTP header is refused when the client is made (remote_names.check_env_tokens).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import KtConvertError, RemoteError, VerifyError
from ktconvert.ops.remote_names import TOKEN_ENV, check_env_tokens
from ktconvert.registry import Registry

UPLOAD_IGNORE = [".ktconvert-journal.json", "*.partial"]
WHOLE_TOKEN_BELOW = 16   # shorter tokens are masked only where they stand alone (they can be ordinary words)

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

    def pin(self, repo: str, revision: str) -> str:
        """The revision to download from: the commit id where the hub has one (HF), else `revision`."""
        return revision

    reads_ranges = False      # read_range is implemented (a source can then be downloaded in part)

    def read_range(self, repo: str, revision: str, path: str, start: int, count: int) -> bytes:
        """`count` bytes of file `path` from byte `start` (an HTTP range request): exactly that many."""
        raise NotImplementedError

    def snapshot(self, repo: str, revision: str, cache_dir, files: dict[str, RemoteFile], progress) -> Path:
        """Download (resumably, into the hub's cache) exactly `files` (names already checked); the local root."""
        raise NotImplementedError


@HUBS.register("hf", aliases=["huggingface"])
class HFHub(HubClient):
    name = "hf"
    default_revision = "main"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        check_env_tokens("hf", token)
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

    def pin(self, repo, revision):
        return self.api.repo_info(repo, revision=revision).sha

    reads_ranges = True

    def read_range(self, repo, revision, path, start, count):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(repo, path, revision=revision, endpoint=self.endpoint)
        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={start}-{start + count - 1}"}
        response = get_session().get(url, headers=headers, follow_redirects=True)
        hf_raise_for_status(response)
        if response.status_code != 206 or len(response.content) != count:
            raise RemoteError(f"hf: the hub did not answer a range request for {path}",
                              expected=f"{count} bytes from {start}", found=f"HTTP {response.status_code}, "
                              f"{len(response.content)} bytes")
        return response.content

    def snapshot(self, repo, revision, cache_dir, files, progress):
        # exact names (glob characters escaped): a listing that changed since ours cannot add a file
        patterns = [glob.escape(name) for name in sorted(files)]
        with _hf_bars(getattr(progress, "draws_bars", False)):
            root = self.api.snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=patterns)
        return Path(root)


@HUBS.register("modelscope", aliases=["ms"])
class ModelScopeHub(HubClient):
    name = "modelscope"
    default_revision = "master"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        check_env_tokens("modelscope", token)
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

    reads_ranges = True

    def read_range(self, repo, revision, path, start, count):
        # the file download the client itself resumes with Range requests (publish.md §3). A server that answers
        # the whole file instead: the first start + count bytes of its stream are read, then the stream is closed
        headers = {"Range": f"bytes={start}-{start + count - 1}", "Accept-Encoding": "identity"}
        with contextlib.closing(self.api.legacy.download_stream(repo, "model", path, revision,
                                                                headers=headers)) as response:
            skip = 0 if response.status_code == 206 else start
            if response.status_code == 206 and not str(response.headers.get("Content-Range", "")).startswith(
                    f"bytes {start}-"):
                raise RemoteError(f"modelscope: the hub answered another range of {path}",
                                  expected=f"bytes {start}-{start + count - 1}",
                                  found=str(response.headers.get("Content-Range")))
            data = _stream_prefix(response, skip + count)[skip:]
        if len(data) != count:
            raise RemoteError(f"modelscope: {path} ended early", expected=f"{count} bytes from {start}",
                              found=f"{len(data)} bytes")
        return data

    def snapshot(self, repo, revision, cache_dir, files, progress):
        # our checked listing is handed over as is: the client does not list (or pick) anything itself
        listing = [{"Path": f.path, "Type": "blob", "Size": f.size, "Sha256": f.sha256} for f in files.values()]
        return Path(self.api.download_repo(repo, "model", revision=revision, cache_dir=cache_dir,
                                           file_list=listing))


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


def _stream_prefix(response, limit: int) -> bytes:
    """At most the first `limit` bytes of a streamed requests response's body (the rest is not read)."""
    data = bytearray()
    for chunk in response.iter_content(chunk_size=min(limit, 1 << 16) or 1):
        data += chunk
        if len(data) >= limit:
            break
    return bytes(data[:limit])


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


def scrub(text: str, token: str | None) -> str:
    """First line of `text` with every hub token masked as "***": `token` and the values of the token variables.

    A token of 16 characters or more (every real HF / ModelScope token) is masked wherever its text appears; a
    shorter one only where it stands as a whole token (not inside a longer run of letters, digits, "_" or "-"), so a
    token such as "local" does not turn "localhost" into "***host"."""
    secrets = {token, *(os.environ.get(var) for names in TOKEN_ENV.values() for var in names)}
    for secret in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
        if len(secret) >= WHOLE_TOKEN_BELOW:
            text = text.replace(secret, "***")
        else:
            text = re.sub(rf"(?<![\w-]){re.escape(secret)}(?![\w-])", "***", text)
    return text.splitlines()[0] if text else text


@contextlib.contextmanager
def remote_call(client: HubClient, action: str, repo: str, downloads: bool = False):
    """Turn the clients' API/network exceptions into RemoteError (exit 5) naming the hub, repo and action.
    downloads: a file the client refused because its bytes do not match the hub's hash (modelscope-hub checks
    each download itself) is a VerifyError (exit 4) naming it, as ``hub.download_checked``'s own check is."""
    try:
        yield
    except KtConvertError:
        raise
    except _remote_errors() as exc:
        refused = _integrity_failure(exc) if downloads else None
        if refused is not None:
            path, why = refused
            raise VerifyError(f"{client.name}: downloaded file differs from the hub's hash "
                              f"({scrub(why, client.token)})", file=f"{repo}/{path}" if path else repo) from None
        raise RemoteError(f"{client.name}: {action} failed: {type(exc).__name__}: "
                          f"{scrub(str(exc), client.token)}", file=repo) from None


def _integrity_failure(exc) -> tuple[str, str] | None:
    """(path or "", the client's message) of a download the hub client refused for its content (modelscope-hub's
    FileIntegrityError: sha256 or size unlike the listing), alone or among a snapshot's failed files; None for
    any other failure (network, refusal)."""
    try:
        from modelscope_hub.errors import FileDownloadError, FileIntegrityError
    except ImportError:
        return None
    if isinstance(exc, FileIntegrityError):
        return "", str(exc)
    if isinstance(exc, FileDownloadError):
        for path, failure in sorted(exc.failed_files.items()):
            if isinstance(failure, FileIntegrityError):
                return str(path), str(failure)
    return None


def client_for(hub: str = "hf", endpoint: str | None = None, token: str | None = None) -> HubClient:
    """The HubClient registered as `hub` ("hf", "modelscope"/"ms")."""
    return HUBS.get(hub)(endpoint=endpoint, token=token)
