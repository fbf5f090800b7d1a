"""Issue 15: the routed experts' storage layout comes from the checkpoint, and never changes a byte of an output.

Every family's tiny checkpoint is rewritten (ktconvert.examples.tiny_relayout: the same stored tensors, moved and
stacked with our safetensors writer) into the other layouts: per-expert 2-D, fused gate_up + down in both
orientations, separate fused gate / up / down in both orientations, under either MoE prefix where a family has
two. The reference is the checkpoint as generated. Checked: the matrices the conversion streams and read_expert
give; every file of every CPU method's output and of the GPU checkpoint (sha256 from each ktconvert.json, plus
every tensor's sha256). The whole matrix (9 families x 5 methods + GPU) is the slow group; the default suite
converts a sample and checks the decoded matrices of every family and layout.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ktconvert.errors import InputError, ShapeError
from ktconvert.formats.hf_source import HFSource

CPU_METHODS = ("amxint4", "amxint8", "bf16", "rawint4", "fp8")
# one model type per family; (tiny keywords, include_mtp)
FAMILIES = {
    "deepseek_v3": ({}, True), "qwen2_moe": ({}, False), "qwen3_moe": ({}, False),
    "qwen3_next": ({"mtp": 1}, True), "qwen3_5_moe": ({"mtp": 1}, True), "glm4_moe": ({}, True),
    "minimax_m2": ({}, False), "mixtral": ({}, False), "gpt_oss": ({}, False),
}
# (layout, orientation, MoE prefix index, --expert-orientation needed: the tiny H == I makes separate fused
# tensors square). Fused families get per_expert as their "other" layout.
VARIANTS = [("fused", "out", 0, None), ("fused", "in", 0, None), ("fused_separate", "out", 0, "out"),
            ("fused_separate", "in", -1, "in"), ("per_expert", "out", 0, None)]


def _variant_id(v) -> str:
    return f"{v[0]}-{v[1]}" + ("-2nd-prefix" if v[2] else "")


def _reference_variant(model_type: str) -> tuple[str, str]:
    """(layout, orientation) the family's tiny checkpoint is generated in (its manifest's usual layout)."""
    from ktconvert.architectures.manifests import manifest_for

    manifest = manifest_for(model_type)
    if manifest.experts.form == "per_expert":
        return "per_expert", "out"
    return "fused", "in" if manifest.tiny[model_type].get("fused_transposed") else "out"


OTHER_LAYOUTS = [(model_type, v) for model_type in sorted(FAMILIES) for v in VARIANTS
                 if v[:2] != _reference_variant(model_type)]


@pytest.fixture(scope="session")
def layouts(tiny_model, tmp_path_factory):
    """layouts(model_type, variant, dtype="bf16") -> checkpoint path (cached; variant None: as generated)."""
    from ktconvert.examples.tiny_relayout import relayout

    cache = {}

    def get(model_type, variant=None, dtype="bf16", **extra):
        kw = {**FAMILIES.get(model_type, ({}, False))[0], **extra}
        src = tiny_model(model_type, **kw) if dtype == "bf16" else tiny_model(model_type, dtype=dtype, **kw)
        if variant is None:
            return src
        layout, orientation, prefix, _ = variant[:4]
        fp8_names = variant[4] if len(variant) > 4 else "tensor"
        key = (model_type, dtype, tuple(sorted(extra.items())), variant)
        if key not in cache:
            dst = tmp_path_factory.mktemp("relayout") / f"{model_type}-{dtype}-{_variant_id(variant)}-{fp8_names}"
            cache[key] = relayout(src, dst, layout, orientation, prefix, fp8_names)
        return cache[key]

    return get


def _stream(source, include_mtp: bool) -> dict:
    """{(layer, expert, proj): sha256 of the BF16 bits} of every matrix the conversion loop would decode."""
    out = {}
    for job in source.matrix_jobs(source.all_layers(include_mtp)):
        raw = np.fromfile(job.file, dtype=np.uint8, count=job.nbytes, offset=job.offset)
        for proj, bits in source.decode(job, raw).items():
            assert bits.dtype == np.uint16 and bits.flags.c_contiguous
            out[(job.layer, job.expert, proj)] = hashlib.sha256(bits.tobytes()).hexdigest()
    return out


def _same_experts(a: HFSource, b: HFSource, layers, experts=(0, 7)) -> None:
    for layer in layers:
        for e in experts:
            x, y = a.read_expert(layer, e), b.read_expert(layer, e)
            for p in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
                u, v = getattr(x, p), getattr(y, p)
                assert (u is None and v is None) or np.array_equal(u, v), (layer, e, p)


@pytest.mark.parametrize("model_type,variant", OTHER_LAYOUTS,
                         ids=[f"{m}-{_variant_id(v)}" for m, v in OTHER_LAYOUTS])
def test_every_layout_decodes_the_same_matrices(layouts, model_type, variant):
    ref = HFSource.open(layouts(model_type))
    assert ref.required_layout(ref.all_layers()[0]).kind == _reference_variant(model_type)[0]
    mtp = FAMILIES[model_type][1]
    src = HFSource.open(layouts(model_type, variant), variant[3])
    src.validate(include_mtp=mtp)
    assert src.required_layout(src.all_layers()[0]).kind == variant[0]
    assert all(o.value == variant[1] for o in src.orientation.values())
    assert _stream(src, mtp) == _stream(ref, mtp)
    _same_experts(ref, src, src.all_layers(mtp))


# ---------------------------------------------------------------- converted files

def _digest(out) -> dict:
    """Every output file's sha256 (ktconvert.json aside) and every tensor's, from the output's manifest."""
    manifest = json.loads((out / "ktconvert.json").read_text())
    files = {path: entry["sha256"] for path, entry in manifest["files"].items()}
    for path in files:
        assert hashlib.sha256((out / path).read_bytes()).hexdigest() == files[path], path
    return {"files": files, "tensors": manifest["tensors"]}


