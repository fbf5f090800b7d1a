"""compressed-tensors pack-quantized weights with ``weight_g_idx`` (activation order "group", issue 14 item 10) decode
as compressed-tensors decompresses them.

Golden values: tests/golden/ct_gidx/ct_gidx.safetensors, compressed and decompressed by compressed-tensors 0.18.0
(the last release that reads g_idx; see make_golden.py there) for identity, permuted and interleaved g_idx, group
sizes 32 / 64 / 128, asymmetric, F16-scale and 8-bit variants, and fused [E, ...] tensors. End to end, a tiny
Kimi-K2-style checkpoint given a permuted g_idx converts to other bytes than the same checkpoint without one, and to
the per-column rule of compressed-tensors' docstring (column j uses scale column g_idx[j]).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.quant import ct_int4
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

GOLDEN = Path(__file__).parent / "golden" / "ct_gidx" / "ct_gidx.safetensors"
BASE = "model.layers.1.mlp.experts.0.up_proj"
FUSED = "model.layers.1.mlp.experts.gate_up_proj"


def _golden() -> dict[str, np.ndarray]:
    """The golden tensors; BF16 as uint16 bits (safetensors' numpy loader has no bfloat16)."""
    out = {}
    raw = GOLDEN.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    kinds = {"BF16": np.uint16, "F16": np.float16, "I32": np.int32, "I64": np.int64}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(raw[8 + header_len + begin:8 + header_len + end],
                                  kinds[entry["dtype"]]).reshape(entry["shape"])
    return out


def _cases(golden: dict) -> list[str]:
    return sorted({n.split(".")[0] for n in golden})


def _config(group_size: int, bits: int = 4, symmetric: bool = True) -> dict:
    return {"model_type": "kimi_k2", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
            "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
            "group_size": group_size, "actorder": "group"}}}}}


