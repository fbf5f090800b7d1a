"""The LLAMAFILE method (ktconvert.methods.llamafile) and its GGUF writer (ktconvert.formats.gguf_sink).

Golden values: llama.cpp's ggml_quantize_chunk hashes of the same experts (golden/gguf/ggml-expert-hashes.json,
make_ggml_expert_hashes.py) and llama-quantize's mix choices (SOURCES.json); gguf-py's ``GGUFReader`` and
``dequantize`` read the output (names, ggml types, shapes, offsets,
values against the BF16 source within each type's round-trip bound), hashlib hashes the files, ktconvert's GGUF
source opens the output as a model, and the quantized bytes are checked against ggml_quant, which
tests/test_ggml_quant.py checks against llama.cpp's own bytes. kt-kernel's rules (I % 256, T <= I/256) come from
launchcheck.rules (the measured kt-kernel 0.7.2 behaviour). End to end through the command line (a subprocess):
plan, cpu, inspect, verify --hashes --source, --resume, parts + merge (compared byte for byte with one run).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ktconvert.errors import NumericError, OutputError, ShapeError, UsageError  # noqa: E402
from ktconvert.formats.gguf_sink import GgufSink, file_name  # noqa: E402
from ktconvert.formats.sources import open_source  # noqa: E402
from ktconvert.methods.llamafile import Llamafile  # noqa: E402
from ktconvert.quant.bf16 import bf16_bits_to_f32  # noqa: E402

SHAPE = dict(hidden=256, intermediate=512, experts=4, layers=2)
# round-trip rel L2 per expert matrix of the tiny model's heavy-tailed weights, worst measured x ~1.3: Q4_K 0.091,
# Q6_K 0.026, Q8_0 0.0088; BF16 is the source itself
REL_L2 = {"Q4_K": 0.12, "Q6_K": 0.034, "Q8_0": 0.0115, "BF16": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lf") / "qwen3", "qwen3_moe", **SHAPE)


def _convert(model, out, ggml_type: str, numa: int = 1, order=reversed):
    """Every routed expert of `model` through the method into `out` (experts in `order`); the layer results."""
    source = open_source(model)
    method = Llamafile.configured(ggml_type=ggml_type)
    sink = method.open_sink(out, list(source.info.moe_layers), source.info, numa, "gguf", False)
    results = {}
    for layer in source.info.moe_layers:
        writer = sink.begin_layer(layer)
        for e in order(range(source.info.n_experts)):
            weights = source.read_expert(layer, e)
            for proj in ("gate", "up", "down"):
                method.write_matrix(writer, proj, e, getattr(weights, proj), numa=numa, quant="rtn",
                                    where=f"layer {layer} expert {e} {proj}")
        results[layer] = writer.finish()
    return source, method, sink, results


GGML_HASHES = json.loads((Path(__file__).parent / "golden" / "gguf" / "ggml-expert-hashes.json").read_text())


@pytest.mark.parametrize("ggml_type", sorted(GGML_HASHES["sha256"]))
def test_expert_tensors_equal_llama_cpp_quantizer(model, tmp_path, ggml_type):
    """Every expert tensor, as the sink wrote it (its sha256 re-read from the file), equals what llama.cpp's
    ggml_quantize_chunk wrote for the same BF16 experts (make_ggml_expert_hashes.py)."""
    assert GGML_HASHES["model"].endswith(json.dumps(SHAPE) + ")")
    _, _, _, results = _convert(model, tmp_path / "out", ggml_type)
    got = {name: digest for r in results.values() for name, digest in r.tensors.items()}
    assert got == GGML_HASHES["sha256"][ggml_type]


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q8_0", "BF16"])
def test_tiny_model_output_reads_back_with_gguf_py(model, tmp_path, ggml_type):
    source, method, sink, results = _convert(model, tmp_path / "out", ggml_type)
    layers = list(source.info.moe_layers)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == [file_name(i + 1, len(layers)) for i in range(len(layers))]
    planned = sink.planned_files()
    for i, layer in enumerate(layers):
        path = tmp_path / "out" / files[i]
        data = path.read_bytes()
        record = results[layer].files[0]
        assert (record.path, record.bytes, record.sha256) == (files[i], len(data), hashlib.sha256(data).hexdigest())
        assert planned[files[i]].nbytes == len(data)
        reader = gguf.GGUFReader(path)
        assert reader.fields["general.architecture"].contents() == "qwen3moe"
        assert reader.fields["qwen3moe.expert_count"].contents() == SHAPE["experts"]
        assert reader.fields["qwen3moe.expert_feed_forward_length"].contents() == SHAPE["intermediate"]
        assert reader.fields["split.no"].contents() == i
        tensors = {t.name: t for t in reader.tensors}
        assert sorted(tensors) == sorted(f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
        for proj in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            n, k = (512, 256) if proj != "down" else (256, 512)
            assert t.tensor_type.name == ggml_type and list(t.shape) == [k, n, SHAPE["experts"]]
            raw = np.asarray(t.data).view(np.uint8).reshape(SHAPE["experts"], n, -1)
            assert results[layer].tensors[t.name] == hashlib.sha256(raw.tobytes()).hexdigest()
            for e in range(SHAPE["experts"]):
                w_bf16 = getattr(source.read_expert(layer, e), proj)
                assert np.array_equal(raw[e], method.encode(w_bf16)["weight"].reshape(n, -1))
                w = bf16_bits_to_f32(w_bf16)
                back = gguf.quants.dequantize(raw[e], gguf.GGMLQuantizationType[ggml_type]).reshape(n, k)
                rel = np.linalg.norm(back - w) / np.linalg.norm(w)
                assert rel <= REL_L2[ggml_type], (proj, e, rel)


def test_output_opens_as_a_gguf_model_in_ktconvert(model, tmp_path):
    source, method, _, _ = _convert(model, tmp_path / "out", "Q6_K", order=lambda r: r)
    back = open_source(tmp_path / "out")
    assert back.input_format == "gguf"
    assert (back.info.moe_layers, back.info.n_experts, back.info.hidden, back.info.intermediate) == \
        (source.info.moe_layers, 4, 256, 512)
    assert back.ggml_types() and set(back.ggml_types()) == {"Q6_K"}
    layer = source.info.moe_layers[-1]
    got = bf16_bits_to_f32(back.read_expert(layer, 2).down)
    want = bf16_bits_to_f32(source.read_expert(layer, 2).down)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < REL_L2["Q6_K"]
    assert Llamafile.reads_as_is(back) == "kt-kernel reads the GGUF"


def test_bf16_output_is_the_source_bits(model):
    source = open_source(model)
    w = source.read_expert(source.info.moe_layers[0], 1).gate
    assert Llamafile.configured(ggml_type="bf16").encode(w)["weight"].tobytes() == w.tobytes()


def test_sizes_and_specs(model):
    q4k = Llamafile.configured(ggml_type="Q4_K")
    assert q4k.tensor_specs(512, 256) == {"weight": ("Q4_K", (512, 256))}
    assert q4k.matrix_bytes(512, 256) == {"weight": 512 * 144}
    assert q4k.expert_bytes(256, 512, 2) == 3 * 512 * 144     # whole matrices, NUMA parts sliced in memory
    assert Llamafile.configured(ggml_type="Q8_0").matrix_bytes(256, 512) == {"weight": 256 * 16 * 34}
    assert q4k.manifest_fields() == {"ggml_type": "Q4_K"}
    assert Llamafile.from_manifest({"method": "LLAMAFILE", "extra": {"ggml_type": "Q6_K"}}).ggml_type == "Q6_K"
    assert Llamafile.configured().ggml_type == "Q4_K"
    with pytest.raises(UsageError, match="Q2_K is not written"):
        Llamafile.configured(ggml_type="Q2_K")


def test_kt_kernel_rules_are_checked_before_writing(model, tmp_path):
    from ktconvert.launchcheck.rules import QK_K

    assert QK_K == 256
    assert Llamafile.valid_numa(256, 1024) == [1, 2, 3, 4]          # T <= I/256; T need not divide I
    assert all(c["ok"] for c in Llamafile.check_numa(256, 1024, 3))
    with pytest.raises(ShapeError, match="cannot work") as e:
        Llamafile.check_numa(256, 512, 3)
    assert "use --numa 1 or 2" in str(e.value)
    with pytest.raises(ShapeError, match="cannot store this model's experts") as e:
        Llamafile.check_numa(256, 384, 1)
    assert "I % 256 == 0" in str(e.value)
    with pytest.raises(ShapeError, match="cannot store"):                     # rows of whole K-quant blocks
        Llamafile.configured(ggml_type="Q4_K").check_numa(288, 512, 1)
    assert Llamafile.configured(ggml_type="Q8_0").valid_numa(288, 512) == [1, 2]
    source = open_source(model)
    with pytest.raises(ShapeError):
        Llamafile.open_sink(tmp_path / "o", [0], source.info, 3, "gguf", False)
    assert not (tmp_path / "o").exists()
    assert Llamafile.open_sink(tmp_path / "o", [0], source.info, 1, "gguf", True).include_dense   # qwen3moe
    assert not (tmp_path / "o").exists()


def test_runtime_notes_say_what_kt_kernel_cannot_run():
    assert Llamafile.configured(ggml_type="Q4_K").runtime_notes(["avx2"]) == []
    assert any("avx2 build does not run BF16" in n for n in Llamafile.configured(ggml_type="BF16")
               .runtime_notes(["avx2"]))
    assert Llamafile.configured(ggml_type="BF16").runtime_notes(["avx2", "avx512f"]) == []
    assert any("Q5_K was not measured" in n for n in Llamafile.configured(ggml_type="Q5_K").runtime_notes([]))
    assert Llamafile.flags(2) == {"kt-method": "LLAMAFILE", "kt-weight-path": ".", "kt-threadpool-count": 2}


def test_writer_refuses_bad_matrices_and_incomplete_layers(model, tmp_path):
    source = open_source(model)
    method = Llamafile.configured(ggml_type="Q8_0")
    sink = GgufSink(tmp_path / "out", method, list(source.info.moe_layers), source.info)
    writer = sink.begin_layer(source.info.moe_layers[0])
    w = source.read_expert(source.info.moe_layers[0], 0)
    with pytest.raises(ShapeError, match="wrong shape"):
        writer.put_matrix("gate", 0, w.down)
    bad = w.gate.copy()
    bad[3, 5] = 0x7FC0                                                        # BF16 NaN
    with pytest.raises(NumericError, match="NaN") as e:
        writer.put_matrix("gate", 0, bad)
    assert "ffn_gate_exps.weight[0]" in str(e.value)
    writer.put_matrix("gate", 0, w.gate)
    with pytest.raises(OutputError, match="written twice"):
        writer.put_matrix("gate", 0, w.gate)
    with pytest.raises(OutputError, match="incomplete"):
        writer.finish()
    assert list((tmp_path / "out").iterdir()) == []                          # the temporary file is gone


def test_mix_types_are_llama_quantize_choices():
    """llama-quantize's own choices in the committed fixtures (SOURCES.json, 2-block model): Q4_K_M / Q5_K_M keep
    gate / up at the default type and give the last block's down Q6_K (use_more_bits: i >= 7n/8)."""
    sources = json.loads((Path(__file__).parent / "golden" / "gguf" / "SOURCES.json").read_text())
    checked = 0
    for record in sources.values():
        mix = record["ftype"].removeprefix("LLAMA_FTYPE_MOSTLY_")
        if mix not in ("Q4_K_M", "Q5_K_M", "Q6_K"):
            continue
        method = Llamafile.configured(ggml_type=mix)
        for name, kind in record["expert_tensor_types"].items():
            layer, proj = int(name.split(".")[1]), name.split(".")[2].split("_")[1]
            assert method.expert_type(proj, layer, 2) == kind, (mix, name)
            checked += 1
    assert checked == 18


