"""The local hub stand-in under hostile requests (issue 14, item 2): blob names are exactly 64 lowercase hex
characters at upload and at download, every path stays under --root, and malformed bodies are a 400, never a file
served from elsewhere. Requests are made by hand with urllib, like a hostile client would."""
from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request

import pytest

from ktconvert.ops.hub_standin.server import HubServer

BAD_OIDS = ["/etc/passwd", "../../secret", "../secret", "A" * 64, "0" * 63, "0" * 65, "g" * 64, "",
            "..%2f..%2fsecret", "0" * 62 + "/.", "0" * 64 + "\x00"]


@pytest.fixture
def srv(tmp_path):
    (tmp_path / "secret").write_bytes(b"TOP SECRET outside the root\n")
    server = HubServer(tmp_path / "root" / "hub").start()
    server.store.create("hf", "org/m")
    server.store.create("ms", "org/m")
    yield server
    server.stop()


def _call(srv, method: str, path: str, body=None, ctype="application/json") -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(srv.url + path, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _no_secret(srv, *responses) -> None:
    for _, body in responses:
        assert b"TOP SECRET" not in body and b"root:" not in body


@pytest.mark.parametrize("oid", BAD_OIDS)
def test_lfs_batch_refuses_bad_oids(srv, oid):
    hf = _call(srv, "POST", "/org/m.git/info/lfs/objects/batch",
               {"operation": "upload", "objects": [{"oid": oid, "size": 3}]})
    ms = _call(srv, "POST", "/api/v1/repos/models/org/m/info/lfs/objects/batch",
               {"operation": "upload", "objects": [{"oid": oid, "size": 3}]})
    assert hf[0] == 400 and ms[0] == 400, (hf, ms)
    _no_secret(srv, hf, ms)


@pytest.mark.parametrize("oid", BAD_OIDS)
def test_commits_refuse_bad_oids_and_nothing_is_served(srv, oid):
    hf_commit = "\n".join(json.dumps(line) for line in [
        {"key": "header", "value": {"summary": "x"}},
        {"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": oid, "size": 29}}]).encode()
    hf = _call(srv, "POST", "/api/models/org/m/commit/main", hf_commit, "application/x-ndjson")
    ms = _call(srv, "POST", "/api/v1/repos/models/org/m/commit/master",
               {"commit_message": "x", "actions": [{"action": "create", "path": "w.safetensors", "type": "lfs",
                                                    "size": 29, "sha256": oid}]})
    assert hf[0] == 400 and ms[0] == 400, (hf, ms)
    got_hf = _call(srv, "GET", "/org/m/resolve/main/w.safetensors")
    got_ms = _call(srv, "GET", "/api/v1/models/org/m/repo?Revision=master&FilePath=w.safetensors")
    assert got_hf[0] == 404 and got_ms[0] == 404
    _no_secret(srv, hf, ms, got_hf, got_ms)


def test_xet_mode_commit_cannot_name_a_file_outside_the_root(srv):
    assert _call(srv, "GET", "/api/models/org/m/xet-write-token/main")[0] == 200     # the repo is in Xet mode now
    commit = "\n".join(json.dumps(line) for line in [
        {"key": "header", "value": {"summary": "x"}},
        {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": "../../secret", "size": 29}}])
    status, body = _call(srv, "POST", "/api/models/org/m/commit/main", commit.encode(), "application/x-ndjson")
    assert status == 400
    _no_secret(srv, (status, body), _call(srv, "GET", "/org/m/resolve/main/w.bin"))


def test_download_of_a_tampered_state_entry_is_refused(srv, tmp_path):
    """state.json under --root names a blob outside it (a tampered or foreign root): 400, not the file."""
    data = b"hello"
    srv.store.put_file("hf", "org/m", "ok.txt", data)
    with srv.store.lock:
        files = srv.store.files("hf", "org/m", "main")
        files["ok.txt"]["sha256"] = "../../secret"
        files["ok.txt"]["lfs"] = True
    status, body = _call(srv, "GET", "/org/m/resolve/main/ok.txt")
    assert status == 400
    _no_secret(srv, (status, body))


def test_upload_put_and_verify_take_only_hex_names(srv):
    data = b"payload"
    oid = hashlib.sha256(data).hexdigest()
    assert _call(srv, "PUT", f"/_lfs/{oid}", data, "application/octet-stream")[0] == 200
    assert _call(srv, "POST", f"/_lfs/{oid}/verify", {"oid": oid, "size": len(data)})[0] == 200
    for bad in ("..%2F..%2Fsecret", oid.upper(), oid[:-1]):
        assert _call(srv, "PUT", f"/_lfs/{bad}", data, "application/octet-stream")[0] in (400, 404)
    assert sorted(p.name for p in (srv.store.root / "blobs").iterdir()) == [oid]


def test_store_api_refuses_bad_names(srv):
    for oid in BAD_OIDS:
        with pytest.raises(ValueError):
            srv.store.blob_path(oid)
        assert srv.store.has_blob(oid) is False


@pytest.mark.parametrize("body", [b"{nope", b"[" * 100_000 + b"]" * 100_000, b'{"files": 3}', b'"x"',
                                  b'{"objects": [1]}', b'{"objects": [{"oid": 5, "size": "x"}]}'])
def test_malformed_bodies_are_400(srv, body):
    for path in ("/api/models/org/m/preupload/main", "/org/m.git/info/lfs/objects/batch",
                 "/api/v1/repos/models/org/m/info/lfs/objects/batch", "/api/v1/repos/models/org/m/commit/master",
                 "/api/repos/create", "/api/v1/models"):
        status, _ = _call(srv, "POST", path, body)
        assert status == 400, (path, body[:20], status)
    status, _ = _call(srv, "POST", "/api/models/org/m/commit/main", body, "application/x-ndjson")
    assert status == 400


def test_commit_paths_are_plain_relative_names(srv):
    content = base64.b64encode(b"x").decode()
    for path in ("../x", "/abs", "a\\b", "a//b"):
        line = json.dumps({"key": "file", "value": {"path": path, "content": content, "encoding": "base64"}})
        status, _ = _call(srv, "POST", "/api/models/org/m/commit/main", line.encode(), "application/x-ndjson")
        assert status == 400, path
