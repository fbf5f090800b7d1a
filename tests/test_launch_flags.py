"""The launch flags a ktconvert.json records are checked, not trusted (issue 14, item 8): `verify` derives the
kt-kernel / SGLang flags from the recorded method and NUMA count (which the structure check ties to the files) and
the expert placement flags from the listed files, and fails on any difference although every hash still matches;
`publish` refuses such a folder before anything is uploaded, so the model card never carries wrong flags.

The expected values are written out here from kt-kernel's / SGLang's flag names (--kt-method, --kt-weight-path,
--kt-threadpool-count = the NUMA count; --model for the GPU checkpoint; --init-expert-location FILE.pt
--kt-expert-placement-strategy frequency), not taken from the code under test."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_VERIFY
from ktconvert.formats.fileio import record_for
from test_hub import hub_env, server  # noqa: F401  (fixtures)


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def cpu_out(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "cpu"
    assert _run("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint4", "--numa", "2", "--quiet").exit_code == 0
    return out


@pytest.fixture(scope="module")
def gpu_out(tiny_model, tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("launch") / "gpu"
    assert _run("gpu", tiny_model("qwen3_moe"), out, "--quiet").exit_code == 0
    return out


def _edited(out, tmp_path, edit) -> tuple:
    """A copy of `out` whose ktconvert.json went through edit(manifest) (in place)."""
    copy = tmp_path / f"edited-{out.name}"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / "ktconvert.json").read_text())
    edit(manifest)
    (copy / "ktconvert.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return copy, manifest


AMXINT8_T4 = {"kt-method": "AMXINT8", "kt-weight-path": ".", "kt-threadpool-count": 4}


def _claim_amxint8_t4(m):
    m["flags"] = dict(AMXINT8_T4)
    m["sglang_args"] = "--kt-method AMXINT8 --kt-weight-path . --kt-threadpool-count 4"


def test_the_written_flags_are_what_kt_kernel_needs(cpu_out):
    manifest = json.loads((cpu_out / "ktconvert.json").read_text())
    assert manifest["flags"] == {"kt-method": "AMXINT4", "kt-weight-path": ".", "kt-threadpool-count": 2}
    res = _run("verify", cpu_out, "--hashes", "--json")
    assert res.exit_code == 0, res.output
    assert {c["name"]: c["status"] for c in json.loads(res.output)["checks"]}["flags"] == "ok"


@pytest.mark.parametrize("edit", [
    _claim_amxint8_t4,                                                            # both, consistently
    lambda m: m.__setitem__("flags", dict(AMXINT8_T4)),                          # the flags only
    lambda m: m.__setitem__("sglang_args", "--kt-method AMXINT8 --kt-weight-path . --kt-threadpool-count 4"),
    lambda m: m["flags"].__setitem__("kt-threadpool-count", 4),                  # one value
    lambda m: m["flags"].__setitem__("kt-cpuinfer", 64),                         # a flag added
    lambda m: m["flags"].pop("kt-weight-path"),                                  # a flag removed
    lambda m: m.__setitem__("expert_activation", "expert_activation.pt"),        # placement without the file
], ids=["flags+args", "flags", "sglang_args", "threadpool", "extra-flag", "missing-flag", "placement"])
def test_verify_fails_on_edited_launch_flags(cpu_out, tmp_path, edit):
    out, _ = _edited(cpu_out, tmp_path, edit)
    res = _run("verify", out, "--hashes", "--json")
    assert res.exit_code == EXIT_VERIFY, res.output
    result = json.loads(res.output)
    checks = {c["name"]: c["status"] for c in result["checks"]}
    assert checks["hashes"] == "ok" and checks["structure"] == "ok"       # what verify --hashes passed before
    assert checks["flags"] == "failed"
    assert any("ktconvert.json" in p and ("flags" in p or "sglang_args" in p or "expert_activation" in p)
               for p in result["problems"])


def test_verify_fails_when_the_placement_file_is_not_in_the_flags(cpu_out, tmp_path):
    """An expert_activation.pt listed in the files (hash right) but not named in the flags: SGLang-KT would not
    get --init-expert-location."""
    def add_counts_file(m):
        (out_dir / "expert_activation.pt").write_bytes(b"counts")
        m["files"]["expert_activation.pt"] = record_for(out_dir, "expert_activation.pt").entry()

    out_dir = tmp_path / "edited-cpu"
    out, _ = _edited(cpu_out, tmp_path, add_counts_file)
    res = _run("verify", out, "--hashes")
    assert res.exit_code == EXIT_VERIFY
    assert "--init-expert-location ./expert_activation.pt --kt-expert-placement-strategy frequency" in res.output

    def named_too(m):
        m["expert_activation"] = "expert_activation.pt"
        m["sglang_args"] += " --init-expert-location ./expert_activation.pt --kt-expert-placement-strategy frequency"

    fixed, _ = _edited(out, tmp_path, named_too)
    res = _run("verify", fixed, "--hashes", "--json")
    assert {c["name"]: c["status"] for c in json.loads(res.output)["checks"]}["flags"] == "ok", res.output


def test_verify_fails_on_edited_gpu_model_flag(gpu_out, tmp_path):
    manifest = json.loads((gpu_out / "ktconvert.json").read_text())
    assert manifest["flags"] == {"model": "."} and manifest["sglang_args"] == "--model ."
    for edit in (lambda m: m.update(flags={"model": ".", "kt-method": "AMXINT4"}),
                 lambda m: m.update(sglang_args="--model /elsewhere")):
        out, _ = _edited(gpu_out, tmp_path, edit)
        res = _run("verify", out, "--hashes", "--json")
        assert res.exit_code == EXIT_VERIFY, res.output
        assert {c["name"]: c["status"] for c in json.loads(res.output)["checks"]}["flags"] == "failed"
        shutil.rmtree(out)


def test_publish_refuses_edited_flags_before_uploading(cpu_out, tmp_path, server, hub_env):
    from ktconvert.ops.hub import client_for

    out, _ = _edited(cpu_out, tmp_path, _claim_amxint8_t4)
    res = _run("publish", out, "org/edited", "--endpoint", server.url, "--quiet")
    assert res.exit_code == EXIT_VERIFY, res.output
    assert "refusing to publish" in res.output and "kt-method" in res.output
    assert not [r for r in server.requests if r[0] in ("POST", "PUT")]        # nothing created or uploaded
    good = _run("publish", cpu_out, "org/good", "--endpoint", server.url, "--quiet")
    assert good.exit_code == 0, good.output
    card = client_for("hf", server.url).read_small("org/good", "main", "README.md").decode()
    assert "--kt-method AMXINT4" in card and "--kt-threadpool-count 2" in card