def test_mix_output_has_each_tensors_type(model, tmp_path):
    source, method, sink, results = _convert(model, tmp_path / "out", "Q4_K_M")
    assert method.base_type() == "Q4_K" and method.ggml_type == "Q4_K_M"
    got = {}
    for path in sorted((tmp_path / "out").iterdir()):
        assert sink.planned_files()[path.name].nbytes == path.stat().st_size
        got.update({t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors})
    assert got == {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q4_K",
                   "blk.0.ffn_down_exps.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "Q4_K",
                   "blk.1.ffn_up_exps.weight": "Q4_K", "blk.1.ffn_down_exps.weight": "Q6_K"}
    assert method.runtime_notes(["avx2"]) == []        # Q4_K and Q6_K: both measured with kt-kernel's LLAMAFILE


def test_manifest_with_a_bad_type_is_refused():
    with pytest.raises(UsageError, match="is not written"):
        Llamafile.from_manifest({"method": "LLAMAFILE", "extra": {"ggml_type": 3}})
    assert Llamafile.from_manifest({"method": "LLAMAFILE", "extra": {"ggml_type": "q5_k_m"}}).expert_type(
        "down", 7, 8) == "Q6_K"


def test_expert_reader_decodes_the_files_and_checks_hashes(model, tmp_path):
    source, method, _, results = _convert(model, tmp_path / "out", "Q5_K_M")
    recorded = {name: digest for r in results.values() for name, digest in r.tensors.items()}
    read = method.expert_reader(tmp_path / "out", {"tensors": recorded})
    layer = source.info.moe_layers[-1]
    got = read(layer, 3)
    reader = gguf.GGUFReader(tmp_path / "out" / file_name(2, 2))
    down = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_down_exps.weight")
    assert down.tensor_type.name == "Q6_K"
    want = gguf.quants.dequantize(np.asarray(down.data)[3], down.tensor_type)          # gguf-py, independently
    assert got["down"].shape == (256, 512) and np.array_equal(got["down"], want.reshape(256, 512))
    w = bf16_bits_to_f32(source.read_expert(layer, 3).gate)
    assert got["gate"].shape == (512, 256) and np.linalg.norm(got["gate"] - w) / np.linalg.norm(w) < 0.06   # Q5_K
    recorded[f"blk.{layer}.ffn_up_exps.weight"] = "0" * 64
    from ktconvert.errors import VerifyError

    with pytest.raises(VerifyError, match="sha256 differs"):
        method.expert_reader(tmp_path / "out", {"tensors": recorded})(layer, 0)


