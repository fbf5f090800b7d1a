"""`ktconvert check` (issue 29): the launch flags kt-kernel 0.7.2 turns into garbage, a crash or a refusal, for any
weights folder.

Folders: written by ktconvert's own writers (whose bytes the project's tests prove equal to kt-kernel's converter)
with ktconvert.json deleted, as kt-kernel's converter leaves them; the formats ktconvert does not write (GPTQ_INT4,
MXFP4, NVFP4, MXFP8, FP8_PERCHANNEL) built by hand from kt-native-formats.md (tests/check_folders.py); GGUF written
with gguf-py. The expected verdicts are the runtime behaviour kt-native-formats.md / kt-format.md record for
kt-kernel 0.7.2 (garbage, segfault, refusal), written out here, not taken from the code under test. Every check
names the CPU (--cpu-flags) so the verdicts do not depend on this machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ktconvert
from ktconvert.cli.main import cli
from ktconvert.formats.safetensors_reader import parse_header

sys.path.insert(0, str(Path(__file__).parent))
from check_folders import build  # noqa: E402

AMX = "amx"
AVX2 = "avx2"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _convert(model, out, *args) -> Path:
    res = run("cpu", model, out, *args, "--quiet")
    assert res.exit_code == 0, res.output
    return out


def _as_kt_converter_left_it(out: Path, tmp_path: Path, name: str) -> Path:
    """A copy of a ktconvert output without its ktconvert.json: what kt-kernel's own converter writes."""
    copy = tmp_path / name
    shutil.copytree(out, copy)
    (copy / "ktconvert.json").unlink()
    return copy


@pytest.fixture(scope="module")
def outputs(tiny_model, tmp_path_factory):
    model = tiny_model("qwen3_moe")
    root = tmp_path_factory.mktemp("check")
    return {"model": model,
            "int4": _convert(model, root / "int4", "--method", "amxint4", "--numa", "2"),
            "int8": _convert(model, root / "int8", "--method", "amxint8", "--numa", "2"),
            "int8kt": _convert(model, root / "int8kt", "--method", "amxint8", "--numa", "1", "--layout", "kt"),
            "rawint4": _convert(model, root / "rawint4", "--method", "rawint4", "--numa", "2"),
            "bf16": _convert(model, root / "bf16", "--method", "bf16"),
            "fp8": _convert(model, root / "fp8", "--method", "fp8")}


def flags(method, numa, path=None):
    return ["--kt-method", method, "--kt-threadpool-count", str(numa)] + (["--kt-weight-path", str(path)]
                                                                          if path else [])


def errors(result) -> dict[str, dict]:
    return {f["flag"]: f for f in result.findings if f["severity"] == "error"}


# ---------------------------------------------------------------- identification


def test_identifies_kt_converter_folders_without_manifest(outputs, tmp_path):
    merged = _as_kt_converter_left_it(outputs["int4"], tmp_path, "int4")
    r = ktconvert.check(merged, cpu_flags=AMX)
    ident = r.identified
    assert (ident["layout"], ident["method"], ident["numa"], ident["experts"], ident["intermediate"],
            ident["hidden"], ident["layers"]) == ("merged safetensors", "AMXINT4", 2, 8, 256, 256, [0, 1])
    assert "4 bits per weight" in ident["how"]["method"] and "numa.0..1" in ident["how"]["numa"]
    assert "MOE_INT4" in " ".join(r.notes)                 # the ambiguity is stated, not guessed
    assert r.works == f"--kt-method AMXINT4 --kt-weight-path {merged} --kt-threadpool-count 2"
    assert r.exit_code == 0 and r.bytes_read["data"] == 0
    tree = _as_kt_converter_left_it(outputs["int8kt"], tmp_path, "int8kt")
    ident = ktconvert.check(tree, cpu_flags=AMX).identified
    assert (ident["layout"], ident["method"], ident["numa"], ident["experts"], ident["intermediate"]) == \
        (".kt tree", "AMXINT8", 1, 8, 256)
    assert "file prefix INT8_" in ident["how"]["method"]


