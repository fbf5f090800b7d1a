"""What a ktconvert.json says about launching its folder, checked instead of trusted: ``flags`` (the kt-kernel /
SGLang options), ``sglang_args`` (the same as one string) and ``expert_activation`` (the routed-token counts file
behind SGLang-KT's placement flags) are derived again from what the other checks tie to the files — the recorded
method and NUMA count (the structure check compares them with every tensor's bytes) and the listed files — and any
difference is a problem, although every hash may still match (the manifest itself is not in its own file list).

    check_launch(manifest) -> (problems, detail)      # used by `verify` and by `publish` before any upload
"""
from __future__ import annotations

from ktconvert.activation.counts import FILE_NAME as ACTIVATION_FILE
from ktconvert.errors import KtConvertError
from ktconvert.formats.out_manifest import launch_fields
from ktconvert.kinds.base import KINDS  # (importing it registers the kinds: kinds/__init__ runs first)


def expected_launch(manifest: dict) -> dict:
    """{"flags", "sglang_args", "expert_activation"} that the output described by `manifest` needs: its kind's
    flags (kt-kernel's of the recorded method and NUMA count, SGLang's --model of a GPU checkpoint), plus the
    placement flags exactly when OUT lists the counts file. KtConvertError / KeyError / TypeError when the manifest
    does not say enough."""
    flags = _kind(manifest).launch_flags(manifest)
    activation = ACTIVATION_FILE if ACTIVATION_FILE in manifest["files"] else None
    return launch_fields(flags, activation)


def _kind(manifest: dict):
    """The manifest's output kind (kinds.KINDS; a manifest without "kind": a CPU output); KeyError for another."""
    kind = manifest.get("kind", "cpu")
    if kind not in KINDS:
        raise KeyError(f"kind {kind!r}")
    return KINDS.get(kind)


def check_launch(manifest: dict) -> tuple[list[str], str]:
    """(problems, detail): one problem per launch field of `manifest` that differs from expected_launch (flags: one
    per differing flag); detail: the SGLang arguments when all agree."""
    try:
        expected = expected_launch(manifest)
    except (KtConvertError, KeyError, TypeError, ValueError) as exc:
        return [f"ktconvert.json: cannot derive the launch flags ({exc})"], ""
    what = _kind(manifest).describe(manifest)
    problems = []
    recorded = manifest.get("flags")
    if not isinstance(recorded, dict):
        problems.append(f"ktconvert.json: flags is not a table (found {recorded!r:.60})")
        recorded = {}
    for flag in sorted(set(expected["flags"]) | set(recorded)):
        want, got = expected["flags"].get(flag), recorded.get(flag)
        if want != got or type(want) is not type(got):
            problems.append(f"ktconvert.json: flags.{flag} is not what {what} needs: expected {want!r}, found {got!r}")
    for key in ("sglang_args", "expert_activation"):
        if manifest.get(key) != expected[key]:
            problems.append(f"ktconvert.json: {key} is not what {what} and its files need: expected "
                            f"{expected[key]!r}, found {manifest.get(key)!r:.200}")
    return problems, "" if problems else expected["sglang_args"]
