"""``ktconvert.verification.numeric_amx.check_numerics``: honest conversions pass; corruption is caught by the manifest's tensor
hashes and, independently of the manifest, by the comparison with the source weights."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ktconvert.native import forward as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason="native library not built")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from test_runtime import make_source

    return make_source(tmp_path_factory.mktemp("src") / "tiny", seed=5)


def _convert(src, out, method="amxint4", numa=2, layout="kt"):
    from test_runtime import write_output

    return write_output(src, out, method, numa, layout)


def _check(out, source=None, **kw):
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.methods import METHODS
    from ktconvert.verification.numeric_amx import check_numerics

    args = {"tokens": 8, "layers": None, "experts": "all", "threshold": None, **kw}
    return check_numerics(out, load_manifest(out), source, args["tokens"], args["layers"], args["experts"],
                          args["threshold"], methods=METHODS)


def _set_tensor_hash(out, key: str, data: bytes) -> None:
    """Rewrite ktconvert.json as if it had been produced from the changed bytes."""
    path = out / "ktconvert.json"
    manifest = json.loads(path.read_text())
    manifest["tensors"][key] = hashlib.sha256(data).hexdigest()
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("method,layout", [("amxint4", "kt"), ("amxint4", "safetensors"), ("amxint8", "kt")])
def test_honest_conversion_passes(src, tmp_path, method, layout):
    report = _check(_convert(src, tmp_path / "o", method, 2, layout), src)
    assert report["ok"], report["problems"]
    assert [row["layer"] for row in report["layers"]] == [0, 1]
    for row in report["layers"]:
        assert row["experts"] == [0, 1, 2, 3]
        assert row["kernel_rel"] < 1e-5 and row["moe_kernel_rel"] < 1e-5
        assert row["rtn_bound_violations"] == 0 and row["hash_mismatches"] == 0
        limit = 0.75 if method == "amxint4" else 0.05      # heavy-tailed weights: INT4 ~0.6, INT8 ~0.03
        assert 0 < row["moe_rel_l2"] < limit and row["moe_cosine"] > 0.8
        assert len(row["worst_experts"]) == 3
    ver = report["verification"]
    assert ver["ok"] and set(ver["layers"]) == {"0", "1"} and "moe_rel_l2" in ver["layers"]["0"]
    json.dumps(ver)


def test_without_source_checks_kernels_and_hashes(src, tmp_path):
    report = _check(_convert(src, tmp_path / "o"), None, layers="1", experts="2")
    assert report["ok"], report["problems"]
    (row,) = report["layers"]
    assert row["layer"] == 1 and len(row["experts"]) == 2 and "moe_rel_l2" not in row


def test_flipped_byte_is_caught_by_the_tensor_hash(src, tmp_path):
    out = _convert(src, tmp_path / "o")
    victim = next((out / "_layer_0" / "_numa_1").glob("INT4_up_2_*_quant_.kt"))
    data = bytearray(victim.read_bytes())
    data[777] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = _check(out, src)
    assert not report["ok"]
    assert any("blk.0.ffn_up_exps.2.numa.1.weight: sha256 differs" in p for p in report["problems"])


def test_swapped_tiles_are_caught_by_hash_and_by_the_source(src, tmp_path):
    out = _convert(src, tmp_path / "o")
    victim = next((out / "_layer_1" / "_numa_0").glob("INT4_gate_3_*_quant_.kt"))
    data = bytearray(victim.read_bytes())
    tile_a, tile_b = bytes(data[0:2048]), bytes(data[5 * 2048:6 * 2048])   # two different 32-row panels
    data[0:2048], data[5 * 2048:6 * 2048] = tile_b, tile_a
    victim.write_bytes(bytes(data))
    report = _check(out, src)
    assert any("blk.1.ffn_gate_exps.3.numa.0.weight: sha256 differs" in p for p in report["problems"])
    # Independently of the manifest: make its hash agree with the corrupted bytes; the source comparison remains.
    _set_tensor_hash(out, "blk.1.ffn_gate_exps.3.numa.0.weight", bytes(data))
    report = _check(out, src)
    assert not report["ok"]
    row = next(r for r in report["layers"] if r["layer"] == 1)
    assert row["hash_mismatches"] == 0 and row["rtn_bound_violations"] > 0
    assert any("round-to-nearest" in p and "expert 3" in p for p in report["problems"])


def test_row_major_blobs_instead_of_tiles_fail_the_source_check(src, tmp_path):
    """A writer that forgot the tile order (codes row-major): hashes match its own manifest, the source does not."""
    from ktconvert.layouts import tiles

    out = _convert(src, tmp_path / "o", "amxint8", 1, "kt")
    for path in sorted((out / "_layer_0" / "_numa_0").glob("INT8_*_quant_.kt")):
        n, k = (256, 256)
        codes = tiles.unpack_int8(np.fromfile(path, np.uint8), n, k)
        raw = codes.view(np.uint8).tobytes()
        path.write_bytes(raw)
        e, proj = int(path.name.split("_")[2]), path.name.split("_")[1]
        _set_tensor_hash(out, f"blk.0.ffn_{proj}_exps.{e}.numa.0.weight", raw)
    report = _check(out, src)
    row = next(r for r in report["layers"] if r["layer"] == 0)
    assert row["hash_mismatches"] == 0 and row["kernel_rel"] < 1e-5
    assert row["moe_rel_l2"] > 1.0 and row["moe_cosine"] < 0.5
    assert not row["ok"] and any("relative L2" in p for p in report["problems"])
    assert next(r for r in report["layers"] if r["layer"] == 1)["ok"]


def test_int8_files_with_an_int4_manifest(src, tmp_path):
    out = _convert(src, tmp_path / "o", "amxint8", 2, "safetensors")
    path = out / "ktconvert.json"
    manifest = json.loads(path.read_text())
    manifest["method"] = "AMXINT4"
    path.write_text(json.dumps(manifest))
    report = _check(out, src)
    assert not report["ok"]
    assert any("AMXINT8 with numa 2" in p for p in report["problems"])


def test_threshold_override_and_worst_experts_named(src, tmp_path):
    report = _check(_convert(src, tmp_path / "o"), src, threshold=0.01, layers="all", experts="3")
    assert not report["ok"] and report["thresholds"]["moe_rel_l2"] == 0.01
    assert all("worst: expert" in p for p in report["problems"])
    assert all(len(row["experts"]) == 3 for row in report["layers"])


def test_bad_layer_selection_is_usage(src, tmp_path):
    """A --layers value naming a layer the output does not hold cannot work: UsageError (exit 2), naming the
    converted layers (issue 30; before: a verification problem, exit 4)."""
    from ktconvert.errors import UsageError

    with pytest.raises(UsageError, match="does not hold"):
        _check(_convert(src, tmp_path / "o"), src, layers="7")
