"""Output kinds as a registry (issue 26 item 3): a test-only kind, declared and registered in this file alone, is
read from `convert --targets` TOML and from the API's `convert(targets=[...])`, planned, written, resumed and
verified through the same path as the CPU and GPU outputs, with no production module naming it.

The kind ("layer-json") writes one JSON file per MoE layer: for every routed expert matrix its shape and the sum
of its BF16 values. The reference sums are computed here from the source's safetensors bytes (header parsed with
json, BF16 widened to float32 by the format's definition: the high 16 bits of an IEEE float32), not by ktconvert's
readers.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ktconvert
from ktconvert.cli.main import cli
from ktconvert.errors import UsageError
from ktconvert.examples.tiny import make_tiny_model
from ktconvert.formats.fileio import LayerResult, write_record
from ktconvert.kinds import KINDS, OutputKind, option, register
from ktconvert.run.options import Options, Plan
from ktconvert.run.output import Output

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class LayerJsonOptions(Options):
    """digits: decimal digits the sums are rounded to; include_mtp: also the MTP layers."""

    digits: int = option(6, help="decimal digits of the sums", minimum=1)
    include_mtp: bool = option(False, help="Also the MTP (next-n) layers' experts")

    kind = "layer-json"

    def check(self) -> None:
        if not 1 <= self.digits <= 12:
            raise UsageError("digits out of range", expected="1..12", found=str(self.digits))


class LayerJsonPlan(Plan):
    def __init__(self, input, options: LayerJsonOptions):
        self.input, self.options = input, options
        self.layers = list(input.source.all_layers(options.include_mtp))
        self.report = {"layers": self.layers, "files": [{"path": f"layer_{L}.json", "bytes": 0} for L in self.layers],
                       "total_bytes": 4096 * len(self.layers)}

    def journal_options(self) -> dict:
        return {"kind": "layer-json", **self.options.journalled(), "layers": self.layers}


class LayerJsonConsumer:
    def __init__(self, output: "LayerJsonOutput", layer: int):
        self.output, self.layer, self.sums, self.lock = output, layer, {}, threading.Lock()

    def put_matrix(self, proj: str, expert: int, w, where: str, stored=None) -> None:
        total = float((np.asarray(w).astype(np.uint32) << 16).view(np.float32).astype(np.float64).sum())
        with self.lock:
            self.sums[f"{expert}.{proj}"] = {"shape": list(w.shape), "sum": round(total, self.output.digits)}

    def finish(self) -> LayerResult:
        data = (json.dumps({"layer": self.layer, "matrices": self.sums}, indent=1, sort_keys=True) + "\n").encode()
        return LayerResult([write_record(self.output.out_dir, f"layer_{self.layer}.json", data)], {})

    def abort(self) -> None:
        pass


class LayerJsonOutput(Output):
    kind = "layer-json"

    def __init__(self, out_dir, plan, **kw):
        super().__init__(out_dir, plan, **kw)
        self.digits = plan.options.digits

    def journal_options(self) -> dict:
        return self.plan.journal_options()

    def begin_layer(self, layer: int) -> LayerJsonConsumer:
        return LayerJsonConsumer(self, layer)

    def finish_files(self) -> LayerResult:
        return LayerResult([], {})

    def manifest_fields(self) -> dict:
        return {"method": "LAYER-JSON", "numa": 1, "layout": "json", "quant": "none", "kind": "layer-json",
                "flags": {}, "packages": {}, "extra": {"layer_json": {"digits": self.digits}}}


class LayerJsonKind(OutputKind):
    name, label, options = "layer-json", "LAYER-JSON", LayerJsonOptions
    help = "Start a per-layer JSON output in folder OUT."

    @classmethod
    def plan(cls, input, options, *, out=None, threads=None):
        return LayerJsonPlan(input, options)

    @classmethod
    def output_class(cls) -> type:
        return LayerJsonOutput

    @classmethod
    def launch_lines(cls, sglang_args: str, out: str) -> list[str]:
        return ["nothing to launch"]

    @classmethod
    def launch_flags(cls, manifest: dict) -> dict:
        return {}


@pytest.fixture
def layer_json(monkeypatch):
    """The kind registered for one test (the registry's table restored afterwards)."""
    monkeypatch.setattr(KINDS, "_items", dict(KINDS._items))
    register(LayerJsonKind)
    return LayerJsonKind


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kinds") / "model", arch="qwen3_moe")


def reference_sums(model: Path, digits: int) -> dict[int, dict]:
    """{layer: {"E.proj": {"shape", "sum"}}} from the safetensors bytes of `model` (no ktconvert reader)."""
    out: dict[int, dict] = {}
    for path in sorted(model.glob("*.safetensors")):
        raw = path.read_bytes()
        size = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + size])
        for name, info in header.items():
            parts = name.split(".")
            if name == "__metadata__" or "experts" not in parts or parts[-1] != "weight":
                continue
            assert info["dtype"] == "BF16"
            begin, end = info["data_offsets"]
            bits = np.frombuffer(raw[8 + size + begin:8 + size + end], dtype="<u2")
            value = float((bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64).sum())
            layer, expert = int(parts[parts.index("layers") + 1]), int(parts[parts.index("experts") + 1])
            proj = next(p for p, n in PROJ_NAMES.items() if n == parts[-2])
            out.setdefault(layer, {})[f"{expert}.{proj}"] = {"shape": info["shape"], "sum": round(value, digits)}
    return out