def _cpu(model, out, method, model_type, orientation=None) -> dict:
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.run.inputs import open_input

    convert_cpu(open_input(model, orientation), out, method=method, numa=2, include_mtp=FAMILIES[model_type][1],
                allow_drop_bias=True, threads=2)
    return _digest(out)


def _check_cpu_identity(layouts, tmp_path, model_type, method, variants, dtype="bf16") -> None:
    want = _cpu(layouts(model_type, dtype=dtype), tmp_path / "ref", method, model_type)
    assert want["tensors"]
    for i, v in enumerate(variants):
        got = _cpu(layouts(model_type, v, dtype=dtype), tmp_path / f"v{i}", method, model_type, v[3])
        assert got == want, (model_type, method, _variant_id(v))


SAMPLE = [("qwen3_moe", m) for m in CPU_METHODS] + [("deepseek_v3", "amxint4"), ("gpt_oss", "bf16"),
                                                     ("qwen3_5_moe", "amxint8"), ("mixtral", "rawint4")]


@pytest.mark.parametrize("model_type,method", SAMPLE)
def test_cpu_output_identical_across_layouts(layouts, tmp_path, model_type, method):
    _check_cpu_identity(layouts, tmp_path, model_type, method, VARIANTS[:2] + VARIANTS[3:])


@pytest.mark.slow
@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_cpu_output_identical_across_layouts_every_family(layouts, tmp_path, model_type, method):
    _check_cpu_identity(layouts, tmp_path, model_type, method, [v for m, v in OTHER_LAYOUTS if m == model_type])


def _gpu(model, out, model_type, orientation=None) -> dict:
    from ktconvert.gpu.convert import convert_gpu
    from ktconvert.run.inputs import open_input

    convert_gpu(open_input(model, orientation), out, experts="w4a16", linears="keep",
                include_mtp=FAMILIES[model_type][1], threads=2)
    return _digest(out)


def _check_gpu_identity(layouts, tmp_path, model_type, variants) -> None:
    pytest.importorskip("compressed_tensors")
    want = _gpu(layouts(model_type), tmp_path / "ref", model_type)
    assert any(".weight_packed" in name for name in want["tensors"])
    for i, v in enumerate(variants):
        assert _gpu(layouts(model_type, v), tmp_path / f"v{i}", model_type, v[3]) == want, _variant_id(v)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_gpu_checkpoint_identical_across_layouts(layouts, tmp_path, model_type):
    _check_gpu_identity(layouts, tmp_path, model_type, [VARIANTS[1], VARIANTS[3]] if model_type == "qwen3_moe"
                        else [VARIANTS[4]])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_gpu_checkpoint_identical_across_layouts_every_family(layouts, tmp_path, model_type):
    _check_gpu_identity(layouts, tmp_path, model_type, [v for m, v in OTHER_LAYOUTS if m == model_type])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_gptq_output_identical_across_layouts(layouts, tmp_path, kind):
    """--quant gptq reads the experts through the same source: fused input-major Qwen3-MoE gives the bytes of
    the per-expert checkpoint (CPU AMXINT4 and the GPU checkpoint)."""
    pytest.importorskip("llmcompressor")
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.gpu.convert import convert_gpu
    from ktconvert.run.inputs import open_input

    calibration = tmp_path / "calib.jsonl"
    calibration.write_text("".join(json.dumps({"input_ids": list(range(5 + i, 37 + 2 * i))}) + "\n" for i in range(3)))
    digests = []
    for i, variant in enumerate([None, VARIANTS[1]]):
        source, out = open_input(layouts("qwen3_moe", variant)), tmp_path / f"v{i}"
        if kind == "cpu":
            convert_cpu(source, out, method="amxint4", numa=2, quant="gptq", calibration=calibration)
        else:
            convert_gpu(source, out, experts="w4a16", linears="keep", quant="gptq", calibration=calibration)
        digest = _digest(out)
        digest["files"].pop("expert_activation.pt")    # its metadata names the source files, which differ
        digests.append(digest)
    assert digests[0]["tensors"] and digests[1] == digests[0]


# ---------------------------------------------------------------- deciding the orientation