@pytest.mark.parametrize("name, method, group", [("rawint4", "RAWINT4", 32), ("bf16", "BF16", None),
                                                  ("fp8", "FP8", None)])
def test_identifies_in_place_writers(outputs, tmp_path, name, method, group):
    folder = _as_kt_converter_left_it(outputs[name], tmp_path, name)
    ident = ktconvert.check(folder, cpu_flags=AMX).identified
    assert (ident["layout"], ident["method"], ident["numa"], ident["group_size"], ident["experts"],
            ident["intermediate"], ident["hidden"]) == ("HF safetensors", method, None, group, 8, 256, 256)
    with_manifest = ktconvert.check(outputs[name], cpu_flags=AMX).identified
    assert with_manifest["how"]["ktconvert.json"].startswith("agrees")


@pytest.mark.parametrize("fmt, method, group, cpu", [("gptq", "GPTQ_INT4", 128, AVX2), ("mxfp4", "MXFP4", 32, AMX),
                                                      ("nvfp4", "NVFP4", 16, AVX2), ("mxfp8", "MXFP8", 32, AMX),
                                                      ("fp8-perchannel", "FP8_PERCHANNEL", None, AMX)])
def test_identifies_formats_ktconvert_does_not_write(tmp_path, fmt, method, group, cpu):
    folder = build(tmp_path / fmt, fmt, experts=4, hidden=256, inter=512)
    r = ktconvert.check(folder, flags(method, 2, folder), cpu_flags=cpu)
    ident = r.identified
    assert (ident["method"], ident["group_size"], ident["experts"], ident["intermediate"], ident["hidden"]) == \
        (method, group, 4, 512, 256)
    assert r.exit_code == 0, [f["line"] for f in r.findings]


# ---------------------------------------------------------------- the runtime-check rows


def test_amx_numa_and_method_rows(outputs, tmp_path):
    folder = _as_kt_converter_left_it(outputs["int4"], tmp_path, "int4")
    assert ktconvert.check(folder, flags("AMXINT4", 2, folder), cpu_flags=AMX).exit_code == 0
    fewer = ktconvert.check(folder, flags("AMXINT4", 1, folder), cpu_flags=AMX)      # silent garbage
    e = errors(fewer)["--kt-threadpool-count"]
    assert fewer.exit_code == 4 and e["effect"] == "garbage" and e["works"] == "--kt-threadpool-count 2"
    assert errors(ktconvert.check(folder, flags("AMXINT4", 4, folder), cpu_flags=AMX))[
        "--kt-threadpool-count"]["effect"] == "crash"                                 # the reverse segfaults
    as_int8 = ktconvert.check(folder, flags("AMXINT8", 2, folder), cpu_flags=AMX)
    e = errors(as_int8)["--kt-method"]
    assert (e["effect"], e["works"]) == ("garbage", "--kt-method AMXINT4")
    back = _as_kt_converter_left_it(outputs["int8"], tmp_path, "int8")
    e = errors(ktconvert.check(back, flags("AMXINT4", 2, back), cpu_flags=AMX))["--kt-method"]
    assert (e["effect"], e["works"]) == ("garbage", "--kt-method AMXINT8")
    on_avx2 = ktconvert.check(folder, flags("AMXINT4", 2, folder), cpu_flags=AVX2)
    assert on_avx2.exit_code == 4 and errors(on_avx2)["host"]["effect"] == "refusal"


def test_fp8_variants_run_as_block_fp8_are_garbage(tmp_path):
    for fmt, method in (("fp8-perchannel", "FP8_PERCHANNEL"), ("mxfp8", "MXFP8")):
        folder = build(tmp_path / fmt, fmt)
        r = ktconvert.check(folder, flags("FP8", 2, folder), cpu_flags=AMX)
        e = errors(r)["--kt-method"]
        assert r.exit_code == 4 and (e["effect"], e["works"]) == ("garbage", f"--kt-method {method}")
        assert ktconvert.check(folder, flags(method, 2, folder), cpu_flags=AMX).exit_code == 0
    perchannel = tmp_path / "fp8-perchannel"
    r = ktconvert.check(perchannel, flags("FP8_PERCHANNEL", 2, perchannel), cpu_flags=AVX2)
    assert errors(r)["host"]["effect"] == "refusal"                        # no FP8_PERCHANNEL on the avx2 build


