"""README.md: one screen for a newcomer, its results table generated from the JSON it quotes
(hack_cli/readme_results.py), and every link in it pointing at a file and a heading that exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hack_cli import readme_results

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    found, fence = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


def test_the_table_is_what_the_json_says():
    """Regenerate with `python -m hack_cli.readme_results --write` after a benchmark rewrote its
    JSON; a number is never edited by hand."""
    assert readme_results.block() in README.read_text()


def test_every_source_states_command_date_and_host():
    for row in readme_results.ROWS:
        for s in row.sources:
            d = s.load()
            assert s.date or d.get("date"), s.path
            assert s.command or d.get("command"), s.path
            assert s.host and s.doc.startswith("docs/") and "#" in s.doc, s.path


@pytest.mark.parametrize("target", sorted(set(LINK.findall(README.read_text()))))
def test_readme_links_resolve(target):
    path, _, anchor = target.partition("#")
    assert (ROOT / path).exists(), target
    if anchor:
        assert anchor in anchors(ROOT / path), f"{target}: no heading with that anchor"


def test_readme_fits_one_screen_and_names_what_a_newcomer_needs():
    text = README.read_text()
    assert len(text.splitlines()) <= 50, "README.md is one screen: move detail into docs/"
    for needed in ("make demo", "make test", "--kv-cache-dtype hack", "hack up", "hack dashboard"):
        assert needed in text, needed


def test_slug_matches_githubs():
    assert slug("On an AVX-512 + AMX host (2026-11-25)") == "on-an-avx-512--amx-host-2026-11-25"
    assert slug("Retrieval: a pass key in a long document") == "retrieval-a-pass-key-in-a-long-document"
    assert slug("`hack up` / `hack status`") == "hack-up--hack-status"
    assert slug("head_dim 256") == "head_dim-256"
