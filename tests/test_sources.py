"""Sources and decoders as registries: one parser of quantization_config (the source and the scheme agree on the
input format), Source / Decoder subclasses register themselves and the registries refuse duplicates and foreign
classes, and inspect describes any registered source without knowing its format."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ktconvert.formats import decoders
from ktconvert.formats.base import SOURCES, Source
from ktconvert.formats.decoders import DECODERS, Decoder, detect_scheme
from ktconvert.formats.hf_source import HFSource
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.quant import ct_int4


def _packed_copy(src, dst, bits: int, group_size: int = 64):
    """`src` (a BF16 tiny model) with every routed expert stored as compressed-tensors pack-quantized `bits`-bit."""
    from ktconvert.formats.st_writer import StreamingSafetensorsWriter

    shutil.copytree(src, dst)
    source = HFSource.open(dst)
    expert = {_base(n) for layer in source.info.moe_layers for e in range(source.info.n_experts)
              for n in source.info.expert_names(layer, e).values()}
    ck = source.checkpoint
    for shard in ck.shards:
        tensors = {}
        for name, ref in shard.tensors.items():
            base = _base(name)
            if base not in expert:
                tensors[name] = (ref.dtype, ck.read(name))
                continue
            q, scale = ct_int4.quantize_sym_groups(ck.read(name), group_size, bits, name)
            tensors[base + ".weight_packed"] = ("I32", ct_int4.pack_int32(q, bits, name))
            tensors[base + ".weight_scale"] = ("BF16", scale)
            tensors[base + ".weight_shape"] = ("I64", np.array(ref.shape, np.int64))
        specs = [(name, dtype, arr.shape) for name, (dtype, arr) in tensors.items()]
        with StreamingSafetensorsWriter(shard.path, specs) as writer:
            for name, (_, arr) in tensors.items():
                writer.write(name, arr)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = ct_int4.pack_quantized_config(group_size, ["Linear"])
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = bits
    config["quantization_config"]["ignore"] = [r"re:.*(self_attn|mlp\.gate|shared_expert|lm_head|embed).*"]
    (dst / "config.json").write_text(json.dumps(config))
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        index.unlink()
    return dst


def _base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


@pytest.mark.parametrize("bits", [4, 8])
def test_source_and_scheme_agree_on_the_input_format(tiny_model, tmp_path, bits):
    """Before: HFSource named every pack-quantized input ct-int4 while the scheme parser said ct-int{bits}."""
    model = _packed_copy(tiny_model("qwen3_moe"), tmp_path / "m", bits)
    scheme = detect_scheme(Checkpoint.open(model).config)
    source = HFSource.open(model)
    assert scheme.input_format == source.input_format == f"ct-int{bits}"
    assert source.expert_quantization().num_bits == bits
    source.validate()
    layer = source.info.moe_layers[0]
    assert source.read_expert(layer, 1).down.shape == (source.info.hidden, source.info.intermediate)


def test_decoder_subclasses_register_and_duplicates_are_refused(monkeypatch):
    monkeypatch.setattr(DECODERS, "_items", dict(DECODERS._items))

    class Int3Decoder(Decoder):
        scheme, quant_method = "test-int3", "test-int3"

    assert DECODERS.get("test-int3") is Int3Decoder
    with pytest.raises(ValueError, match="registered twice"):
        class Again(Decoder):
            scheme = "pack-quantized"
    with pytest.raises(ValueError, match="not a subclass of Decoder"):
        DECODERS.register("x")(object)
    assert sorted(DECODERS.names()) == sorted(["plain", "fp8-block", "float-quantized", "pack-quantized", "mxfp4",
                                               "gptq", "gptq-v2", "awq", "fp8-scaled", "fbgemm-fp8", "mxfp8",
                                               "nvfp4", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "modelopt",
                                               "deepseek-v4", "test-int3"])


def test_unknown_quant_method_lists_the_known_ones():
    from ktconvert.errors import InputError

    with pytest.raises(InputError, match="expected awq or fbgemm_fp8 or fp8 or gptq or modelopt or mxfp4 or mxfp8 or "
                                         "compressed-tensors, found 'hqq'"):
        detect_scheme({"quantization_config": {"quant_method": "hqq"}})
    assert decoders.config_summary({"text_config": {"quantization_config": {"quant_method": "hqq", "bits": 4}}}) \
        == {"quant_method": "hqq", "bits": 4}


def test_source_registry_refuses_non_subclasses_and_duplicates(monkeypatch):
    import ktconvert.formats.sources  # noqa: F401  (every source registered)

    monkeypatch.setattr(SOURCES, "_items", dict(SOURCES._items))
    with pytest.raises(ValueError, match="not a subclass of Source"):
        SOURCES.register("x")(dict)
    with pytest.raises(ValueError, match="registered twice"):
        class Another(Source):
            name = "gguf"
    assert SOURCES.names() == ["gguf", "hf-safetensors"]


def test_inspect_describes_any_registered_source(tmp_path, monkeypatch, tiny_model):
    """A new container format is one Source subclass: inspect asks it, and the method registry judges it."""
    from ktconvert.run.inspection import inspect

    monkeypatch.setattr(SOURCES, "_items", dict(SOURCES._items))
    monkeypatch.setattr(SOURCES, "_aliases", dict(SOURCES._aliases))
    inner = HFSource.open(tiny_model("qwen3_moe"))

    class Wrapped(Source):
        name = "test-wrapped"
        input_format = "bf16"
        info = inner.info

        @classmethod
        def sniff(cls, path):
            return (path / "WRAPPED").is_file()

        @classmethod
        def open(cls, path):
            return cls()

        def describe(self):
            return {"family": self.info.family, "supported": True}

    (tmp_path / "WRAPPED").write_text("")
    result = inspect(tmp_path)
    assert result["family"] == inner.info.family and result["path"] == str(tmp_path)
    assert result["kt_methods"]["AMXINT4"].startswith("convert: ") and result["kt_methods"]["BF16"].startswith("convert")
