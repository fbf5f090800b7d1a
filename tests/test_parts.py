"""Parts by layer range (`--layers A-B`) and `ktconvert merge`: a merged OUT is byte-identical to a single run's
(every file, ktconvert.json included) whatever the split and the order of the parts; a part reads only the source
files holding its layers; mismatched, overlapping and missing parts are refused with the parts named (exit 3).

The reference is the single-process conversion itself (the existing pipeline, tested against kt-kernel and
compressed-tensors elsewhere): what is checked here is that splitting changes no byte."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktconvert import api
from ktconvert.cli.main import cli
from ktconvert.distributed.merge import merge
from ktconvert.distributed.parts import PART_NAME, balanced_ranges, load_part, parse_range

from trees import tree

MODEL = dict(layers=4, experts=4, hidden=128, intermediate=256)   # deepseek_v3: layer 0 dense, MoE layers 1..3
CPU = dict(method="amxint4", numa=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("parts") / "ds", "deepseek_v3", **MODEL)


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out"
    api.convert_cpu(source, out, **CPU)
    return out


def write_parts(source, folder: Path, ranges: list[str], **options) -> list[Path]:
    parts = []
    for text in ranges:
        part = folder / f"part-{text}"
        api.convert_cpu(source, part, layers=text, **(options or CPU))
        parts.append(part)
    return parts


@pytest.mark.parametrize("ranges, order", [
    (["1-1", "2-3"], [1, 0]),
    (["0-2", "3-9"], [0, 1]),
    (["1-1", "2-2", "3-3"], [2, 0, 1]),
])
def test_merge_equals_single_run(source, single, tmp_path, ranges, order):
    parts = write_parts(source, tmp_path, ranges)
    result = merge(tmp_path / "merged", [parts[i] for i in order])
    assert tree(tmp_path / "merged") == tree(single)
    assert result.files == len(json.loads((single / "ktconvert.json").read_text())["files"])


def test_part_holds_only_its_layers_and_reads_only_their_files(source, tmp_path):
    part = write_parts(source, tmp_path, ["2-3"])[0]
    record = load_part(part)
    assert record["layers"] == [2, 3] and record["all_layers"] == [1, 2, 3] and not record["writes_rest"]
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    holding = {file for name, file in index.items() if ".experts." in name
               and int(name.split(".layers.")[1].split(".")[0]) in (2, 3)}
    assert set(record["manifest"]["source"]["files"]) == holding
    on_disk = {p.relative_to(part).as_posix() for p in part.rglob("*") if p.is_file()} - {PART_NAME}
    assert on_disk == set(record["manifest"]["files"])
    assert all(name.startswith(("blk.2.", "blk.3.")) for name in record["manifest"]["tensors"])


def test_kt_layout_merge_equals_single_run(source, tmp_path):
    options = dict(CPU, layout="kt")
    api.convert_cpu(source, tmp_path / "single", **options)
    parts = write_parts(source, tmp_path, ["3-3", "0-2"], **options)
    merge(tmp_path / "merged", parts)
    assert tree(tmp_path / "merged") == tree(tmp_path / "single")


def test_gpu_and_convert_parts_merge_equal_single_run(source, tmp_path):
    pytest.importorskip("compressed_tensors", reason="the GPU checkpoint needs the [gpu] extra")
    targets = lambda root: [(root / "cpu", dict(CPU)), (root / "gpu", dict(experts="w4a16", group_size=32))]
    api.convert(source, targets(tmp_path / "single"))
    for text in ("2-3", "1-1"):
        api.convert(source, targets(tmp_path / text), layers=text)
    for kind in ("cpu", "gpu"):
        merge(tmp_path / f"merged-{kind}", [tmp_path / "2-3" / kind, tmp_path / "1-1" / kind])
        assert tree(tmp_path / f"merged-{kind}") == tree(tmp_path / "single" / kind)


def test_part_resume_is_complete_and_other_range_refused(source, tmp_path):
    part = write_parts(source, tmp_path, ["1-2"])[0]
    result = api.convert_cpu(source, part, layers="1-2", resume=True, **CPU)
    assert result.complete_before
    with pytest.raises(Exception, match="cannot resume"):
        api.convert_cpu(source, part, layers="1-1", resume=True, **CPU)


def run_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def test_merge_refuses_missing_overlapping_and_mismatched_parts(source, tmp_path):
    first, rest, middle = write_parts(source, tmp_path, ["1-1", "2-3", "2-2"])
    code, out = run_cli("merge", tmp_path / "m1", first)
    assert code == 3 and "held by no part" in out and "2-3" in out
    code, out = run_cli("merge", tmp_path / "m2", first, rest, middle)
    assert code == 3 and "overlap" in out and str(rest) in out and str(middle) in out
    other = tmp_path / "other"
    api.convert_cpu(source, other, layers="2-3", method="amxint8", numa=2)
    code, out = run_cli("merge", tmp_path / "m3", first, other)
    assert code == 3 and "different conversions" in out and str(other) in out and "AMXINT8" in out
    code, out = run_cli("merge", tmp_path / "m4", first, tmp_path)
    assert code == 3 and PART_NAME in out
    (rest / "model-00003-of-00003.safetensors").write_bytes(b"x")
    code, out = run_cli("merge", tmp_path / "m5", first, rest)
    assert code == 3 and "recorded size" in out
    assert not any((tmp_path / f"m{i}" / "ktconvert.json").exists() for i in range(1, 6))


def test_cli_layers_part_and_merge(source, single, tmp_path):
    for text in ("2-3", "1"):
        code, out = run_cli("cpu", source, tmp_path / text, "--method", "amxint4", "--numa", "2", "--layers", text,
                            "--quiet")
        assert code == 0, out
    code, out = run_cli("merge", tmp_path / "merged", tmp_path / "1", tmp_path / "2-3")
    assert code == 0, out
    assert tree(tmp_path / "merged") == tree(single)
    code, out = run_cli("cpu", source, tmp_path / "none", "--method", "amxint4", "--numa", "2", "--layers", "7-9")
    assert code == 2 and "no MoE layer" in out
    code, out = run_cli("cpu", source, tmp_path / "bad", "--method", "amxint4", "--layers", "3-1")
    assert code == 2


def test_parse_range_and_balanced_ranges():
    assert parse_range("3-17") == (3, 17) and parse_range("4") == (4, 4)
    assert balanced_ranges({1: 10, 2: 10, 3: 10, 4: 10}, 2) == [(1, 2), (3, 4)]
    assert balanced_ranges({1: 30, 2: 10, 3: 10, 4: 10}, 2) == [(1, 1), (2, 4)]
    assert balanced_ranges({1: 1, 2: 1, 3: 100}, 3) == [(1, 1), (2, 2), (3, 3)]
    assert balanced_ranges({5: 7}, 1) == [(5, 5)]
    with pytest.raises(Exception, match="--parts"):
        balanced_ranges({1: 1, 2: 1}, 3)


def test_executor_options_checked_by_the_api(source, tmp_path):
    from ktconvert.errors import UsageError

    out = tmp_path / "out"
    with pytest.raises(UsageError, match="unknown executor 'dask'"):
        api.convert_cpu(source, out, executor="dask", **CPU)
    with pytest.raises(UsageError, match="--parts needs --executor ray"):
        api.convert_cpu(source, out, parts=2, **CPU)
    with pytest.raises(UsageError, match="--ray-address needs --executor ray"):
        api.batch([], ray_address="127.0.0.1:6379")
    with pytest.raises(UsageError, match="--layers writes one part by itself"):
        api.convert(source, [(out, CPU)], executor="ray", layers="1-2")
    code, text = run_cli("cpu", source, out, "--method", "amxint4", "--parts-dir", tmp_path / "p")
    assert code == 2 and text.strip().splitlines()[-1] == "error: --parts-dir needs --executor ray"
    assert not out.exists()