def test_square_separate_tensors_need_the_flag(layouts):
    """H == I: [E, 256, 256] fits both orientations and no other tensor tells: refused, naming the flag; the
    flag settles it; a flag that contradicts a shape is refused."""
    path = layouts("qwen3_moe", VARIANTS[2])
    with pytest.raises(InputError) as err:
        HFSource.open(path).validate()
    msg = str(err.value)
    assert err.value.exit_code == 3
    assert "model.layers.0.mlp.experts.gate_proj" in msg and "--expert-orientation out" in msg and "H == I" not in msg
    assert "I == H = 256" in msg and "model-" in msg
    HFSource.open(path, "out").validate()
    fused_in = layouts("qwen3_moe", VARIANTS[1])       # gate_up [E, H, 2I] decides: in
    with pytest.raises(InputError, match="contradicts the stored shape of gate_up"):
        HFSource.open(fused_in, "out").validate()


def test_h_not_i_decides_from_the_shapes(layouts):
    """H = 256, I = 128: separate tensors decide by shape; fused gate_up is square (H == 2I) and follows down."""
    ref = HFSource.open(layouts("qwen3_moe", intermediate=128))
    for variant in (("fused_separate", "in", 0, None), ("fused_separate", "out", 0, None), ("fused", "in", 0, None)):
        src = HFSource.open(layouts("qwen3_moe", variant, intermediate=128))
        src.validate()
        assert {o.value for o in src.orientation.values()} == {variant[1]}
        assert "(H=256, I=128)" in src.orientation["down"].why
        _same_experts(ref, src, src.all_layers())
    assert "(2I == H = 256); follows down" in src.orientation["gate_up"].why


def test_cli_flag_reaches_the_conversion_and_verify(layouts, tmp_path):
    """--expert-orientation on `cpu`; the recorded orientation lets `verify --source` reopen the source."""
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    path = layouts("qwen3_moe", VARIANTS[3])
    refused = CliRunner().invoke(cli, ["cpu", str(path), str(tmp_path / "a"), "--method", "amxint8", "--quiet"])
    assert refused.exit_code == 3 and "--expert-orientation" in refused.output
    ok = CliRunner().invoke(cli, ["cpu", str(path), str(tmp_path / "b"), "--method", "amxint8", "--quiet",
                                  "--expert-orientation", "in"])
    assert ok.exit_code == 0, ok.output
    manifest = json.loads((tmp_path / "b" / "ktconvert.json").read_text())
    assert manifest["source"]["expert_orientation"] == "in"
    verified = CliRunner().invoke(cli, ["verify", str(tmp_path / "b"), "--source", str(path), "--json"])
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.output)
    assert report["ok"] and report["checks"]
    planned = CliRunner().invoke(cli, ["plan", str(path), "--method", "amxint4", "--gpu-experts-ratio", "0.25",
                                       "--expert-orientation", "in", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.output)["placement"]["gpu_experts_total"] > 0


def test_two_layouts_in_one_layer_are_refused(layouts, tmp_path):
    import shutil

    from ktconvert.examples.tiny import _save_shard

    path = tmp_path / "both"
    shutil.copytree(layouts("qwen3_moe"), path)
    fused = layouts("qwen3_moe", VARIANTS[0])
    name = "model.layers.1.mlp.experts.gate_up_proj"
    extra = HFSource.open(fused).checkpoint
    _save_shard(path / "extra.safetensors", {name: (extra.read(name), "BF16")})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError) as err:
        HFSource.open(path).validate()
    assert "layer 1" in str(err.value) and "more than one layout" in str(err.value) and name in str(err.value)


def test_fused_shape_against_config_is_shape_error(layouts, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(layouts("qwen3_moe", VARIANTS[0]), path)
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] = 192
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShapeError) as err:
        HFSource.open(path).validate()
    msg = str(err.value)
    assert "[E, 2I, H] or [E, H, 2I] = [8, 384, 256] or [8, 256, 384]" in msg and "[8, 512, 256]" in msg


def test_inspect_reports_layout_orientation_and_why(layouts):
    from ktconvert.run.inspection import inspect, render

    result = inspect(layouts("mixtral", VARIANTS[1]))
    el = result["expert_layout"]
    assert el["form"] == "fused" and el["family_usual"] == "per_expert"
    assert el["tensors"]["gate_up"] == "model.layers.{L}.block_sparse_moe.experts.gate_up_proj"
    gate_up, down = el["orientation"]["gate_up"], el["orientation"]["down"]
    assert gate_up["stored"] == "[E, H, 2I]" and gate_up["orientation"] == "in" and "[256, 512]" in gate_up["why"]
    assert down["stored"] == "[E, I, H]" and "follows gate_up" in down["why"]
    assert result["components"]["routed_experts"] > 0 and "other" not in result["components"]
    text = render(result)
    assert "the family usually stores per_expert" in text and "follows gate_up" in text
    square = inspect(layouts("qwen3_moe", VARIANTS[2]))["expert_layout"]
    assert "--expert-orientation" in square["problem"]
    assert inspect(layouts("qwen3_moe", VARIANTS[2]), "out")["expert_layout"]["orientation"]["gate"]["why"] \
        .endswith("--expert-orientation out")
