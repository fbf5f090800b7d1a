"""`ktconvert batch`: job file parsing, order, --keep-going, summary JSON, publish targets, exit codes."""
from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import pytest

from ktconvert.ops.batch import load_jobs, run_jobs
from ktconvert.errors import InputError
from test_hub import hub_env, make_out, sample_files, server  # noqa: F401  (fixtures)

JOBS = """
[defaults]
method = "amxint4"
numa = 2

[[jobs]]
name = "bad"
source = "missing-model"
out = "out/bad"

[[jobs]]
name = "good"
source = "model"
  [[jobs.outputs]]
  out = "out/good"
  bundle = "dist/good.tar.zst"
    [[jobs.outputs.publish]]
    hub = "hf"
    repo = "org/good"
    endpoint = "ENDPOINT"
"""


@pytest.fixture
def fake_pipeline(monkeypatch):
    """Stand-in for ktconvert.cpu.convert.convert_cpu: writes a synthetic output, or fails like the real one on a
    missing source. Records its calls. ktconvert.api (which the CLI's batch goes through) is imported first, so that
    the API module, cached for the later tests, keeps the real convert_cpu."""
    import ktconvert.api  # noqa: F401

    calls = []

    def convert_cpu(src, out, **options):
        calls.append((src, out, options))
        if not Path(src).exists():
            raise InputError("source does not exist", file=src)
        if not Path(out, "ktconvert.json").exists():
            make_out(out, sample_files(12), numa=options["numa"])
        return f"{out}: done"

    monkeypatch.setitem(sys.modules, "ktconvert.cpu.convert", types.SimpleNamespace(convert_cpu=convert_cpu))
    return calls


def _job_file(tmp_path, endpoint: str) -> Path:
    (tmp_path / "model").mkdir()
    path = tmp_path / "jobs.toml"
    path.write_text(JOBS.replace("ENDPOINT", endpoint))
    return path


def test_first_failure_stops_without_keep_going(tmp_path, fake_pipeline):
    summary = run_jobs(load_jobs(_job_file(tmp_path, "http://127.0.0.1:9")))
    assert [j["status"] for j in summary["jobs"]] == ["failed", "skipped"]
    assert summary["exit_code"] == 3 and not summary["ok"]
    assert "missing-model" in summary["jobs"][0]["error"]
    assert len(fake_pipeline) == 1


def test_keep_going_runs_the_rest_and_publishes(tmp_path, fake_pipeline, server):
    jobs = load_jobs(_job_file(tmp_path, server.url))
    summary = run_jobs(jobs, keep_going=True)
    assert [j["status"] for j in summary["jobs"]] == ["failed", "ok"]
    assert summary["exit_code"] == 3
    good = summary["jobs"][1]["outputs"][0]
    src, out, options = fake_pipeline[1]
    assert options["resume"] is True and options["method"] == "amxint4" and options["numa"] == 2
    manifest = json.loads(Path(out, "ktconvert.json").read_text())
    lines = "".join(f"{p} {manifest['files'][p]['sha256']}\n" for p in sorted(manifest["files"]))
    assert good["files_root"] == hashlib.sha256(lines.encode()).hexdigest()
    assert good["bytes"] == sum(e["bytes"] for e in manifest["files"].values())
    assert good["remotes"][0]["url"] == f"{server.url}/org/good" and good["remotes"][0]["ok"]
    assert Path(good["bundle"]["path"]).exists()
    again = run_jobs(jobs, keep_going=True)  # resumable: a rerun converts nothing new and publishes nothing new
    assert again["jobs"][1]["status"] == "ok"


def test_cli_summary_file_and_exit_code(tmp_path, fake_pipeline, server, monkeypatch):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    path = _job_file(tmp_path, server.url)
    result = CliRunner().invoke(cli, ["batch", str(path), "--keep-going", "--quiet",
                                      "--summary", str(tmp_path / "summary.json")])
    assert result.exit_code == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [j["name"] for j in summary["jobs"]] == ["bad", "good"]
    assert all("wall_s" in j for j in summary["jobs"])


def test_job_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "jobs.toml"
    bad.write_text('[[jobs]]\nname = "x"\nsource = "m"\nout = "o"\nmethd = "amxint4"\n')
    with pytest.raises(InputError, match="methd"):
        load_jobs(bad)
    bad.write_text('[[jobs]]\nsource = "m"\nout = "o"\n')
    with pytest.raises(InputError, match="method"):
        load_jobs(bad)


def test_example_job_file_parses():
    jobs = load_jobs(Path(__file__).parents[1] / "examples" / "jobs.toml")
    assert jobs and all(job["outputs"] for job in jobs)


# ---------------------------------------------------------------- typed job files (issue 14, items 15 and 16)

