"""Repeatable `convert` targets (issue 16 item 4): one read of the source, every output.

The reference for every byte is the output's own single run (`ktconvert cpu` / `ktconvert gpu` written alone),
manifest included; the checks come before anything is written (schema, folders, plans, free disk, locks)."""
from __future__ import annotations

import filecmp
import json
import os
import socket
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ktconvert
from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_ERROR, EXIT_INPUT, EXIT_USAGE, UsageError

pytest.importorskip("torch")       # the GPU target needs the [gpu] extra

THREE = ("--cpu", "{a}", "--method", "amxint4", "--numa", "2", "--cpu", "{b}", "--method", "amxint8", "--numa", "1",
         "--gpu", "{g}", "--experts", "w4a16")


def run(*args, code: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def three(tmp_path: Path, prefix: str = "") -> tuple[list[str], list[Path]]:
    outs = [tmp_path / f"{prefix}{name}" for name in ("a", "b", "g")]
    return [arg.format(a=outs[0], b=outs[1], g=outs[2]) for arg in THREE], outs


@pytest.fixture(scope="module")
def singles(tiny_model, tmp_path_factory):
    """The three outputs, each written alone by its own command: the reference bytes."""
    src, root = tiny_model("qwen3_moe", layers=4), tmp_path_factory.mktemp("singles")
    run("cpu", src, root / "a", "--method", "amxint4", "--numa", "2", "--quiet")
    run("cpu", src, root / "b", "--method", "amxint8", "--numa", "1", "--quiet")
    run("gpu", src, root / "g", "--experts", "w4a16", "--quiet")
    return src, [root / "a", root / "b", root / "g"]


def assert_same_tree(got: Path, want: Path) -> None:
    """Every file of `want` (manifest included) in `got` with the same bytes, and nothing else."""
    names = sorted(p.relative_to(want) for p in want.rglob("*") if p.is_file())
    assert sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file()) == names
    assert "ktconvert.json" in map(str, names)
    _, mismatch, errors = filecmp.cmpfiles(want, got, names, shallow=False)
    assert mismatch == [] and errors == [], (got, mismatch, errors)


def test_three_outputs_equal_their_single_runs(singles, tmp_path):
    src, refs = singles
    args, outs = three(tmp_path)
    result = run("convert", src, *args, "--quiet", "--json", "--threads", "2")
    assert result.stderr == ""
    reported = json.loads(result.stdout)["outputs"]
    assert [(o["kind"], o["method"], o["out"]) for o in reported] == \
        [("cpu", "AMXINT4", str(outs[0])), ("cpu", "AMXINT8", str(outs[1])), ("gpu", "W4A16", str(outs[2]))]
    for got, want in zip(outs, refs):
        assert_same_tree(got, want)


def test_the_source_is_read_once_for_every_output(singles, tmp_path, monkeypatch):
    from ktconvert.formats import stream

    src, _ = singles
    read: dict[tuple, int] = {}
    original = stream.HashingFileReader.read_range

    def counting(self, offset, nbytes):
        key = (str(self.path), offset)
        read[key] = read.get(key, 0) + 1
        return original(self, offset, nbytes)

    monkeypatch.setattr(stream.HashingFileReader, "read_range", counting)
    args, _ = three(tmp_path)
    run("convert", src, *args, "--quiet")
    assert read and set(read.values()) == {1}      # each expert range read once, whatever the number of outputs


