"""``verify`` checks ktconvert.json itself and the source it records (issue 25, item 7).

* integrity: the manifest's self hash (``self_sha256``) shows any edit that does not recompute it (before, editing
  ``source.config_sha256``, a source file's sha256 or ``tool_version`` went unnoticed: exit 0); without a self hash
  (a manifest written before it was recorded) ``tool_version`` is still checked against ``packages.ktconvert``.
* ``--source SRC``: SRC's config sha256, its files' names and sizes against the recorded fingerprint, the files'
  sha256 with ``--hashes`` (before, any SRC of the same shapes passed). A difference is exit 4.
"""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.formats.out_manifest import SELF_KEY, self_sha256

SHARD = "model-00002-of-00002.safetensors"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    src = tiny_model("qwen3_moe")
    out = tmp_path_factory.mktemp("identity") / "out"
    assert _cli("cpu", src, out, "--method", "bf16", "--quiet").exit_code == 0
    return src, out


def _edited(out, tmp_path, edit, keep_self_hash: bool = True):
    """A copy of `out` whose ktconvert.json went through edit(manifest), rewritten in ktconvert's own layout with
    the recorded self hash kept (or, keep_self_hash False, without one: a manifest of an older writer)."""
    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / "ktconvert.json").read_text())
    if not keep_self_hash:
        manifest.pop(SELF_KEY)
    edit(manifest)
    (copy / "ktconvert.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return copy


def _failed(result, *needles):
    assert result.exit_code == 4, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  - ")]
    for needle in needles:
        assert any(needle in line for line in problems), (needle, result.output)
    return problems


def test_written_manifest_records_its_self_hash_and_verifies(converted):
    src, out = converted
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest[SELF_KEY] == self_sha256(manifest)
    result = _cli("verify", out, "--source", src, "--hashes", "--json")
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["integrity"]["status"] == "ok" and checks["source"]["status"] == "ok"
    assert checks["source"]["detail"] == "config.json and 2 files: 2 blake3 compared"


EDITS = [
    pytest.param(lambda m: m["source"].__setitem__("config_sha256", "0" * 64), id="source-config-sha256"),
    pytest.param(lambda m: m["source"]["files"][SHARD].__setitem__("sha256", "1" * 64), id="source-file-sha256"),
    pytest.param(lambda m: m.__setitem__("tool_version", "9.9.9"), id="tool-version"),
    pytest.param(lambda m: m["files"]["model-00001-of-00002.safetensors"].__setitem__("git_sha1", "2" * 40),
                 id="file-git-sha1"),
]


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_manifest_fails_verify(converted, tmp_path, edit):
    _src, out = converted
    _failed(_cli("verify", _edited(out, tmp_path, edit)), "ktconvert.json: edited after it was written")


def test_without_a_self_hash_tool_version_is_checked_against_packages(converted, tmp_path):
    _src, out = converted
    unedited = _edited(out, tmp_path, lambda m: None, keep_self_hash=False)
    result = _cli("verify", unedited, "--json")
    assert result.exit_code == 0, result.output
    integrity = next(c for c in json.loads(result.output)["checks"] if c["name"] == "integrity")
    assert integrity["detail"].startswith(f"no {SELF_KEY} (written before ktconvert recorded it)")
    shutil.rmtree(unedited)
    edited = _edited(out, tmp_path, lambda m: m.__setitem__("tool_version", "9.9.9"), keep_self_hash=False)
    _failed(_cli("verify", edited), "tool_version '9.9.9' disagrees with packages.ktconvert")


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m["source"].__setitem__("config_sha256", "abc"), "source.config_sha256 is not a sha256"),
    (lambda m: m["source"]["files"].__setitem__("../x", {"bytes": 1, "sha256": "0" * 64}), "not a plain relative"),
    (lambda m: m["source"]["files"][SHARD].__setitem__("bytes", -1), "source.files: '" + SHARD),
], ids=["config-not-a-hash", "unsafe-name", "negative-size"])
def test_a_malformed_source_record_fails_verify(converted, tmp_path, edit, problem):
    _src, out = converted
    _failed(_cli("verify", _edited(out, tmp_path, edit, keep_self_hash=False)), problem)


def test_source_edits_without_a_self_hash_are_caught_against_the_source(converted, tmp_path):
    """What an old manifest cannot tell by itself, ``--source SRC`` (sizes, config) and ``--hashes`` can."""
    src, out = converted
    edited = _edited(out, tmp_path, lambda m: m["source"]["files"][SHARD].__setitem__("sha256", "1" * 64),
                     keep_self_hash=False)
    assert _cli("verify", edited, "--source", src).exit_code == 0       # sizes and config agree
    _failed(_cli("verify", edited, "--source", src, "--hashes"),
            f"--source: {SHARD}: content differs from ktconvert.json; expected sha256 '{'1' * 64}'")


def test_another_source_of_the_same_shapes(converted, tmp_path):
    """Same config.json and sizes, other weights: the files' sha256 (--hashes) tell it."""
    from ktconvert.examples.tiny import make_tiny_model

    src, out = converted
    other = make_tiny_model(tmp_path / "other", "qwen3_moe", seed=1)
    assert (other / "config.json").read_bytes() == (src / "config.json").read_bytes()
    problems = _failed(_cli("verify", out, "--source", other, "--hashes", "--experts", "1"),
                       f"--source: {SHARD}: content differs from ktconvert.json")
    assert all("config.json" not in p for p in problems)


def test_another_config_is_a_difference_and_a_broken_source_bad_input(converted, tmp_path):
    src, out = converted
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "note": "another checkpoint"}))
    _failed(_cli("verify", out, "--source", copy, "--experts", "1"),
            "--source: config.json is not the one the folder was made from; expected sha256 '")
    shutil.copy(src / "config.json", copy / "config.json")
    with open(copy / "model-00001-of-00002.safetensors", "ab") as fh:     # trailing bytes: the header refuses them
        fh.write(b"\0" * 8)
    result = _cli("verify", out, "--source", copy, "--experts", "1")
    assert result.exit_code == 3, result.output                              # an unreadable SRC is bad input
