"""``--method llamafile --split-max-size``: the routed-expert GGUF in shards by size (formats/gguf_sink.py).

Golden values: llama.cpp's own expert bytes (golden/gguf/ggml-expert-hashes.json, as tests/test_llamafile.py reads
them); the shard assignment from gguf-split's rule as llama.cpp's gguf-split.cpp states it (a new split where the
current split's tensor data, each tensor GGML_PAD-ed to 32 bytes, plus the next tensor would exceed the size),
applied here to the tensor sizes gguf-py's GGUFReader reads back; gguf-py reads every shard (``split.*`` keys as
gguf.Keys.Split names them); ktconvert's GGUF source opens the split set as input. End to end through the command
line: plan == files written, verify --hashes --source, a refused size (exit 2, OUT never made), resume after a
kill, and parts + merge equal to one run.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ktconvert.errors import UsageError  # noqa: E402
from ktconvert.formats.gguf_sink import GgufSink  # noqa: E402
from ktconvert.formats.sources import open_source  # noqa: E402
from ktconvert.methods.llamafile import Llamafile, split_bytes_of  # noqa: E402
from ktconvert.quant.bf16 import bf16_bits_to_f32  # noqa: E402

SHAPE = dict(hidden=256, intermediate=512, experts=4, layers=4)
GOLDEN_SHAPE = dict(SHAPE, layers=2)    # the model golden/gguf/ggml-expert-hashes.json holds llama.cpp's bytes of
GGML_HASHES = json.loads((Path(__file__).parent / "golden" / "gguf" / "ggml-expert-hashes.json").read_text())
TENSOR = 4 * 512 * 144                  # one Q4_K expert tensor of the tiny model: E * rows * row bytes


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lfs") / "qwen3", "qwen3_moe", **SHAPE)


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    assert GGML_HASHES["model"].endswith(json.dumps(GOLDEN_SHAPE) + ")")
    return make_tiny_model(tmp_path_factory.mktemp("lfg") / "qwen3", "qwen3_moe", **GOLDEN_SHAPE)


def _cli(*args, code: int = 0, env=None) -> str:
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc.stdout or proc.stderr


def _hashes(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _gguf_split(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """gguf-split.cpp's split_strategy by size, written from its source's rule."""
    shards, current = [[]], 0
    for name, nbytes in sizes:
        padded = (nbytes + 31) // 32 * 32
        if shards[-1] and current + padded > max_bytes:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += padded
    return shards


def test_sizes_read_as_llama_cpp_spells_them():
    assert [split_bytes_of(s) for s in ("500M", "2G", "300K", "1000", " 7g ")] == \
        [500 * 10 ** 6, 2 * 10 ** 9, 300_000, 1000, 7 * 10 ** 9]
    for bad in ("", "0M", "1.5G", "-3M", "2T", "M"):
        with pytest.raises(UsageError, match="not a size"):
            split_bytes_of(bad)
    method = Llamafile.configured(ggml_type="Q6_K", split_max_size="2G")
    assert (method.ggml_type, method.split_bytes, method.split_max_size) == ("Q6_K", 2 * 10 ** 9, "2G")
    assert method.manifest_fields() == {"ggml_type": "Q6_K", "split_max_size": "2G"}
    assert Llamafile.configured().manifest_fields() == {"ggml_type": "Q4_K"}          # manifests as before
    back = Llamafile.from_manifest({"method": "LLAMAFILE", "extra": method.manifest_fields()})
    assert (back.ggml_type, back.split_bytes) == ("Q6_K", 2 * 10 ** 9)


@pytest.mark.parametrize("size", ["300K", "600K", "1G"])
def test_cli_split_set_reads_back_with_gguf_py_and_as_a_source(golden_model, tmp_path, size):
    """300K: a shard per tensor; 600K: two tensors a shard, the second shard across layers 0 and 1; 1G: one."""
    model, out = golden_model, tmp_path / "out"
    planned = json.loads(_cli("plan", model, "--method", "llamafile", "--split-max-size", size, "--json"))["cpu"]
    _cli("cpu", model, out, "--method", "llamafile", "--split-max-size", size, "--quiet")
    files = {p.name: p.stat().st_size for p in out.iterdir() if p.name != "ktconvert.json"}
    assert {f["path"]: f["bytes"] for f in planned["files"] if not f.get("approx")} == files
    names = sorted(files)
    assert names == [f"experts-{i:05d}-of-{len(names):05d}.gguf" for i in range(1, len(names) + 1)]
    found, order = {}, []
    for i, name in enumerate(names):
        reader = gguf.GGUFReader(out / name)
        assert reader.fields[gguf.Keys.Split.LLM_KV_SPLIT_NO].contents() == i
        assert reader.fields[gguf.Keys.Split.LLM_KV_SPLIT_COUNT].contents() == len(names)
        assert reader.fields[gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT].contents() == 6
        assert reader.fields["general.architecture"].contents() == "qwen3moe"
        for t in reader.tensors:
            raw = np.asarray(t.data).view(np.uint8)
            found[t.name] = hashlib.sha256(raw.tobytes()).hexdigest()
            order.append((t.name, int(t.n_bytes), name))
    assert found == GGML_HASHES["sha256"]["Q4_K"]                   # llama.cpp's own Q4_K bytes, every tensor
    expected = _gguf_split([(n, b) for n, b, _ in order], split_bytes_of(size))
    assert [[n for n, _, f in order if f == name] for name in names] == expected
    assert len(names) == {"300K": 6, "600K": 3, "1G": 1}[size]
    back, source = open_source(out), open_source(model)             # ktconvert's GGUF source reads the set
    assert back.input_format == "gguf" and back.info.moe_layers == source.info.moe_layers
    got, want = bf16_bits_to_f32(back.read_expert(1, 1).down), bf16_bits_to_f32(source.read_expert(1, 1).down)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.12
    report = json.loads(_cli("verify", out, "--source", model, "--hashes", "--json"))
    assert report["ok"], report["problems"]
    assert report["hashes"]["tensors_checked"] == 6


def test_too_small_a_size_is_refused_before_out_exists(model, tmp_path):
    out = tmp_path / "out"
    err = _cli("cpu", model, out, "--method", "llamafile", "--split-max-size", "200K", code=2)
    assert err.count("\n") <= 1 and "--split-max-size is smaller than the largest tensor" in err
    assert f">= {TENSOR} bytes" in err and "blk.0.ffn_gate_exps.weight" in err
    assert "not a size" in _cli("cpu", model, out, "--method", "llamafile", "--split-max-size", "2X", code=2)
    assert "does not apply to --method amxint4" in _cli("cpu", model, out, "--method", "amxint4",
                                                       "--split-max-size", "2G", code=2)
    assert not out.exists()


def test_parts_of_whole_shards_merge_to_one_run_and_a_cut_shard_is_refused(model, tmp_path):
    one = tmp_path / "one"
    _cli("cpu", model, one, "--method", "llamafile", "--split-max-size", "1800K", "--quiet")
    for layers in ("0-1", "2-3"):
        _cli("cpu", model, tmp_path / f"p{layers}", "--method", "llamafile", "--split-max-size", "1800K",
             "--layers", layers, "--quiet")
    _cli("merge", tmp_path / "merged", tmp_path / "p0-1", tmp_path / "p2-3")
    assert _hashes(tmp_path / "merged") == _hashes(one)
    err = _cli("cpu", model, tmp_path / "cut", "--method", "llamafile", "--split-max-size", "1800K", "--layers",
               "0", "--quiet", code=2)
    assert "experts-00001-of-00002.gguf" in err and "must hold whole shards" in err and "other layers 1" in err
    assert not (tmp_path / "cut").exists()


def test_killed_run_resumes_to_the_same_bytes(model, tmp_path):
    one = tmp_path / "one"
    _cli("cpu", model, one, "--method", "llamafile", "--split-max-size", "600K", "--quiet")
    out = tmp_path / "killed"
    env = {**os.environ, "KTCONVERT_FAULT_AFTER_JOBS": "30", "KTCONVERT_NO_PROGRESS": "1"}
    args = ("cpu", model, out, "--method", "llamafile", "--split-max-size", "600K", "--quiet")
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (out / "ktconvert.json").exists()
    _cli(*args, "--resume")
    assert _hashes(out) == _hashes(one)


def test_a_shard_across_layers_survives_an_interrupted_run(model, tmp_path):
    """The sink alone: run 1 finishes layer 0 of a shard holding layers 0 and 1 and stops (no abort, like a kill);
    run 2 is told layer 0 is journalled, writes layer 1 into the reopened partial file and completes it: the
    same file and record as one uninterrupted run."""
    source = open_source(model)
    method = Llamafile.configured(split_max_size="1800K")
    layers = list(source.info.moe_layers)

    def run(out, todo, done):
        sink = GgufSink(out, method, layers, source.info)
        sink.start_run(layers, done, True)
        results = {}
        for layer in todo:
            writer = sink.begin_layer(layer)
            for e in range(source.info.n_experts):
                w = source.read_expert(layer, e)
                for proj in ("gate", "up", "down"):
                    writer.put_matrix(proj, e, getattr(w, proj))
            results[layer] = writer.finish()
        return sink, results

    _, whole = run(tmp_path / "one", layers, set())
    first, partial = run(tmp_path / "two", [0], set())
    assert partial[0].files == [] and (tmp_path / "two" / ".experts-00001-of-00002.gguf.partial").is_file()
    second, rest = run(tmp_path / "two", [1, 2, 3], {0})
    assert rest[1].files == whole[1].files                     # the completed shard, hashed as one run hashes it
    assert _hashes(tmp_path / "two") == _hashes(tmp_path / "one")
    assert {**partial[0].tensors, **rest[1].tensors} == {**whole[0].tensors, **whole[1].tensors}
    (tmp_path / "three").mkdir()
    _, only = run(tmp_path / "three", [0], set())
    (tmp_path / "three" / ".experts-00001-of-00002.gguf.partial").unlink()
    from ktconvert.errors import OutputError

    with pytest.raises(OutputError, match="partial file, which is gone"):
        run(tmp_path / "three", [1], {0})