def test_targets_file_and_api_take_the_same_list(singles, tmp_path):
    src, refs = singles
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "variants.toml").write_text(
        '[[targets]]\ncpu = "out/a"\nmethod = "AMXINT4"\nnuma = 2\n\n'
        '[[targets]]\ncpu = "out/b"\nmethod = "amxint8"\n\n'
        '[[targets]]\ngpu = "out/g"\nexperts = "w4a16"\nlinears = "fp8"\n')
    run("convert", src, "--targets", folder / "variants.toml", "--quiet")
    for name, want in zip("abg", refs):
        assert_same_tree(folder / "out" / name, want)      # relative to the file's folder
    api_outs = [tmp_path / "api" / name for name in "abg"]
    results = ktconvert.convert(src, targets=[{"cpu": api_outs[0], "method": "amxint4", "numa": 2},
                                              {"cpu": str(api_outs[1]), "method": "amxint8"},
                                              {"gpu": api_outs[2], "experts": "w4a16"}], threads=1)
    assert [r.out for r in results] == list(map(str, api_outs))
    for got, want in zip(api_outs, refs):
        assert_same_tree(got, want)


@pytest.mark.parametrize("table, message", [
    ('cpu = "x"\nmethod = "amxint4"\nnumaa = 2', "target 1 (cpu x): unknown key 'numaa'"),
    ('cpu = "x"\nmethod = "amxint4"\nnuma = "2"', "target 1 (cpu x): 'numa' must be an integer, found a string '2'"),
    ('cpu = "x"\nmethod = "amxint4"\nexperts = "w4a16"', "target 1 (cpu x): unknown key 'experts'"),
    ('gpu = "x"\ninclude_mtp = "yes"', "target 1 (gpu x): 'include_mtp' must be a boolean"),
    ('cpu = "x"\nnuma = 2', "target 1 (cpu x): 'method' is required"),
    ('out = "x"\nmethod = "amxint4"', "target 1 needs exactly one of 'cpu' / 'gpu'"),
    ('cpu = "x"\ngpu = "y"', "target 1 needs exactly one of 'cpu' / 'gpu'"),
    ('cpu = 3\nmethod = "amxint4"', "target 1: 'cpu' must be the output folder"),
])
def test_targets_file_schema_errors_name_target_and_key(singles, tmp_path, table, message):
    src, _ = singles
    path = tmp_path / "t.toml"
    path.write_text(f'[[targets]]\ngpu = "ok"\n\n[[targets]]\n{table}\n'.replace("target 1", "target 2"))
    result = run("convert", src, "--targets", path, "--quiet", code=EXIT_USAGE)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {path}: ") and message.replace("target 1", "target 2") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]       # nothing written
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import tomllib
        ktconvert.convert(src, targets=tomllib.loads(f"[[targets]]\n{table}\n")["targets"])


def test_targets_file_top_level_is_checked(singles, tmp_path):
    src, _ = singles
    path = tmp_path / "t.toml"
    path.write_text('[[target]]\ncpu = "x"\nmethod = "amxint4"\n')
    assert "unknown key 'target'" in run("convert", src, "--targets", path, code=EXIT_USAGE).output
    path.write_text("targets = 3\n")
    assert "targets must be a list" in run("convert", src, "--targets", path, code=EXIT_USAGE).output
    assert "give one or more outputs" in run("convert", src, "--quiet", code=EXIT_USAGE).output


def test_shared_and_nested_folders_are_refused_before_anything_is_written(singles, tmp_path):
    src, _ = singles
    res = run("convert", src, "--cpu", tmp_path / "x", "--method", "amxint4", "--cpu", tmp_path / "x", "--method",
              "amxint8", code=EXIT_USAGE)
    assert f"target 1 (cpu {tmp_path / 'x'}) and target 2 (cpu {tmp_path / 'x'}) write the same folder" in res.output
    res = run("convert", src, "--cpu", tmp_path / "x", "--method", "amxint4", "--gpu", tmp_path / "x" / "g",
              code=EXIT_USAGE)
    assert "write nested folders" in res.output
    with pytest.raises(UsageError, match="write the same folder"):
        ktconvert.convert(src, [{"cpu": tmp_path / "y", "method": "amxint4"}, {"gpu": str(tmp_path / "y")}])
    assert list(tmp_path.iterdir()) == []


