"""Publish / remote verify / hub sources against the local stand-in (ktconvert.ops.hub_standin.server) with the real
clients: huggingface_hub (Xet and LFS transports) and modelscope-hub. Everything runs on 127.0.0.1."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ktconvert.errors import RemoteError, VerifyError
from ktconvert.formats.fileio import record_for
from ktconvert.formats.out_manifest import build_manifest, write_manifest
from ktconvert.ops.hub_standin.server import HubServer

TOKEN = "hf_test_secret_token_123"


def make_out(out, files: dict, method="AMXINT4", numa=2) -> dict:
    """A synthetic output folder: `files` {relative path: bytes} + a ktconvert.json from the manifest builder."""
    out = Path(out)
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    model = {"family": "qwen3_moe", "model_type": "qwen3_moe", "layers": [0, 1], "experts": 4, "hidden": 256,
             "intermediate": 128}
    manifest = build_manifest(method=method, numa=numa, layout="kt", model=model,
                              source={"config_sha256": "0" * 64, "files": {}},
                              files=[record_for(out, rel) for rel in files], tensors={})
    write_manifest(out, manifest)
    return manifest


def sample_files(seed: int = 0) -> dict:
    rng = __import__("random").Random(seed)
    return {"config.json": b'{"model_type": "qwen3_moe"}\n',
            "_layer_0/_numa_0/INT4_down_0_Weight.kt": rng.randbytes(150_000),
            "_layer_0/_numa_1/INT4_down_0_Weight.kt": rng.randbytes(150_000),
            "notes.txt": b"small text file\n"}


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    for key in ("HF_ENDPOINT", "MODELSCOPE_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    monkeypatch.setenv("KTCONVERT_CACHE", str(tmp_path / "kt-cache"))
    return tmp_path


@pytest.fixture
def server(hub_env):
    srv = HubServer(hub_env / "hub-root").start()
    yield srv
    srv.stop()


@pytest.fixture
def lfs_transport(monkeypatch):
    """huggingface_hub's HTTP LFS path instead of Xet (the flag is read at call time)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("hub,transport", [("hf", "xet"), ("hf", "lfs"), ("modelscope", "lfs")])
def test_publish_then_verify(hub, transport, server, hub_env, request):
    from ktconvert.ops.hub import client_for, publish

    if transport == "lfs" and hub == "hf":
        request.getfixturevalue("lfs_transport")
    files = sample_files()
    make_out(hub_env / "out", files)
    result = publish(hub_env / "out", "org/model", hub=hub, endpoint=server.url)
    assert result["ok"] and result["checked"] == len(files) and not result["extra"]
    remote = client_for(hub, server.url).list_remote("org/model", result["revision"])
    assert set(remote) == set(files) | {"ktconvert.json", "README.md"}
    shard = "_layer_0/_numa_0/INT4_down_0_Weight.kt"
    assert remote[shard].sha256 == hashlib.sha256(files[shard]).hexdigest()
    if hub == "hf":  # small files: only the git blob SHA-1, which must equal git's own formula
        assert remote["notes.txt"].sha256 is None
        assert remote["notes.txt"].git_sha1 == git_sha1(files["notes.txt"])
    card = client_for(hub, server.url).read_small("org/model", result["revision"], "README.md").decode()
    assert "--kt-method AMXINT4" in card and "--kt-threadpool-count 2" in card
    assert "0" * 64 in card  # the source fingerprint (config sha256)
    from huggingface_hub import ModelCard

    assert ModelCard(card).data.to_dict()["library_name"] == "ktransformers"   # the hub's own parser reads it
    commits_before = len(server.store.repo("hf" if hub == "hf" else "ms", "org/model")["commits"])
    again = publish(hub_env / "out", "org/model", hub=hub, endpoint=server.url)
    assert again["ok"]
    assert len(server.store.repo("hf" if hub == "hf" else "ms", "org/model")["commits"]) == commits_before


def test_hf_resume_uploads_only_missing(server, hub_env, lfs_transport):
    from ktconvert.ops.hub import publish

    files = sample_files(1)
    make_out(hub_env / "out", files)
    server.fail("PUT", r"^/_lfs/", 403, times=1)  # the first LFS object upload is refused: the run dies
    with pytest.raises(RemoteError):
        publish(hub_env / "out", "org/resume", endpoint=server.url)
    assert len([p for m, p in server.requests if m == "PUT"]) == 2  # one refused, one stored
    shards = [hashlib.sha256(files[p]).hexdigest() for p in files if p.endswith(".kt")]
    missing = [oid for oid in shards if not server.store.has_blob(oid)]
    assert len(missing) == 1
    n = len(server.requests)
    result = publish(hub_env / "out", "org/resume", endpoint=server.url)
    assert result["ok"]
    assert [p for m, p in server.requests[n:] if m == "PUT"] == [f"/_lfs/{missing[0]}"]


