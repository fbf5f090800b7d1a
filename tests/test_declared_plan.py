"""The declared tensor plan (issue 26 item 1): a CPU method declares its tensors as data (``tensor_specs``) and the
sink's ``planned_files()`` is the one plan every size comes from.

* For every writable method, every layout it has and every family's tiny model, the files `plan` lists with their
  bytes are exactly the files `convert` writes (ktconvert.json aside: written after the fact, planned as an
  estimate), and every planned shard holds exactly its planned tensors (headers parsed here per the safetensors
  format, not by ktconvert).
* A test-only method with per-group scales (AMXINT4 tiles, one fp32 scale per 32 in-features of a row) flows
  through the plan, the writer, verify's structure check and the reader with no production change.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ktconvert import api
from ktconvert.architectures.manifests import families
from ktconvert.errors import ShapeError
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.methods import METHODS, all_methods
from ktconvert.methods.amx import AmxInt4
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.verification.folder import OutputFolder
from ktconvert.verification.reader import KtOutput

SHAPES = {"experts": 4, "hidden": 256, "intermediate": 256}   # small, and whole blocks / groups for every method
# (llamafile's K-quants: 256-element super-blocks along H and I)
# every family with a tiny model (deepseek_v4 has none: tests/test_input_deepseek_v4.py writes its own checkpoints)
FAMILIES = {name: next(iter(manifest.tiny)) for name, manifest in families().items() if manifest.tiny}
CASES = [(method.name, layout) for method in all_methods() if method.writable for layout in method.layouts]
ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}   # safetensors dtype sizes
GROUP = 32


def _source(tiny_model, family: str):
    return tiny_model(FAMILIES[family], **SHAPES)


def _on_disk(out) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}


def _header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} of a safetensors file: 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {key: (entry["dtype"], tuple(entry["shape"])) for key, entry in header.items()}


def _source_matrix(src, name: str) -> np.ndarray:
    """float32 weights of BF16 tensor `name` of a tiny checkpoint, read per the safetensors format."""
    index = src / "model.safetensors.index.json"
    shard = src / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    with open(shard, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + length + begin)
        bits = np.frombuffer(f.read(end - begin), dtype="<u2").reshape(entry["shape"])
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _plan_and_convert(src, out, method: str, layout: str) -> dict:
    """The plan report of `method` / `layout` (numa 1) and the output it converts into `out`."""
    options = {"method": method, "layout": layout, "numa": 1, "allow_drop_bias": True}
    report = api.plan(src, **options).cpu.report
    api.convert_cpu(src, out, threads=1, **options)
    return report


def _check_written_as_planned(report: dict, out) -> None:
    assert report["file_count"] == len(report["files"]), "small shapes: every planned file is listed"
    planned = {f["path"]: f["bytes"] for f in report["files"] if not f.get("approx")}
    written = _on_disk(out)
    assert [f["path"] for f in report["files"] if f.get("approx")] == ["ktconvert.json"]
    assert written.pop("ktconvert.json") > 0
    assert planned == written
    assert report["total_bytes"] - next(f["bytes"] for f in report["files"] if f.get("approx")) == sum(written.values())


@pytest.mark.parametrize("method,layout", CASES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_files_are_the_written_files(tiny_model, tmp_path, family, method, layout):
    src = _source(tiny_model, family)
    try:
        report = _plan_and_convert(src, tmp_path / "out", method, layout)
    except ShapeError as exc:
        pytest.skip(f"{method} refuses the tiny {family} model's shapes: {exc}")
    _check_written_as_planned(report, tmp_path / "out")
    index = tmp_path / "out" / "model.safetensors.index.json"
    if index.is_file():     # every shard holds exactly the tensors the index (from the plan) gives it
        weight_map = json.loads(index.read_text())["weight_map"]
        for shard in set(weight_map.values()):
            assert set(_header(tmp_path / "out" / shard)) == {k for k, name in weight_map.items() if name == shard}


# ---------------------------------------------------------------- a method with per-group scales

def _group_scaled_int4(monkeypatch):
    """Register (for this test only) AMXINT4 tiles with one fp32 scale per 32 in-features: its tensor_specs entry
    plus its math, nothing else."""
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))
    monkeypatch.setattr(METHODS, "_aliases", dict(METHODS._aliases))

    class GroupScaledInt4(AmxInt4):
        name, aliases, kt_method, file_prefix = "testg32int4", (), "TESTG32INT4", "G32INT4"
        default = False
        quants = ("rtn",)

        @classmethod
        def tensor_specs(cls, n: int, k: int):
            return {"weight": ("I8", (n * k // 2,)), "scale": ("F32", (n, k // GROUP))}

        @classmethod
        def quantize(cls, w_bf16, threads=1, where="", quant="rtn"):
            n, k = w_bf16.shape
            groups = bf16_bits_to_f32(np.ascontiguousarray(w_bf16)).reshape(n, k // GROUP, GROUP)
            d = np.abs(groups).max(axis=2) / np.float32(7)
            d[d == 0] = 1
            codes = np.clip(np.rint(groups / d[:, :, None]), -7, 7).astype(np.int8).reshape(n, k)
            return cls._pack(codes), d.astype(np.float32)

        @classmethod
        def dequantize(cls, blob, scale, n, k):
            codes = cls._unpack(blob, n, k).astype(np.float32).reshape(n, k // GROUP, GROUP)
            return (codes * np.asarray(scale, np.float32).reshape(n, k // GROUP, 1)).reshape(n, k)

    return GroupScaledInt4


def test_expert_bytes_follow_the_declared_scales(monkeypatch):
    method = _group_scaled_int4(monkeypatch)
    H, I = 256, 128
    # per part [n, k]: n * k / 2 bytes of int4 tiles + n * k / 32 fp32 scales (4 bytes each)
    assert method.expert_bytes(H, I, 1) == 3 * (I * H // 2 + 4 * I * H // GROUP)
    assert method.expert_bytes(H, I, 1) - AmxInt4.expert_bytes(H, I, 1) == 3 * 4 * I * H // GROUP - 4 * (2 * I + H)


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_group_scaled_method_flows_through_plan_writer_and_verify(tiny_model, tmp_path, monkeypatch, layout):
    method = _group_scaled_int4(monkeypatch)
    src, out = tiny_model("qwen3_moe", **SHAPES), tmp_path / "out"
    report = _plan_and_convert(src, out, method.name, layout)
    _check_written_as_planned(report, out)
    H, I = SHAPES["hidden"], SHAPES["intermediate"]
    assert report["expert_bytes"] == 3 * (I * H // 2 + 4 * I * H // GROUP)
    if layout == "safetensors":
        header = _header(next(out.glob("model-*.safetensors")))
        layer = int(next(iter(header)).split(".")[1])
        assert header[f"blk.{layer}.ffn_down_exps.0.numa.0.scale"] == ("F32", (H, I // GROUP))
        assert header[f"blk.{layer}.ffn_gate_exps.0.numa.0.weight"] == ("I8", (I * H // 2,))
    else:
        assert (out / "_layer_0/_numa_0" / f"G32INT4_down_0_{4 * H * I // GROUP}Byte_scale_.kt").is_file()
    manifest = load_manifest(out)
    folder = OutputFolder.scan(out)
    assert method.check_structure(folder, manifest)[0] == []
    per_row = AmxInt4.check_structure(folder, manifest)[0]     # the same files against per-row scales
    assert per_row and all("bytes" in line or "missing" in line or "unexpected" in line for line in per_row)
    rt = KtOutput.open(out, manifest, folder, methods=METHODS)
    layer = rt.layers[0]
    blobs = rt.read_expert(layer, 1)
    (gate_w, gate_s), _, (down_w, down_s) = blobs.parts[0]
    assert gate_s.size == I * H // GROUP and down_s.size == H * I // GROUP
    # read back, the down matrix is the source's to half a step of its group (round to nearest)
    w = _source_matrix(src, f"model.layers.{layer}.mlp.experts.1.down_proj.weight")
    step = np.repeat(down_s.reshape(H, I // GROUP), GROUP, axis=1)
    assert np.all(np.abs(method.dequantize(down_w, down_s, H, I) - w) <= step * 0.5001)
    assert gate_w.size == I * H // 2