def test_model_intermediate_and_experts_rows(outputs, tiny_model, tmp_path):
    folder = _as_kt_converter_left_it(outputs["int4"], tmp_path, "int4")
    ok = ktconvert.check(folder, flags("AMXINT4", 2, folder), model=outputs["model"], cpu_flags=AMX)
    assert ok.exit_code == 0 and ok.model["intermediate"] == 256
    smaller = ktconvert.check(folder, flags("AMXINT4", 2, folder), model=tiny_model("qwen3_moe", intermediate=128),
                              cpu_flags=AMX)
    assert errors(smaller)["--model-path"]["effect"] == "garbage"
    larger = ktconvert.check(folder, flags("AMXINT4", 2, folder), model=tiny_model("qwen3_moe", intermediate=512),
                             cpu_flags=AMX)
    assert errors(larger)["--model-path"]["effect"] == "crash"
    more = ktconvert.check(folder, flags("AMXINT4", 2, folder), model=tiny_model("qwen3_moe", experts=16),
                           cpu_flags=AMX)
    e = errors(more)["--model-path"]
    assert e["effect"] == "crash" and "8 experts" in e["works"]
    via_command = ktconvert.check(folder, ["--model-path", str(tiny_model("qwen3_moe", intermediate=512))] +
                                  flags("AMXINT4", 2, folder), cpu_flags=AMX)
    assert via_command.exit_code == 4 and "--model-path" in errors(via_command)


def test_mxfp4_group_64_on_avx512_and_nvfp4(tmp_path):
    g64 = build(tmp_path / "g64", "mxfp4", group=64)
    r = ktconvert.check(g64, flags("MXFP4", 2, g64), cpu_flags=AMX)
    e = errors(r)["KT_MXFP4_BACKEND"]
    assert e["effect"] == "garbage" and e["works"].startswith("KT_MXFP4_BACKEND=avx2")
    assert ktconvert.check(g64, ["KT_MXFP4_BACKEND=avx2"] + flags("MXFP4", 2, g64), cpu_flags=AMX).exit_code == 0
    assert ktconvert.check(g64, flags("MXFP4", 2, g64), cpu_flags=AVX2).exit_code == 0        # the AVX2 kernel
    assert r.fixed.startswith("KT_MXFP4_BACKEND=avx2 --kt-method MXFP4")
    nv = build(tmp_path / "nv", "nvfp4")
    for cpu in ("avx512_base", AMX):
        refused = ktconvert.check(nv, flags("NVFP4", 2, nv), cpu_flags=cpu)
        assert errors(refused)["KT_MXFP4_BACKEND"]["effect"] == "refusal"
        assert ktconvert.check(nv, ["KT_MXFP4_BACKEND=avx2"] + flags("NVFP4", 2, nv), cpu_flags=cpu).exit_code == 0
    assert ktconvert.check(nv, flags("NVFP4", 2, nv), cpu_flags=AVX2).exit_code == 0


