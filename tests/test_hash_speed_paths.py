"""Hashing at a fraction of its cost with the same guarantees (issue 32, item 1).

* tensor and source digests are BLAKE3 since manifest format_version 3 ("blake3:<hex>" for a tensor, key "blake3"
  for a source file); every output file keeps its sha256 (what the hubs compare), and a tensor that is a whole file
  of its own (a ``.kt`` file) records its file's sha256 instead of a second hash of the same bytes;
* a source file that is a Hugging Face cache snapshot symlink into ``blobs/<sha256>`` records that sha256 without a
  read, only where every check of ``stream.known_sha256`` holds; ``--verify-source-hash`` re-hashes it at conversion
  and ``verify --source --hashes`` at any time;
* ``verify --hashes`` catches a flipped byte in an output tensor and in a source file, for manifests of this release
  and of the previous one (``golden/manifest_v2``: outputs the previous release wrote, format_version 2, of the
  seeded model below; their weights are byte-identical to what this release writes).

Expected digests come from hashlib and the ``blake3`` package over bytes read back with the safetensors library,
never from the code under test; BLAKE3's own test vectors pin the package.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from ktconvert.cli.main import cli
from ktconvert.formats import digests
from ktconvert.formats.safetensors_reader import parse_header
from ktconvert.formats.stream import known_sha256

GOLDEN = Path(__file__).parent / "golden" / "manifest_v2"
MODEL = dict(layers=1, experts=2, hidden=128, intermediate=128, seed=7)     # the model GOLDEN was converted from
CPU = ("--method", "amxint4")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _b3(data) -> str:
    return blake3.blake3(data).hexdigest()


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def src(tiny_model):
    return tiny_model("qwen3_moe", **MODEL)


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory):
    """{layout: OUT} converted by this release."""
    root = tmp_path_factory.mktemp("hash-speed")
    outs = {}
    for layout in ("safetensors", "kt"):
        outs[layout] = root / layout
        result = _cli("cpu", src, outs[layout], *CPU, "--layout", layout, "--quiet")
        assert result.exit_code == 0, result.output
    return outs


def _manifest(out: Path) -> dict:
    return json.loads((out / "ktconvert.json").read_text())


# ---------------------------------------------------------------- the digests themselves


def test_blake3_package_matches_the_spec_vectors():
    # BLAKE3 paper / reference implementation: the hash of the empty input and of b"abc"
    assert _b3(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert _b3(b"abc") == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"


def test_digest_forms_name_their_algorithm():
    data = os.urandom(1000)
    assert digests.digest(data) == "blake3:" + _b3(data)
    assert digests.digest(data, "sha256") == _sha(data)
    for recorded in ("blake3:" + "0" * 64, "0" * 64):
        assert digests.digest_like(recorded, data) == (digests.digest(data) if recorded.startswith("blake3:")
                                                      else _sha(data))
    assert digests.digest_algorithm(None) == "sha256" and digests.digest_algorithm("blake3:ab") == "blake3"


def test_tensor_hasher_per_tensor_algorithms_any_chunking(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.integers(0, 255, size=n, dtype="uint8") for i, n in enumerate((0, 1, 63, 4096, 70001))}
    save_file(tensors, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    header = parse_header(tmp_path / "x.safetensors")
    algorithms = {"t1": "sha256", "t3": "sha256"}           # the others: BLAKE3 (the default for a name not given)
    want = {n: (_sha(a.tobytes()) if n in algorithms else "blake3:" + _b3(a.tobytes())) for n, a in tensors.items()}
    for step in (1, 7, 4096, len(data)):
        hasher = digests.TensorHasher(header.tensors, algorithms)
        for i in range(0, len(data), step):
            hasher.update(memoryview(data)[i:i + step])
        assert hasher.digests() == want, step


# ---------------------------------------------------------------- what a conversion records


def test_new_manifest_records_blake3_tensors_and_sources_and_sha256_files(src, outputs):
    out = outputs["safetensors"]
    manifest = _manifest(out)
    assert manifest["format_version"] == 3
    shard = next(out.glob("model-*.safetensors"))
    assert manifest["files"][shard.name]["sha256"] == _sha(shard.read_bytes())
    read_back = load_file(shard)
    assert read_back and all(manifest["tensors"][n] == "blake3:" + _b3(a.tobytes()) for n, a in read_back.items())
    source_file = src / "model.safetensors"
    assert manifest["source"]["files"] == {"model.safetensors": {"bytes": source_file.stat().st_size,
                                                                 "blake3": _b3(source_file.read_bytes())}}


def test_a_kt_file_is_its_tensor_hashed_once(outputs):
    """A .kt file holds one tensor's bytes and nothing else: its file sha256 is the tensor's digest (one hash of
    those bytes, not two), and that still names every tensor byte."""
    out = outputs["kt"]
    manifest = _manifest(out)
    kt_files = sorted(out.rglob("*.kt"))
    assert kt_files
    by_digest = {manifest["files"][p.relative_to(out).as_posix()]["sha256"]: p for p in kt_files}
    assert all(by_digest[_sha(p.read_bytes())] == p for p in kt_files)
    assert sorted(manifest["tensors"].values()) == sorted(_sha(p.read_bytes()) for p in kt_files)


def test_weights_are_the_previous_release_s_bytes(outputs):
    for layout, out in outputs.items():
        old, new = _manifest(GOLDEN / layout), _manifest(out)
        assert old["format_version"] == 2
        weights = {k for k in old["files"] if k.endswith((".safetensors", ".kt"))}
        assert weights and {k: old["files"][k] for k in weights} == {k: new["files"][k] for k in weights}, layout
        if layout == "kt":              # the .kt tensor digests are the same sha256s in both versions
            assert old["tensors"] == new["tensors"]


# ---------------------------------------------------------------- verify --hashes catches every flipped byte


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tensor_offset(path: Path) -> tuple[str, int]:
    """(a tensor's name, the file offset of one byte inside its data) of a .safetensors file."""
    header = parse_header(path)
    name, ref = max(header.tensors.items(), key=lambda item: item[1].nbytes)
    return name, ref.offset + ref.nbytes // 2


def _copies(outputs, tmp_path):
    """{(release, layout): a writable copy of OUT}: this release's outputs and the previous one's (GOLDEN)."""
    copies = {}
    for release, root in (("new", None), ("old", GOLDEN)):
        for layout in ("safetensors", "kt"):
            copy = tmp_path / f"{release}-{layout}"
            shutil.copytree(outputs[layout] if root is None else root / layout, copy)
            copies[release, layout] = copy
    return copies


def _verify(out, *args):
    result = _cli("verify", out, "--hashes", "--json", *args)
    return result.exit_code, {c["name"]: c for c in json.loads(result.output)["checks"]}, result.output


@pytest.mark.parametrize("release", ["new", "old"])
def test_verify_hashes_catches_a_flipped_output_tensor_byte(outputs, tmp_path, release):
    copies = _copies(outputs, tmp_path)
    for layout in ("safetensors", "kt"):
        out = copies[release, layout]
        code, checks, text = _verify(out)
        assert code == 0, text
        if layout == "safetensors":
            shard = next(out.glob("model-*.safetensors"))
            tensor, offset = _tensor_offset(shard)
            _flip(shard, offset)
            rel = shard.name
        else:
            kt = sorted(out.rglob("*_quant_.kt"))[0]
            _flip(kt, kt.stat().st_size // 2)
            rel = kt.relative_to(out).as_posix()
            tensor = None
        code, checks, text = _verify(out)
        assert code != 0, text
        assert f"{rel}: content differs" in text, text
        if tensor is not None:
            assert f"{tensor}: tensor bytes differ" in text, text


@pytest.mark.parametrize("release", ["new", "old"])
def test_verify_source_hashes_catches_a_flipped_source_byte(src, outputs, tmp_path, release):
    out = outputs["safetensors"] if release == "new" else GOLDEN / "safetensors"
    recorded = _manifest(out)["source"]["files"]["model.safetensors"]
    data = (src / "model.safetensors").read_bytes()
    algorithm = "blake3" if release == "new" else "sha256"
    if recorded.get(algorithm) != (_b3(data) if release == "new" else _sha(data)):
        pytest.skip("the seeded tiny model is not the bytes the golden output was made from on this install")
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    code, checks, text = _verify(out, "--source", copy)
    assert code == 0 and checks["source"]["detail"].endswith(f"1 {algorithm} compared"), text
    header = parse_header(copy / "model.safetensors")
    ref = next(iter(header.tensors.values()))
    _flip(copy / "model.safetensors", ref.offset)
    code, checks, text = _verify(out, "--source", copy)
    assert code != 0 and checks["source"]["status"] != "ok", text
    assert f"model.safetensors: content differs from ktconvert.json; expected {algorithm}" in text, text


# ---------------------------------------------------------------- the Hugging Face cache's blob names


def _cache(root: Path, src: Path, lie: bool = False) -> Path:
    """A Hugging Face hub cache of `src` (``models--t--m/{blobs,snapshots/REV}``); the weights' blob is named by
    their sha256 (lie: by another file's); returns the snapshot folder."""
    repo = root / "models--t--m"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        data = path.read_bytes()
        blob = _sha(b"another file" if lie and path.suffix == ".safetensors" else data)
        if path.suffix != ".safetensors":
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()      # a git file: 40 hex digits
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def test_known_sha256_takes_only_a_cache_s_own_sha256_blob(src, tmp_path):
    snapshot = _cache(tmp_path / "hub", src)
    shard = snapshot / "model.safetensors"
    size, sha = shard.stat().st_size, _sha(shard.read_bytes())
    assert known_sha256(shard) == sha and known_sha256(shard, size) == sha
    assert known_sha256(shard, size + 1) is None                   # not the size the hub recorded
    assert known_sha256(snapshot / "config.json") is None          # a git blob id, not a sha256
    assert known_sha256(src / "model.safetensors") is None         # no symlink
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "model.safetensors").symlink_to(os.path.realpath(shard))
    assert known_sha256(planted / "model.safetensors") is None     # not in a snapshot of the cache
    other = tmp_path / "hub" / "models--o--x" / "snapshots" / "b"
    other.mkdir(parents=True)
    (other / "model.safetensors").symlink_to(os.path.realpath(shard))
    assert known_sha256(other / "model.safetensors") is None       # into another repo's blobs


def test_cache_sha256_is_recorded_unread_and_checked_on_demand(src, tmp_path):
    snapshot = _cache(tmp_path / "hub", src)
    out = tmp_path / "out"
    assert _cli("cpu", snapshot, out, *CPU, "--quiet").exit_code == 0
    data = (snapshot / "model.safetensors").read_bytes()
    assert _manifest(out)["source"]["files"]["model.safetensors"] == {"bytes": len(data), "sha256": _sha(data)}
    code, checks, text = _verify(out, "--source", snapshot)
    assert code == 0 and checks["source"]["detail"].endswith("1 sha256 compared"), text


def test_a_lying_blob_name_is_caught_by_the_re_hashing_checks(src, tmp_path):
    """The trust model: a cache blob whose name is not its content's sha256 is recorded as named (the cache is the
    user's own), and both re-hashing checks refuse it."""
    snapshot = _cache(tmp_path / "hub", src, lie=True)
    out = tmp_path / "out"
    assert _cli("cpu", snapshot, out, *CPU, "--quiet").exit_code == 0
    assert _manifest(out)["source"]["files"]["model.safetensors"]["sha256"] == _sha(b"another file")
    code, checks, text = _verify(out, "--source", snapshot)
    assert code != 0 and "model.safetensors: content differs from ktconvert.json; expected sha256" in text, text
    refused = _cli("cpu", snapshot, tmp_path / "out2", *CPU, "--quiet", "--verify-source-hash")
    assert refused.exit_code != 0 and "does not match its Hugging Face cache blob name" in refused.output
    assert not (tmp_path / "out2" / "ktconvert.json").exists()


# ---------------------------------------------------------------- resuming what the previous release began


def test_resume_of_a_journal_that_recorded_sha256s(tiny_model, tmp_path):
    """An OUT left unfinished by the previous release records its finished source files by sha256: the resume
    checks that sha256 (one read, which also gives the BLAKE3 this run records) and finishes with the bytes and
    ktconvert.json of a clean run; a recorded sha256 the file does not have is refused."""
    from test_resume_options import _killed_after, _run

    model = tiny_model("deepseek_v3", layers=6, experts=8)
    options = ("--method", "amxint4", "--numa", "2")
    clean = tmp_path / "clean"
    assert _run("cpu", model, clean, *options, "--quiet").exit_code == 0
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(model, src)
    _killed_after(60, "cpu", src, out, *options, "--threads", "1")
    path = out / ".ktconvert-journal.json"
    journal = json.loads(path.read_text())
    assert journal["sources"]
    for name, entry in journal["sources"].items():
        assert entry == {"bytes": entry["bytes"], "blake3": _b3((src / name).read_bytes())}
        journal["sources"][name] = {"bytes": entry["bytes"], "sha256": "0" * 64}
    path.write_text(json.dumps(journal, sort_keys=True))
    refused = _run("cpu", src, out, *options, "--resume", "--quiet")
    assert refused.exit_code == 2 and f"expected sha256 {'0' * 64}" in refused.output, refused.output
    for name, entry in journal["sources"].items():
        entry["sha256"] = _sha((src / name).read_bytes())
    path.write_text(json.dumps(journal, sort_keys=True))
    assert _run("cpu", src, out, *options, "--resume", "--quiet").exit_code == 0
    tree = {p.relative_to(clean).as_posix(): p.read_bytes() for p in sorted(clean.rglob("*")) if p.is_file()}
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == tree
