"""The README's table of headline results, generated from the JSON the benchmarks and studies
wrote (docs/bench/*.json, docs/study/*.json), so the numbers a newcomer reads first are the
files' numbers, never retyped. Each value links to the doc section that explains it and names
the command, date and host that measured it (the host as the docs state it: the JSON records
no CPU model for most runs).

    python -m hack_cli.readme_results           # print the table
    python -m hack_cli.readme_results --write   # rewrite it in README.md between the markers

tests/test_readme_results.py fails when README.md and the JSON disagree.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN = "<!-- headline-results:begin (generated: python -m hack_cli.readme_results --write) -->"
END = "<!-- headline-results:end -->"

NO_AMX = "x86, no AMX"
AMX = "Intel Xeon, AMX"
UNRECORDED = "x86, CPU not recorded"
ANY_CPU = "2-core x86"


@dataclass(frozen=True)
class Source:
    """One measurement a row quotes: a JSON file, the words the README shows for it, the doc
    section that explains it, and who measured it when."""

    path: str                       # relative to the repository root
    text: Callable[[dict], str]     # the value as shown, computed from the JSON
    doc: str                        # "docs/engine.md#anchor"
    host: str
    date: str | None = None         # for JSON without a "date" field (the studies)
    command: str | None = None      # for JSON without a "command" field

    def load(self, root: Path = ROOT) -> dict:
        return json.loads((root / self.path).read_text())


@dataclass(frozen=True)
class Row:
    what: str
    sources: tuple[Source, ...]


def _x(v: float) -> str:
    return f"x{v:.2f}"


def _pct(v: float, digits: int = 1) -> str:
    return f"{100 * v:.{digits}f}%"


def _jct(d: dict, method: str, rate: float) -> float:
    return next(p["jct_s"]["mean"] for p in d["points"] if p["method"] == method and p["link_mbps"] == rate)


def _jct_cut(d: dict, method: str, rate: float) -> str:
    """How much lower `method`'s mean JCT is than BF16's, as the bench's own compare lines say it."""
    return _pct(1 - _jct(d, method, rate) / _jct(d, "bf16", rate))


def _row(d: dict, variant: str, mode: str) -> dict:
    return next(r for r in d["rows"] if r["variant"] == variant and r["mode"] == mode)


def _ppl_against_plain(d: dict, variant: str) -> str:
    """A `hack eval accuracy --bits-plan` run's perplexity for `variant` (the shipped plan's row), with
    the plain 2-bit format's beside it."""
    ratio = lambda v: _x3(_row(d, v, "hack")["ppl_ratio"])  # noqa: E731
    return f"perplexity {ratio(variant)} of exact (2K; plain 2-bit {ratio('default, plain 2-bit')})"


def _served_pass_key(d: dict, method: str = "hack") -> str:
    """A `hack eval retrieval --served` run's pass keys found by the default HACK server (`method`:
    the run's name for a server with the default's flags)."""
    r = _row(d, method, "served")
    return f"pass key at 4K, served, calibrated bits (default) {_pct(r['accuracy'], 0)} of {r['items']}"


def _gpu_decode(d: dict) -> str:
    r = [c["hack_vs_bf16"] for c in d["results"] if c["phase"] == "decode"]
    return f"Triton: {_x(min(r))}-{_x(max(r))} (slower; {len(r)} cells)"


def _cuda_decode(d: dict, card: str = "") -> str:
    r = [c["cuda_vs_bf16"] for c in d["results"]]
    big = max(d["results"], key=lambda c: c["batch"] * c["context"])
    return (f"{card or 'CUDA kernel'}: {_x(big['cuda_vs_bf16'])} BF16 flash attention's speed at batch {big['batch']} x "
            f"{big['context'] // 1024}K ({_pct(big['methods']['cuda']['fraction_of_copy'], 0)} of copy bandwidth); "
            f"{_x(min(r))}-{_x(max(r))} over {len(r)} cells (small cells' BF16 time varies run to run)")


def _model_decode(d: dict, card: str = "") -> str:
    by = {r["format"]: r for r in d["results"]}
    return (f"{card + ': ' if card else ''}{_x(d['hack_vs_bf16'])} BF16's tokens/s (Llama-3-8B shapes, "
            f"{d['context'] // 1024}K context, batch {by['hack']['batch']} vs {by['bf16']['batch']} in "
            f"{d['kv_budget_gib']:.0f} GiB)")