def test_every_plan_is_checked_before_any_out_exists(singles, tmp_path, monkeypatch):
    src, _ = singles
    args, outs = three(tmp_path)
    bad = [a if a != "1" else "3" for a in args]          # target 2: --numa 3 cannot split the tiny dims
    res = run("convert", src, *bad, "--quiet", code=EXIT_INPUT)
    assert f"target 2 (cpu {outs[1]}): --numa 3 cannot work for --method amxint8" in res.output
    assert not any(o.exists() for o in outs)
    from ktconvert.run import local as conversion
    monkeypatch.setattr(conversion, "free_at", lambda path: (str(tmp_path), 5_000_000))   # each fits, not all three
    res = run("convert", src, *args, "--quiet", code=EXIT_ERROR)
    assert "not enough free disk space for these outputs together" in res.output
    assert not any(o.exists() for o in outs)


def test_each_out_is_locked(singles, tmp_path):
    from test_output import _hold_lock, _ktconvert

    src, _ = singles
    args, outs = three(tmp_path)
    holder = _hold_lock(src, outs[1], "cpu")
    try:
        res = _ktconvert("convert", src, *args, "--quiet")
        holder_named = f"(pid {holder.pid} on host {socket.gethostname()})"
        assert res.returncode == EXIT_ERROR and holder_named in res.stderr and str(outs[1]) in res.stderr
        assert not outs[0].exists() and not outs[2].exists()      # the outputs opened before it were undone
    finally:
        holder.communicate("")


def test_resume_continues_each_target_from_its_own_state(singles, tmp_path):
    """Target 1 complete, target 2 killed half way, target 3 not started: one --resume finishes all three, leaves
    target 1 as it was, does not rewrite target 2's finished layers, and every byte equals the single runs."""
    src, refs = singles
    args, outs = three(tmp_path)
    run("cpu", src, outs[0], "--method", "amxint4", "--numa", "2", "--quiet")
    env = dict(os.environ, KTCONVERT_NO_PROGRESS="1", KTCONVERT_FAULT_AFTER_JOBS="70")
    killed = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "cpu", str(src), str(outs[1]), "--method",
                             "amxint8", "--threads", "1"], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    journal = json.loads((outs[1] / ".ktconvert-journal.json").read_text())
    finished = [f["path"] for layer in journal["layers"].values() for f in layer["files"]]
    assert finished and len(journal["layers"]) < 4
    inodes = {path: (outs[1] / path).stat().st_ino for path in finished}
    manifest_inode = (outs[0] / "ktconvert.json").stat().st_ino
    result = json.loads(run("convert", src, *args, "--resume", "--quiet", "--json").stdout)
    assert [o["complete_before"] for o in result["outputs"]] == [True, False, False]
    assert (outs[0] / "ktconvert.json").stat().st_ino == manifest_inode
    assert {path: (outs[1] / path).stat().st_ino for path in finished} == inodes
    for got, want in zip(outs, refs):
        assert_same_tree(got, want)


def test_shared_options_and_the_old_spelling(singles, tmp_path):
    src, refs = singles
    res = run("convert", src, "--numa", "2", "--cpu", tmp_path / "a", "--method", "amxint4", "--cpu",
              tmp_path / "b", "--method", "amxint8", "--numa", "1", "--quiet")
    assert res.stderr == ""                          # options before the first target are shared, not deprecated
    assert_same_tree(tmp_path / "a", refs[0])
    assert_same_tree(tmp_path / "b", refs[1])
    # the old spelling: one --cpu and one --gpu, the CPU options after --gpu
    res = run("convert", src, "--cpu", tmp_path / "oa", "--gpu", tmp_path / "og", "--method", "amxint4", "--numa",
              "2", "--experts", "w4a16", "--quiet")
    assert res.stderr.splitlines() == ["warning: --method after --gpu, --numa after --gpu is deprecated: give each "
                                       "output's options after its own --cpu / --gpu"]
    assert_same_tree(tmp_path / "oa", refs[0])
    assert_same_tree(tmp_path / "og", refs[2])
    # with two CPU targets an option after --gpu cannot be placed
    res = run("convert", src, "--cpu", tmp_path / "x1", "--method", "amxint4", "--cpu", tmp_path / "x2",
              "--method", "amxint8", "--gpu", tmp_path / "x3", "--numa", "2", code=EXIT_USAGE)
    assert "--numa is not an option of a GPU output (it follows --gpu" in res.output
    res = run("convert", src, "--experts", "w8a16", "--cpu", tmp_path / "x1", "--method", "amxint4",
              code=EXIT_USAGE)
    assert "--experts applies to no target" in res.output
    assert not any((tmp_path / name).exists() for name in ("x1", "x2", "x3"))


