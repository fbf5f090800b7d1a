"""What `verify` checks of a CPU output beyond what every output shares: its folder's layout against the recorded
method, NUMA count and model dims (the method's own ``check_structure``), the kt-kernel flags they need, and the
numerics (the method's own check on random probes, or ``verification.calibrated`` on calibration tokens)."""
from __future__ import annotations

from ktconvert.errors import ShapeError, UnknownNameError, UsageError
from ktconvert.methods import METHODS, CpuMethod
from ktconvert.verification import calibrated


def check_structure(folder, manifest: dict) -> tuple[list[str], str]:
    """(problems, detail) of the folder's layout (verification.folder.OutputFolder) against the manifest's method /
    NUMA count / model. The NUMA count must be one the converter accepts for the method and dims (in-place outputs'
    files do not depend on it, so nothing else would catch an edited one)."""
    try:
        method = CpuMethod.from_manifest(manifest)
        model, numa = manifest["model"], manifest["numa"]
        failed = [c for c in method.alignment_checks(model["hidden"], model["intermediate"], numa) if not c["ok"]]
        if failed:
            return [f"ktconvert.json: numa {numa} is not a NUMA count {method.kt_method} converts H={model['hidden']},"
                    f" I={model['intermediate']} with; expected {failed[0]['check']}, found {failed[0]['detail']}"], ""
        return method.check_structure(folder, manifest)
    except (KeyError, TypeError, ValueError, UnknownNameError, ShapeError) as exc:
        return [f"ktconvert.json: cannot derive the expected tensors ({exc})"], ""


def launch_flags(manifest: dict) -> dict:
    """kt-kernel's flags of the recorded method and NUMA count."""
    return CpuMethod.from_manifest(manifest).flags(manifest["numa"])


def check_numerics(out, manifest: dict, folder, *, source, tokens, layers, experts, threshold, calibration, compare,
                   max_length, num_samples) -> dict | None:
    """The numerics report of a CPU output whose method ktconvert knows (None: another method): with
    `calibration` on the hidden states its tokens produce in `source` (`compare`: a second output side by side),
    else the method's own check on random probes."""
    if manifest.get("method", "") not in METHODS:
        return None
    if calibration is not None:
        return calibrated.check_calibrated(out, manifest, source, calibration, compare=compare, layers=layers,
                                           threshold=threshold, folder=folder, max_length=max_length,
                                           num_samples=num_samples)
    try:
        method = CpuMethod.from_manifest(manifest)
    except (UsageError, TypeError) as exc:      # e.g. a group size that is not a number
        return {"ok": False, "problems": [f"ktconvert.json: cannot read the method's options ({exc})"]}
    report = method.check_numerics(out, manifest, source, tokens, layers, experts, threshold, folder=folder)
    report["summary"] = f"on random probes: {report.get('summary', '')}"
    return report
