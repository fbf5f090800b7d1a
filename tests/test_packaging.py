"""What users install is what is tested: the sdist and the wheel are built from this tree in a temporary folder
(``python -m build --no-isolation``: the sdist first, then the wheel from the unpacked sdist, as pip does), their
contents are checked against the tree, and the wheel is installed into a throwaway venv that runs its own
``ktconvert``. The venv gets the wheel with ``--no-deps``; the test environment's packages are visible to it through
a .pth file (plain paths: the editable install's own .pth there is not processed, so ``import ktconvert`` finds the
wheel). Subprocesses run with ``-P`` / from an empty folder so the source tree is never on their path."""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import click
import pytest

from hidden_modules import NOT_IN_BASE, run_cli_without

ROOT = Path(__file__).resolve().parents[1]
BUILD_OUTPUTS = ("__pycache__", "*.pyc", "*.so", "*.o", "*.egg-info", "build", "dist", ".pytest_cache")
SDIST_FOLDERS = ("ktconvert", "manifests", "native", "tests", "examples", "docs", "benchmarks", "scripts")
SDIST_FILES = ("README.md", "pyproject.toml", "setup.py", "MANIFEST.in")
LIBRARY = "ktconvert/native/_ktnative.so"
# Python C-API names (PyLong_FromLong, Py_BuildValue, PyInit_x, ...) as they would appear in the dynamic symbol
# table of a library that used the Python ABI.
PYTHON_API_SYMBOL = re.compile(rb"\x00_?Py[A-Za-z]*_[A-Za-z]\w*\x00")

# A run of the copied tree's tests from the unpacked sdist: conftest's tiny_model fixture, the golden GGUF fixtures,
# the hidden_modules helper.
SDIST_TESTS = ["tests/test_tiny.py::test_files_shards_and_index",
               "tests/test_input_gguf.py::test_fixture_files_match_sources_json",
               "tests/test_input_gguf.py::test_llama_cpp_fixture_decodes_like_gguf_py",
               "tests/test_extras.py::test_require_in_process"]