# ---------------------------------------------------------------- the command line, end to end

def _cli(*args, code: int = 0) -> str:
    """`ktconvert ARGS` in a fresh interpreter (the exit code checked): its stdout, or where it printed nothing
    there, its stderr (the one error line)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], capture_output=True,
                          text=True)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc.stdout or proc.stderr


def _snapshot(folder: Path) -> dict:
    """{name: (bytes, mtime_ns, sha256)} of every file in `folder`."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir())}


def test_cli_llamafile_end_to_end(model, tmp_path):
    """`ktconvert cpu --method llamafile --ggml-type Q4_K`: the plan's files are the files written; gguf-py and
    ktconvert's GGUF source read the output; every expert tensor is llama.cpp's own Q4_K bytes (golden hashes);
    verify --hashes --source passes; --resume on the complete output writes nothing; parts + merge are the same
    bytes."""
    out = tmp_path / "out"
    planned = json.loads(_cli("plan", model, "--method", "llamafile", "--ggml-type", "q4_k", "--json"))["cpu"]
    assert (planned["kt_method"], planned["layout"]) == ("LLAMAFILE", "gguf")
    assert planned["flags"] == {"kt-method": "LLAMAFILE", "kt-weight-path": ".", "kt-threadpool-count": 1}
    text = _cli("plan", model, "--method", "llamafile", "--ggml-type", "Q4_K")
    assert "run with: --kt-method LLAMAFILE --kt-weight-path OUT --kt-threadpool-count 1" in text
    result = json.loads(_cli("cpu", model, out, "--method", "llamafile", "--ggml-type", "Q4_K", "--quiet", "--json"))
    assert result["method"] == "LLAMAFILE" and "--kt-method LLAMAFILE" in result["sglang_args"]
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert {f["path"]: f["bytes"] for f in planned["files"] if not f.get("approx")} == \
        {name: size for name, size in files.items() if name != "ktconvert.json"} and len(files) == 3

    manifest = json.loads((out / "ktconvert.json").read_text())
    assert (manifest["method"], manifest["layout"], manifest["ggml_type"]) == ("LLAMAFILE", "gguf", "Q4_K")
    assert manifest["tensors"] == GGML_HASHES["sha256"]["Q4_K"]              # llama.cpp's ggml_quantize_chunk
    for name in sorted(f for f in files if f.endswith(".gguf")):
        reader = gguf.GGUFReader(out / name)
        for t in reader.tensors:
            assert t.tensor_type.name == "Q4_K"
            raw = np.asarray(t.data).view(np.uint8)
            assert hashlib.sha256(raw.tobytes()).hexdigest() == GGML_HASHES["sha256"]["Q4_K"][t.name]
    back, source = open_source(out), open_source(model)
    assert back.input_format == "gguf" and set(back.ggml_types()) == {"Q4_K"}
    assert (back.info.moe_layers, back.info.n_experts, back.info.hidden, back.info.intermediate) == \
        (source.info.moe_layers, 4, 256, 512)
    w, got = bf16_bits_to_f32(source.read_expert(1, 3).up), bf16_bits_to_f32(back.read_expert(1, 3).up)
    assert np.linalg.norm(got - w) / np.linalg.norm(w) < REL_L2["Q4_K"]
    assert json.loads(_cli("inspect", out, "--json"))["kt_methods"]["LLAMAFILE"] == "as is (kt-kernel reads the GGUF)"

    report = json.loads(_cli("verify", out, "--source", model, "--hashes", "--json"))
    assert report["ok"], report["problems"]
    checks = {c["name"]: c for c in report["checks"]}
    assert all(checks[name]["status"] == "ok" for name in ("structure", "hashes", "numerics")), checks
    assert report["hashes"]["tensors_checked"] == 6
    assert 0 < max(r["moe_rel_l2"] for r in report["numerics"]["layers"]) < Llamafile.thresholds["moe_rel_l2"]

    before = _snapshot(out)
    assert "already complete" in _cli("cpu", model, out, "--method", "llamafile", "--ggml-type", "Q4_K", "--resume")
    assert _snapshot(out) == before

    for layer in (0, 1):
        _cli("cpu", model, tmp_path / f"p{layer}", "--method", "llamafile", "--layers", layer, "--quiet")
    _cli("merge", tmp_path / "merged", tmp_path / "p0", tmp_path / "p1")
    merged = tmp_path / "merged"
    assert {p.name: p.read_bytes() for p in merged.iterdir()} == {p.name: p.read_bytes() for p in out.iterdir()}