def test_modelscope_resume_after_failed_put(server, hub_env):
    from ktconvert.ops.hub import publish

    make_out(hub_env / "out", sample_files(2))
    server.fail("PUT", r"^/_lfs/", 403, times=50)  # every retry of one object is refused
    with pytest.raises((RemoteError, VerifyError)):
        publish(hub_env / "out", "org/ms-resume", hub="modelscope", endpoint=server.url)
    server._server.faults.clear()
    n = len(server.requests)
    result = publish(hub_env / "out", "org/ms-resume", hub="modelscope", endpoint=server.url)
    assert result["ok"]
    assert len([p for m, p in server.requests[n:] if m == "PUT"]) <= 2


@pytest.mark.parametrize("hub", ["hf", "modelscope"])
def test_verify_remote_catches_changes(hub, server, hub_env):
    from ktconvert.ops.hub import publish, verify_remote

    files = sample_files(3)
    manifest = make_out(hub_env / "out", files)
    publish(hub_env / "out", "org/tamper", hub=hub, endpoint=server.url)
    store_hub = "hf" if hub == "hf" else "ms"
    server.store.put_file(store_hub, "org/tamper", "notes.txt", b"small text filE\n")           # small file changed
    server.store.put_file(store_hub, "org/tamper", "_layer_0/_numa_1/INT4_down_0_Weight.kt",
                          files["_layer_0/_numa_1/INT4_down_0_Weight.kt"][:-1] + b"\0")       # shard changed
    server.store.put_file(store_hub, "org/tamper", "sub/extra.bin", b"surprise")                # extra file
    server.store.delete_file(store_hub, "org/tamper", "config.json")                            # missing file
    result = verify_remote(manifest, "org/tamper", hub, None, server.url)
    assert not result["ok"]
    assert result["mismatched"] == ["_layer_0/_numa_1/INT4_down_0_Weight.kt", "notes.txt"]
    assert result["extra"] == ["sub/extra.bin"] and result["missing"] == ["config.json"]
    # without a local folder: the repo's own ktconvert.json is the reference
    alone = verify_remote(None, "org/tamper", hub, None, server.url)
    assert alone["missing"] == result["missing"] and alone["mismatched"] == result["mismatched"]


def test_changed_remote_manifest_is_a_mismatch(server, hub_env):
    from ktconvert.ops.hub import publish, verify_remote

    manifest = make_out(hub_env / "out", sample_files(4))
    publish(hub_env / "out", "org/man", endpoint=server.url)
    server.store.put_file("hf", "org/man", "ktconvert.json", b'{"files": {}}')
    assert verify_remote(manifest, "org/man", "hf", None, server.url)["mismatched"] == ["ktconvert.json"]


def test_publish_refuses_corrupted_folder(server, hub_env):
    from ktconvert.ops.hub import publish

    make_out(hub_env / "out", sample_files(5))
    shard = hub_env / "out" / "_layer_0/_numa_0/INT4_down_0_Weight.kt"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(VerifyError):
        publish(hub_env / "out", "org/bad", endpoint=server.url)
    assert server.requests == []  # nothing was sent


def test_publish_refuses_an_edited_manifest(server, hub_env):
    """The model card carries the source fingerprint and tool version: an edited ktconvert.json (its self hash
    unlike its content) is not published (before: uploaded as is)."""
    import json

    from ktconvert.ops.hub import publish

    make_out(hub_env / "out", sample_files(24))
    path = hub_env / "out" / "ktconvert.json"
    manifest = json.loads(path.read_text())
    manifest["source"]["config_sha256"] = "1" * 64
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(VerifyError, match="edited after it was written"):
        publish(hub_env / "out", "org/edited", endpoint=server.url)
    assert server.requests == []


