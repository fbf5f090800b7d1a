"""The pre-flight of a Ray run: one cheap task on every node that may run a part, before any conversion work.

Each node reports its host name, node id, package versions (ktconvert, numpy: those that change output bytes) and
whether ktconvert's native library loads there (``native_status``: a node where it does not, while it does on the
driver, would run its parts in numpy, many times slower, or fail where a path is native only), stats every source
file the plan reads (a local SRC: present, readable, of the planned size) and writes a marker file into the parts
folder, which the driver then reads back: a node-local ``--parts-dir`` (the default ``OUT.parts`` beside a
node-local OUT) shows as a marker the driver cannot see. ``check_reports`` turns what differs into one NodeError
line (exit 3) naming each node and what to fix; the run stops there, before a byte of output. A node that does not
answer in PREFLIGHT_SECONDS is named the same way; one that died meanwhile is left out (Ray schedules nothing
there).
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.out_manifest import package_versions

PREFLIGHT_DIR = ".ktconvert-preflight"
PREFLIGHT_SECONDS = 120


class NodeError(InputError):
    """A node of the cluster cannot run this conversion's parts (exit 3)."""


def preflight(ray, nodes: list[dict], src: str, files: dict[str, int] | None, parts_root: Path | None,
              options: dict) -> list[str]:
    """Run ``check_node`` on every node of `nodes` (ray.nodes() entries) with Ray task `options` (runtime_env);
    NodeError for any problem (``check_reports``). files: {absolute path: bytes} of SRC's files to stat (None: a hub
    source, which each node downloads, or no source). parts_root: the parts folder every node must share with the
    driver (None: none, as for GPTQ, where only the driver writes). Returns one line per node left out because it
    died meanwhile."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nonce = secrets.token_hex(8)
    task = ray.remote(check_node)
    refs = {task.options(num_cpus=0, max_retries=0, **options,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(src, files, parts_root and str(parts_root), nonce): node for node in nodes}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PREFLIGHT_SECONDS)
    reports, gone = [], []
    for ref in ready:
        node = refs[ref]
        try:
            reports.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            if node["NodeID"] in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
                cause = getattr(exc, "cause", None) or exc
                reports.append({**_identity(node), "problems": [
                    f"cannot run ktconvert's pre-flight ({_first_line(cause)}): install ktconvert "
                    f"{package_versions().get('ktconvert')} there"]})
            else:
                gone.append(f"node {_name(_identity(node))} left the cluster during the pre-flight "
                            f"({type(exc).__name__}): no task will run there")
    reports += [{**_identity(refs[ref]), "problems": [f"no answer to the pre-flight in {PREFLIGHT_SECONDS} s "
                                                      "(frozen or overloaded?): check it or remove it"]}
                for ref in late]
    try:
        check_reports(reports, package_versions(), parts_root, nonce)
    finally:
        if parts_root is not None:
            shutil.rmtree(Path(parts_root) / PREFLIGHT_DIR, ignore_errors=True)
    return gone


def check_node(src: str, files: dict[str, int] | None, parts_root: str | None, nonce: str) -> dict:
    """A Ray task on one node: {"host", "node_id", "versions", "problems": [what is wrong there]} (`src` as the
    driver names it, `files` as ``preflight`` takes them); the marker PARTS/.ktconvert-preflight/<node id>
    holding `nonce` written (none without `parts_root`)."""
    import ray

    report = {"host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
              "versions": package_versions(), "native": native_status(), "problems": []}
    problems = report["problems"]
    if files is not None and not os.path.exists(src):
        problems.append(f"SRC {src} is not there: make SRC the same path on every node (shared storage)")
        files = {}
    for path, size in (files or {}).items():
        try:
            found = os.stat(path).st_size
            readable = os.access(path, os.R_OK)
        except OSError as exc:
            problems.append(f"SRC file {path} is not there ({exc.strerror}): make SRC the same path on every node "
                            "(shared storage)")
            break
        if not readable or found != size:
            problems.append(f"SRC file {path} is " + ("not readable" if not readable else
                                                      f"{found} bytes there, {size} on the driver")
                            + ": make SRC the same checkpoint on every node")
            break
    if parts_root is None:
        report["marker"] = False
        return report
    marker = Path(parts_root) / PREFLIGHT_DIR / report["node_id"]
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(nonce)
    except OSError as exc:
        problems.append(f"--parts-dir {parts_root} is not writable there ({exc.strerror})")
        report["marker"] = False
    return report


def native_status() -> str:
    """"loaded", or why ktconvert's native library does not load in this process (one line)."""
    from ktconvert import native

    return "loaded" if native.lib() is not None else str(native.load_error())


def check_reports(reports: list[dict], versions: dict, parts_root, nonce: str, driver_native: str | None = None) \
        -> None:
    """NodeError naming every node whose report shows a problem: other package versions than `versions`, a
    native library that does not load where the driver's does (`driver_native`: the driver's ``native_status``,
    asked when None), a problem it found, or a marker it wrote in `parts_root` (None: none) that the driver does
    not read back with `nonce`."""
    lines, driver_native = [], driver_native or native_status()
    for report in reports:
        problems = list(report.get("problems", []))
        theirs = report.get("versions")
        if theirs is not None and theirs != versions:
            problems.insert(0, f"it runs {_versions(theirs)}, the driver {_versions(versions)}: install the "
                            "driver's on every node")
        native = report.get("native")
        if native is not None and native != "loaded" and driver_native == "loaded":
            problems.append(f"ktconvert's native library does not load there ({native}), on the driver it does: "
                            "reinstall ktconvert on that node (pip install --force-reinstall)")
        if parts_root is not None and report.get("marker", True) and "versions" in report \
                and not _holds(Path(parts_root) / PREFLIGHT_DIR / str(report.get("node_id")), nonce):
            problems.append(f"the file it wrote in --parts-dir {parts_root} is not visible to the driver: put "
                            "--parts-dir on storage every node and the driver share")
        if problems:
            lines.append(f"node {_name(report)}: " + "; ".join(problems))
    if lines:
        raise NodeError(f"pre-flight failed on {len(lines)} of {len(reports)} nodes: " + " | ".join(lines),
                        hint="fix the nodes named (nothing was converted)")


def _holds(marker: Path, nonce: str) -> bool:
    try:
        return marker.read_text() == nonce
    except OSError:
        return False


def _identity(node: dict) -> dict:
    return {"host": node.get("NodeManagerHostname") or node.get("NodeManagerAddress"), "node_id": node["NodeID"]}


def _name(report: dict) -> str:
    return f"{report.get('host') or 'unknown host'} (id {str(report.get('node_id'))[:12]})"


def _versions(packages: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in sorted(packages.items()))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"
