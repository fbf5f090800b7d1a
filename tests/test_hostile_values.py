"""Values a hostile pass put where numbers or names belong (issue 14, leftovers of items 8, 11, 12 and 15).

* An edited ktconvert.json (``model.layers: 5``, ``method: 3``, ``model.experts: 10**12``, ...) fails `verify`
  (exit 4, one problem line naming the key) instead of a TypeError / AttributeError traceback or a hang.
* In-place outputs (bf16 / rawint4 / fp8) do not depend on the NUMA count, so an edited ``numa`` (with flags and
  sglang_args edited to match) passed every check: verify now applies the converter's NUMA rule to it.
* config.json counts far beyond any model (``num_hidden_layers: 10**12``) are refused at once (`plan` / `cpu`: exit
  3 naming the key; `inspect` names it as why the model is unsupported) instead of hanging in the MoE-layer rules.
* A shard replaced (deleted, a FIFO, a folder) or truncated between the header check and the read: InputError naming
  the shard, never a FileNotFoundError traceback or a read blocked on a FIFO.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_INPUT, EXIT_VERIFY, InputError, UnknownNameError


@contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) when the body takes longer than `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def outputs(tiny_model, tmp_path_factory):
    """{method: OUT} of the tiny Qwen3-MoE (2 layers x 8 experts, H = I = 256), NUMA 2."""
    src = tiny_model("qwen3_moe")
    outs = {}
    for method in ("bf16", "amxint4"):
        outs[method] = tmp_path_factory.mktemp("out") / method
        result = _cli("cpu", src, outs[method], "--method", method, "--numa", "2", "--quiet")
        assert result.exit_code == 0, result.output
    return outs


def _edited(out, tmp_path, edit) -> object:
    """A copy of output `out` whose ktconvert.json went through `edit(manifest)`, written as ktconvert writes it
    (its self hash recomputed: what is tested is the other checks, not that the file was edited)."""
    from ktconvert.formats.out_manifest import manifest_bytes

    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / "ktconvert.json").read_text())
    edit(manifest)
    (copy / "ktconvert.json").write_bytes(manifest_bytes(manifest))
    return copy


def _set(path: str, value):
    def edit(manifest):
        *parents, key = path.split(".")
        node = manifest
        for p in parents:
            node = node[p]
        node[key] = value
    return edit


MANIFEST_EDITS = [
    pytest.param("model.layers", 5, id="layers-int"),
    pytest.param("model.layers", ["1"], id="layers-str"),
    pytest.param("model.layers", [-1], id="layers-negative"),
    pytest.param("model.layers", list(range(10_000)), id="layers-too-many"),
    pytest.param("model.experts", 10**12, id="experts-huge"),
    pytest.param("model.experts", "8", id="experts-str"),
    pytest.param("model.hidden", 0, id="hidden-0"),
    pytest.param("model.intermediate", 2.5, id="intermediate-float"),
    pytest.param("method", 3, id="method-int"),
    pytest.param("method", None, id="method-null"),
    pytest.param("kind", ["cpu"], id="kind-list"),
    pytest.param("numa", True, id="numa-bool"),
]


@pytest.mark.parametrize("method", ["bf16", "amxint4"])
@pytest.mark.parametrize("key, value", MANIFEST_EDITS)
def test_edited_manifest_value_fails_verification(outputs, tmp_path, method, key, value):
    out = _edited(outputs[method], tmp_path, _set(key, value))
    with deadline(30):
        result = _cli("verify", out)
    assert result.exit_code == EXIT_VERIFY, (result.output, result.exception)
    assert "Traceback" not in result.output and "result: FAILED" in result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert problems and "ktconvert.json" in problems[0] and key.split(".")[-1] in problems[0], result.output


@pytest.mark.parametrize("numa", [3, 0, -2, 512])
def test_inplace_numa_the_converter_refuses_fails_verification(outputs, tmp_path, numa):
    """H = I = 256: `cpu --method bf16 --numa 3` (or 512, 0) is refused, so a folder claiming it is not honest,
    although bf16 files are the same for any NUMA count and the edited flags agree with the edited numa."""
    def edit(manifest):
        manifest["numa"] = numa
        manifest["flags"]["kt-threadpool-count"] = numa
        manifest["sglang_args"] = manifest["sglang_args"].replace("--kt-threadpool-count 2",
                                                                  f"--kt-threadpool-count {numa}")

    result = _cli("verify", _edited(outputs["bf16"], tmp_path, edit), "--hashes")
    assert result.exit_code == EXIT_VERIFY, result.output
    assert "numa" in result.output and "Traceback" not in result.output


def test_inplace_numa_the_converter_accepts_still_verifies(outputs, tmp_path):
    def edit(manifest):
        manifest["numa"] = 4
        manifest["flags"]["kt-threadpool-count"] = 4
        manifest["sglang_args"] = manifest["sglang_args"].replace("count 2", "count 4")

    result = _cli("verify", _edited(outputs["bf16"], tmp_path, edit), "--hashes")
    assert result.exit_code == 0, result.output


def test_registry_lookup_of_a_non_string_is_an_unknown_name():
    from ktconvert.methods import METHODS

    for name in (3, None, ["bf16"]):
        with pytest.raises(UnknownNameError, match="unknown"):
            METHODS.get(name)
        assert name not in METHODS


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**12), ("num_experts", 10**12),
                                        ("moe_intermediate_size", 10**12), ("hidden_size", 2**40)])
def test_config_count_beyond_any_model_is_refused_at_once(tiny_model, tmp_path, key, value):
    src = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3_moe"), src)
    config = json.loads((src / "config.json").read_text())
    assert key in config
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    with deadline(30):
        described = _cli("inspect", src)       # inspect describes what it cannot convert, naming why
        planned = _cli("plan", src, "--method", "bf16")
    assert described.exit_code == 0 and f"{key} is not usable" in described.output, described.output
    assert planned.exit_code == EXIT_INPUT, (planned.output, planned.exception)
    line = planned.output.strip().splitlines()[-1]
    assert line.startswith("error: config.json") and key in line and str(value) in line, line


# ---------------------------------------------------------------- shards changing under the reader

def _checkpoint(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    from ktconvert.formats.safetensors_reader import Checkpoint

    path = tmp_path / "model.safetensors"
    st_numpy.save_file({"a": np.arange(64, dtype=np.float32), "b": np.ones(32, dtype=np.float32)}, str(path))
    return Checkpoint.open(tmp_path), path


REPLACEMENTS = {
    "deleted": lambda p: p.unlink(),
    "fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "folder": lambda p: (p.unlink(), p.mkdir()),
    "truncated": lambda p: os.truncate(p, 100),
}


@pytest.mark.parametrize("how", sorted(REPLACEMENTS))
def test_shard_replaced_after_its_header_was_checked(tmp_path, how):
    ck, path = _checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.read("b"), np.ones(32, dtype=np.float32))
    REPLACEMENTS[how](path)
    with deadline(20), pytest.raises(InputError) as err:
        ck.read("b")
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("how", sorted(REPLACEMENTS))
def test_streamed_shard_replaced_after_its_header_was_checked(tmp_path, how):
    from ktconvert.formats.stream import HashingFileReader

    _ck, path = _checkpoint(tmp_path)
    REPLACEMENTS[how](path)
    with deadline(20), pytest.raises(InputError) as err:
        with HashingFileReader(path) as reader:
            reader.read_range(200, 128)
            reader.finish()
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- counts and calibration no router or tokenizer makes

@pytest.mark.parametrize("case", ["nan", "inf", "negative", "fraction", "complex", "bool", "stride0", "pickle"])
def test_activation_counts_a_router_cannot_produce_are_refused(tmp_path, case):
    """plan --expert-stats / the counts loader: one InputError line naming the file, never a traceback or a long
    computation (a 1 KB stride-0 tensor of 10^9 elements is refused without being summed)."""
    torch = pytest.importorskip("torch")
    from ktconvert.activation.counts import load_activation

    tensors = {"nan": torch.tensor([[[float("nan"), 1.0]]]), "inf": torch.tensor([[[float("inf"), 1.0]]]),
               "negative": torch.tensor([[[-1, 2]]]), "fraction": torch.tensor([[[0.5, 1.0]]]),
               "complex": torch.zeros(1, 1, 2, dtype=torch.complex64), "bool": torch.ones(1, 1, 2, dtype=torch.bool),
               "stride0": torch.zeros(1).expand(1000 * 1000 * 1000).view(1000, 1000, 1000)}
    path = tmp_path / "counts.pt"
    if case == "pickle":
        import pickle

        path.write_bytes(pickle.dumps({"logical_count": [1, 2]}))
    else:
        torch.save({"logical_count": tensors[case]}, path)
        assert path.stat().st_size < 4096
    with pytest.raises(InputError) as info:
        load_activation(path)
    assert str(path) in str(info.value) and info.value.exit_code == 3
    ok = tmp_path / "ok.pt"
    torch.save({"logical_count": torch.tensor([[[3, 0]]])}, ok)
    assert load_activation(ok).counts.tolist() == [[3.0, 0.0]]


@pytest.mark.parametrize("content, message", [(b'{"text": "caf\xe9"}\n', "not UTF-8"),
                                              (b'{"input_ids": [true, false]}\n', "list of integers"),
                                              (b'{"input_ids": [1, 2]}\n' + b" " * (17 << 20) + b"\n",
                                               "longer than one sample")])
def test_calibration_lines_no_tokenizer_makes_are_refused(tmp_path, content, message):
    pytest.importorskip("torch")
    from ktconvert.gptq.calibration import load_samples

    path = tmp_path / "calib.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as info:
        load_samples(path, tmp_path)
    assert "calib.jsonl" in str(info.value)


@pytest.mark.parametrize("option", ["--max-length", "--num-samples"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_expert_stats_refuses_counts_below_one(tiny_model, tmp_path, option, value):
    calib = tmp_path / "c.jsonl"
    calib.write_text('{"input_ids": [1, 2, 3]}\n')
    res = CliRunner().invoke(cli, ["expert-stats", str(tiny_model("qwen3_moe")), str(tmp_path / "o.pt"),
                                   "--calibration", str(calib), option, value])
    assert res.exit_code == 2 and option in res.output and not (tmp_path / "o.pt").exists()
    from ktconvert.errors import UsageError
    from ktconvert.gptq.calibration import load_samples

    with pytest.raises(UsageError, match=option):
        load_samples(calib, tmp_path, **{option[2:].replace("-", "_"): int(value)})


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_plan_refuses_an_out_that_overlaps_the_source_like_convert(tiny_model, tmp_path, where):
    """plan refuses (exit 1, one line) the OUT that cpu / convert refuse: SRC itself, inside SRC, or holding SRC."""
    src = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), src)
    out = {"same": src, "inside": src / "out", "around": tmp_path}[where]
    for cmd in (["plan", str(src), "--method", "amxint4", str(out)], ["plan", str(src), "--cpu", str(out), "--method", "amxint4"],
                ["cpu", str(src), str(out), "--method", "amxint4", "--quiet"]):
        res = CliRunner().invoke(cli, cmd)
        assert res.exit_code == 1 and "overlaps the source" in res.output, (cmd, res.output)
    assert not (src / "out").exists()


def test_bad_files_named_by_options_are_bad_input(tiny_model, tmp_path):
    """convert / plan --targets of a missing file, verify --calibration of a file that is not calibration
    samples: exit 3 (bad input, README's table), one line naming the file."""
    src = tiny_model("qwen3_moe")
    for cmd in ("convert", "plan"):
        res = CliRunner().invoke(cli, [cmd, str(src), "--targets", str(tmp_path / "missing.toml")])
        assert res.exit_code == EXIT_INPUT and "missing.toml" in res.output, res.output
    out = tmp_path / "out"
    assert CliRunner().invoke(cli, ["cpu", str(src), str(out), "--method", "amxint4", "--quiet"]).exit_code == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff\xfe{"text"\n')
    res = CliRunner().invoke(cli, ["verify", str(out), "--source", str(src), "--calibration", str(bad)])
    assert res.exit_code == EXIT_INPUT and "bad.jsonl" in res.output and "not UTF-8" in res.output, res.output


def test_a_shape_no_numa_count_fixes_blames_the_shape(tiny_model):
    """H = 200 fits no AMXINT4 part (k % 128): the error names the model's shape and offers no --numa value."""
    res = CliRunner().invoke(cli, ["plan", str(tiny_model("qwen3_moe", hidden=200)), "--method", "amxint4"])
    assert res.exit_code == EXIT_INPUT and "cannot store this model's experts (H=200" in res.output, res.output
    assert "use --numa" not in res.output and "valid NUMA counts" not in res.output