ROWS: tuple[Row, ...] = (
    Row("KV bytes vs BF16", (
        Source("docs/bench/hack-wire.json",
               lambda d: f"{_pct(d['bytes_hack_pages'] / d['bytes_bf16'], 2)} on the PD wire ({d['tokens']:,} tokens)",
               "docs/disagg.md#what-travels-per-request", NO_AMX),
        Source("docs/study/accuracy-smollm2-8k.json",
               lambda d: f"{_pct(_row(d, 'default', 'hack')['bytes_vs_bf16'])} in the pool (8K tokens)",
               "docs/accuracy.md#today", ANY_CPU, "2026-11-24", "hack eval accuracy"),
    )),
    Row("Capacity, same KV memory", (
        Source("docs/bench/serve-quick.json",
               lambda d: f"{_x(d['ratios_vs_bf16']['hack']['capacity'])} the tokens (SmolLM2)",
               "docs/engine.md#smollm2-135m-without-amx-2026-11-24", NO_AMX),
        Source("docs/bench/serve-gemma3.json",
               lambda d: f"{_x(d['ratios_vs_bf16']['hack']['capacity'])} (Gemma-3; all layers 2-bit "
                         f"{_x(d['ratios_vs_bf16']['hack-2bit']['capacity'])})",
               "docs/engine.md#gemma-3-270m", UNRECORDED),
    )),
    Row("Decode speed, CPU server", (
        Source("docs/bench/serve-8k.json",
               lambda d: f"{_x(d['ratios_vs_bf16']['hack']['decode']['8000'])} BF16's tokens/s at 8K (SmolLM2)",
               "docs/engine.md#smollm2-135m-without-amx-2026-11-24", NO_AMX),
        Source("docs/bench/serve-quick.json",
               lambda d: f"{_x(d['ratios_vs_bf16']['hack']['decode']['2048'])} at 2K",
               "docs/engine.md#smollm2-135m-without-amx-2026-11-24", NO_AMX),
        Source("docs/bench/serve-8k-amx-dense.json",
               lambda d: f"{_x(d['ratios_vs_bf16']['hack']['decode']['8000'])} at 8K with AMX",
               "docs/engine.md#on-an-avx-512--amx-host", AMX),
    )),
    Row("Decode speed, GPU kernel", (
        Source("docs/bench/decode-cuda.json", lambda d: _cuda_decode(d, "CUDA kernel, H200"),
               "docs/kernels.md#measured-on-an-h200", "NVIDIA H200"),
        Source("docs/bench/decode-cuda-h100.json", lambda d: _cuda_decode(d, "H100"),
               "docs/kernels.md#measured-on-an-h100", "NVIDIA H100"),
        Source("docs/bench/attention-cuda.json", _gpu_decode,
               "docs/kernels.md#measured-on-a-gpu", "NVIDIA H200"),
    )),
    Row("Decode, GPU, same KV memory", (
        Source("docs/bench/decode-model.json", lambda d: _model_decode(d, "H200"),
               "docs/kernels.md#measured-on-an-h200", "NVIDIA H200"),
        Source("docs/bench/decode-model-h100.json", lambda d: _model_decode(d, "H100"),
               "docs/kernels.md#measured-on-an-h100", "NVIDIA H100"),
    )),
    Row("PD mean JCT, 7.5K-token documents", (
        Source("docs/bench/disagg.json",
               lambda d: f"{_jct_cut(d, 'hack', 100.0)} below BF16's at 100 Mbit/s, "
                         f"{_jct_cut(d, 'hack', 1000.0)} at 1000",
               "docs/disagg.md#long-documents-without-amx", NO_AMX),
        Source("docs/bench/disagg-amx.json",
               lambda d: f"with AMX {_jct_cut(d, 'hack-dense-prefill', 100.0)} at 100",
               "docs/disagg.md#on-a-cpu-with-amx", AMX),
        Source("docs/bench/disagg-amx-1000.json",
               lambda d: f"{_jct_cut(d, 'hack-dense-prefill', 1000.0)} at 1000",
               "docs/disagg.md#on-a-cpu-with-amx", AMX),
    )),
    Row("Returning conversations (page tier)", (
        Source("docs/bench/restore-multiturn-smollm2.json",
               lambda d: f"SmolLM2: TTFT {_x(d['ratios']['ttft_returning_tier_vs_recompute'])} recompute's, "
                         f"{_x(d['ratios']['tier_tokens_per_byte_hack_vs_bf16'])} the tokens of a BF16 tier per byte",
               "docs/engine.md#the-page-tier", AMX),
        Source("docs/bench/restore-multiturn-gemma3.json",
               lambda d: f"Gemma-3: {_x(d['ratios']['ttft_returning_tier_vs_recompute'])}, "
                         f"{_x(d['ratios']['tier_tokens_per_byte_hack_vs_bf16'])}",
               "docs/engine.md#the-page-tier", AMX),
    )),
    Row("Accuracy, SmolLM2-135M", (
        Source("docs/study/accuracy-smollm2-2k-rotation.json",
               lambda d: _ppl_against_plain(d, "default, calibrated bit plan"),
               "docs/accuracy.md#today", NO_AMX, "2026-12-02", "hack eval accuracy --bits-plan"),
        # the shipped plan with its rotation (hadamard_kv): the default server's flags, named explicitly
        Source("docs/study/retrieval-smollm2-4k-served-rotation.json",
               lambda d: _served_pass_key(d, "hack-rotation"),
               "docs/accuracy.md#today", NO_AMX, "2026-12-02", "hack eval retrieval --served hack-rotation"),
        Source("docs/study/retrieval-smollm2-4k-served-plan-rounds.json",
               lambda d: f"BF16 {_pct(_row(d, 'bf16', 'served')['accuracy'], 0)} (the same items)",
               "docs/accuracy.md#today", NO_AMX, "2026-12-02", "hack eval retrieval --served bf16,hack"),
        Source("docs/study/retrieval-smollm2-8k-served-rotation.json",
               lambda d: f"at 8K {_pct(_row(d, 'hack-rotation', 'served')['accuracy'], 0)} of 50",
               "docs/accuracy.md#today", NO_AMX, "2026-12-02", "hack eval retrieval --served hack-rotation"),
        Source("docs/study/retrieval-smollm2-8k-served-bf16-50.json",
               lambda d: f"BF16 {_pct(_row(d, 'bf16', 'served')['accuracy'], 0)} (the same items)",
               "docs/accuracy.md#today", NO_AMX, "2026-12-02", "hack eval retrieval --served bf16"),
        Source("docs/study/retrieval-smollm2-4k-served.json",
               lambda d: f"plain 2-bit {_pct(_row(d, 'hack', 'served')['accuracy'], 0)}",
               "docs/accuracy.md#retrieval-a-pass-key-in-a-long-document", ANY_CPU, "2026-11-25",
               "hack eval retrieval --served bf16,hack"),
    )),
    Row("Accuracy, Gemma-3-270M", (
        Source("docs/study/accuracy-gemma3-2k-plan-rounds.json",
               lambda d: _ppl_against_plain(d, "default, calibrated bit plan"),
               "docs/accuracy.md#today", NO_AMX, "2026-12-01", "hack eval accuracy --model gemma3 --bits-plan"),
        Source("docs/study/retrieval-gemma3-4k-served-plan-rounds.json",
               _served_pass_key,
               "docs/accuracy.md#today", NO_AMX, "2026-12-01", "hack eval retrieval --model gemma3 --served hack"),
        Source("docs/study/retrieval-gemma3-4k-served-50.json",
               lambda d: f"BF16 {_pct(_row(d, 'bf16', 'served')['accuracy'], 0)} of 50 (the same items), plain 2-bit "
                         f"{_pct(_row(d, 'hack', 'served')['accuracy'], 0)}",
               "docs/accuracy.md#retrieval-a-pass-key-in-a-long-document", ANY_CPU, "2026-11-26",
               "hack eval retrieval --model gemma3"),
    )),
)


