"""No import circles among the project's modules (docs/architecture.md): each concern has one
owner that the others import, so no module needs another that needs it back. The graph is read
from the source (ast), every import counted, late ones inside functions too: a late import
hides a circle from Python, not from a reader. tests/ is not scanned."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hack_ops", "hack_eval", "hack_metrics", "engine", "disagg", "dashboard", "hack_cli")


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> its file (a package is its __init__.py)."""
    mods = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module that `name` (a module, or a name inside one) lives in."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str, is_package: bool, mods: dict[str, Path]) -> set[str]:
    """The project modules `module` imports. `from pkg import sub` counts as importing pkg.sub
    when sub is a module (not pkg: a package's __init__ running first is no dependency of ours)."""
    found = set()
    for node in ast.walk(ast.parse(source, module)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for n in names:
            owner = _owner(n, mods)
            if owner and owner != module:
                found.add(owner)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = module_names(root, packages)
    return {m: imports_of(m, p.read_text(), p.name == "__init__.py", mods) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import circles (move what they share to the module that owns it):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_scan_finds_a_circle_through_late_and_relative_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from p.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    (pkg / "d.py").write_text("from . import a\nimport p.sub\n")  # imports into the circle: not part of it
    graph = import_graph(tmp_path, ("p",))
    assert graph["p.sub.c"] == {"p.a"} and graph["p.d"] == {"p.a", "p.sub"}
    assert cycles(graph) == [["p.a", "p.b", "p.sub.c"]]
    (pkg / "sub" / "c.py").write_text("from p import sub\n")
    assert cycles(import_graph(tmp_path, ("p",))) == []
