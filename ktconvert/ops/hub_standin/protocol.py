"""What the hub stand-in (ktconvert.ops.hub_standin.server) reads from and writes to the wire.

Requests are checked field by field before they reach the store: JSON bodies bounded in size and depth
(safe_read.parse_json), each field of the expected type (a bool is not an int), blob names ("oid", "sha256") exactly
64 lowercase hex characters, file paths plain relative names. Every failure raises `BadRequest`, which the
server answers with 400 and the message. The HF listing shapes (tree / paths-info entries) are built here too, and
`WireHandler` holds the HTTP plumbing (bounded bodies, answers, routing) the stand-in's handler builds on.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from ktconvert.errors import InputError
from ktconvert.util.safe_read import parse_json
from ktconvert.ops.hub_standin.store import check_path, lfs_pointer, valid_oid

MAX_BODY = 1 << 30                 # whole request bodies are held in memory (a test server)
MAX_JSON_BODY = 64 << 20
_MISSING = object()


class BadRequest(ValueError):
    """A malformed request (answered 400 with the message)."""


def load_json(data: bytes, kind: type = dict):
    """A request's JSON (bounded in size and depth) of type `kind`; BadRequest otherwise."""
    try:
        value = parse_json(data, what="request body", max_bytes=MAX_JSON_BODY)
    except InputError as exc:
        raise BadRequest(str(exc)) from None
    if not isinstance(value, kind):
        raise BadRequest(f"request body: expected a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def field(obj, key: str, kind, default=_MISSING):
    """obj[key] checked to be of `kind` (a type or a tuple of types; a bool is not an int); BadRequest otherwise."""
    value = obj.get(key, default) if isinstance(obj, dict) else _MISSING
    if value is _MISSING:
        raise BadRequest(f"missing {key!r}")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"{key!r} has the wrong type ({type(value).__name__})")
    return value


def oid_of(obj, key: str = "oid") -> str:
    """obj[key] as a blob name: 64 lowercase hex characters."""
    value = field(obj, key, str)
    if not valid_oid(value):
        raise BadRequest(f"{key} {value[:80]!r} is not 64 lowercase hex characters")
    return value


def path_of(obj, key: str = "path") -> str:
    """obj[key] as a repo file path: a plain relative name."""
    try:
        return check_path(field(obj, key, str))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"content is not base64 ({exc})") from None


def lfs_objects(body: bytes) -> list[tuple[str, int]]:
    """(oid, size) of every object of an LFS batch request (HF and ModelScope alike)."""
    return [(oid_of(obj), field(obj, "size", int)) for obj in field(load_json(body), "objects", list)]


def hf_commit_ops(body: bytes) -> tuple[str, list[tuple[str, dict]]]:
    """(title, [(key, value)]) of an HF NDJSON commit body ("file", "lfsFile", "deletedFile", "deletedFolder"),
    every field checked (lines with other keys are ignored, as before)."""
    title, ops = "", []
    for line in body.splitlines():
        if not line.strip():
            continue
        item = load_json(line)
        key, value = field(item, "key", str), field(item, "value", dict)
        if key == "header":
            title = str(value.get("summary", ""))
        elif key in ("file", "lfsFile", "deletedFile", "deletedFolder"):
            path_of(value)
            if key == "file":
                field(value, "content", str)
            elif key == "lfsFile":
                oid_of(value)
                if field(value, "size", int) < 0:
                    raise BadRequest("negative size")
            ops.append((key, value))
    if not body.strip():
        raise BadRequest("empty commit")
    return title, ops


def ms_commit_actions(body: bytes) -> tuple[str, list[dict]]:
    """(message, actions) of a ModelScope commit body, every field checked."""
    req = load_json(body)
    actions = field(req, "actions", list)
    for action in actions:
        path_of(action)
        if action.get("action") == "delete":
            continue
        if action.get("type") == "lfs":
            oid_of(action, "sha256")
            if field(action, "size", int) < 0:
                raise BadRequest("negative size")
        else:
            field(action, "content", (str, type(None)), "")
    return str(req.get("commit_message", "")), actions


def hf_entry(path: str, entry: dict) -> dict:
    """One file of an HF tree / paths-info answer (git blob SHA-1 as "oid"; "lfs" with the sha256 for LFS files)."""
    out = {"type": "file", "path": path, "size": entry["size"], "oid": entry["git_sha1"]}
    if entry["lfs"]:
        out["lfs"] = {"oid": entry["sha256"], "size": entry["size"],
                      "pointerSize": len(lfs_pointer(entry["sha256"], entry["size"]))}
    return out


def hf_listing(files: dict, prefix: str, recursive: bool) -> list:
    """The HF tree answer for folder `prefix` of a commit's {path: entry}: directories first, then files."""
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
            out.append(hf_entry(path, files[path]))
    dir_entries = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
                   for d in sorted(dirs) if recursive or "/" not in d[len(base):]]
    return dir_entries + out


class WireHandler(BaseHTTPRequestHandler):
    """HTTP plumbing of the stand-in: bounded request bodies, JSON and ModelScope-envelope answers, routing.

    Subclasses set `routes` [(method, compiled path regex, handler method name)]; a handler gets the regex groups
    (URL-decoded) as arguments, `self.body` (bytes) and `self.query`. BadRequest → 400, any other exception → 500
    (a stand-in bug shows up as an answer, not a dropped connection). The server provides `take_fault(method,
    path)` (an injected status or None) and `requests` (every (method, path) served)."""

    protocol_version = "HTTP/1.1"
    routes: list = []

    def log_message(self, fmt, *args) -> None:  # quiet: requests are recorded in server.requests instead
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks, total = [], 0
            while True:
                try:
                    size = int(self.rfile.readline(64).strip().split(b";")[0], 16)
                except ValueError:
                    raise BadRequest("malformed chunked body") from None
                total += size
                if total > MAX_BODY:
                    raise BadRequest(f"body larger than {MAX_BODY} bytes")
                if size == 0:
                    self.rfile.readline(64)
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(64)
            return b"".join(chunks)
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit() or int(length) > MAX_BODY:
            raise BadRequest(f"Content-Length {length[:20]!r}: not a number of at most {MAX_BODY} bytes")
        return self.rfile.read(int(length)) if int(length) else b""

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
        message = message.splitlines()[0] if message else message
        if self.path.startswith("/api/v1/"):
            self._ms(None, status, False, message)
        else:
            header = message.encode("ascii", "replace").decode()
            self._json(status, {"error": message}, headers={"X-Error-Message": header})

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        try:
            self.body = self._body() if self.command in ("POST", "PUT") else b""
        except BadRequest as exc:
            self.close_connection = True
            self._error(400, str(exc))
            return
        fault = self.server.take_fault(self.command, url.path)
        self.server.requests.append((self.command, url.path))
        if fault is not None:
            self._error(fault, "injected fault")
            return
        for method, pattern, name in self.routes:
            match = pattern.fullmatch(url.path)
            if match and (method == self.command or (method == "GET" and self.command == "HEAD")):
                try:
                    getattr(self, name)(*[None if g is None else unquote(g) for g in match.groups()])
                except BadRequest as exc:
                    self._error(400, str(exc))
                except Exception as exc:  # noqa: BLE001  (see the class docstring)
                    self._error(500, f"{type(exc).__name__}: {exc}")
                return
        self._error(404, f"no route for {self.command} {url.path}")

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch
