"""Strict safetensors reader and HF expert source.

References: safetensors' own `safe_open(framework="pt")` for headers and bytes, torch indexing/transposes for
fused expert slices, torch's BF16 cast (round-to-nearest-even) for FP16/FP32 inputs. Malformed inputs are
hand-made files; each error must name the file and the tensor, and the CLI must exit non-zero.
"""
from __future__ import annotations

import json
import struct
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ktconvert.errors import EXIT_INPUT, InputError, ShapeError  # noqa: E402
from ktconvert.formats.hf_source import HFSource  # noqa: E402
from ktconvert.formats.safetensors_reader import Checkpoint, parse_header  # noqa: E402

TORCH_BITS = {torch.bfloat16: torch.uint16 if hasattr(torch, "uint16") else torch.int16,
              torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _bits(t: "torch.Tensor") -> np.ndarray:
    """Reference raw bits of a torch tensor, as the reader returns them (BF16 -> uint16, F8 -> uint8)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.contiguous().view(torch.uint8).numpy()
    return t.numpy()


def _mixed_tensors(seed: int = 0) -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "a.bf16": r(4, 6, 10).to(torch.bfloat16),
        "b.f16": r(7, 3).to(torch.float16),
        "c.f32": r(5),
        "d.f8": r(3, 8).to(torch.float8_e4m3fn),
        "e.f8e5": r(9).to(torch.float8_e5m2),
        "f.i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "g.i32": torch.arange(6, dtype=torch.int32),
        "h.u8": torch.arange(5, dtype=torch.uint8),
        "i.bool": torch.tensor([True, False, True]),
        "j.empty": torch.zeros(0, 4),
    }


def _write_sharded(root: Path, tensors: dict, shards: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, root / fname)
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _raw_file(path: Path, header: dict, data: bytes = b"", declared_len: int | None = None) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if declared_len is None else declared_len) + text + data)
    return path


# ---------------------------------------------------------------- headers and reads vs safetensors


def test_headers_and_reads_match_safetensors(tmp_path):
    tensors = _mixed_tensors()
    root = _write_sharded(tmp_path / "m", tensors, shards=3)
    ck = Checkpoint.open(root)
    assert set(ck.tensors) == set(tensors)
    assert len(ck.files()) == 3
    for shard in ck.files():
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                ref = ck.tensors[name]
                assert ref.file == shard
                assert list(ref.shape) == f.get_slice(name).get_shape()
                assert ref.dtype == f.get_slice(name).get_dtype()
                np.testing.assert_array_equal(ck.read(name), _bits(f.get_tensor(name)))


def test_read_slice_is_one_expert_and_single_file_path(tmp_path):
    t = torch.randn(5, 6, 7).to(torch.bfloat16)
    save_file({"w": t}, tmp_path / "x.safetensors")
    ck = Checkpoint.open(tmp_path / "x.safetensors")   # a single file path, no config.json
    assert ck.config == {}
    for i in range(5):
        np.testing.assert_array_equal(ck.read_slice("w", i), _bits(t[i]))
        np.testing.assert_array_equal(ck.read_rows("w", i), _bits(t[i]))
    with pytest.raises(InputError, match="index 5"):
        ck.read_slice("w", 5)


def test_read_slice_allocates_only_the_slice(tmp_path):
    t = torch.zeros(64, 128, 256, dtype=torch.bfloat16)   # 4 MiB, slice 64 KiB
    save_file({"w": t}, tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    tracemalloc.start()
    try:
        ck.read_slice("w", 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 128 * 256 * 2 + 64 * 1024      # the slice (+ small change), never the 4 MiB tensor


# ---------------------------------------------------------------- malformed inputs


def _expect_input_error(path, *needles):
    with pytest.raises(InputError) as info:
        Checkpoint.open(path)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    assert "\n" not in msg
    return msg


def _good_two_shards(root: Path) -> Path:
    return _write_sharded(root, {"x.w": torch.ones(2, 2), "y.w": torch.ones(3)}, shards=2)


def test_index_names_missing_shard(tmp_path):
    root = _good_two_shards(tmp_path / "m")
    (root / "model-00002-of-00002.safetensors").unlink()
    _expect_input_error(root, "model.safetensors.index.json", "y.w", "model-00002-of-00002.safetensors")


def test_index_maps_tensor_to_shard_lacking_it(tmp_path):
    root = _good_two_shards(tmp_path / "m")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["z.w"] = "model-00001-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_input_error(root, "model.safetensors.index.json", "z.w", "model-00001-of-00002.safetensors")


def test_header_length_past_end_of_file(tmp_path):
    p = _raw_file(tmp_path / "model.safetensors", {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                  b"\0" * 4, declared_len=10_000)
    _expect_input_error(tmp_path, "model.safetensors", "truncated")
    p.write_bytes(b"\1\2\3")
    _expect_input_error(tmp_path, "model.safetensors", "8-byte")


def test_data_past_end_of_file(tmp_path):
    save_file({"a": torch.ones(16), "b": torch.ones(32)}, tmp_path / "model.safetensors")
    p = tmp_path / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    _expect_input_error(tmp_path, "model.safetensors", "past the end", ": b:")  # b is stored last


def test_unsupported_dtype(tmp_path):
    _raw_file(tmp_path / "model.safetensors", {"weird": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}},
              b"\0\0")
    _expect_input_error(tmp_path, "model.safetensors", "weird", "unsupported dtype", "'Q7'")


def test_span_mismatch_overlap_and_bad_json(tmp_path):
    _raw_file(tmp_path / "model.safetensors", {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},
              b"\0" * 12)
    _expect_input_error(tmp_path, "model.safetensors", ": t:", "16 bytes", "found 12 bytes")
    _raw_file(tmp_path / "model.safetensors", {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                               "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
              b"\0" * 12)
    _expect_input_error(tmp_path, "model.safetensors", "overlaps")
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    _expect_input_error(tmp_path, "model.safetensors", "JSON")


def test_duplicate_tensor_across_shards(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    save_file({"dup.w": torch.ones(2)}, root / "a.safetensors")
    save_file({"dup.w": torch.ones(2)}, root / "b.safetensors")
    _expect_input_error(root, "b.safetensors", "dup.w", "duplicate", "a.safetensors")


def test_parse_header_reads_only_header(tmp_path):
    save_file({"w": torch.ones(1000)}, tmp_path / "model.safetensors")
    sh = parse_header(tmp_path / "model.safetensors")
    assert sh.file_bytes == sh.header_bytes + 4000
    assert sh.tensors["w"].offset == sh.header_bytes


def _run_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    from ktconvert.cli import main as cli
    monkeypatch.setattr(sys, "argv", ["ktconvert", *map(str, args)])
    monkeypatch.delenv("KTCONVERT_DEBUG", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main()
    return info.value.code, capsys.readouterr().err


def test_cli_exit_codes_for_malformed_inputs(tmp_path, monkeypatch, capsys):
    root = _good_two_shards(tmp_path / "missing_shard")
    (root / "model-00001-of-00002.safetensors").unlink()
    code, err = _run_cli(monkeypatch, capsys, "inspect", root)
    assert code == EXIT_INPUT and "model-00001-of-00002.safetensors" in err and "x.w" in err
    bad = tmp_path / "bad_dtype"
    bad.mkdir()
    _raw_file(bad / "model.safetensors", {"weird": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")
    code, err = _run_cli(monkeypatch, capsys, "plan", bad, "--method", "amxint4")
    assert code == EXIT_INPUT and "weird" in err and "model.safetensors" in err


# ---------------------------------------------------------------- HF source on hand-made checkpoints

H, I, E, LAYERS = 96, 64, 4, 2     # H != I != 2I: every fused orientation is unambiguous

MANIFEST = """
family = "{family}"
model_types = ["{family}"]
name_prefixes = ["model."]
[config]
n_layers = ["num_hidden_layers"]
n_experts = ["num_experts"]
hidden = ["hidden_size"]
intermediate = ["moe_intermediate_size"]
experts_per_tok = ["num_experts_per_tok"]
[moe_layers]
rule = "all"
[experts]
{experts}
[components]
routed_experts = ['\\.mlp\\.experts\\.']
"""
FUSED = ('form = "fused"\ngate_up = "layers.{L}.mlp.experts.gate_up_proj"\n'
         'down = "layers.{L}.mlp.experts.down_proj"\n')
BIASES = ('gate_up_bias = "layers.{L}.mlp.experts.gate_up_proj_bias"\n'
          'down_bias = "layers.{L}.mlp.experts.down_proj_bias"\ngate_up_interleaved = true\n')
PER_EXPERT = ('form = "per_expert"\npattern = "layers.{L}.mlp.experts.{E}.{proj}.weight"\n'
              'proj = { gate = "w1", up = "w3", down = "w2" }\n')


@pytest.fixture
def test_manifests(tmp_path, monkeypatch):
    d = tmp_path / "manifests"
    d.mkdir()
    for family, experts in (("test_fused", FUSED), ("test_fused_il", FUSED + BIASES),
                            ("test_per_expert", PER_EXPERT)):
        (d / f"{family}.toml").write_text(MANIFEST.format(family=family, experts=experts))
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(d))
    return d


def _config(model_type: str, h: int = H, i: int = I, **extra) -> dict:
    return {"model_type": model_type, "num_hidden_layers": LAYERS, "num_experts": E, "hidden_size": h,
            "moe_intermediate_size": i, "num_experts_per_tok": 2, **extra}


def _save_model(root: Path, tensors: dict, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(config))
    return root


def _fused_model(root: Path, gu_t: bool, down_t: bool, family="test_fused", dtype=torch.bfloat16, bias=False,
                 h: int = H, i: int = I):
    """Random fused checkpoint; returns (root, {layer: (gate_up [E,2I,H], down [E,H,I])}, stored tensors)."""
    g = torch.Generator().manual_seed(int(gu_t) * 2 + int(down_t))
    tensors, logical = {}, {}
    for layer in range(LAYERS):
        gu = torch.randn(E, 2 * i, h, generator=g).to(dtype)
        dn = torch.randn(E, h, i, generator=g).to(dtype)
        base = f"model.layers.{layer}.mlp.experts."
        tensors[base + "gate_up_proj"] = gu.transpose(1, 2).contiguous() if gu_t else gu
        tensors[base + "down_proj"] = dn.transpose(1, 2).contiguous() if down_t else dn
        if bias:
            tensors[base + "gate_up_proj_bias"] = torch.randn(E, 2 * I, generator=g).to(torch.bfloat16)
            tensors[base + "down_proj_bias"] = torch.randn(E, H, generator=g).to(torch.bfloat16)
        logical[layer] = (gu, dn)
    return _save_model(root, tensors, _config(family, h, i)), logical, tensors


@pytest.mark.parametrize("gu_t,down_t", [(False, False), (True, False), (False, True), (True, True)])
def test_fused_orientations_read_expert(tmp_path, test_manifests, gu_t, down_t):
    root, logical, _ = _fused_model(tmp_path / "m", gu_t, down_t)
    src = HFSource.open(root)
    src.validate()
    orient = {role: o.value for role, o in src.orientation.items()}
    assert orient == {"gate_up": "in" if gu_t else "out", "down": "in" if down_t else "out"}
    assert src.required_layout(0).kind == "fused"
    for layer in range(LAYERS):
        gu, dn = logical[layer]
        for e in (0, E - 1):
            ew = src.read_expert(layer, e)
            np.testing.assert_array_equal(ew.gate, _bits(gu[e, :I]))
            np.testing.assert_array_equal(ew.up, _bits(gu[e, I:]))
            np.testing.assert_array_equal(ew.down, _bits(dn[e]))
            assert ew.gate.dtype == np.uint16 and ew.gate.shape == (I, H) and ew.down.shape == (H, I)


def test_fused_interleaved_with_biases(tmp_path, test_manifests):
    root, logical, tensors = _fused_model(tmp_path / "m", True, True, family="test_fused_il", bias=True)
    src = HFSource.open(root)
    src.validate()
    gu, dn = logical[1]
    ew = src.read_expert(1, 2)
    np.testing.assert_array_equal(ew.gate, _bits(gu[2, 0::2]))
    np.testing.assert_array_equal(ew.up, _bits(gu[2, 1::2]))
    np.testing.assert_array_equal(ew.down, _bits(dn[2]))
    b = tensors["model.layers.1.mlp.experts.gate_up_proj_bias"][2].float().numpy()
    np.testing.assert_array_equal(ew.gate_bias, b[0::2])
    np.testing.assert_array_equal(ew.up_bias, b[1::2])
    np.testing.assert_array_equal(ew.down_bias, tensors["model.layers.1.mlp.experts.down_proj_bias"][2].float())
    assert src.has_expert_biases()
    assert len(src.nonzero_expert_biases([0, 1])) == 4


def test_streaming_jobs_decode_like_read_expert(tmp_path, test_manifests):
    root, _, _ = _fused_model(tmp_path / "m", True, False)
    src = HFSource.open(root)
    jobs = src.matrix_jobs([1])
    assert len(jobs) == 2 * E
    for job in jobs:
        raw = np.fromfile(job.file, dtype=np.uint8, count=job.nbytes, offset=job.offset)
        mats = src.decode(job, raw)
        ew = src.read_expert(job.layer, job.expert)
        for proj, m in mats.items():
            np.testing.assert_array_equal(m, getattr(ew, proj))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_fp32_round_to_bf16(tmp_path, test_manifests, dtype):
    g = torch.Generator().manual_seed(7)
    w = {f"model.layers.{L}.mlp.experts.{e}.{p}.weight": torch.randn(*s, generator=g).to(dtype)
         for L in range(LAYERS) for e in range(E) for p, s in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}
    src = HFSource.open(_save_model(tmp_path / "m", w, _config("test_per_expert")))
    assert src.input_format == {torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ew = src.read_expert(1, 3)
    for proj, name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        ref = w[f"model.layers.1.mlp.experts.3.{name}.weight"].to(torch.bfloat16)   # torch: RNE
        np.testing.assert_array_equal(getattr(ew, proj), _bits(ref))


def _per_expert_tensors(skip=None, bad_shape=None, dtype=torch.bfloat16):
    out = {}
    for L in range(LAYERS):
        for e in range(E):
            for p, s in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                name = f"model.layers.{L}.mlp.experts.{e}.{p}.weight"
                if name == skip:
                    continue
                out[name] = torch.zeros(*(s[::-1] if name == bad_shape else s), dtype=dtype)
    return out


def test_validate_missing_expert(tmp_path, test_manifests):
    name = "model.layers.1.mlp.experts.2.w3.weight"
    src = HFSource.open(_save_model(tmp_path / "m", _per_expert_tensors(skip=name), _config("test_per_expert")))
    with pytest.raises(InputError) as info:
        src.validate()
    assert name in str(info.value) and "model.safetensors" in str(info.value) and "expert 2" in str(info.value)


def test_validate_wrong_shape(tmp_path, test_manifests):
    name = "model.layers.0.mlp.experts.3.w2.weight"
    src = HFSource.open(_save_model(tmp_path / "m", _per_expert_tensors(bad_shape=name), _config("test_per_expert")))
    with pytest.raises(ShapeError) as info:
        src.validate()
    msg = str(info.value)
    assert name in msg and "model.safetensors" in msg and f"[{H}, {I}]" in msg and f"found [{I}, {H}]" in msg


def test_validate_fused_wrong_shape(tmp_path, test_manifests):
    root, _, tensors = _fused_model(tmp_path / "m", False, False)
    tensors["model.layers.1.mlp.experts.down_proj"] = torch.zeros(E, H, I + 1, dtype=torch.bfloat16)
    _save_model(root, tensors, _config("test_fused"))
    with pytest.raises(ShapeError) as info:
        HFSource.open(root).validate()
    assert "model.layers.1.mlp.experts.down_proj" in str(info.value) and f"[{E}, {H}, {I + 1}]" in str(info.value)


def test_unsupported_expert_dtype_and_quant_method(tmp_path, test_manifests):
    root = _save_model(tmp_path / "a", _per_expert_tensors(dtype=torch.int32), _config("test_per_expert"))
    with pytest.raises(InputError) as info:
        HFSource.open(root)
    assert "model.layers.0.mlp.experts.0.w1.weight" in str(info.value) and "I32" in str(info.value)
    cfg = _config("test_per_expert", quantization_config={"quant_method": "foo-quant"})
    src = HFSource.open(_save_model(tmp_path / "b", _per_expert_tensors(dtype=torch.uint8), cfg))
    with pytest.raises(InputError, match="foo-quant"):
        src.validate()
    with pytest.raises(InputError, match="foo-quant"):
        src.read_expert(0, 0)


def test_missing_config_json(tmp_path, test_manifests):
    root = tmp_path / "m"
    root.mkdir()
    save_file(_per_expert_tensors(), root / "model.safetensors")
    with pytest.raises(InputError, match="config.json"):
        HFSource.open(root)


def test_open_source_registry(tmp_path, test_manifests):
    from ktconvert.formats.sources import open_source

    root, _, _ = _fused_model(tmp_path / "m", False, True)
    assert isinstance(open_source(root), HFSource)
    with pytest.raises(InputError, match="no reader"):
        open_source(tmp_path / "manifests")


@pytest.mark.parametrize("gu_t,down_t", [(False, False), (True, True), (True, False)])
def test_inspect_reports_fused_orientation(tmp_path, test_manifests, gu_t, down_t):
    from ktconvert.run.inspection import inspect

    root, _, tensors = _fused_model(tmp_path / "m", gu_t, down_t)
    r = inspect(root)
    el = r["expert_layout"]
    assert el["form"] == "fused" and "problem" not in el
    assert all("H=96, I=64" in o["why"] for o in el["orientation"].values())
    assert el["gate_up"] == ("[E, H, 2I]" if gu_t else "[E, 2I, H]")
    assert el["down"] == ("[E, I, H]" if down_t else "[E, H, I]")
    assert r["components"]["routed_experts"] == sum(t.numel() * 2 for t in tensors.values())
    assert (r["experts"], r["hidden"], r["intermediate"], r["layers"]["moe"]) == (E, H, I, list(range(LAYERS)))


def test_ambiguous_down_follows_gate_up_convention(tmp_path, test_manifests):
    from ktconvert.run.inspection import inspect

    h = i = 64   # H == I: down's shape cannot tell; gate_up [E, H, 2I] (2I != H) can
    root, logical, _ = _fused_model(tmp_path / "m", True, True, h=h, i=i)
    src = HFSource.open(root)
    assert {role: o.value for role, o in src.orientation.items()} == {"gate_up": "in", "down": "in"}
    np.testing.assert_array_equal(src.read_expert(0, 1).down, _bits(logical[0][1][1]))
    why = inspect(root)["expert_layout"]["orientation"]["down"]["why"]
    assert "H == I = 64" in why and "follows gate_up" in why, why


# ---------------------------------------------------------------- strict as safetensors itself (issue 14, item 12)

def _u8(begin: int, end: int) -> dict:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


# (header JSON text, data bytes): the five leniencies of issue 14 item 12, then valid controls next to them
STRICTNESS_CASES = {
    "duplicate_name": ('{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
                       '"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}', b"\1\2\3\4"),
    "gap_between_tensors": (json.dumps({"a": _u8(0, 2), "b": _u8(3, 4)}), b"\1\2\3\4"),
    "trailing_bytes": (json.dumps({"a": _u8(0, 2)}), b"\1\2\3"),
    "metadata_value_not_string": (json.dumps({"__metadata__": {"format": 1}, "a": _u8(0, 2)}), b"\1\2"),
    "first_tensor_not_at_0": (json.dumps({"a": _u8(1, 3)}), b"\1\2\3"),
    "no_tensor_but_data": ("{}", b"\1\2"),
    "zero_sized_past_end": (json.dumps({"a": _u8(0, 2), "z": _u8(3, 3)}), b"\1\2\3"),
    "control_contiguous": (json.dumps({"b": _u8(2, 4), "a": _u8(0, 2)}), b"\1\2\3\4"),
    "control_zero_sized_between": (json.dumps({"a": _u8(0, 1), "z": _u8(1, 1), "b": _u8(1, 2)}), b"\1\2"),
    "control_string_metadata_and_padding": (json.dumps({"__metadata__": {"format": "pt"}, "a": _u8(0, 2)}) + "  ",
                                            b"\1\2"),
    "control_null_metadata": (json.dumps({"__metadata__": None, "a": _u8(0, 2)}), b"\1\2"),
}


def _safetensors_verdict(path: Path) -> str:
    """The reference: does safetensors itself open the file and read every tensor?"""
    try:
        with safe_open(str(path), framework="pt") as f:      # pt: the numpy framework has no BF16 / F8
            for key in f.keys():
                f.get_tensor(key)
        return "ok"
    except Exception:  # noqa: BLE001  (SafetensorError and friends: any refusal counts)
        return "refused"


@pytest.mark.parametrize("case", sorted(STRICTNESS_CASES))
def test_reader_is_as_strict_as_safetensors(tmp_path, case):
    header, data = STRICTNESS_CASES[case]
    path = tmp_path / "model.safetensors"
    text = header.encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    try:
        parse_header(path)
        ours = "ok"
    except InputError as exc:
        ours = "refused"
        assert "model.safetensors" in str(exc) and "\n" not in str(exc)
    assert ours == _safetensors_verdict(path), case


# ---------------------------------------------------------------- index entries stay inside the checkpoint (item 3)

def test_index_entry_outside_the_checkpoint_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    save_file({"y.w": torch.ones(3)}, other / "shard.safetensors")
    root = _write_sharded(tmp_path / "m", {"x.w": torch.ones(2, 2)}, shards=1)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for outside in ("../other/shard.safetensors", str(other / "shard.safetensors"), "sub/../../other/shard.safetensors",
                    "..\\other\\shard.safetensors"):
        index["weight_map"]["y.w"] = outside
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        msg = _expect_input_error(root, "model.safetensors.index.json", "y.w", "outside the checkpoint")
        assert repr(outside) in msg


def test_symlinked_shard_with_a_plain_name_is_followed(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file({"y.w": torch.arange(3, dtype=torch.float32)}, blobs / "0123abcd")
    root = _write_sharded(tmp_path / "m", {"x.w": torch.ones(2, 2)}, shards=1)
    (root / "model-00002-of-00002.safetensors").symlink_to(blobs / "0123abcd")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["y.w"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint.open(root)
    assert ck.read("y.w").tolist() == [0.0, 1.0, 2.0]
