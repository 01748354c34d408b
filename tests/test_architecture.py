"""Dependencies point down (docs/architecture.md): hack_cli -> disagg -> engine -> hack_ops,
disagg -> hack_eval -> hack_ops, dashboard -> hack_metrics <- engine (the writer). Nothing in engine/ or
hack_ops/ imports disagg, nothing in hack_ops imports engine, not even by a module name in a
string (importlib). The scan reads the source (ast); docstrings may name other packages."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages of this project it must never import
FORBIDDEN = {
    "hack_ops": ("disagg", "engine", "hack_eval", "hack_cli", "dashboard", "hack_metrics"),
    "hack_eval": ("disagg", "engine", "hack_cli", "dashboard", "hack_metrics"),
    "hack_metrics": ("disagg", "engine", "hack_eval", "hack_cli", "dashboard", "hack_ops"),
    "engine": ("disagg", "hack_eval", "hack_cli", "dashboard"),
    "disagg": ("hack_cli", "dashboard"),
    "dashboard": ("disagg", "hack_cli", "engine"),
}


# A string that is a file name ("dashboard.log") names no module.
FILE_NAME = re.compile(r"[\w-]+\.(log|md|json|jsonl|png|txt|csv|py|arrow)")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def upward_references(source: str, filename: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports of, and non-docstring strings naming, a module of a forbidden package."""
    tree = ast.parse(source, filename)
    docs = _docstrings(tree)
    name = re.compile(r"(?<![\w.-])(%s)(\.|$)" % "|".join(map(re.escape, forbidden)))
    found = []
    for node in ast.walk(tree):
        mods: list[str] = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        for m in mods:
            if m.split(".")[0] in forbidden:
                found.append(f"{filename}:{node.lineno}: import {m}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if name.search(node.value) and not FILE_NAME.fullmatch(node.value):
                found.append(f"{filename}:{node.lineno}: string {node.value[:60]!r}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_import(package):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += upward_references(path.read_text(), str(path.relative_to(ROOT)), FORBIDDEN[package])
    assert not found, "upward references:\n" + "\n".join(found)


def test_the_scan_sees_imports_and_module_names_in_strings():
    src = ('"""Docstrings may say disagg.connector."""\n'
           "import importlib\nfrom disagg import faults\nimport engine.pool\n"
           "importlib.import_module('disagg.wire_meter')\nx = f'disagg.{1}'\n"
           "flag = '--disagg-mode'\nok = 'disaggregation'\nlog = 'disagg.log'\n")
    found = upward_references(src, "m.py", ("disagg", "engine"))
    assert found == ["m.py:3: import disagg", "m.py:4: import engine.pool",
                     "m.py:5: string 'disagg.wire_meter'", "m.py:6: string 'disagg.'"]
