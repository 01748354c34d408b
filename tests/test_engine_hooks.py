"""The hook table against the installed SGLang: every upstream symbol the project touches is a
row (engine.hooks, plus the PD connector's rows that disagg registers), every row resolves, and
the source imports no upstream symbol that no row names. A version bump that moves one fails
here rather than silently in a server."""
from __future__ import annotations

import ast
import inspect
import os
import pkgutil
import tomllib
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from disagg import connector  # noqa: E402
from engine import hooks  # noqa: E402

connector.register()  # what the plugin entry point does before the engine registers the table

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("engine", "disagg", "hack_ops", "hack_cli", "hack_eval", "dashboard")
SETS = hooks.hook_sets()
HOOKS = [h for s in SETS for h in s.hooks]
USES = [u for s in SETS for u in s.uses]
PATCHES = [p for s in SETS for p in s.patches]


def test_the_table_holds_the_engine_and_the_pd_connector():
    assert [s.name for s in SETS] == ["engine", "disagg"]
    assert len(HOOKS) == len(hooks.HOOKS) + len(connector.CONNECTOR.rows().hooks)


@pytest.mark.parametrize("target", sorted({h.target for h in HOOKS} | {u.symbol for u in USES}))
def test_upstream_symbol_exists(target):
    assert pkgutil.resolve_name(target) is not None


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.owner.rsplit('.', 1)[-1]}.{p.attr}")
def test_patched_attribute_is_still_upstream(patch):
    """On a class: the attribute exists there. On a reader function: it still reads it."""
    owner = pkgutil.resolve_name(patch.owner)
    if inspect.isclass(owner):
        assert hasattr(owner, patch.attr)
    else:
        assert patch.attr in inspect.getsource(owner)


@pytest.mark.parametrize("cls,name", hooks.DIRECT_FIELDS)
def test_upstream_field_exists(cls, name):
    import dataclasses

    assert name in {f.name for f in dataclasses.fields(pkgutil.resolve_name(cls))}


def test_rows_are_well_formed():
    from sglang.srt.plugins.hook_registry import HookType

    for h in HOOKS:
        assert h.kind in HookType.__members__, h
        assert callable(h.fn) and h.why, h
    for row in USES + PATCHES:
        assert row.why, row


def test_plugin_entry_points_are_the_declared_ones():
    """The installed metadata matches pyproject.toml (after a change there: `make install`)."""
    from importlib.metadata import entry_points

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    for group in ("sglang.srt.plugins", "sglang.srt.platforms"):
        installed = {ep.name: ep.value for ep in entry_points(group=group)}
        assert installed.get("hack") == declared[group]["hack"], \
            f"{group}: installed {installed.get('hack')!r}; run `make install` to refresh the entry points"
    assert declared["sglang.srt.plugins"]["hack"] == "disagg.plugin:load"


def test_layer_attributes_exist():
    """The RadixAttention attributes engine.backend / engine.model_checks read."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=2, head_dim=64, scaling=0.125, num_kv_heads=1, layer_id=0)
    for name in hooks.LAYER_ATTRS:
        assert hasattr(layer, name), name


def test_every_pool_override_is_a_row():
    """A method HackKVPool overrides is a row, so an upstream rename is caught, not ignored."""
    from engine.pool import HackKVPool

    base = HackKVPool.__mro__[1]
    prefix = f"{base.__module__}.{base.__qualname__}."
    overrides = {name for name, v in vars(HackKVPool).items()
                 if callable(v) and name != "__init__" and hasattr(base, name)}
    rows = {u.symbol[len(prefix):] for u in USES if u.symbol.startswith(prefix)}
    assert overrides <= rows, sorted(overrides - rows)


# ---- the source against the table ----------------------------------------------------------

def _upstream_imports_and_sets() -> tuple[set[tuple[str, str]], set[tuple[str, str, str]]]:
    """(file, symbol) of every `sglang...` import and (file, symbol, attr) of every attribute
    assignment on a name bound by one, in the scanned packages."""
    imports, sets = set(), set()
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(), rel)
            bound: dict[str, str] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
                    for a in node.names:
                        imports.add((rel, f"{node.module}.{a.name}"))
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] == "sglang":
                            imports.add((rel, a.name))
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in bound:
                        sets.add((rel, bound[t.value.id], t.attr))
    return imports, sets


def test_every_upstream_import_in_the_source_is_a_row():
    named = {h.target for h in HOOKS} | {u.symbol for u in USES}
    imports, _ = _upstream_imports_and_sets()
    assert imports, "the scan found no upstream import at all"
    # A module imported to reach a listed attribute (`from x import http_server`) counts.
    missing = sorted(f"{f}: {s}" for f, s in imports
                     if s not in named and not any(n.startswith(s + ".") for n in named))
    assert not missing, "upstream symbols used but in no row of the hook table:\n" + "\n".join(missing)


def test_every_attribute_set_on_an_upstream_symbol_is_a_patch_row():
    _, sets = _upstream_imports_and_sets()
    rows = {(p.owner, p.attr) for p in PATCHES}
    missing = sorted(f"{f}: {s}.{a}" for f, s, a in sets if (s, a) not in rows)
    assert not missing, "attributes set on upstream symbols without a Patch row:\n" + "\n".join(missing)
    assert sets, "the scan found no attribute set (disagg.connector sets one)"


def test_fault_injection_is_a_row_only_when_switched_on(monkeypatch):
    from disagg import faults

    monkeypatch.delenv(faults.FAULT_FILE_ENV, raising=False)
    off = connector.PdConnector().rows()
    assert faults.before_verify not in [h.fn for h in off.hooks]
    monkeypatch.setenv(faults.FAULT_FILE_ENV, "/nonexistent/trigger")
    on = [h for h in connector.PdConnector().rows().hooks if h.target.endswith("._verify_kv_checksums")]
    # The fault row comes after `install`: registered later, it wraps it and runs first.
    assert [h.fn.__name__ for h in on] == ["install", "before_verify"]