def test_cli_publish_exit_codes_and_token_never_printed(server, hub_env):
    make_out(hub_env / "out", sample_files(6))
    env = {**os.environ, "HF_ENDPOINT": server.url, "KTCONVERT_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "ktconvert.cli.main"]
    ok = subprocess.run(cmd + ["publish", str(hub_env / "out"), "org/cli"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout and TOKEN not in ok.stdout + ok.stderr
    server.store.put_file("hf", "org/cli", "notes.txt", b"changed")
    shard = hub_env / "out" / "notes.txt"
    shard.write_bytes(b"changed locally")
    bad = subprocess.run(cmd + ["publish", str(hub_env / "out"), "org/cli"], env=env, capture_output=True, text=True)
    assert bad.returncode == 4 and "notes.txt" in bad.stderr
    down = subprocess.run(cmd + ["publish", str(hub_env / "out"), "org/cli", "--endpoint", "http://127.0.0.1:9"],
                          env=env, capture_output=True, text=True)
    assert down.returncode in (4, 5)


@pytest.mark.parametrize("hub,scheme", [("hf", "hf"), ("ms", "ms")])
def test_hub_source_download_and_verify(hub, scheme, server, hub_env, monkeypatch):
    from ktconvert.ops.hub import resolve_source

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    src = hub_env / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b'{"model_type": "qwen3_moe"}')
    (src / "model.safetensors").write_bytes(os.urandom(70_000))
    (src / "ignored.bin").write_bytes(b"not a source file")
    commit = server.store.seed(hub, "org/src", src)
    path, extra = resolve_source(f"{scheme}://org/src", cache_dir=str(hub_env / "dl"))
    assert (path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert not (path / "ignored.bin").exists()
    assert extra["repo"] == "org/src"
    if hub == "hf":
        assert extra["revision"] == commit
    # a damaged cached copy never reaches the converter: huggingface_hub trusts its cache, so our hash check
    # refuses it; modelscope-hub re-checks its cache by sha256 and downloads the file again
    target = (path / "model.safetensors").resolve()
    data = bytearray(target.read_bytes())
    data[10] ^= 0xFF
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    if hub == "hf":
        with pytest.raises(VerifyError):
            resolve_source(f"{scheme}://org/src", cache_dir=str(hub_env / "dl"))
    else:
        again, _ = resolve_source(f"{scheme}://org/src", cache_dir=str(hub_env / "dl"))
        assert (again / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_hub_source_then_convert(server, hub_env, monkeypatch):
    pipeline = pytest.importorskip("ktconvert.cpu.convert", reason="pipeline not importable yet")
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.verification.hashes import verify_hashes
    from ktconvert.examples.tiny import make_tiny_model

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    make_tiny_model(hub_env / "tiny", arch="qwen3_moe")
    commit = server.store.seed("hf", "org/tiny", hub_env / "tiny")
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "dl"))
    pipeline.convert_cpu(f"hf://org/tiny@{commit}", hub_env / "out", method="amxint4", numa=1)
    manifest = load_manifest(hub_env / "out")
    assert verify_hashes(hub_env / "out", manifest)["ok"]
    assert commit in (hub_env / "out" / "ktconvert.json").read_text()


@pytest.mark.parametrize("hub,scheme", [("hf", "hf"), ("ms", "ms")])
def test_hub_serving_a_corrupted_shard_is_a_verification_failure(hub, scheme, server, hub_env, monkeypatch):
    """The hub lists a shard's sha256 but serves other bytes: exit 4 from either hub, naming the shard (before:
    5 from ms://, where modelscope-hub's own sha256 check failed the download as a storage error). 5 stays for
    network failures and refusals."""
    from click.testing import CliRunner

    from ktconvert.cli.main import cli
    from ktconvert.examples.tiny import make_tiny_model

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "dl"))
    local = make_tiny_model(hub_env / "tiny", "qwen3_moe")
    server.store.seed(hub, "org/tiny", local)
    shard = sorted(local.glob("*.safetensors"))[-1]
    blob = server.store.blob_path(hashlib.sha256(shard.read_bytes()).hexdigest())
    data = bytearray(blob.read_bytes())
    data[-10] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["cpu", f"{scheme}://org/tiny", str(hub_env / "out"), "--method", "bf16",
                                      "--quiet"])
    assert result.exit_code == 4, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and shard.name in line and "differs from the hub's hash" in line, line
    assert not (hub_env / "out" / "ktconvert.json").exists()


def test_parse_source_rejects_garbage():
    from ktconvert.errors import InputError
    from ktconvert.ops.hub import parse_source

    assert parse_source("hf://org/name@abc123") == ("hf", "org/name", "abc123")
    assert parse_source("ms://org/name") == ("modelscope", "org/name", None)
    for bad in ("hf://name", "s3://org/name", "hf://org/name/extra"):
        with pytest.raises(InputError):
            parse_source(bad)


# ---------------------------------------------------------------- hostile repos and bad arguments (issue 14, 1 and 15)

UNSAFE_NAMES = ["../../escape.json", "/tmp/escape-abs.json", "sub/../../escape.json", "sub\\..\\escape.json",
                "nul\x00.json", "./config2.json", "sub//x.json"]


