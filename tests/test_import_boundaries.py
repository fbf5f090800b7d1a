"""Layering rules: pure-math packages stay pure, and the CLI entry point stays light."""
import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_quant_and_layouts_import_only_numpy():
    mods = _modules_after("import ktconvert.quant.amx_rows, ktconvert.quant.row_quant, ktconvert.quant.mse, "
                          "ktconvert.quant.ct_int4, ktconvert.quant.fp8, ktconvert.quant.mxfp4, ktconvert.layouts.tiles, "
                          "ktconvert.layouts.naming, ktconvert.layouts.numa")
    assert not {"torch", "safetensors", "click", "transformers", "llmcompressor"} & mods


def test_cli_import_is_light():
    mods = _modules_after("import ktconvert.cli.main")
    assert "click" in mods
    assert not {"numpy", "torch", "safetensors", "transformers", "llmcompressor", "compressed_tensors"} & mods