def _x3(v: float) -> str:
    return f"x{v:.3f}"


def short_command(command: str) -> str:
    """The command's name as the table shows it: up to its first option, plus --model if given
    (the full line is in the JSON the cell links)."""
    words = command.split()
    name = []
    for w in words:
        if w.startswith("--"):
            break
        name.append(w)
    if "--model" in words and words.index("--model") + 1 < len(words):
        name += ["--model", words[words.index("--model") + 1]]
    return " ".join(name)


def render(root: Path = ROOT) -> str:
    lines = ["| | HACK, today | measured by: command, date (its JSON), host |", "|---|---|---|"]
    for row in ROWS:
        values, who = [], []
        for s in row.sources:
            d = s.load(root)
            command = s.command or short_command(d["command"])
            date = s.date or d["date"]
            values.append(f"[{s.text(d)}]({s.doc})")
            who.append(f"`{command}`, [{date}]({s.path}), {s.host}")
        lines.append(f"| {row.what} | {'; '.join(values)} | {'; '.join(who)} |")
    return "\n".join(lines)


def block(root: Path = ROOT) -> str:
    return f"{BEGIN}\n{render(root)}\n{END}"


def write(readme: Path = README, root: Path = ROOT) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no headline-results markers")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + block(root) + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack_cli.readme_results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = ap.parse_args(argv)
    if args.write:
        write()
    else:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
