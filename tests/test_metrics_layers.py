"""Dependencies point down: dashboard -> hack_metrics <- engine. The reader side (hack_metrics)
and the dashboard import neither the engine nor SGLang, and hack_metrics is packaged."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPWARD = ("engine", "disagg", "hack_cli", "sglang", "dashboard")


def _imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_hack_metrics_imports_no_engine_sglang_or_dashboard():
    bad = {f"{p.name}: {m}" for p in (ROOT / "hack_metrics").glob("*.py")
           for m in _imported_modules(p) if _top(m) in UPWARD}
    assert not bad, f"hack_metrics must not import upward: {sorted(bad)}"


def test_dashboard_reads_metrics_only_through_hack_metrics():
    bad = {f"{p.name}: {m}" for p in (ROOT / "dashboard").glob("*.py")
           for m in _imported_modules(p) if _top(m) in ("engine", "disagg", "hack_cli", "sglang")}
    assert not bad, f"the dashboard must read runs through hack_metrics only: {sorted(bad)}"


def test_dashboard_modules_load_without_engine_or_sglang():
    """Importing them for real, in a fresh interpreter, pulls in neither package."""
    code = ("import sys, hack_metrics.run_view, hack_metrics.http_client, dashboard.sources, "
            "dashboard.figures; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('engine', 'sglang', 'disagg')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_every_top_level_package_is_in_the_distribution():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    missing = [p for p in packages if f"{p}*" not in include and p not in include]
    assert not missing, f"pyproject's packages.find.include misses {missing}"
    assert "hack_metrics" in packages
