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

Files uploaded through Xet are recorded by the sha256 the client reports (their bytes stay in the client-side CAS
folder) and cannot be downloaded back. State lives under ROOT (blobs by sha256 + state.json), so `ktconvert hub-server
--root DIR` keeps repos across restarts. Tests drive it through `HubServer` (start/stop, `faults`, `requests`,
`put_file` / `delete_file` to tamper with a remote repo).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".kt", ".gguf", ".zst", ".npy", ".h5", ".msgpack")
LFS_MIN_BYTES = 10 * 1024 * 1024
DEFAULT_BRANCH = {"hf": "main", "ms": "master"}


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
        self.lock = threading.RLock()
        state = self.root / "state.json"
        self.state = json.loads(state.read_text()) if state.exists() else {"hf": {}, "ms": {}}

    def _save(self) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, sort_keys=True))
        tmp.replace(self.root / "state.json")

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
    def has_blob(self, sha256: str) -> bool:
        return (self.blob_dir / sha256).exists()

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_dir / sha
        if not path.exists():
            tmp = self.blob_dir / f"{sha}.{threading.get_ident()}.tmp"
            tmp.write_bytes(data)
            tmp.replace(path)
        return sha

    def blob_path(self, sha256: str) -> Path:
        return self.blob_dir / sha256

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
        """A file entry from bytes (stored) or from a client-reported sha256/size (Xet: bytes not here)."""
        if data is not None:
            sha256 = self.put_blob(data)
            size = len(data)
        lfs = is_lfs_path(path, size, (data or b"")[:512]) if lfs is None else lfs
        git_sha1 = git_blob_sha1(lfs_pointer(sha256, size)) if lfs else git_blob_sha1(data)
        return {"sha256": sha256, "size": size, "lfs": lfs, "git_sha1": git_sha1}

    def put_file(self, hub: str, repo_id: str, path: str, data: bytes, rev: str | None = None) -> str:
        """Test helper: add or replace one file in a commit of its own."""
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, fmt, *args) -> None:  # quiet: requests are recorded in server.requests instead
        pass

    # plumbing -----------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json", headers=None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers=None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _ms(self, data, status: int = 200, ok: bool = True, message: str = "") -> None:
        self._json(status, {"Code": status, "Data": data, "Success": ok, "Message": message,
                            "RequestId": "local"})

    def _error(self, status: int, message: str) -> None:
        if self.path.startswith("/api/v1/"):
            self._ms(None, status, False, message)
        else:
            self._json(status, {"error": message}, headers={"X-Error-Message": message})

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        self.body = self._body() if self.command in ("POST", "PUT") else b""
        fault = self.server.take_fault(self.command, url.path)
        self.server.requests.append((self.command, url.path))
        if fault is not None:
            self._error(fault, "injected fault")
            return
        for method, pattern, name in ROUTES:
            if method == self.command or (method == "GET" and self.command == "HEAD"):
                match = pattern.fullmatch(url.path)
                if match:
                    args = [None if g is None else unquote(g) for g in match.groups()]
                    try:
                        getattr(self, name)(*args)
                    except Exception as exc:  # a stand-in bug must show up as a 500, not a dropped connection
                        self._error(500, f"{type(exc).__name__}: {exc}")
                    return
        self._error(404, f"no route for {self.command} {url.path}")

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch

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
        req = json.loads(self.body or b"{}")
        repo_id = f"{req.get('organization') or 'user'}/{req['name']}"
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
        files = self._need_repo("hf", repo_id, rev)
        if files is None:
            return
        out = []
        for item in json.loads(self.body)["files"]:
            sample = base64.b64decode(item.get("sample") or "")
            lfs = item["size"] > 0 and is_lfs_path(item["path"], item["size"], sample)
            remote = files.get(item["path"])
            oid = None if remote is None else (remote["sha256"] if remote["lfs"] else remote["git_sha1"])
            out.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self._json(200, {"files": out})

    def hf_xet_token(self, repo_id: str, rev: str) -> None:
        if self.store.repo("hf", repo_id) is None:
            self._error(404, "Repository not found")
            return
        with self.store.lock:
            self.store.repo("hf", repo_id)["xet"] = True
        cas = (self.store.root / "xet-cas").resolve()
        cas.mkdir(parents=True, exist_ok=True)
        self._json(200, {"accessToken": "local", "exp": int(time.time()) + 3600, "casUrl": f"local://{cas}"})

    def hf_lfs_batch(self, repo_id: str) -> None:
        req = json.loads(self.body)
        objects = []
        for obj in req.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if not self.store.has_blob(obj["oid"]):
                entry["actions"] = {"upload": {"href": f"{self._base()}/_lfs/{obj['oid']}", "header": {}},
                                    "verify": {"href": f"{self._base()}/_lfs/{obj['oid']}/verify", "header": {}}}
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
        if self._need_repo("hf", repo_id, rev) is None:
            return
        adds, deletes, title = {}, [], ""
        xet = self.store.repo("hf", repo_id)["xet"]
        for line in self.body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                title = value.get("summary", "")
            elif key == "file":
                adds[value["path"]] = self.store.entry(base64.b64decode(value["content"]), value["path"], lfs=False)
            elif key == "lfsFile":
                if not xet and not self.store.has_blob(value["oid"]):
                    self._error(422, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                    return
                adds[value["path"]] = self.store.entry(None, value["path"], sha256=value["oid"],
                                                       size=value["size"], lfs=True)
            elif key in ("deletedFile", "deletedFolder"):
                deletes.append(value["path"])
        commit = self.store.commit("hf", repo_id, rev, adds, deletes, title)
        self._json(200, {"commitOid": commit, "commitUrl": f"{self._base()}/{repo_id}/commit/{commit}"})

    def _hf_entry(self, path: str, entry: dict) -> dict:
        out = {"type": "file", "path": path, "size": entry["size"], "oid": entry["git_sha1"]}
        if entry["lfs"]:
            out["lfs"] = {"oid": entry["sha256"], "size": entry["size"],
                          "pointerSize": len(lfs_pointer(entry["sha256"], entry["size"]))}
        return out

    def _hf_listing(self, files: dict, prefix: str, recursive: bool) -> list:
        prefix = prefix.strip("/")
        base = prefix + "/" if prefix else ""
        out, dirs = [], set()
        for path in sorted(files):
            if not path.startswith(base):
                continue
            rest = path[len(base):].split("/")
            for depth in range(1, len(rest)):
                dirs.add(base + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                out.append(self._hf_entry(path, files[path]))
        dir_entries = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
                       for d in sorted(dirs) if recursive or "/" not in d[len(base):]]
        return dir_entries + out

    def hf_tree(self, repo_id: str, rev: str, path: str | None = None) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is not None:
            recursive = self.query.get("recursive", ["false"])[0].lower() == "true"
            self._json(200, self._hf_listing(files, path or "", recursive))

    def hf_paths_info(self, repo_id: str, rev: str) -> None:
        files = self._need_repo("hf", repo_id, rev)
        if files is not None:
            form = parse_qs(self.body.decode())
            self._json(200, [self._hf_entry(p, files[p]) for p in form.get("paths", []) if p in files])

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
        if not self.store.has_blob(entry["sha256"]):
            self._error(501, "file was uploaded through Xet; the stand-in holds only its hash")
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
        req = json.loads(self.body or b"{}")
        repo_id = f"{req['Path']}/{req['Name']}"
        if not self.store.create("ms", repo_id, req.get("Visibility") == 1):
            self._ms(None, 409, False, "repo already exists")
            return
        self._ms({"Path": req["Path"], "Name": req["Name"], "Id": 1})

    def ms_repo_info(self, repo_id: str) -> None:
        if self.store.repo("ms", repo_id) is None:
            self._ms(None, 404, False, "repo not exist")
            return
        owner, name = repo_id.split("/", 1)
        self._ms({"Path": owner, "Name": name, "Id": 1, "Visibility": 5})

    def ms_lfs_batch(self, repo_id: str) -> None:
        objects = []
        for obj in json.loads(self.body).get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if not self.store.has_blob(obj["oid"]):
                entry["actions"] = {"upload": {"href": f"{self._base()}/_lfs/{obj['oid']}", "header": {}}}
            objects.append(entry)
        self._json(200, {"objects": objects})

    def ms_commit(self, repo_id: str, rev: str) -> None:
        if self._need_repo("ms", repo_id, rev) is None:
            return
        req = json.loads(self.body)
        adds, deletes = {}, []
        for action in req.get("actions", []):
            path = action["path"]
            if action.get("action") == "delete":
                deletes.append(path)
            elif action.get("type") == "lfs":
                if not self.store.has_blob(action["sha256"]):
                    self._ms(None, 400, False, f"lfs object {action['sha256']} for {path} was never uploaded")
                    return
                adds[path] = self.store.entry(None, path, sha256=action["sha256"], size=int(action["size"]),
                                              lfs=True)
            else:
                adds[path] = self.store.entry(base64.b64decode(action.get("content") or ""), path, lfs=False)
        commit = self.store.commit("ms", repo_id, rev, adds, deletes, req.get("commit_message", ""))
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
ROUTES = [(m, re.compile(p), n) for m, p, n in [
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
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)
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

