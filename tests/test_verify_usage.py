"""What a user sees from ``verify`` (issue 30, item 1).

* ``--layers`` naming a layer OUT does not hold cannot work: usage, exit 2 (before: a failed verification, 4).
* ``--json`` lists every problem line (before: the list ended with a literal "... and N more" string, and the
  headline counted that placeholder); one truncated shard is one line, not one per check that saw it.
* ``verify OUT --remote`` without REPO on a local folder is refused (exit 2) naming what to pass (before: the folder
  name was sent to the real hub as a repo id, exit 5).
* ``--source hf://ORG/NAME@REV`` is accepted, as cpu / gpu take it (before: "must be a local path here").
"""
from __future__ import annotations

import json
import os

from test_hub import hub_env, server  # noqa: F401  (fixtures: the stand-in hub on 127.0.0.1)
from test_verify_identity import SHARD, _cli, converted  # noqa: F401  (converted: a fixture)


def test_layers_not_in_out_is_usage(converted):
    _, out = converted
    result = _cli("verify", out, "--layers", "7")
    assert result.exit_code == 2, result.output
    assert "--layers" in result.output and "[0, 1]" in result.output


def test_json_problems_complete_deduplicated_and_counted(converted, tmp_path):
    src, out = converted
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in out.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    os.truncate(broken / SHARD, 1_000_000)
    result = _cli("verify", broken, "--hashes", "--source", src, "--json")
    assert result.exit_code == 4, result.output
    problems = json.loads(result.output)["problems"]
    assert not [p for p in problems if p.startswith("...") or " more" in p]
    assert sum("missing" in p for p in problems) == 24          # every missing tensor of layer 1, none elided
    assert sum("lies past the end of the file" in p for p in problems) == 1
    assert len(problems) == len(set(problems))
    text = _cli("verify", broken, "--hashes", "--source", src).output
    assert f"result: FAILED ({len(problems)} problem line(s))" in text


def test_remote_without_repo_on_a_folder_is_usage(converted, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")      # nothing may be asked of any hub
    _, out = converted
    result = _cli("verify", out, "--remote")
    assert result.exit_code == 2, result.output
    assert "--remote OWNER/NAME" in result.output


def test_source_from_the_hub(converted, server, hub_env, monkeypatch):  # noqa: F811
    src, out = converted
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "dl"))
    commit = server.store.seed("hf", "org/tiny", src)
    result = _cli("verify", out, "--source", f"hf://org/tiny@{commit}", "--hashes", "--json")
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c["status"] for c in json.loads(result.output)["checks"]}
    assert checks["source"] == "ok" and checks["numerics"] == "ok"
