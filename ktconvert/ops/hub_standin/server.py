"""A local stand-in for the Hugging Face Hub and ModelScope, for offline tests and for trying `ktconvert publish`.

stdlib `http.server` only; binds 127.0.0.1. It serves the endpoints the real clients (huggingface_hub 1.33,
modelscope-hub 0.5.1) call to create a repo, upload (HF: preupload + LFS batch/PUT/verify or Xet with a `local://`
CAS, + NDJSON commit; ModelScope: LFS batch/PUT + JSON commit), list files with their hashes and download files:

    HF   POST /api/repos/create                      POST /api/models/{repo}/preupload/{rev}
         GET  /api/models/{repo}/xet-write-token/{rev}   POST /{repo}.git/info/lfs/objects/batch
         PUT  /_lfs/{oid}   POST /_lfs/{oid}/verify  POST /api/models/{repo}/commit/{rev}
         GET  /api/models/{repo}[/revision/{rev}]     GET  /api/models/{repo}/tree/{rev}[/{path}]
         POST /api/models/{repo}/paths-info/{rev}     GET|HEAD /{repo}/resolve/{rev}/{path}
    MS   POST /api/v1/models   GET /api/v1/models/{repo}   POST /api/v1/repos/models/{repo}/info/lfs/objects/batch
         POST /api/v1/repos/models/{repo}/commit/{rev}  GET /api/v1/models/{repo}/repo/files  GET /api/v1/models/{repo}/repo

Files uploaded through Xet (huggingface_hub's default) are read back from the local CAS when their commit arrives
(`hub_xet.read_back`) and kept only if they hash to the committed sha256, so they download like LFS files; a commit
whose Xet files cannot be read back is refused (422) with the hint to set HF_HUB_DISABLE_XET=1. Requests are
checked before they touch the store: JSON bodies bounded (safe_read), blob names 64 lowercase hex characters, file
paths plain relative names; anything else is a 400. State lives under ROOT (`hub_store.HubStore`: blobs by sha256 +
state.json), so `ktconvert hub-server --root DIR` keeps repos across restarts. Tests drive it through `HubServer`
(start/stop, `fail`, `requests`, `store.put_file` / `delete_file` to tamper with a remote repo).
"""
from __future__ import annotations

import hashlib
import re
import shutil
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from ktconvert.ops.hub_standin import xet as hub_xet
from ktconvert.ops.hub_standin.protocol import (BadRequest, WireHandler, b64, field, hf_commit_ops, hf_entry,
                                                hf_listing, lfs_objects, load_json, ms_commit_actions, path_of)
from ktconvert.ops.hub_standin.store import (DEFAULT_BRANCH, HubStore, git_blob_sha1, is_lfs_path,  # noqa: F401  (API)
                                         lfs_pointer, valid_oid)

XET_HINT = "set HF_HUB_DISABLE_XET=1 to upload through LFS"