@pytest.mark.parametrize("hub,scheme", [("hf", "hf"), ("ms", "ms")])
@pytest.mark.parametrize("bad", UNSAFE_NAMES)
def test_hub_source_refuses_unsafe_remote_names(hub, scheme, bad, server, hub_env, monkeypatch):
    from ktconvert.ops.hub import resolve_source

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    src = hub_env / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b'{"model_type": "qwen3_moe"}')
    server.store.seed(hub, "org/evil", src)
    server.store.put_file(hub, "org/evil", bad, b'{"planted": true}')
    n = len(server.requests)
    with pytest.raises(RemoteError) as err:
        resolve_source(f"{scheme}://org/evil", cache_dir=str(hub_env / "dl" / "cache"))
    assert err.value.exit_code == 5 and repr(bad)[1:-1] in str(err.value) and "\n" not in str(err.value)
    downloads = [p for m, p in server.requests[n:] if "/resolve/" in p or p.endswith("/repo")]
    assert downloads == []                                    # refused before any file request
    planted = [p for p in hub_env.rglob("*") if p.is_file() and "hub-root" not in p.parts      # (the hub's blobs)
               and "planted" in p.read_text(errors="ignore")]
    assert planted == [] and not Path("/tmp/escape-abs.json").exists()


def test_remote_name_rules():
    from ktconvert.util.safe_read import unsafe_name as unsafe_reason

    for good in ("config.json", "sub/dir/model-00001-of-00002.safetensors", "a..b.json", ".gitattributes"):
        assert unsafe_reason(good) is None, good
    for bad in UNSAFE_NAMES + ["", "a/", "C:\\x.json", "x" * 256, "a/" * 3000 + "b"]:
        assert unsafe_reason(bad), bad


@pytest.mark.parametrize("repo", ["bad repo", "org/name/extra", "org//name", "../x", "org/na..me", "org/name-"])
def test_invalid_repo_id_is_a_one_line_error(repo, server, hub_env):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    make_out(hub_env / "out", sample_files(15))
    runner = CliRunner()
    for args in (["publish", str(hub_env / "out"), repo, "--endpoint", server.url],
                 ["verify", repo, "--remote", "--endpoint", server.url],
                 ["verify", str(hub_env / "out"), "--remote", repo, "--endpoint", server.url]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 3, (args, result.output, result.exception)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and repo in lines[0], result.output
    assert [r for r in server.requests if "/api/repos/create" in r[1]] == []


def test_non_ascii_token_is_a_one_line_error(server, hub_env, monkeypatch):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    make_out(hub_env / "out", sample_files(16))
    secret = "hf_sécret_tøken_value"
    monkeypatch.setenv("HF_TOKEN", secret)
    result = CliRunner().invoke(cli, ["publish", str(hub_env / "out"), "org/tok", "--endpoint", server.url])
    assert result.exit_code == 3, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "HF_TOKEN" in lines[0] and "ASCII" in lines[0]
    assert secret not in result.output and "sécret" not in result.output
    assert server.requests == []


def test_token_is_masked_as_a_whole_token_only(monkeypatch):
    from ktconvert.ops.hub_clients import scrub

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    text = "GET http://localhost/api?token=local failed for local hub: Bearer local, localised (local)"
    assert scrub(text, "local") == ("GET http://localhost/api?token=*** failed for *** hub: Bearer ***, localised "
                                    "(***)")
    token = "hf_AbCdEf0123456789"           # 16+ characters: masked wherever its text appears, glued or not
    assert scrub(f"401: bad token {token}; url token%3D{token}&x", token) == "401: bad token ***; url token%3D***&x"
    monkeypatch.setenv("HF_TOKEN", token)
    assert token not in scrub(f"Authorization: Bearer {token}\nsecond line", None)
    assert "\n" not in scrub("a\nb", None)


def test_readme_example_token_is_not_a_word():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    jobs = (Path(__file__).parents[1] / "examples" / "tiny-jobs.toml").read_text()
    for text in (readme, jobs):
        assert "HF_TOKEN=local " not in text
        for token in __import__("re").findall(r"HF_TOKEN=(\S+)", text):
            assert not token.isalpha(), token


def test_xet_upload_is_served_back(server, hub_env, monkeypatch):
    """huggingface_hub's default Xet transport against the stand-in: the files can be downloaded again."""
    from ktconvert.ops.hub import client_for, publish, resolve_source

    files = sample_files(17)
    files["model.safetensors"] = os.urandom(90_000)
    make_out(hub_env / "out", files)
    publish(hub_env / "out", "org/xet", endpoint=server.url)
    assert any("xet-write-token" in p for _, p in server.requests)           # the upload went through Xet
    client = client_for("hf", server.url)
    shard = "_layer_0/_numa_0/INT4_down_0_Weight.kt"
    assert client.read_small("org/xet", "main", shard) == files[shard]
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    root, _ = resolve_source("hf://org/xet", cache_dir=str(hub_env / "dl"))
    assert (root / "model.safetensors").read_bytes() == files["model.safetensors"]