def test_gptq_numa_slice_smaller_than_a_group(tmp_path):
    folder = build(tmp_path / "gptq", "gptq", group=128, inter=256)
    zeros = ktconvert.check(folder, flags("GPTQ_INT4", 4, folder), cpu_flags=AVX2)      # I/T = 64 < 128
    e = errors(zeros)["--kt-threadpool-count"]
    assert (e["effect"], e["works"]) == ("zeros", "--kt-threadpool-count 2")
    vnni = ktconvert.check(folder, flags("GPTQ_INT4", 4, folder), cpu_flags="avx2,fma,avx_vnni")
    assert "packed" in vnni.backend and errors(vnni)["--kt-threadpool-count"]["effect"] == "refusal"
    assert ktconvert.check(folder, flags("GPTQ_INT4", 2, folder), cpu_flags=AVX2).exit_code == 0
    act = build(tmp_path / "act", "gptq", quant={"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                  "desc_act": True, "sym": True})
    r = ktconvert.check(act, flags("GPTQ_INT4", 1, str(act) + "/"), cpu_flags=AVX2)
    assert r.exit_code == 4 and "desc_act" in errors(r)["files"]["line"]


def test_gguf_types_and_numa(tmp_path):
    gguf = pytest.importorskip("gguf")
    import importlib.util

    spec = importlib.util.spec_from_file_location("mf", Path(__file__).parent / "golden/gguf/make_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    T = gguf.GGMLQuantizationType
    for name, cpu, code in (("Q8_0", AVX2, 0), ("Q5_1", AMX, 4), ("BF16", AVX2, 4), ("BF16", AMX, 0)):
        path = tmp_path / f"m-{name}.gguf"
        if not path.exists():
            fixtures.write_moe_gguf(path, getattr(T, name))
        r = ktconvert.check(path, flags("LLAMAFILE", 1, path), cpu_flags=cpu)
        assert r.identified["facts"]["gguf_types"] == {name: 6} and r.exit_code == code, (name, cpu, r.findings)
    r = ktconvert.check(tmp_path / "m-Q8_0.gguf", flags("LLAMAFILE", 2), cpu_flags=AMX)     # I = 256: one block
    assert errors(r)["--kt-threadpool-count"]["works"] == "--kt-threadpool-count 1"


def test_rawint4_needs_amx_and_in_place_numa(outputs):
    folder = outputs["rawint4"]
    assert ktconvert.check(folder, flags("RAWINT4", 2, folder), cpu_flags=AMX).exit_code == 0
    assert errors(ktconvert.check(folder, flags("RAWINT4", 2, folder), cpu_flags="avx512_bf16"))["host"]
    bad = ktconvert.check(folder, flags("RAWINT4", 3, folder), cpu_flags=AMX)      # 256 % 3
    assert errors(bad)["--kt-threadpool-count"]["works"] == "--kt-threadpool-count 2"
    nodes = ktconvert.check(folder, flags("RAWINT4", 2, folder) + ["--kt-numa-nodes", "0"], cpu_flags=AMX)
    assert errors(nodes)["--kt-numa-nodes"]["works"] == "--kt-numa-nodes 0 1"


# ---------------------------------------------------------------- the command line


def test_cli_full_command_fix_and_exit_codes(outputs, tmp_path):
    folder = _as_kt_converter_left_it(outputs["int4"], tmp_path, "int4")
    model = outputs["model"]
    good = run("check", folder, "--cpu-flags", AMX, "--", "CUDA_VISIBLE_DEVICES=0", "python", "-m",
               "sglang.launch_server", "--model-path", model, "--kt-weight-path", folder, "--kt-method", "AMXINT4",
               "--kt-threadpool-count", "2", "--trust-remote-code", "--tp", "2")
    assert good.exit_code == 0, good.output
    assert "ok: no mismatch" in good.output
    bad = run("check", folder, "--cpu-flags", AMX, "--fix", "--", "python", "-m", "sglang.launch_server",
              "--model-path", model, "--kt-weight-path", folder, "--kt-method=AMXINT8", "--kt-threadpool-count", "1")
    assert bad.exit_code == 4
    lines = bad.output.splitlines()
    assert any(line.startswith("error: --kt-threadpool-count 1: the files hold 2 NUMA parts") and
               line.endswith("use --kt-threadpool-count 2") for line in lines)
    fixed = next(line for line in lines if line.startswith("fixed: "))[7:]
    assert fixed == (f"python -m sglang.launch_server --model-path {model} --kt-weight-path {folder} "
                     "--kt-method=AMXINT4 --kt-threadpool-count 2")
    assert run("check", folder, "--cpu-flags", AMX, "--", *fixed.split()).exit_code == 0
    as_json = json.loads(run("check", folder, "--cpu-flags", AMX, "--json", "--", "--kt-method", "AMXINT4").output)
    assert as_json["identified"]["numa"] == 2 and as_json["exit_code"] == 4          # no --kt-threadpool-count


def test_old_spellings_and_flags_from(outputs, tmp_path):
    folder = outputs["int4"]
    old = ktconvert.check(folder, ["--kt-amx-weight-path", str(folder), "--kt-amx-method", "AMXINT4",
                                   "--kt-threadpool-count", "2"], cpu_flags=AMX)
    assert old.exit_code == 0 and old.launch["options"]["kt-method"] == "AMXINT4"
    assert any("--kt-amx-method is the old spelling" in f["line"] for f in old.findings)
    env_method = ktconvert.check(folder, ["AMX_METHOD=AMXINT8", "--kt-threadpool-count", "2"], cpu_flags=AMX)
    assert errors(env_method)["AMX_METHOD"]["works"] == "--kt-method AMXINT4"
    script = tmp_path / "launch.sh"
    script.write_text("#!/bin/sh\nexport KT_MXFP4_BACKEND=avx2\npython -m sglang.launch_server \\\n"
                      f"  --kt-weight-path {folder} \\\n  --kt-method AMXINT4 --kt-threadpool-count 2  # two nodes\n")
    res = run("check", folder, "--flags-from", script, "--cpu-flags", AMX, "--json")
    data = json.loads(res.output)
    assert res.exit_code == 0 and data["launch"]["env"] == {"KT_MXFP4_BACKEND": "avx2"}


def test_malformed_folders_are_one_line_errors(outputs, tmp_path):
    def one_line(folder, code=3):
        res = run("check", folder, "--cpu-flags", AMX, "--", "--kt-method", "AMXINT4", "--kt-threadpool-count", "2")
        assert res.exit_code == code and res.exception is None or isinstance(res.exception, SystemExit), res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
        return res.output

    missing = _as_kt_converter_left_it(outputs["int4"], tmp_path, "missing")
    (missing / "model-00002-of-00002.safetensors").unlink()
    assert "missing shard" in one_line(missing)
    mixed = _as_kt_converter_left_it(outputs["int4"], tmp_path, "mixed")
    shutil.copy(outputs["int8"] / "model-00002-of-00002.safetensors", mixed / "model-00002-of-00002.safetensors")
    assert "differ in method" in one_line(mixed)
    truncated = _as_kt_converter_left_it(outputs["int4"], tmp_path, "truncated")
    shard = truncated / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    assert "truncated" in one_line(truncated)
    tree = _as_kt_converter_left_it(outputs["int8kt"], tmp_path, "tree")
    victim = next(tree.glob("_layer_1/_numa_0/INT8_down_3_*quant_.kt"))
    os.truncate(victim, 10)
    assert "truncated" in one_line(tree)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no routed expert tensors" in one_line(empty)


# ---------------------------------------------------------------- --deep and bytes read


def _poke(folder: Path, key: str, offset: int, data: bytes) -> None:
    for shard in folder.glob("*.safetensors"):
        ref = parse_header(shard).tensors.get(key)
        if ref is not None:
            with open(shard, "r+b") as fh:
                fh.seek(ref.offset + offset)
                fh.write(data)
            return
    raise KeyError(key)


def test_deep_finds_nan_scales_bad_codes_and_hash_changes(outputs, tmp_path):
    clean = ktconvert.check(outputs["int4"], flags("AMXINT4", 2, outputs["int4"]), cpu_flags=AMX, deep=True)
    assert clean.exit_code == 0 and clean.deep["matrices_checked"] == 2 * 3 * 2 * 3      # layers x experts x T x proj
    assert clean.deep["hashes"]["ok"] and clean.bytes_read["data"] > 0
    nan = _as_kt_converter_left_it(outputs["int4"], tmp_path, "nan")
    _poke(nan, "blk.1.ffn_down_exps.7.numa.1.scale", 8, np.float32(np.nan).tobytes())
    r = ktconvert.check(nan, flags("AMXINT4", 2, nan), cpu_flags=AMX, deep=True)
    assert r.exit_code == 4 and "NaN / Inf scales" in errors(r)["files"]["line"]
    assert ktconvert.check(nan, flags("AMXINT4", 2, nan), cpu_flags=AMX).exit_code == 0   # headers cannot see it
    code8 = _as_kt_converter_left_it(outputs["int4"], tmp_path, "code8")
    _poke(code8, "blk.0.ffn_gate_exps.0.numa.0.weight", 100, b"\x88")
    assert "codes -8" in errors(ktconvert.check(code8, flags("AMXINT4", 2, code8), cpu_flags=AMX,
                                                deep=True))["files"]["line"]
    changed = tmp_path / "changed"
    shutil.copytree(outputs["int4"], changed)
    _poke(changed, "blk.0.ffn_up_exps.3.numa.0.weight", 0, b"\x11")        # not a sampled expert: the hashes see it
    assert "hashes" in errors(ktconvert.check(changed, flags("AMXINT4", 2, changed), cpu_flags=AMX,
                                              deep=True))["files"]["line"]


def test_headers_only_bytes_read(tiny_model, tmp_path):
    """A bigger tiny model: the check reads the shard headers and small JSON files only, counted by the check
    itself and by the kernel's rchar (every byte read() / pread() returned to the process)."""
    model = tiny_model("qwen3_moe", experts=32, hidden=1024, intermediate=512)
    out = _convert(model, tmp_path / "big", "--method", "amxint4", "--numa", "2")
    folder = _as_kt_converter_left_it(out, tmp_path, "big-kt")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    code = ("import ktconvert, ktconvert.api, sys\n"
            "def rchar():\n    return int(open('/proc/self/io').read().split('rchar: ')[1].split()[0])\n"
            "ktconvert.check(sys.argv[1], ['--kt-method', 'AMXINT4'], cpu_flags='amx')\n"
            "before = rchar()\n"
            "r = ktconvert.check(sys.argv[1], ['--kt-method', 'AMXINT4', '--kt-threadpool-count', '2'],"
            " cpu_flags='amx')\n"
            "print(rchar() - before, r.bytes_read['total'], r.bytes_read['data'], r.exit_code)\n")
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io")
    out_line = subprocess.run([sys.executable, "-c", code, str(folder)], check=True, capture_output=True,
                              text=True).stdout.split()
    rchar, counted, data, exit_code = map(int, out_line)
    assert exit_code == 0 and data == 0
    assert counted < 0.005 * size and rchar < 0.01 * size, (rchar, counted, size)


def test_conversion_prints_the_check_line(tiny_model, tmp_path):
    out = tmp_path / "o"
    res = run("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint4", "--numa", "2", "--quiet")
    assert f"ktconvert check {out} -- --kt-method AMXINT4 --kt-weight-path {out} --kt-threadpool-count 2" in \
        res.output
    assert "check" in dir(ktconvert) and "Returns" in ktconvert.check.__doc__


def test_deep_reads_gptq_qzeros_and_hf_scales(tmp_path):
    folder = build(tmp_path / "gptq", "gptq")
    assert ktconvert.check(folder, flags("GPTQ_INT4", 2, folder), cpu_flags=AVX2, deep=True).exit_code == 0
    _poke(folder, "model.layers.1.mlp.experts.3.down_proj.qzeros", 0, np.uint32(0x12345678).tobytes())
    r = ktconvert.check(folder, flags("GPTQ_INT4", 2, folder), cpu_flags=AVX2, deep=True)
    assert "asymmetric" in errors(r)["files"]["line"]
    nv = build(tmp_path / "nv", "nvfp4")
    _poke(nv, "model.layers.0.mlp.experts.0.up_proj.weight_scale", 5, b"\x7f")          # E4M3 NaN
    r = ktconvert.check(nv, ["KT_MXFP4_BACKEND=avx2"] + flags("NVFP4", 2, nv), cpu_flags=AMX, deep=True)
    assert "1 NaN / Inf values" in errors(r)["files"]["line"]


def test_cpu_flags_from_a_file_and_the_variant_override(outputs, tmp_path):
    lscpu = tmp_path / "lscpu.txt"
    lscpu.write_text("Architecture: x86_64\nFlags: fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512vbmi\n")
    folder = outputs["int4"]
    r = ktconvert.check(folder, flags("AMXINT4", 2, folder), cpu_flags=str(lscpu))
    assert r.host["build"] == "avx512_vbmi" and r.exit_code == 0           # "avx512vbmi" matches without "_"
    forced = ktconvert.check(folder, ["KT_KERNEL_CPU_VARIANT=amx"] + flags("AMXINT4", 2, folder),
                             cpu_flags=str(lscpu))
    assert errors(forced)["KT_KERNEL_CPU_VARIANT"]["effect"] == "refusal"
    down = ktconvert.check(folder, ["KT_KERNEL_CPU_VARIANT=avx2"] + flags("AMXINT4", 2, folder),
                           cpu_flags=str(lscpu))
    assert down.host["build"] == "avx2" and errors(down)["host"]["effect"] == "refusal"


def test_build_detection_matches_kt_kernels_own(monkeypatch):
    """hostcpu.detect_build against kt-kernel's _cpu_detect.detect_cpu_features (loaded from the installed wheel's
    file, without importing kt_kernel and its extension) on the flag sets of each build and some near misses."""
    import importlib.util
    import io

    from ktconvert.launchcheck.hostcpu import BUILDS, detect_build

    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("kt-kernel is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "_cpu_detect.py"
    detect = importlib.util.spec_from_file_location("kt_cpu_detect", path)
    module = importlib.util.module_from_spec(detect)
    detect.loader.exec_module(module)
    monkeypatch.delenv("KT_KERNEL_CPU_VARIANT", raising=False)
    sets = [set(needs) for _, needs in BUILDS] + [{"avx2", "avx512f"}, {"avx512f", "avx512bw", "avx512vnni"},
                                                  {"amx_tile", "amx_int8", "avx512f", "avx512bw"}, set()]
    for flags_set in sets:
        text = "processor : 0\nflags\t\t: " + " ".join(sorted(flags_set)) + "\n"
        monkeypatch.setattr(module, "open", lambda *a, **k: io.StringIO(text), raising=False)
        assert detect_build(flags_set)[0] == module.detect_cpu_features(), flags_set


def test_verify_identifies_a_folder_without_ktconvert_json(tiny_model, tmp_path):
    """verify on outputs it did not write (no ktconvert.json): still a failure (nothing recorded to verify against),
    but it says what the headers hold, as `check` identifies it, and points at `ktconvert check`."""
    from ktconvert.verification.run import verify

    out = tmp_path / "out"
    assert CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(out), "--method", "amxint4", "--numa",
                                    "2", "--quiet"]).exit_code == 0
    (out / "ktconvert.json").unlink()
    result = verify(out)
    assert not result["ok"] and result["identified"]["method"] == "AMXINT4" and result["identified"]["numa"] == 2
    row = next(c for c in result["checks"] if c["name"] == "identified")
    assert row["status"] == "info" and "ktconvert check" in row["detail"]


def test_fp8_perchannel_on_avx2_is_refused_and_runs_on_avx512(tmp_path):
    # kt-native-formats.md: kt-kernel 0.7.2's avx2 build has no FP8_PERCHANNEL kernel (it raises)
    out = build(tmp_path / "pc", "fp8-perchannel")
    avx2 = ktconvert.check(out, flags("FP8_PERCHANNEL", 1, out), cpu_flags=AVX2)
    assert avx2.exit_code == 4
    assert any("AVX2" in f["holds"] or "avx2" in f["holds"] for f in avx2.findings if f["severity"] == "error")
    assert ktconvert.check(out, flags("FP8_PERCHANNEL", 1, out), cpu_flags=AMX).exit_code == 0
