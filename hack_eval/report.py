"""Renders the accuracy study's results as docs/accuracy.md."""
from __future__ import annotations

from hack_ops import HackConfig

BYTE_BUDGET = 0.18  # default = most accurate 2-bit variant at <= 18% of BF16 bytes at 2K


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def choose_default(rows: list[dict]) -> dict | None:
    """The most accurate (lowest perplexity ratio) 2-bit row within the byte budget."""
    ok = [r for r in rows if r["config"] and "2bit" in r["config"] and r["bytes_vs_bf16"] <= BYTE_BUDGET]
    return min(ok, key=lambda r: r["ppl_ratio"]) if ok else None


def report_head(title: str, intro: str, command: str) -> list[str]:
    """The opening lines every study report shares: title, what was run, and the command."""
    return [f"# {title}", "", intro, "", "Produced by:", "", f"```\n{command}\n```", ""]


def render(results: dict, command: str) -> str:
    rows = results["rows"]
    lines = report_head(
        "Accuracy of the KV formats on a real model",
        f"Model: {results['model']}. Context {results['context']} tokens, teacher-forced over "
        f"{results['windows']['essays']} essay windows and {results['windows']['plays']} play windows "
        f"({results['predicted_tokens']} predicted tokens); greedy generation of "
        f"{results['gen_tokens']} tokens on {results['gen_prompts']} HumanEval prompts.", command) + [
        "Columns: perplexity ratio to the exact model (pooled; min-max over windows), mean KL",
        "divergence from the exact next-token distribution (nats), top-1 agreement with the exact",
        "model, edit similarity of greedy continuations to the exact model's, and bytes per element",
        "relative to BF16 at this context (pages, side tables, FP16 tails averaged over the open",
        "partition's fill, and sinks included). 'hack' rows run the homomorphic path (INT8 Q and P,",
        "no dequantization); 'dequant' rows run the same 2-bit cache dequantized before exact",
        "attention, i.e. the layout's error without the INT8 noise.",
        "",
        "| variant | mode | config | ppl ratio (min-max) | KL | top-1 | edit sim. | bytes vs BF16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['mode']} | {r['config'] or '—'} | x{r['ppl_ratio']:.3f} "
            f"({r['ppl_ratio_min']:.2f}-{r['ppl_ratio_max']:.2f}) | {r['kl']:.4f} | {r['top1'] * 100:.1f}% | "
            f"{_fmt(r['edit_similarity'], '.3f')} | {r['bytes_vs_bf16'] * 100:.1f}% |"
        )
    lines += ["", "## The default", ""]
    best = choose_default(rows)
    default_label = HackConfig().label()
    if best is None:
        lines.append("No 2-bit variant fits the byte budget in this run.")
    else:
        agree = best["config"] == default_label
        lines.append(
            f"The most accurate 2-bit variant within {BYTE_BUDGET:.0%} of BF16 bytes in this run is "
            f"`{best['config']}` ({best['mode']}, x{best['ppl_ratio']:.3f} perplexity, "
            f"{best['bytes_vs_bf16'] * 100:.1f}% of BF16). `HackConfig()` defaults to `{default_label}`"
            + (": the same." if agree else ": they DIFFER — revisit the defaults.")
        )
    hack = {r["config"]: r for r in rows if r["mode"] == "hack"}
    deq = {r["config"]: r for r in rows if r["mode"] == "dequant"}
    pairs = [(c, hack[c], deq[c]) for c in hack if c in deq]
    if pairs:
        lines += ["", "INT8 Q/P noise (hack vs dequant on the same layout):", ""]
        for c, h, d in pairs:
            lines.append(f"- `{c}`: perplexity {h['ppl']:.3f} vs {d['ppl']:.3f} "
                         f"({(h['ppl'] / d['ppl'] - 1) * 100:+.2f}%)")
    return "\n".join(lines) + "\n"
