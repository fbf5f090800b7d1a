"""scripts/suite_figures.py: the README's suite figures come from a run's own output, parsed, not typed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("suite_figures", ROOT / "scripts" / "suite_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LOG = """tests/test_x.py ....
-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
=== 2012 passed, 53 skipped, 150 deselected, 7 warnings in 588.20s (0:09:48) ===

real\t11m24.974s
user\t9m53.233s
"""


def test_summary_and_time_of_a_ci_log():
    mod = _module()
    counts, seconds = mod.summary(LOG)
    assert counts == {"passed": 2012, "skipped": 53, "deselected": 150} and seconds == 588.20
    assert mod.real_seconds(LOG) == pytest.approx(684.974)
    text = mod.paragraph((counts, seconds), mod.real_seconds(LOG), ({"passed": 150, "skipped": 5}, 840.0))
    assert "took 11 min 25 s, the tests 9 min 48 s (2012 passed, 53 skipped, 150 deselected" in text
    assert "`-m slow` adds 14 min 0 s (150 passed, 5 skipped)" in text
    assert mod.summary("1 failed, 3 passed in 2.50s")[0] == {"failed": 1, "passed": 3}


def test_a_log_without_a_summary_is_refused():
    with pytest.raises(ValueError, match="no pytest summary"):
        _module().summary("collected 0 items\n")


def test_the_readme_has_the_markers_once():
    body = (ROOT / "README.md").read_text()
    mod = _module()
    assert body.count(mod.BEGIN) == 1 and body.count(mod.END) == 1
    assert body.index(mod.BEGIN) < body.index(mod.END)
