"""One exit-code rule for every command (issue 14, item 14), as README.md's "Exit codes" table states it.

* The table lists exactly the codes ktconvert.errors defines, with the error classes' codes in the right rows.
* A nonexistent path is bad input (3) in every command and option that reads one, with one line naming it (before:
  2 from click's own check in inspect / plan / verify --source / expert-stats / publish / bundle / unbundle / batch,
  3 in cpu / gpu / convert, and 4 for a missing `verify OUT`).
* Every fault inside a bundle, in its manifest or in a member, fails verification (4) in `verify` and `unbundle`
  (before: a bad manifest 3, a bad member 4).
* A job file value that cannot work is 3 in `batch`, found before any job runs (before: an unknown method or quant
  was found by the job, exit 2).
A broken `verify --source` (3) is tested in test_verify_hostile.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktconvert import errors
from ktconvert.cli.main import cli
from test_bundle import _manifest_for, _zst_tar

README = Path(__file__).parents[1] / "README.md"


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line_error(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output and all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def _readme_table() -> dict[int, str]:
    """{code: meaning} of the README's exit-code table."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Exit codes"):]
    section = section[:section.index("\n\n", section.index("| code |"))]
    return {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"^\| (\d+) \| ([^|]*)\|", section, re.M)}


def test_readme_table_is_the_error_classes_codes():
    table = _readme_table()
    assert sorted(table) == sorted({errors.EXIT_OK, errors.EXIT_ERROR, errors.EXIT_USAGE, errors.EXIT_INPUT,
                                    errors.EXIT_VERIFY, errors.EXIT_REMOTE, errors.EXIT_INTERRUPTED})
    rows = {errors.KtConvertError: "error", errors.OutputError: "error", errors.NativeError: "error",
            errors.UsageError: "usage", errors.MissingExtraError: "usage", errors.ResumeMismatchError: "usage",
            errors.InputError: "bad input", errors.ShapeError: "bad input", errors.ManifestError: "bad input",
            errors.VerifyError: "verification failed", errors.RemoteError: "hub / network"}
    for cls, meaning in rows.items():
        assert table[cls.exit_code].startswith(meaning), (cls.__name__, cls.exit_code, table[cls.exit_code])
    assert table[errors.EXIT_INTERRUPTED].startswith("interrupted") and table[0].startswith("ok")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """An existing folder OUT, a calibration file and an empty job file beside the missing path `nope`."""
    root = tmp_path_factory.mktemp("codes")
    (root / "out").mkdir()
    (root / "cal.jsonl").write_text('{"text": "hello"}\n')
    return root


NONEXISTENT = [
    pytest.param(["inspect", "{nope}"], id="inspect"),
    pytest.param(["plan", "{nope}", "--method", "amxint4"], id="plan"),
    pytest.param(["plan", "{out}", "--method", "amxint4", "--expert-stats", "{nope}"], id="plan--expert-stats"),
    pytest.param(["cpu", "{nope}", "{root}/o1", "--method", "amxint4"], id="cpu"),
    pytest.param(["cpu", "{out}", "{root}/o1", "--method", "amxint4", "--quant", "gptq", "--calibration", "{nope}"],
                 id="cpu--calibration"),
    pytest.param(["gpu", "{nope}", "{root}/o2"], id="gpu"),
    pytest.param(["convert", "{nope}", "--cpu", "{root}/o3", "--method", "amxint4", "--gpu", "{root}/o4"],
                 id="convert"),
    pytest.param(["verify", "{nope}"], id="verify"),
    pytest.param(["verify", "{nope}.tar.zst"], id="verify-bundle"),
    pytest.param(["verify", "{out}", "--source", "{nope}"], id="verify--source"),
    pytest.param(["verify", "{out}", "--calibration", "{nope}"], id="verify--calibration"),
    pytest.param(["expert-stats", "{nope}", "{root}/s.pt", "--calibration", "{cal}"], id="expert-stats"),
    pytest.param(["publish", "{nope}", "me/repo"], id="publish"),
    pytest.param(["bundle", "{nope}", "{root}/b.tar.zst"], id="bundle"),
    pytest.param(["unbundle", "{nope}", "{root}/d"], id="unbundle"),
    pytest.param(["batch", "{nope}"], id="batch"),
    pytest.param(["merge", "{root}/merged", "{nope}"], id="merge"),
]


@pytest.mark.parametrize("args", NONEXISTENT)
def test_a_nonexistent_path_is_bad_input_in_every_command(workdir, args):
    nope = workdir / "nope"
    where = {"nope": nope, "out": workdir / "out", "root": workdir, "cal": workdir / "cal.jsonl"}
    line = _one_line_error(_run(*[a.format(**where) for a in args]), errors.EXIT_INPUT, str(nope))
    assert "does not exist" in line
    assert not (workdir / "o1").exists() and not (workdir / "d").exists()