BASE_JOB = '[[jobs]]\nname = "j"\nsource = "model"\nout = "o"\nmethod = "amxint4"\n'


@pytest.mark.parametrize("extra,needles", [
    ('include_dense = "false"', ["job j", "include_dense", "boolean", "'false'"]),
    ("numa = true", ["job j", "numa", "integer", "True"]),
    ("numa = 0", ["job j", "numa", "0"]),
    ('numa = "2"', ["job j", "numa", "'2'"]),
    ("numa = 2.0", ["job j", "numa", "2.0"]),
    ('revision = "main"', ["job j", "revision", "hub source"]),
    ("method = 4", ["job j", "method", "string"]),
    ('layout = "tiles"', ["job j", "layout", "'tiles'"]),
    ("threads = -1", ["job j", "threads"]),
    ("group_size = [128]", ["job j", "group_size"]),
    ("allow_drop_bias = 1", ["job j", "allow_drop_bias", "boolean"]),
    ('bundle = 3', ["job j", "bundle", "string"]),
    ('publish = "org/repo"', ["job j", "publish", "table"]),
    ('publish = [1]', ["job j", "publish", "table"]),
    ('publish = {repo = "a/b", private = "yes"}', ["job j", "publish", "private", "boolean"]),
    ('publish = {repo = "a/b", hub = "gitlab"}', ["job j", "publish", "hub", "'gitlab'"]),
    ('publish = {repo = ["a/b"]}', ["job j", "publish", "repo", "string"]),
    ('publish = {hub = "hf"}', ["job j", "publish", "repo"]),
    ('outputs = "x"', ["job j", "outputs"]),
    ("outputs = [1]", ["job j", "outputs"]),
    ("outputs = []", ["job j", "outputs"]),
    ("frobnicate = 1", ["job j", "frobnicate"]),
    ("out = 7", ["job j", "out", "string"]),
])
def test_job_value_of_the_wrong_type_is_refused(tmp_path, extra, needles):
    path = tmp_path / "jobs.toml"
    key = extra.split("=")[0].strip()
    base = "".join(line + "\n" for line in BASE_JOB.splitlines() if not line.startswith(key + " "))
    path.write_text(base + extra + "\n")
    with pytest.raises(InputError) as err:
        load_jobs(path)
    msg = str(err.value)
    assert "jobs.toml" in msg and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize("text,needles", [
    ("jobs = 1", ["jobs"]),
    ("jobs = [1]", ["job 1"]),
    ('jobs = ["x"]', ["job 1"]),
    ("defaults = 3\n" + BASE_JOB, ["defaults"]),
    ("[defaults]\nnuma = true\n" + BASE_JOB, ["defaults", "numa"]),
    ("[defaults]\nout = 'x'\n" + BASE_JOB, ["defaults", "out"]),
    ('[[jobs]]\nname = 5\nsource = "m"\nout = "o"\nmethod = "amxint4"\n', ["name", "string"]),
    ('[[jobs]]\nsource = 5\nout = "o"\nmethod = "amxint4"\n', ["job-1", "source", "string"]),
    ('[[jobs]]\nsource = "m"\n[[jobs.outputs]]\nout = "o"\nmethod = "amxint4"\nsource = "n"\n', ["source"]),
    ('[[jobs]]\nname = "a"\nsource = "m"\nout = "o"\nmethod = "amxint4"\n'
     '[[jobs]]\nname = "a"\nsource = "m"\nout = "p"\nmethod = "amxint4"\n', ["'a'", "twice"]),
    ("x = " + "[" * 5000 + "]" * 5000 + "\n" + BASE_JOB, ["jobs.toml"]),
])
def test_job_file_shape_errors(tmp_path, text, needles):
    path = tmp_path / "jobs.toml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_jobs(path)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_typed_values_reach_the_pipeline_unchanged(tmp_path, fake_pipeline):
    (tmp_path / "model").mkdir()
    path = tmp_path / "jobs.toml"
    path.write_text("[defaults]\ninclude_dense = false\nnuma = 2\n" + BASE_JOB + "include_mtp = true\n")
    jobs = load_jobs(path)
    run_jobs(jobs)
    _, _, options = fake_pipeline[0]
    assert options["include_dense"] is False and options["include_mtp"] is True
    assert options["numa"] == 2 and type(options["numa"]) is int


def test_revision_on_a_hub_source_is_kept(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text('[[jobs]]\nsource = "hf://org/name"\nrevision = "abc123"\nout = "o"\nmethod = "amxint4"\n')
    assert load_jobs(path)[0]["source"] == "hf://org/name@abc123"


def test_cli_batch_bad_job_file_is_one_line(tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    path = tmp_path / "jobs.toml"
    path.write_text("jobs = [1]\n")
    result = CliRunner().invoke(cli, ["batch", str(path)])
    assert result.exit_code == 3, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