def test_cli_llamafile_refusals_come_before_out_exists(model, tmp_path):
    """Usage errors (exit 2) and kt-kernel's rules (ShapeError, exit 3, listing what works): OUT never made."""
    out = tmp_path / "out"
    err = _cli("cpu", model, out, "--method", "amxint4", "--ggml-type", "Q4_K", code=2)
    assert "--ggml-type does not apply to --method amxint4" in err and "llamafile" in err
    err = _cli("plan", model, "--method", "llamafile", "--numa", "3", code=3)
    assert "T <= I/256" in err and "use --numa 1 or 2" in err
    err = _cli("cpu", model, out, "--method", "llamafile", "--layout", "kt", code=2)
    assert "--layout kt does not exist for LLAMAFILE" in err
    assert not out.exists()


def test_inspect_and_plan_refuse_what_kt_kernel_cannot_run(tmp_path):
    from ktconvert.examples.tiny import make_tiny_model

    odd = make_tiny_model(tmp_path / "odd", "qwen3_moe", hidden=256, intermediate=384, experts=2, layers=1)
    err = _cli("plan", odd, "--method", "llamafile", code=3)
    assert "cannot store this model's experts" in err and "I % 256 == 0" in err
    assert json.loads(_cli("inspect", odd, "--json"))["kt_methods"]["LLAMAFILE"] == \
        "no: needs I % 256 == 0 (kt-kernel's LLAMAFILE), found I = 384"