def _write(folder: Path, tensors: dict, config: dict) -> Checkpoint:
    """tensors: {name: (numpy array, safetensors dtype)} written by hand (safetensors' numpy API has no BF16)."""
    folder.mkdir(parents=True, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for name, (arr, dtype) in sorted(tensors.items()):
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    (folder / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(folder)


GEOMETRY = {"g32": 32, "g64": 64, "g128": 128, "fused_g32": 32}
DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64"}


def _case_checkpoint(tmp_path: Path, golden: dict, case: str, base: str, drop: tuple[str, ...] = ()) -> Checkpoint:
    group = next(v for k, v in GEOMETRY.items() if case.startswith(k))
    tensors = {f"{base}.{n.split('.', 1)[1]}": (golden[n], DTYPES[golden[n].dtype]) for n in golden
               if n.startswith(case + ".") and not n.endswith(".decompressed") and n.split(".", 1)[1] not in drop}
    bits = 8 if case.endswith("int8") else 4
    return _write(tmp_path / case, tensors, _config(group, bits, symmetric=not case.endswith("asym")))


@pytest.fixture(scope="module")
def golden():
    return _golden()


def test_every_2d_case_decodes_as_compressed_tensors(tmp_path, golden):
    checked = 0
    for case in _cases(golden):
        if case.startswith("fused"):
            continue
        ck = _case_checkpoint(tmp_path, golden, case, BASE)
        got = decode_matrix(ck, BASE, detect_scheme(ck.config))
        np.testing.assert_array_equal(got, golden[f"{case}.decompressed"], case)
        checked += 1
    assert checked == 8


def test_g_idx_changes_the_weights_unless_it_is_the_identity(tmp_path, golden):
    """The defect: g_idx was ignored, so a permuted g_idx decoded like none at all."""
    for case in ("g32_identity", "g32_permuted", "g64_permuted", "g32_interleaved"):
        ck = _case_checkpoint(tmp_path / "with", golden, case, BASE)
        bare = _case_checkpoint(tmp_path / "without", golden, case, BASE, drop=("weight_g_idx",))
        same = np.array_equal(decode_matrix(ck, BASE, detect_scheme(ck.config)),
                              decode_matrix(bare, BASE, detect_scheme(bare.config)))
        assert same == (case == "g32_identity"), case


def test_fused_experts_decode_each_slice_as_compressed_tensors(tmp_path, golden):
    """A fused [E, n, k/8] tensor with per-expert g_idx [E, k]; compressed-tensors decompressed each expert alone.
    (weight_shape is left out: its fused form belongs to the fused-storage decoders; k comes from the scales.)"""
    ck = _case_checkpoint(tmp_path, golden, "fused_g32_permuted", FUSED, drop=("weight_shape",))
    scheme = detect_scheme(ck.config)
    for e in range(3):
        got = decode_matrix(ck, FUSED, scheme, e)
        np.testing.assert_array_equal(got, golden["fused_g32_permuted.decompressed"][e], e)


@pytest.mark.parametrize("g_idx, message", [
    (np.r_[np.full(64, -1), np.arange(64) // 16].astype(np.int32), "mixes -1"),
    (np.r_[np.arange(127) // 32, [4]].astype(np.int32), "names a group that does not exist"),
    (np.r_[np.zeros(33), np.arange(95) // 32 + 1].astype(np.int32), "every group group_size columns.*group 0 has 33"),
    (np.arange(128, dtype=np.float32) // 32, "wrong dtype"),
    (np.arange(64, dtype=np.int32), r"each of the 128 input columns; expected \[128\], found \[64\]"),
])
def test_bad_g_idx_is_refused_naming_the_tensor(tmp_path, golden, g_idx, message):
    ck = _case_checkpoint(tmp_path, golden, "g32_permuted", BASE)
    tensors = {n: (ck.read(n), ck.tensors[n].dtype) for n in ck.tensors}
    tensors[f"{BASE}.weight_g_idx"] = (g_idx, {"int32": "I32", "float32": "F32"}[str(g_idx.dtype)])
    bad = _write(tmp_path / "bad", tensors, ck.config)
    with pytest.raises(InputError, match=rf"model.safetensors: {BASE}.weight_g_idx: .*{message}"):
        decode_matrix(bad, BASE, detect_scheme(bad.config))


def test_all_unset_g_idx_reads_in_column_order(tmp_path, golden):
    """-1 everywhere is compressed-tensors' "not initialised" g_idx: it decompresses in column order."""
    ck = _case_checkpoint(tmp_path, golden, "g32_identity", BASE)
    tensors = {n: (ck.read(n), ck.tensors[n].dtype) for n in ck.tensors}
    tensors[f"{BASE}.weight_g_idx"] = (np.full(128, -1, np.int32), "I32")
    unset = _write(tmp_path / "unset", tensors, ck.config)
    np.testing.assert_array_equal(decode_matrix(unset, BASE, detect_scheme(unset.config)),
                                  golden["g32_identity.decompressed"])


# ---------------------------------------------------------------- end to end

def _with_g_idx(src: Path, dst: Path, permute: bool, seed: int = 3) -> Path:
    """A copy of tiny checkpoint `src` (ct-int4, group 32) whose routed experts get a weight_g_idx: the identity, or
    a random permutation of it (same packed values and scales: other weights)."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    for shard in dst.glob("*.safetensors"):
        ck = Checkpoint.open(dst)
        tensors = {n: (ck.read(n), ref.dtype) for n, ref in ck.tensors.items() if ref.file.name == shard.name}
        for name in [n for n in tensors if n.endswith(".weight_shape")]:
            k = int(tensors[name][0][1])
            g_idx = (np.arange(k) // 32).astype(np.int32)
            tensors[name.replace(".weight_shape", ".weight_g_idx")] = (rng.permutation(g_idx) if permute else g_idx,
                                                                       "I32")
        _write(dst / "x", tensors, {})
        (dst / "x" / "model.safetensors").replace(shard)
        shutil.rmtree(dst / "x")
    config = json.loads((dst / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _column_rule(ck: Checkpoint, base: str) -> np.ndarray:
    """BF16 bits [n, k] by compressed-tensors' documented rule: w[:, j] = q[:, j] * scale[:, g_idx[j]]."""
    k = int(ck.read(f"{base}.weight_shape")[1])
    q = ct_int4.unpack_int32(ck.read(f"{base}.weight_packed"), k, 4).astype(np.float32)
    scale = bf16_bits_to_f32(ck.read(f"{base}.weight_scale"))
    return f32_to_bf16_bits(q * scale[:, ck.read(f"{base}.weight_g_idx")])


def test_cpu_bf16_applies_g_idx_end_to_end(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the ct-int4 writer)

    src = tiny_model("kimi_k2", layers=2, experts=3, dtype="ct-int4", seed=2)
    outs = {}
    for kind, permute in (("identity", False), ("permuted", True)):
        model = _with_g_idx(src, tmp_path / kind, permute)
        outs[kind] = tmp_path / f"out-{kind}"
        result = CliRunner().invoke(cli, ["cpu", str(model), str(outs[kind]), "--method", "bf16", "--quiet"])
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(cli, ["verify", str(outs[kind]), "--source", str(model), "--experts", "all"])
        assert result.exit_code == 0, result.output
    plain = tmp_path / "out-plain"
    assert CliRunner().invoke(cli, ["cpu", str(src), str(plain), "--method", "bf16", "--quiet"]).exit_code == 0
    out_ck = {k: Checkpoint.open(v) for k, v in (*outs.items(), ("plain", plain))}
    model_ck = Checkpoint.open(tmp_path / "permuted")
    experts = [n[: -len(".weight_g_idx")] for n in model_ck.tensors if n.endswith(".weight_g_idx")]
    assert experts
    for base in experts:
        plain_w = out_ck["plain"].read(base + ".weight")
        np.testing.assert_array_equal(out_ck["identity"].read(base + ".weight"), plain_w, base)
        permuted_w = out_ck["permuted"].read(base + ".weight")
        assert not np.array_equal(permuted_w, plain_w), base
        np.testing.assert_array_equal(permuted_w, _column_rule(model_ck, base), base)


def test_rawint4_is_not_read_as_is_with_g_idx(tiny_model, tmp_path):
    """kt-kernel's RAWINT4 loader reads weight_packed / weight_scale in column order: with a g_idx the experts must
    be converted, and inspect must not say "as is"."""
    import ktconvert.examples.tiny_quantized  # noqa: F401
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.methods import METHODS

    src = tiny_model("kimi_k2", layers=2, experts=3, dtype="ct-int4", seed=2)
    rawint4 = METHODS.get("rawint4")
    assert rawint4.inspect_line(HFSource.open(src)).startswith("as is")
    assert rawint4.inspect_line(HFSource.open(_with_g_idx(src, tmp_path / "p", True))).startswith("convert")
