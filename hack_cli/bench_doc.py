"""Benchmarks write their measured tables into the docs between named markers, so a page
always quotes the last run of its command (and the command itself)."""
from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def command_line(bench: str, argv: list[str] | None = None) -> str:
    """`hack bench <bench> ...` as invoked: `argv` as given to `hack_cli.main.main` (from
    "bench" on), else this process's command line."""
    rest = argv[2:] if argv is not None else sys.argv[3:]
    return " ".join(["hack", "bench", bench, *(shlex.quote(a) for a in rest)])


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench-{name}:begin -->", f"<!-- bench-{name}:end -->"


def replace_block(doc: Path, name: str, body: str, heading: str = "## Measured") -> None:
    """Put `body` between the `name` markers of `doc` (appended under `heading` if absent)."""
    begin, end = markers(name)
    block = f"{begin}\n\n{body.strip()}\n\n{end}"
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    doc.write_text(text)


def cpu_name() -> str:
    """This host's CPU model (/proc/cpuinfo's "model name"), for the tables that name their host."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def publish(doc: dict, body: str, out: str, model: str, block: str, to_doc: bool,
            page: str = "engine.md", heading: str = "## Measured") -> None:
    """A benchmark's result: the JSON at `out` (a template with {model}; '' = none) and, with
    `to_doc`, `body` in docs/`page` between the `block` markers."""
    if to_doc:
        replace_block(DOCS / page, block, body, heading=heading)
    if out:
        path = Path(out.format(model=model))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