def _source_files() -> list[str]:
    """The files a build sees: git's tracked + untracked-not-ignored files in a checkout, else every file (an
    unpacked sdist) but build outputs."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return sorted(p for p in listed if p and (ROOT / p).is_file())
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and not any(
        fnmatch(part, pattern) for part in p.relative_to(ROOT).parts for pattern in BUILD_OUTPUTS))


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{cmd}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KTCONVERT_", "VIRTUAL_ENV"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Copy of the tree -> sdist -> wheel (from the sdist) -> unpacked sdist -> venv with the wheel installed."""
    work = tmp_path_factory.mktemp("packaging")
    tree = work / "tree"
    files = _source_files()
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tree / rel)
    build = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", tree], env=_clean_env())
    (sdist,), (wheel,) = sorted((work / "dist").glob("*.tar.gz")), sorted((work / "dist").glob("*.whl"))
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        sdist_names = {PurePosixPath(n).relative_to(top).as_posix() for n in tar.getnames() if n != top}
        tar.extractall(work / "sdist", filter="data")
    with zipfile.ZipFile(wheel) as zf:
        wheel_names = set(zf.namelist())
        library = zf.read(LIBRARY) if LIBRARY in wheel_names else None
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    (Path(purelib) / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    run_dir = work / "run"
    run_dir.mkdir()
    return SimpleNamespace(build_log=build.stdout + build.stderr, tree=tree, files=files, sdist=sdist, sdist_names=sdist_names,
                           sdist_dir=work / "sdist" / top, wheel=wheel, wheel_names=wheel_names, library=library,
                           venv=venv, python=python, run_dir=run_dir, work=work)


def test_build_prints_no_deprecation_of_our_metadata(built):
    """The project's metadata is current (SPDX license string): building prints no setuptools deprecation box."""
    assert "deprecated" not in built.build_log.lower() and "BuildBackendWarning" not in built.build_log, \
        built.build_log[-3000:]


def test_sdist_holds_the_tree(built):
    """Sources, manifests, C sources and headers, the tests with conftest, helpers and golden fixtures, examples/,
    docs/, benchmarks/ and the install script."""
    wanted = {f for f in built.files if f.split("/")[0] in SDIST_FOLDERS} | set(SDIST_FILES)
    assert {f for f in wanted if f.startswith("ktconvert/") and f.endswith(".py")}, "no package sources found"
    for must in ("tests/conftest.py", "tests/hidden_modules.py", "examples/tiny-jobs.toml", "docs/architecture.md",
                 "native/kt_native.h", "manifests/qwen3_moe.toml"):
        assert must in wanted, must
    assert sorted(wanted - built.sdist_names) == []


def test_wheel_holds_every_module_and_manifest(built):
    modules = {f for f in built.files if f.startswith("ktconvert/") and f.endswith(".py")}
    manifests = {"ktconvert/manifests/" + f.split("/", 1)[1] for f in built.files
                 if f.startswith("manifests/") and f.endswith((".toml", ".py"))}
    assert "ktconvert/gpu/output.py" in modules and "ktconvert/manifests/deepseek.toml" in manifests
    assert sorted((modules | manifests) - built.wheel_names) == []
    outside = [n for n in built.wheel_names if not n.startswith(("ktconvert/", "ktconvert-"))]
    assert outside == []


def test_one_platform_wheel_for_every_python(built):
    """The native library is loaded with ctypes and uses no Python ABI: py3-none-<platform>, stripped."""
    if built.library is None:
        assert built.wheel.name.endswith("-py3-none-any.whl")    # no compiler: numpy fallback, pure wheel
        pytest.skip("no C compiler here: the native library was not built")
    platform = built.wheel.name.rsplit("-", 1)[1][: -len(".whl")]
    assert built.wheel.name.endswith(f"-py3-none-{platform}.whl") and platform != "any"
    with zipfile.ZipFile(built.wheel) as zf:
        meta = zf.read(next(n for n in built.wheel_names if n.endswith(".dist-info/WHEEL"))).decode()
    assert f"Tag: py3-none-{platform}" in meta.splitlines() and "Root-Is-Purelib: false" in meta
    assert [n for n in built.wheel_names if n.endswith(".so")] == [LIBRARY]     # no python-ABI-tagged name
    assert b".debug_info" not in built.library and b".symtab" not in built.library    # no debug info, stripped
    assert b"libpython" not in built.library and not PYTHON_API_SYMBOL.search(built.library)


def _command_paths(group: click.Group, prefix: tuple = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, command in sorted(group.commands.items()):
        paths.append(prefix + (name,))
        if isinstance(command, click.Group):
            paths += _command_paths(command, prefix + (name,))
    return paths


def test_installed_wheel_runs_every_command_help(built):
    from ktconvert.cli.main import cli

    script = built.venv / "bin" / "ktconvert"
    top = _run([script, "--help"], cwd=built.run_dir, env=_clean_env())
    paths = _command_paths(cli)
    assert {"cpu", "gpu", "convert", "verify", "demo"} <= {p[0] for p in paths}
    for path in paths:
        assert path[0] in top.stdout
        result = _run([script, *path, "--help"], cwd=built.run_dir, env=_clean_env())
        assert result.stdout.startswith("Usage:"), path


def test_installed_wheel_imports_every_module(built):
    """Every module of the tree, ktconvert.gpu and ktconvert.gptq first, imports from the installed wheel."""
    modules = ["ktconvert.gpu", "ktconvert.gptq"] + sorted(
        f[:-3].replace("/", ".").removesuffix(".__init__") for f in built.files
        if f.startswith("ktconvert/") and f.endswith(".py"))
    code = """if True:
        import importlib, json, sys
        files = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
        import ktconvert.native
        print(json.dumps({"files": files, "native": ktconvert.native.available()}))
    """
    report = json.loads(_run([built.python, "-P", "-c", code, *modules], cwd=built.run_dir, env=_clean_env()).stdout)
    outside = [name for name, file in report["files"].items() if not Path(file).is_relative_to(built.venv)]
    assert outside == []
    assert report["native"] == (built.library is not None)     # the ABI-free library name is found and loads


def test_installed_wheel_runs_the_demo_without_gpu_extra(built):
    """`pip install ktconvert` (no extras): torch, compressed-tensors, llmcompressor, transformers, safetensors
    and tokenizers hidden, the wheel's own demo (tiny model -> cpu -> verify) passes."""
    result = run_cli_without(NOT_IN_BASE, ["demo", built.work / "demo"], python=built.python, cwd=built.run_dir,
                             env=_clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result: OK" in result.stdout
    gpu = run_cli_without(NOT_IN_BASE, ["gpu", built.work / "demo" / "model", built.work / "gpu"],
                          python=built.python, cwd=built.run_dir, env=_clean_env())
    assert gpu.returncode == 2 and "needs the [gpu] extra" in gpu.stderr and not (built.work / "gpu").exists()


def test_tests_run_from_the_unpacked_sdist(built):
    """conftest, helpers and golden fixtures ship: a few tests run from the unpacked sdist against the wheel."""
    result = _run([built.python, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *SDIST_TESTS],
                  cwd=built.sdist_dir, env=_clean_env())
    summary = result.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, summary