def written_sums(out: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text())["matrices"] for p in sorted(out.glob("layer_*.json"))}


def test_the_kind_is_one_registration(layer_json):
    assert "layer-json" in KINDS and KINDS.get("layer-json") is LayerJsonKind
    # the --targets schema is generated from the options' fields
    fields = LayerJsonKind.target_fields()
    assert {k: (f.kind, f.minimum) for k, f in fields.items()} == {"digits": (int, 1), "include_mtp": (bool, None)}
    assert LayerJsonKind.required() == ()


def test_api_targets_write_the_kind_beside_a_cpu_output(layer_json, model, tmp_path):
    results = ktconvert.convert(model, [{"layer-json": str(tmp_path / "sums"), "digits": 4},
                                        {"cpu": str(tmp_path / "int8"), "method": "amxint8"}], threads=2)
    assert [r.kind for r in results] == ["layer-json", "cpu"]
    reference = reference_sums(model, 4)
    assert len(reference) >= 2 and all(len(matrices) % 3 == 0 and matrices for matrices in reference.values())
    assert written_sums(tmp_path / "sums") == reference
    manifest = json.loads((tmp_path / "sums" / "ktconvert.json").read_text())
    assert manifest["kind"] == "layer-json" and manifest["layer_json"] == {"digits": 4}
    assert sorted(manifest["files"]) == sorted(f"layer_{L}.json" for L in reference_sums(model, 4))
    assert results[0].summary().endswith("nothing to launch")
    # the CPU output of the shared pass is the one `convert_cpu` writes alone
    alone = ktconvert.convert_cpu(model, tmp_path / "alone", method="amxint8", threads=2)
    for rel in alone.files:
        assert (tmp_path / "int8" / rel).read_bytes() == (tmp_path / "alone" / rel).read_bytes(), rel
    # resume finds it complete; verify re-hashes it and re-derives its (empty) launch flags through the kind
    again = ktconvert.convert(model, [{"layer-json": str(tmp_path / "sums"), "digits": 4}], resume=True)
    assert again[0].complete_before
    report = ktconvert.verify(str(tmp_path / "sums"), hashes=True)
    assert report.ok, report.problems
    assert {c["name"]: c["status"] for c in report.checks}["structure"] == "skipped"
    # a pair with the kind's options instance is a target too
    pair = ktconvert.convert(model, [(tmp_path / "pair", LayerJsonOptions(digits=4))])
    assert pair[0].kind == "layer-json" and written_sums(tmp_path / "pair") == reference_sums(model, 4)


def test_targets_toml_plans_and_writes_the_kind(layer_json, model, tmp_path):
    toml = tmp_path / "targets.toml"
    toml.write_text('[[targets]]\nlayer-json = "sums"\ndigits = 5\n')
    plan = CliRunner().invoke(cli, ["convert", str(model), "--targets", str(toml), "--dry-run", "--json"])
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.output)["targets"]
    assert [(t["kind"], t["name"]) for t in planned] == [("layer-json", "target 1 (layer-json sums)")]
    assert not (tmp_path / "sums").exists()
    res = CliRunner().invoke(cli, ["convert", str(model), "--targets", str(toml), "--quiet", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["outputs"][0]["kind"] == "layer-json"
    assert written_sums(tmp_path / "sums") == reference_sums(model, 5)


@pytest.mark.parametrize("body, words", [
    ('layer-json = "x"\ndigits = "6"', ["target 1 (layer-json x)", "'digits' must be an integer"]),
    ('layer-json = "x"\ndigits = 0', ["'digits' must be an integer >= 1"]),
    ('layer-json = "x"\nmethod = "amxint4"', ["unknown key 'method'"]),
    ('layer-json = "x"\ncpu = "y"\nmethod = "amxint4"', ["needs exactly one of 'cpu' / 'gpu' / 'layer-json'"]),
])
def test_targets_toml_schema_of_the_kind(layer_json, model, tmp_path, body, words):
    toml = tmp_path / "targets.toml"
    toml.write_text("[[targets]]\n" + body + "\n")
    res = CliRunner().invoke(cli, ["convert", str(model), "--targets", str(toml)])
    assert res.exit_code == 2, res.output
    for word in words:
        assert word in res.output
    assert not (tmp_path / "x").exists()


def test_without_the_registration_the_kind_is_unknown(model, tmp_path):
    assert "layer-json" not in KINDS
    with pytest.raises(UsageError, match="needs exactly one of 'cpu' / 'gpu'"):
        ktconvert.convert(model, [{"layer-json": str(tmp_path / "sums")}])