class _Handler(WireHandler):
    """The HF and ModelScope endpoints (see the module docstring); routes in ROUTES below."""

    @property
    def store(self) -> HubStore:
        return self.server.store

    def _base(self) -> str:
        return f"http://{self.headers.get('Host')}"

    def _need_repo(self, hub: str, repo_id: str, rev: str | None = None) -> dict | None:
        files = self.store.files(hub, repo_id, rev)
        if files is None:
            if self.store.repo(hub, repo_id) is None:
                self._json(404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"}) \
                    if hub == "hf" else self._ms(None, 404, False, "repo not exist")
            else:
                self._json(404, {"error": "Invalid rev id"}, headers={"X-Error-Code": "RevisionNotFound"}) \
                    if hub == "hf" else self._ms(None, 404, False, "revision not exist")
        return files

    # HF -----------------------------------------------------------------------------------------------------
    def hf_create(self) -> None:
        req = load_json(self.body or b"{}")
        name = field(req, "name", str)
        org = field(req, "organization", (str, type(None)), None) or "user"
        repo_id = f"{org}/{name}"
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
            raise BadRequest(f"invalid repo id {repo_id[:100]!r}")
        created = self.store.create("hf", repo_id, bool(req.get("private")))
        self._json(200 if created else 409, {"url": f"{self._base()}/{repo_id}", "name": repo_id,
                                             **({} if created else {"error": "You already created this model repo"})})

    def hf_repo_info(self, repo_id: str, rev: str | None = None) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is None:
            return
        commit = self.store.resolve("hf", repo_id, rev)
        self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                         "siblings": [{"rfilename": p} for p in sorted(files)]})

    def hf_branch(self, repo_id: str, branch: str) -> None:
        repo = self.store.repo("hf", repo_id)
        if repo is None:
            self._error(404, "Repository not found")
            return
        with self.store.lock:
            if branch in repo["branches"]:
                self._json(409, {"error": "Reference already exists"})
                return
            repo["branches"][branch] = repo["branches"]["main"]
            self.store._save()
        self._json(200, {})

    def hf_validate_yaml(self) -> None:
        self._json(200, {"errors": [], "warnings": []})

    def hf_preupload(self, repo_id: str, rev: str) -> None:
        items = field(load_json(self.body), "files", list)
        files = self._need_repo("hf", repo_id, rev)
        if files is None:
            return
        out = []
        for item in items:
            path, size = path_of(item), field(item, "size", int)
            sample = b64(field(item, "sample", str, ""))
            lfs = size > 0 and is_lfs_path(path, size, sample)
            remote = files.get(path)
            oid = None if remote is None else (remote["sha256"] if remote["lfs"] else remote["git_sha1"])
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": out})

    def hf_xet_token(self, repo_id: str, rev: str) -> None:
        if self.store.repo("hf", repo_id) is None:
            self._error(404, "Repository not found")
            return
        with self.store.lock:
            self.store.repo("hf", repo_id)["xet"] = True
        cas = self.store.inside(self.store.root / "xet-cas")
        cas.mkdir(parents=True, exist_ok=True)
        self._json(200, {"accessToken": "local", "exp": int(time.time()) + 3600, "casUrl": f"local://{cas}"})

    def hf_lfs_batch(self, repo_id: str) -> None:
        objects = []
        for oid, size in lfs_objects(self.body):
            entry = {"oid": oid, "size": size}
            if not self.store.has_blob(oid):
                entry["actions"] = {"upload": {"href": f"{self._base()}/_lfs/{oid}", "header": {}},
                                    "verify": {"href": f"{self._base()}/_lfs/{oid}/verify", "header": {}}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects})

    def lfs_put(self, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            self._error(400, f"sha256 of the body does not match {oid}")
            return
        self.store.put_blob(self.body)
        self._send(200, b"", headers={"ETag": f'"{oid}"'})

    def lfs_verify(self, oid: str) -> None:
        self._json(200 if self.store.has_blob(oid) else 404, {})

    def hf_commit(self, repo_id: str, rev: str) -> None:
        title, ops = hf_commit_ops(self.body)
        if self._need_repo("hf", repo_id, rev) is None:
            return
        lfs = {value["oid"]: value["size"] for key, value in ops if key == "lfsFile"}
        missing = {oid: size for oid, size in lfs.items() if not self.store.has_blob(oid)}
        if missing and self.store.repo("hf", repo_id)["xet"]:
            missing = self._adopt_xet(missing)
        if missing:
            oid = next(iter(missing))
            path = next(v["path"] for k, v in ops if k == "lfsFile" and v["oid"] == oid)
            hint = f" ({XET_HINT})" if self.store.repo("hf", repo_id)["xet"] else ""
            self._error(422, f"LFS object {oid} for {path} was never uploaded{hint}")
            return
        adds, deletes = {}, []
        for key, value in ops:
            if key == "file":
                adds[value["path"]] = self.store.entry(b64(value["content"]), value["path"], lfs=False)
            elif key == "lfsFile":
                adds[value["path"]] = self.store.entry(None, value["path"], sha256=value["oid"],
                                                       size=value["size"], lfs=True)
            else:
                deletes.append(value["path"])
        commit = self.store.commit("hf", repo_id, rev, adds, deletes, title)
        self._json(200, {"commitOid": commit, "commitUrl": f"{self._base()}/{repo_id}/commit/{commit}"})

    def _adopt_xet(self, wanted: dict[str, int]) -> dict[str, int]:
        """Read Xet-uploaded files back from the local CAS into the blob store; {oid: size} of those still missing."""
        scratch = self.store.scratch()
        try:
            for sha, file in hub_xet.read_back(self.store.root / "xet-cas", wanted, scratch).items():
                self.store.adopt_blob(sha, file)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {oid: size for oid, size in wanted.items() if not self.store.has_blob(oid)}

    def hf_tree(self, repo_id: str, rev: str, path: str | None = None) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is not None:
            recursive = self.query.get("recursive", ["false"])[0].lower() == "true"
            self._json(200, hf_listing(files, path or "", recursive))

    def hf_paths_info(self, repo_id: str, rev: str) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is not None:
            form = parse_qs(self.body.decode())
            self._json(200, [hf_entry(p, files[p]) for p in form.get("paths", []) if p in files])

    def hf_resolve(self, repo_id: str, rev: str, path: str) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is None:
            return
        entry = files.get(path)
        if entry is None:
            self._json(404, {"error": "Entry not found"}, headers={"X-Error-Code": "EntryNotFound"})
            return
        headers = {"X-Repo-Commit": self.store.resolve("hf", repo_id, rev),
                   "ETag": f'"{entry["sha256"] if entry["lfs"] else entry["git_sha1"]}"', "Accept-Ranges": "bytes"}
        if entry["lfs"]:
            headers["X-Linked-Etag"] = headers["ETag"]
            headers["X-Linked-Size"] = str(entry["size"])
        self._send_blob(entry, headers)

    def _send_blob(self, entry: dict, headers: dict) -> None:
        if not valid_oid(entry.get("sha256")):
            raise BadRequest("the stored entry names no valid blob")
        if not self.store.has_blob(entry["sha256"]):
            self._error(501, f"the stand-in holds only the hash of this file ({XET_HINT})")
            return
        data = self.store.blob_path(entry["sha256"]).read_bytes()
        status = 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        self._send(status, data, "application/octet-stream", headers)

    # ModelScope ---------------------------------------------------------------------------------------------
    def ms_create(self) -> None:
        req = load_json(self.body or b"{}")
        owner, name = field(req, "Path", str), field(req, "Name", str)
        repo_id = f"{owner}/{name}"
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
            raise BadRequest(f"invalid repo id {repo_id[:100]!r}")
        if not self.store.create("ms", repo_id, req.get("Visibility") == 1):
            self._ms(None, 409, False, "repo already exists")
            return
        self._ms({"Path": owner, "Name": name, "Id": 1})

    def ms_repo_info(self, repo_id: str) -> None:
        if self.store.repo("ms", repo_id) is None:
            self._ms(None, 404, False, "repo not exist")
            return
        owner, name = repo_id.split("/", 1)
        self._ms({"Path": owner, "Name": name, "Id": 1, "Visibility": 5})

    def ms_lfs_batch(self, repo_id: str) -> None:
        objects = []
        for oid, size in lfs_objects(self.body):
            entry = {"oid": oid, "size": size}
            if not self.store.has_blob(oid):
                entry["actions"] = {"upload": {"href": f"{self._base()}/_lfs/{oid}", "header": {}}}
            objects.append(entry)
        self._json(200, {"objects": objects})

    def ms_commit(self, repo_id: str, rev: str) -> None:
        message, actions = ms_commit_actions(self.body)
        if self._need_repo("ms", repo_id, rev) is None:
            return
        adds, deletes = {}, []
        for action in actions:
            path = action["path"]
            if action.get("action") == "delete":
                deletes.append(path)
            elif action.get("type") == "lfs":
                if not self.store.has_blob(action["sha256"]):
                    self._ms(None, 400, False, f"lfs object {action['sha256']} for {path} was never uploaded")
                    return
                adds[path] = self.store.entry(None, path, sha256=action["sha256"], size=action["size"], lfs=True)
            else:
                adds[path] = self.store.entry(b64(action.get("content") or ""), path, lfs=False)
        commit = self.store.commit("ms", repo_id, rev, adds, deletes, message)
        self._ms({"CommitId": commit, "Revision": rev})

    def ms_files(self, repo_id: str) -> None:
        rev = self.query.get("Revision", [None])[0]
        files = self._need_repo("ms", repo_id, rev)
        if files is None:
            return
        root = (self.query.get("Root", [""])[0] or "").strip("/")
        out = [{"Path": p, "Name": p.rsplit("/", 1)[-1], "Type": "blob", "Size": e["size"], "Sha256": e["sha256"],
                "IsLFS": e["lfs"], "Revision": self.store.resolve("ms", repo_id, rev)}
               for p, e in sorted(files.items()) if not root or p.startswith(root + "/")]
        self._ms({"Files": out})

    def ms_download(self, repo_id: str) -> None:
        rev = self.query.get("Revision", [None])[0]
        files = self._need_repo("ms", repo_id, rev)
        if files is None:
            return
        entry = files.get(self.query.get("FilePath", [""])[0])
        if entry is None:
            self._ms(None, 404, False, "file not exist")
            return
        self._send_blob(entry, {"ETag": f'"{entry["sha256"]}"', "Accept-Ranges": "bytes"})


_REPO = r"([^/]+/[^/]+)"
_Handler.routes = ROUTES = [(m, re.compile(p), n) for m, p, n in [
    ("POST", r"/api/repos/create", "hf_create"),
    ("POST", r"/api/validate-yaml", "hf_validate_yaml"),
    ("GET", rf"/api/models/{_REPO}", "hf_repo_info"),
    ("GET", rf"/api/models/{_REPO}/revision/(.+)", "hf_repo_info"),
    ("POST", rf"/api/models/{_REPO}/branch/([^/]+)", "hf_branch"),
    ("POST", rf"/api/models/{_REPO}/preupload/([^/]+)", "hf_preupload"),
    ("GET", rf"/api/models/{_REPO}/xet-write-token/([^/]+)", "hf_xet_token"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "hf_lfs_batch"),
    ("PUT", r"/_lfs/([0-9a-f]{64})", "lfs_put"),
    ("POST", r"/_lfs/([0-9a-f]{64})/verify", "lfs_verify"),
    ("POST", rf"/api/models/{_REPO}/commit/([^/]+)", "hf_commit"),
    ("GET", rf"/api/models/{_REPO}/tree/([^/]+)(?:/(.*))?", "hf_tree"),
    ("POST", rf"/api/models/{_REPO}/paths-info/([^/]+)", "hf_paths_info"),
    ("GET", rf"/{_REPO}/resolve/([^/]+)/(.+)", "hf_resolve"),
    ("POST", r"/api/v1/models", "ms_create"),
    ("GET", rf"/api/v1/models/{_REPO}", "ms_repo_info"),
    ("POST", rf"/api/v1/repos/models/{_REPO}/info/lfs/objects/batch", "ms_lfs_batch"),
    ("POST", rf"/api/v1/repos/models/{_REPO}/commit/([^/]+)", "ms_commit"),
    ("GET", rf"/api/v1/models/{_REPO}/repo/files", "ms_files"),
    ("GET", rf"/api/v1/models/{_REPO}/repo", "ms_download"),
]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, store: HubStore):
        super().__init__(address, _Handler)
        self.store = store
        self.requests: list[tuple[str, str]] = []
        self.faults: list[list] = []
        self._fault_lock = threading.Lock()

    def take_fault(self, method: str, path: str) -> int | None:
        """The status of the first armed fault matching this request (and use one of its shots)."""
        with self._fault_lock:
            for fault in self.faults:
                want_method, pattern, status, shots = fault
                if shots > 0 and want_method == method and re.search(pattern, path):
                    fault[3] -= 1
                    return status
        return None


class HubServer:
    """The stand-in on 127.0.0.1:`port` (0 = a free port), serving in a background thread.

    `url` is the endpoint to hand to the clients. `fail(method, path_regex, status, times)` arms an injected error;
    `requests` lists (method, path) of every request served; `store` tampers with repos directly.
    """

    def __init__(self, root, port: int = 0):
        self.store = HubStore(Path(root))
        self._server = _Server(("127.0.0.1", port), self.store)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list:
        return self._server.requests

    def fail(self, method: str, path_regex: str, status: int = 500, times: int = 1) -> None:
        self._server.faults.append([method, path_regex, status, times])

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

