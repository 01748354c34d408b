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


def render_gpu_run(path: Path, bench: str, name: str, block: str, table, heading: str,
                   page: str = "kernels.md") -> int:
    """A GPU run's JSON (files come back from the GPU machine) made docs/bench/`name`.json and its
    table in docs/`page` between the `block` markers, with no GPU. `table(doc)` renders it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from-json: cannot read {path}: {exc}") from None
    missing = [k for k in ("device", "date", "command", "results", "copy_bandwidth_gb_per_s") if k not in doc]
    if missing:
        raise ValueError(f"--from-json: {path} is not a {bench} result (missing {', '.join(missing)})")
    (DOCS / "bench").mkdir(parents=True, exist_ok=True)
    (DOCS / "bench" / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    replace_block(DOCS / page, block, table(doc), heading=heading)
    print(f"wrote docs/bench/{name}.json and the table in docs/{page} ({len(doc['results'])} cells, {doc['device']})")
    return 0


def gpu_bench_cli(ap, argv: list[str] | None, run, render) -> int:
    """The command line of a GPU benchmark module (`python -m hack_cli.bench_*_cuda`): parse argv
    (`--from-json` and `--repeats` among its options), then render a GPU run's JSON or measure;
    a ValueError or RuntimeError is one line on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.command_line = " ".join([ap.prog, *argv])
    try:
        if args.from_json:
            return render(args.from_json)
        if args.repeats <= 0:
            raise ValueError("--repeats must be positive")
        return run(args)
    except (ValueError, RuntimeError) as exc:
        print(f"{ap.prog.rsplit('.', 1)[-1]}: error: {exc}", file=sys.stderr)
        return 2


def gpu_run_header(doc: dict, versions: str, baseline_note: str = "") -> list[str]:
    """The paragraph above a GPU benchmark's table (card, date, command, the BF16 baseline, the
    tools' `versions`, how it timed, the copy bandwidth of the run) and, for a run stopped at its
    time limit, how many cells it measured; then a blank line."""
    lines = [f"Measured on {doc['device']} ({doc['date']}) with `{doc['command']}`; BF16 baseline: "
             f"**{doc['bf16_baseline']}**{baseline_note}; {versions}. Median of {doc['repeats']} CUDA-event timings "
             f"after {doc['warmup']} warm-up calls, methods alternating, L2 flushed before each call. Copy bandwidth "
             f"(read + write) in the same run: {doc['copy_bandwidth_gb_per_s']:.0f} GB/s.", ""]
    if doc.get("complete") is False:
        lines[-1:] = [f"Stopped early: {doc['cells_done']} of {doc['cells_planned']} planned cells measured.", ""]
    return lines
