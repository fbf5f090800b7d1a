"""Extension points, proven from the test alone (issue 26 item 7): each extension below is defined and registered
by code in this file, run in a child process of its own (a registration must not leak into other tests), and taken
through inspect -> plan -> convert -> verify -> resume -> parts/merge without a change to any production module.

* a test-only **input decoder** (``toy_row_int8``: int8 codes + one float32 scale per output row, a scheme no
  production decoder reads) with the tiny-model writer that produces it. The reference for its output is independent
  of ktconvert's readers: the same checkpoint dequantized here with safetensors + torch (w = q * s, RNE to BF16) and
  written as a plain BF16 checkpoint; the AMXINT4 files converted from both must be byte-identical.

docs/architecture.md's "what an extension touches" table states what these tests prove.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

TOY_DECODER = textwrap.dedent('''
    import numpy as np

    from ktconvert.formats.decoders.base import (Decoder, MatrixRefs, QuantGroup, QuantScheme, matrix_shape,
                                                 read_partner, tensor_ref)
    from ktconvert.quant.bf16 import f32_to_bf16_bits
    from ktconvert.examples.tiny import DTYPE_WRITERS
    from ktconvert.examples.tiny_qweight import ExpertWriter


    class ToyRowInt8(Decoder):
        """int8 codes W.weight [n, k] + float32 W.weight_scale [n]: w = q * s[row]."""

        scheme, quant_method = "toy-row-int8", "toy_row_int8"

        @classmethod
        def parse_config(cls, qc):
            return QuantScheme("toy_row_int8", "toy-row-int8", (QuantGroup("toy-row-int8"),),
                               tuple(qc.get("ignore") or ()))

        @classmethod
        def input_format(cls, group, dtype):
            return "toy-row-int8"

        @classmethod
        def locate(cls, checkpoint, base, group, expert):
            w = tensor_ref(checkpoint, base + ".weight")
            s = tensor_ref(checkpoint, base + ".weight_scale")
            return MatrixRefs(cls.scheme, w.name, {"scale": s.name}, expert, matrix_shape(w, expert), group)

        @classmethod
        def decode(cls, checkpoint, refs, data, where):
            s = read_partner(checkpoint, refs.partners["scale"], refs.index0).astype(np.float32)
            return f32_to_bf16_bits(np.asarray(data, np.float32) * s.reshape(-1, 1))


    class ToyWriter(ExpertWriter):
        def matrix(self, w, name):
            s = np.abs(w).max(axis=1) / np.float32(127)
            s = np.where(s > 0, s, 1).astype(np.float32)
            return {"weight": (np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8), "I8"),
                    "weight_scale": (s, "F32")}

        def update_config(self, config, info):
            self.hidden = info.hidden
            config["quantization_config"] = {"quant_method": "toy_row_int8"}


    DTYPE_WRITERS.register("toy-row-int8")(ToyWriter())
''')

TOY_SOURCE = textwrap.dedent('''
    import json
    from pathlib import Path

    from ktconvert.formats.hf_source import HFSource


    class ToyPointerSource(HFSource):
        """A folder whose checkpoint sits where its toy-source.json says (a layout no production source reads)."""

        name, aliases = "toy-pointer", ()

        @staticmethod
        def target(path):
            return Path(path) / json.loads((Path(path) / "toy-source.json").read_text())["weights"]

        @classmethod
        def sniff(cls, path):
            return Path(path).is_dir() and (Path(path) / "toy-source.json").is_file()

        @classmethod
        def open(cls, path, expert_orientation=None, remote=None):
            return super().open(cls.target(path), expert_orientation, remote)

        @classmethod
        def describe_path(cls, path, expert_orientation=None):
            return super().describe_path(cls.target(path), expert_orientation)
''')

# The per-group AMXINT4 variant of tests/test_declared_plan.py, registered here in a process of its own.
GROUP_METHOD = textwrap.dedent('''
    import types
    sys.path.insert(0, TESTS)
    from test_declared_plan import _group_scaled_int4
    _group_scaled_int4(types.SimpleNamespace(setattr=setattr))
''')

# The independent reference: dequantize with safetensors + torch only, write a plain BF16 checkpoint.
DEQUANTIZE = textwrap.dedent('''
    def dequantized_copy(src, dest):
        import json, shutil
        from pathlib import Path
        import torch
        from safetensors.torch import load_file, save_file
        src, dest = Path(src), Path(dest)
        dest.mkdir()
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                t = load_file(f)
                out = {}
                for name, value in t.items():
                    if name.endswith(".weight_scale"):
                        continue
                    scale = t.get(name + "_scale")
                    out[name] = (value.to(torch.float32) * scale[:, None]).to(torch.bfloat16) \\
                        if scale is not None else value
                save_file(out, dest / f.name, metadata={"format": "pt"})
            elif f.name == "config.json":
                config = json.loads(f.read_text())
                config.pop("quantization_config")
                (dest / f.name).write_text(json.dumps(config))
            elif f.name.endswith(".json"):
                if f.name.endswith(".index.json"):
                    index = json.loads(f.read_text())
                    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                                           if not k.endswith(".weight_scale")}
                    (dest / f.name).write_text(json.dumps(index))
                else:
                    shutil.copy(f, dest / f.name)
''')

HEAD = textwrap.dedent('''
    import hashlib, json, sys
    from pathlib import Path
    import ktconvert
    from ktconvert.examples.tiny import make_tiny_model

    tmp, TESTS, METHOD, BEHIND_POINTER = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
''')

FLOW = textwrap.dedent('''
    src = make_tiny_model(tmp / "toy", arch="qwen3_moe", layers=2, hidden=128, intermediate=256,
                          dtype="toy-row-int8")
    dequantized_copy(src, tmp / "ref")
    if BEHIND_POINTER:
        (tmp / "top").mkdir()
        src.rename(tmp / "top" / "weights")
        (tmp / "top" / "toy-source.json").write_text(json.dumps({"weights": "weights"}))
        src = tmp / "top"

    def digests(folder):
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != "ktconvert.json"}

    report = {}
    info = ktconvert.inspect(src)
    report["input_format"] = info.input_format
    report["kt_methods"] = info.kt_methods
    plan = ktconvert.plan(src, method=METHOD, numa=2)
    report["planned_bytes"] = plan.cpu.report["total_bytes"]
    r = ktconvert.convert_cpu(src, tmp / "out", method=METHOD, numa=2)
    report["written_bytes"] = r.bytes
    ktconvert.convert_cpu(tmp / "ref", tmp / "out_ref", method=METHOD, numa=2)
    mine, ref = digests(tmp / "out"), digests(tmp / "out_ref")
    report["differ"] = sorted(k for k in set(mine) | set(ref) if mine.get(k) != ref.get(k))
    report["files"] = len(digests(tmp / "out"))
    v = ktconvert.verify(tmp / "out", source=src, hashes=True)
    report["verify_ok"], report["verify_problems"] = v.ok, v.problems
    again = ktconvert.convert_cpu(src, tmp / "out", method=METHOD, numa=2, resume=True)
    report["resume_complete_before"] = again.complete_before
    parts = []
    for layers in ("0", "1"):
        part = tmp / f"part{layers}"
        ktconvert.convert_cpu(src, part, method=METHOD, numa=2, layers=layers)
        parts.append(part)
    ktconvert.merge(tmp / "merged", parts)
    report["merged_same"] = digests(tmp / "merged") == digests(tmp / "out")
    print(json.dumps(report))
''')


def run_child(tmp_path, parts, method: str = "amxint4", behind_pointer: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", "\n".join((HEAD, *parts)), str(tmp_path), str(Path(__file__).parent),
                           method, "1" if behind_pointer else "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_toy_decoder_registered_from_the_test_runs_the_whole_pipeline(tmp_path):
    r = run_child(tmp_path, (TOY_DECODER, DEQUANTIZE, FLOW))
    assert r["input_format"] == "toy-row-int8"
    assert r["kt_methods"]["AMXINT4"].startswith("convert:")
    assert r["planned_bytes"] > 0 and r["files"] > 0
    # the expert files equal; config.json is the source's own (it names the toy quantization)
    assert r["differ"] == ["config.json"], "AMXINT4 from the toy decoder differs from the dequantized source"
    assert r["verify_ok"], r["verify_problems"]
    assert r["resume_complete_before"] is True
    assert r["merged_same"]


def test_toy_source_and_group_scaled_method_registered_from_the_test(tmp_path):
    """The toy checkpoint behind a pointer file only the test-only source reads, converted with the test-only
    per-group AMXINT4 method: every command finds both through their registries."""
    r = run_child(tmp_path, (TOY_DECODER, TOY_SOURCE, GROUP_METHOD, DEQUANTIZE, FLOW), "testg32int4", True)
    assert r["input_format"] == "toy-row-int8"
    assert r["kt_methods"]["TESTG32INT4"].startswith("convert:")
    assert r["differ"] == ["config.json"]
    assert r["verify_ok"], r["verify_problems"]
    assert r["resume_complete_before"] is True
    assert r["merged_same"]
    assert r["planned_bytes"] > 0 and r["files"] > 0