def test_gptq_target_is_refused_and_names_it(singles, tmp_path):
    src, _ = singles
    for gptq in ({"gpu": tmp_path / "g", "quant": "GPTQ"},
                 (tmp_path / "g", ktconvert.GpuOptions.make(quant="gptq", calibration=str(tmp_path / "c.jsonl")))):
        with pytest.raises(UsageError, match=r"target 2 \(gpu .*\): --quant gptq writes one output at a time"):
            ktconvert.convert(src, [{"cpu": tmp_path / "a", "method": "amxint4"}, gptq])
    assert list(tmp_path.iterdir()) == []


def test_the_example_targets_file_is_valid():
    from ktconvert.run.targets import load_targets

    path = Path(__file__).resolve().parents[1] / "examples" / "targets.toml"
    targets = load_targets(path)
    assert [(t.kind, t.out, t.values) for t in targets] == [
        ("cpu", path.parent / "out/qwen3-amxint4-numa2", {"method": "amxint4", "numa": 2}),
        ("cpu", path.parent / "out/qwen3-amxint8-numa1", {"method": "amxint8", "numa": 1}),
        ("gpu", path.parent / "out/qwen3-gpu-w4a16", {"experts": "w4a16", "linears": "fp8"})]


def test_a_targets_file_comes_before_the_command_line_targets(singles, tmp_path):
    src, _ = singles
    path = tmp_path / "t.toml"
    path.write_text('[[targets]]\ncpu = "a"\nmethod = "amxint4"\n')
    res = run("convert", src, "--targets", path, "--gpu", tmp_path / "a", code=EXIT_USAGE)
    assert f"target 1 (cpu a) and target 2 (gpu {tmp_path / 'a'}) write the same folder" in res.output
    res = run("convert", src, "--cpu", tmp_path / "b", "--method", "amxint4", "--numa", "x", code=EXIT_USAGE)
    assert "Invalid value for '--numa'" in res.output
    res = run("convert", src, "--cpu", tmp_path / "b", "--method", "amxint4", "--gpu", code=EXIT_USAGE)
    assert "Option '--gpu' requires an argument" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]


def test_old_spelling_warns_when_an_option_both_sides_take_now_goes_to_one(capsys):
    """`--cpu A --method rawint4 --gpu B --group-size 64`: before repeatable targets --group-size went to both
    outputs; now it is B's only. That change is said on stderr, not made silently."""
    import click

    from ktconvert.cli.targets import _tables

    ctx = click.Context(click.Command("convert"))
    kinds = [("cpu", "A"), ("gpu", "B")]
    events = [(1, "method", "rawint4", "--method"), (2, "group_size", 64, "--group-size")]
    tables = _tables(kinds, events, ctx)
    assert tables == [{"cpu": "A", "method": "rawint4"}, {"gpu": "B", "group_size": 64}]
    assert capsys.readouterr().err.strip() == (
        "warning: --group-size after --gpu B applies to that output only (before this release it applied to both); "
        "give it before the first --cpu / --gpu for both")
    # several outputs (the new spelling) or an option only one kind takes: nothing to say
    _tables(kinds + [("cpu", "C")], events, ctx)
    _tables(kinds, [(1, "method", "amxint4", "--method"), (1, "numa", 2, "--numa")], ctx)
    assert capsys.readouterr().err == ""
