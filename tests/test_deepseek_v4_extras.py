"""DeepSeek-V4 (issue 27): its dense linears (manifests/deepseek_v4.toml ``[linears]``) and its MTP layers.

The hub checkpoint (DeepSeek-V4-Flash) keeps MTP layer k as a whole decoder block under ``mtp.{k}.``: attention,
FP4 routed experts ``mtp.{k}.ffn.experts.E.{w1,w3,w2}``, shared experts, router, plus its own ``e_proj`` / ``h_proj``
/ norms; config.json counts them in ``num_nextn_predict_layers``. They are layer num_hidden_layers + k and handled as
DeepSeek-V3's layer 61: routed experts converted with ``--include-mtp`` and left out (with a plan note) otherwise;
the GPU checkpoint carries ``mtp.`` only with ``--include-mtp``.

Expected values come from the source files read with the safetensors library and an E2M1 / E8M0 decode written
here from the OCP Microscaling definition, not from ktconvert's decoders. The linears the GPU checkpoint writes as
block FP8 are the ones the hub stores as block FP8 (attn.wq_a / wq_b / wkv / wo_b, the indexer's wq_b, the shared
experts), as listed in the hub's safetensors index.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert import api
from ktconvert.architectures.manifests import manifest_for
from ktconvert.examples.tiny_deepseek_v4 import make_tiny_deepseek_v4
from ktconvert.formats.hf_describe import describe
from ktconvert.formats.hf_source import HFSource

torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open

LAYERS, EXPERTS = 2, 4
MTP = LAYERS                       # the MTP layer's number: num_hidden_layers + 0
W_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_tiny_deepseek_v4(tmp_path_factory.mktemp("v4mtp") / "src", layers=LAYERS, experts=EXPERTS, mtp=1)


def _tensors(folder) -> dict:
    """Every tensor of a folder's safetensors files as the safetensors library reads it: 1-byte dtypes (FP8, E8M0,
    I8) as uint8, 2-byte ones (BF16, F16) as uint16 bits, the rest as their numpy dtype."""
    as_bits = {1: torch.uint8, 2: torch.int16}
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                bits = as_bits.get(t.dtype.itemsize)
                out[name] = t.numpy() if bits is None else t.view(bits).numpy().view(f"u{t.dtype.itemsize}")
    return out


def mx_reference(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """OCP MXFP4: byte j of a row holds elements 2j (low nibble) and 2j+1 (high); nibble bit 3 = sign, bits 0-2 index
    the E2M1 values; each 32 elements share 2^(e - 127). Returns float64 [n, k]."""
    b = weight.view(np.uint8)
    nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    values = np.where(nib & 8, -1.0, 1.0) * E2M1[nib & 7]
    return values * np.repeat(np.exp2(scale.astype(np.float64) - 127), 32, axis=1)


# ---------------------------------------------------------------------------------------------- linears

def test_linears_are_the_hub_checkpoints_block_fp8_modules():
    """Module names from DeepSeek-V4-Flash's safetensors index: the block-FP8 ones are SGLang LinearBase layers
    (attention / shared), the others are not (routed experts, router, the grouped wo_a, compressors, indexer
    weights_proj, the MTP block's e_proj / h_proj)."""
    manifest = manifest_for("deepseek_v4")
    kinds = {"layers.0.attn.wq_a": "attention", "layers.0.attn.wq_b": "attention", "layers.0.attn.wkv": "attention",
             "layers.42.attn.wo_b": "attention", "layers.2.attn.indexer.wq_b": "attention",
             "mtp.0.attn.wq_a": "attention", "layers.0.ffn.shared_experts.w1": "shared",
             "layers.0.ffn.shared_experts.w2": "shared", "mtp.0.ffn.shared_experts.w3": "shared",
             "layers.0.attn.wo_a": None, "layers.2.attn.compressor.wkv": None, "layers.2.attn.compressor.wgate": None,
             "layers.2.attn.indexer.weights_proj": None, "layers.2.attn.indexer.compressor.wkv": None,
             "layers.0.ffn.gate": None, "layers.0.ffn.experts.7.w1": None, "mtp.0.ffn.experts.7.w2": None,
             "mtp.0.e_proj": None, "mtp.0.h_proj": None, "head": None, "embed": None}
    assert {m: manifest.linear_kind(m) for m in kinds} == kinds


def test_gpu_checkpoint_writes_the_declared_linears_fp8_and_mtp_only_with_include_mtp(v4, tmp_path):
    pytest.importorskip("compressed_tensors", reason="the GPU checkpoint needs the [gpu] extra")
    from ktconvert.verification.run import verify

    index = {}
    for flag in (False, True):
        out = tmp_path / f"gpu-{flag}"
        api.convert_gpu(v4, out, experts="w4a16", linears="fp8", include_mtp=flag, threads=2)
        index[flag] = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        report = verify(out, source=str(v4))
        assert report["ok"], report["problems"]
    assert not any(n.startswith("mtp.") for n in index[False])
    assert {n for n in index[True] if not n.startswith("mtp.")} == set(index[False])
    fp8 = {n[:-len(".weight_scale_inv")] for n in index[True] if n.endswith(".weight_scale_inv")}
    want = {f"{p}{m}" for p in ("layers.0.", "layers.1.", "mtp.0.")
            for m in ("attn.wq_a", "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")}
    assert fp8 == want
    written = _tensors(tmp_path / "gpu-True")
    assert all(written[m + ".weight"].dtype == np.uint8 for m in want)          # F8_E4M3 codes
    assert written["mtp.0.e_proj.weight"].dtype == np.uint16                     # BF16, as DeepSeek-V3's eh_proj
    assert "mtp.0.ffn.experts.3.w2.weight_packed" in written


# ---------------------------------------------------------------------------------------------- MTP layers

def test_mtp_layer_is_found_under_mtp_k(v4, tmp_path):
    """mtp.0.* is layer num_hidden_layers; without the config's count the present mtp.{k} layers are counted."""
    info = HFSource.open(v4).info
    assert info.moe_layers == (0, 1) and info.mtp_layers == (MTP,)
    assert HFSource.open(v4).present_mtp_layers() == (MTP,)
    assert info.expert_names(MTP, 3) == {p: f"mtp.0.ffn.experts.3.{w}.weight" for p, w in W_NAMES.items()}
    assert info.expert_names(1, 3) == {p: f"layers.1.ffn.experts.3.{w}.weight" for p, w in W_NAMES.items()}
    assert {info.layer_of(n) for n in ("mtp.0.e_proj.weight", "mtp.0.ffn.experts.0.w1.scale",
                                       "mtp.0.attn.wq_a.weight")} == {MTP}
    assert info.layer_of("layers.1.attn.wq_a.weight") == 1 and info.layer_of("head.weight") is None
    layout = describe(HFSource.open(v4))["expert_layout"]                # what `ktconvert inspect` shows
    assert (layout["pattern"], layout["mtp"]["pattern"]) == ("layers.{L}.ffn.experts.{E}.w1.weight",
                                                             "mtp.{L}.ffn.experts.{E}.w1.weight")
    bare = tmp_path / "no-count"
    bare.mkdir()
    for f in v4.iterdir():
        (bare / f.name).symlink_to(f)
    config = json.loads((v4 / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (bare / "config.json").unlink()
    (bare / "config.json").write_text(json.dumps(config))
    assert HFSource.open(bare).info.mtp_layers == (MTP,)


def test_cpu_mtp_experts_carried_only_with_include_mtp(v4, tmp_path):
    """mxfp4 (the source's own format): layer 2's experts are mtp.0's bytes with --include-mtp; without it the
    output has layers 0 and 1 only and the plan says why."""
    assert "MTP layers [2] not converted (--include-mtp)" in api.plan(v4, method="mxfp4").cpu.report["notes"]
    api.convert_cpu(v4, tmp_path / "no-mtp", method="mxfp4")
    manifest = json.loads((tmp_path / "no-mtp" / "ktconvert.json").read_text())
    assert manifest["model"]["layers"] == [0, 1]
    assert not any(".layers.2." in n for n in manifest["tensors"])
    api.convert_cpu(v4, tmp_path / "mtp", method="mxfp4", include_mtp=True)
    assert json.loads((tmp_path / "mtp" / "ktconvert.json").read_text())["model"]["layers"] == [0, 1, MTP]
    source, out = _tensors(v4), _tensors(tmp_path / "mtp")
    for e in range(EXPERTS):
        for w in W_NAMES.values():
            for part in ("weight", "scale"):
                np.testing.assert_array_equal(out[f"model.layers.{MTP}.ffn.experts.{e}.{w}.{part}"],
                                              source[f"mtp.0.ffn.experts.{e}.{w}.{part}"])


def test_cpu_bf16_mtp_experts_decode_the_source(v4, tmp_path):
    """bf16 --include-mtp: layer 2's experts are the OCP decode of mtp.0's FP4 tensors (exact in BF16)."""
    api.convert_cpu(v4, tmp_path / "bf16", method="bf16", include_mtp=True)
    source, out = _tensors(v4), _tensors(tmp_path / "bf16")
    for e in (0, EXPERTS - 1):
        for proj, w in W_NAMES.items():
            base = f"mtp.0.ffn.experts.{e}.{w}"
            want = mx_reference(source[base + ".weight"], source[base + ".scale"]).astype(np.float32)
            got = (out[f"model.layers.{MTP}.mlp.experts.{e}.{proj}_proj.weight"].astype(np.uint32) << 16).view(
                np.float32)
            np.testing.assert_array_equal(got, want, base)


def test_include_dense_copies_the_mtp_block_but_its_routed_experts(v4, tmp_path):
    """--include-dense: the MTP block's non-expert tensors are copied byte for byte, its routed experts are not
    (they are the converted layer 2), as for DeepSeek-V3's layer 61."""
    api.convert_cpu(v4, tmp_path / "dense", method="amxint4", include_dense=True, include_mtp=True)
    manifest = json.loads((tmp_path / "dense" / "ktconvert.json").read_text())
    source, out = _tensors(v4), _tensors(tmp_path / "dense")
    mtp_dense = {n for n in source if n.startswith("mtp.0.") and ".ffn.experts." not in n}
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.scale", "mtp.0.ffn.shared_experts.w2.weight"} <= mtp_dense
    assert mtp_dense <= set(out)
    assert not any(n.startswith("mtp.0.ffn.experts.") for n in out)
    for name in mtp_dense:
        np.testing.assert_array_equal(out[name], source[name], name)
    assert manifest["model"]["layers"] == [0, 1, MTP]


@pytest.mark.parametrize("extra, message", [
    ("mtp.0.ffn.experts.9.w1.weight", "expert 9 is outside the experts"),
    ("mtp.1.attn_norm.weight", "tensor of layer 3, outside the 3 layers"),
])
def test_mtp_tensors_the_config_does_not_describe_are_refused(v4, extra, message):
    """As in the main layers: an MTP expert past n_routed_experts or an MTP layer past num_nextn_predict_layers is a
    ManifestError naming the tensor, not silently dropped."""
    from ktconvert.architectures.manifests import resolve
    from ktconvert.errors import ManifestError

    config = json.loads((v4 / "config.json").read_text())
    with pytest.raises(ManifestError, match=message) as err:
        resolve(config, ["layers.0.attn_norm.weight", "mtp.0.attn_norm.weight", extra])
    assert extra in str(err.value)
