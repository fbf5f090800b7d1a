"""`ktconvert verify` on the in-place outputs (bf16, rawint4, fp8): structure, hashes and error against the source,
and each kind of damage caught."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert.cpu.convert import convert_cpu
from ktconvert.verification.run import verify


@pytest.fixture(scope="module")
def outputs(tiny_model, tmp_path_factory):
    model = tiny_model("deepseek_v3")
    outs = {}
    for method in ("bf16", "rawint4", "fp8"):
        out = tmp_path_factory.mktemp("inplace") / method
        convert_cpu(model, out, method=method, numa=2)
        outs[method] = out
    return model, outs


@pytest.mark.parametrize("method", ["bf16", "rawint4", "fp8"])
def test_honest_outputs_verify(outputs, method):
    model, outs = outputs
    result = verify(outs[method], source=str(model), hashes=True, experts="all", layers="all")
    assert result["ok"], result["problems"]
    rows = result["numerics"]["layers"]
    assert rows and all("moe_rel_l2" in r for r in rows)
    if method == "bf16":
        assert all(r["moe_rel_l2"] == 0.0 and r["weight_rel_l2"] == 0.0 for r in rows)
    else:
        assert all(0.0 < r["moe_rel_l2"] < 0.6 for r in rows)
    manifest = json.loads((outs[method] / "ktconvert.json").read_text())
    assert manifest["method"] == method.upper() and manifest["numa"] == 2


def _rewrite_tensor(out, name: str, change) -> None:
    """Rewrite one tensor's bytes in place (same size), as silent disk or transfer corruption would."""
    from ktconvert.formats.safetensors_reader import Checkpoint

    ref = Checkpoint.open(out).tensors[name]
    with open(ref.file, "r+b") as fh:
        fh.seek(ref.offset)
        data = bytearray(fh.read(ref.nbytes))
        change(data)
        fh.seek(ref.offset)
        fh.write(bytes(data))


def test_flipped_byte_is_caught(outputs, tmp_path):
    import shutil

    model, outs = outputs
    out = tmp_path / "fp8"
    shutil.copytree(outs["fp8"], out)
    layer = json.loads((out / "ktconvert.json").read_text())["model"]["layers"][0]
    name = f"model.layers.{layer}.mlp.experts.0.up_proj.weight"

    def flip(data):
        data[5] ^= 0x40

    _rewrite_tensor(out, name, flip)
    result = verify(out, source=str(model), hashes=True, experts="all", layers=str(layer))
    assert not result["ok"]
    assert any(name in p and "sha256" in p for p in result["problems"])


def test_wrong_scales_fail_against_the_source(outputs, tmp_path):
    """Scales multiplied by 4 with the manifest re-hashed to match: only the comparison with the source sees it."""
    import shutil

    from ktconvert.formats.fileio import hash_safetensors
    from ktconvert.formats.out_manifest import write_manifest

    model, outs = outputs
    out = tmp_path / "rawint4"
    shutil.copytree(outs["rawint4"], out)
    manifest = json.loads((out / "ktconvert.json").read_text())
    layer = manifest["model"]["layers"][0]
    for e in range(manifest["model"]["experts"]):
        name = f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight_scale"

        def scale_up(data):
            bits = np.frombuffer(bytes(data), dtype=np.uint16).copy()
            bits += np.uint16(2 << 7)       # BF16 exponent + 2: every scale x4
            data[:] = bits.tobytes()

        _rewrite_tensor(out, name, scale_up)
    for shard in out.glob("model-*.safetensors"):  # an attacker / buggy tool that also rewrites the hashes
        _, _, _, tensors = hash_safetensors(shard)
        manifest["tensors"].update(tensors)
    write_manifest(out, manifest)
    assert verify(out, experts="all", layers=str(layer))["ok"]          # self-consistent without a source
    result = verify(out, source=str(model), experts="all", layers=str(layer))
    assert not result["ok"] and any("above the limit" in p for p in result["problems"])