@pytest.mark.parametrize("args, needle", [
    pytest.param(["publish", "{cal}", "me/repo"], "is not a folder", id="publish-file"),
    pytest.param(["bundle", "{cal}", "{root}/b.tar.zst"], "is not a folder", id="bundle-file"),
    pytest.param(["unbundle", "{out}", "{root}/d"], "is a folder", id="unbundle-folder"),
    pytest.param(["batch", "{out}"], "is a folder", id="batch-folder"),
    pytest.param(["merge", "{root}/merged", "{cal}"], "is not a folder", id="merge-part-file"),
    pytest.param(["inspect", "hf://org/name"], "must be a local path", id="inspect-hub-source"),
])
def test_a_path_of_the_wrong_kind_is_bad_input(workdir, args, needle):
    where = {"out": workdir / "out", "root": workdir, "cal": workdir / "cal.jsonl"}
    _one_line_error(_run(*[a.format(**where) for a in args]), errors.EXIT_INPUT, needle)


def _bundle_faults() -> dict[str, list[tuple[str, bytes]]]:
    """Bundles written by hand, each with one fault in its manifest or in a member."""
    data = b"member bytes\n"
    good = _manifest_for({"a.bin": data})
    return {
        "manifest-not-json": [("ktconvert.json", good[:-3]), ("a.bin", data)],
        "manifest-no-files": [("ktconvert.json", b'{"files": {}}'), ("a.bin", data)],
        "manifest-unsafe-name": [("ktconvert.json", _manifest_for({"../a.bin": data})), ("a.bin", data)],
        "manifest-not-first": [("a.bin", data), ("ktconvert.json", good)],
        "member-bytes": [("ktconvert.json", good), ("a.bin", data.upper())],
        "member-size": [("ktconvert.json", good), ("a.bin", data + b"x")],
        "member-missing": [("ktconvert.json", _manifest_for({"a.bin": data, "b.bin": data})), ("a.bin", data)],
        "member-extra": [("ktconvert.json", good), ("a.bin", data), ("b.bin", data)],
    }


@pytest.mark.parametrize("fault", sorted(_bundle_faults()))
def test_every_fault_inside_a_bundle_fails_verification(tmp_path, fault):
    path = tmp_path / "b.tar.zst"
    _zst_tar(path, _bundle_faults()[fault])
    result = _run("verify", path)
    assert result.exit_code == errors.EXIT_VERIFY and "result: FAILED" in result.output, result.output
    assert "Traceback" not in result.output
    _one_line_error(_run("unbundle", path, tmp_path / "dest", "--quiet"), errors.EXIT_VERIFY, str(path))
    assert not (tmp_path / "dest").exists() and not (tmp_path / ".dest.partial").exists()


def test_a_damaged_zstd_stream_fails_verification_too(tmp_path):
    path = tmp_path / "b.tar.zst"
    _zst_tar(path, [("ktconvert.json", _manifest_for({"a.bin": b"x" * 5000})), ("a.bin", b"x" * 5000)])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))
    assert _run("verify", path).exit_code == errors.EXIT_VERIFY
    _one_line_error(_run("unbundle", path, tmp_path / "dest", "--quiet"), errors.EXIT_VERIFY)


@pytest.mark.parametrize("values, key", [
    ('method = "nope"', "'method'"),
    ('method = "amxint4"\nquant = "nope"', "'quant'"),
    ('method = "amxint4"\nquant = "gptq"', "'quant'"),
    ('method = "amxint4"\nlayout = "tiles"', "'layout'"),
    ('method = "amxint4"\nnuma = "2"', "'numa'"),
])
def test_batch_job_values_that_cannot_work_are_bad_input(tmp_path, values, key):
    """Unknown method and unknown quant: the same code as any other job file fault, before any job runs (the
    source does not exist: a job that ran would fail on that instead)."""
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[jobs]]\nname = "j"\nsource = "missing-model"\nout = "o"\n{values}\n')
    _one_line_error(_run("batch", jobs), errors.EXIT_INPUT, "job j", key)
    assert not (tmp_path / "o").exists()


def test_verify_of_a_hub_repo_is_not_a_local_path(tmp_path, monkeypatch):
    """`verify REPO --remote` names a repo, not a path: no "does not exist" for it (an invalid id is 3 anyway)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    result = _run("verify", "bad repo", "--remote")
    line = _one_line_error(result, errors.EXIT_INPUT, "bad repo")
    assert "does not exist" not in line


@pytest.mark.parametrize("args", [["cpu", "M", "O", "--method", "foo"], ["cpu", "M", "--bogus"], ["--bogus"],
                                  ["bogus"], ["cpu", "M"]])
def test_click_usage_errors_are_one_line(args):
    """click's own usage errors (unknown option, command or value, missing argument) are the one `error:` line of
    every other error, exit 2; the unknown --method lists only the methods ktconvert writes."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and not proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], proc.stderr
    if "foo" in args:
        from ktconvert.methods import writable_names

        assert all(name in lines[0] for name in writable_names()) and "llamafile" in lines[0]