def test_verify_finds_a_wrong_type_a_missing_file_and_changed_bytes(model, tmp_path):
    """The structure check compares the folder with the sink's plan (read by gguf-py); the hash check re-hashes
    each GGUF tensor; the numerics decode with gguf-py."""
    from ktconvert.verification.folder import OutputFolder

    out = tmp_path / "out"
    _cli("cpu", model, out, "--method", "llamafile", "--ggml-type", "Q6_K", "--quiet")
    manifest = json.loads((out / "ktconvert.json").read_text())
    method = Llamafile.from_manifest(manifest)
    assert method.ggml_type == "Q6_K" and method.thresholds["moe_rel_l2"] == 0.08
    assert method.check_structure(OutputFolder.scan(out), manifest)[0] == []
    numerics = method.check_numerics(out, manifest, str(model), 8, "all", "all", None)
    assert numerics["ok"] and len(numerics["layers"]) == 2 and numerics["layers"][0]["experts"] == [0, 1, 2, 3]
    assert all(0 < r["moe_rel_l2"] < 0.08 and r["weight_rel_l2"] < REL_L2["Q6_K"] for r in numerics["layers"])

    _convert(model, tmp_path / "q8", "Q8_0")
    second = file_name(2, 2)
    (out / second).write_bytes((tmp_path / "q8" / second).read_bytes())
    problems, _ = method.check_structure(OutputFolder.scan(out), manifest)
    assert any("blk.1.ffn_gate_exps.weight: ggml type Q8_0, expected Q6_K" in p for p in problems), problems
    (out / second).unlink()
    problems, _ = method.check_structure(OutputFolder.scan(out), manifest)
    assert problems == [f"{second}: missing"]

    first = out / file_name(1, 2)
    data = bytearray(first.read_bytes())
    data[-100] ^= 0xFF                                                  # inside blk.0.ffn_down_exps
    first.write_bytes(bytes(data))
    report = json.loads(_cli("verify", out, "--hashes", "--json", code=4))
    assert any("blk.0.ffn_down_exps.weight: tensor bytes differ" in p for p in report["problems"]), report["problems"]


def test_options_resolve_the_method_defaults():
    """A layout or --ggml-type left out is the method's default, so a journal records the same options either way;
    the other methods' options (and journals) are as before."""
    from ktconvert.cpu.options import CpuOptions

    default = CpuOptions.make(method="llamafile")
    assert (default.layout, default.ggml_type) == ("gguf", "Q4_K")
    assert default.journalled() == CpuOptions.make(method="LLAMAFILE", ggml_type="q4_k", layout="GGUF").journalled()
    assert CpuOptions.make(method="llamafile", ggml_type="Q5_K_M").method_class().expert_type("down", 0, 8) == "Q6_K"
    amx = CpuOptions.make(method="amxint4")
    assert amx.layout == "safetensors" and "ggml_type" not in amx.journalled()
    assert "split_max_size" not in amx.journalled() and "split_max_size" not in default.journalled()
    split = CpuOptions.make(method="llamafile", split_max_size="2G")
    assert split.journalled()["split_max_size"] == "2G" and split.method_class().split_bytes == 2 * 10 ** 9
    assert CpuOptions.make(method="bf16").layout == "safetensors"
    with pytest.raises(UsageError, match="--layout gguf does not exist for AMXINT4"):
        CpuOptions.make(method="amxint4", layout="gguf")
