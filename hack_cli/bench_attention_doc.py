"""The CPU attention benchmark's tables for docs/kernels.md (`hack bench attention --doc`):
decode and prefill rows with their ratios and roofline fractions, the store rows, and the
target lines, all from one result of `hack_cli.bench_attention.run`."""
from __future__ import annotations

from .bench_doc import DOCS, replace_block

DOC = DOCS / "kernels.md"
BLOCK = "attention-cpu"
# Targets of the prefill-on-codes work: prefill HACK >= 1.5x the faster of BF16/FP32 SDPA at
# >= 8K and >= 1.0x at 2K; decode >= 40% of the measured copy bandwidth at >= 8K.
PREFILL_TARGET = {2048: 1.0, 8192: 1.5}
DECODE_BW_TARGET = 0.40


def _ms(results: list[dict], phase: str, shape: str, batch: int, ctx: int) -> dict[str, float]:
    return {r["method"]: r["median_ms"] for r in results
            if (r["phase"], r["shape"], r["batch"], r["context"]) == (phase, shape, batch, ctx)}


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def render(doc: dict, command: str, date: str) -> str:
    roof = doc["roofline"]
    lines = [f"Command: `{command}`  ",
             f"Measured: {date} on {doc['machine']}, {doc['threads']} thread(s), {doc['clock']} clock, "
             f"median of {doc['repeats']} repeats (prefill: {max(1, doc['repeats'] // 2)}); CPU kernel "
             f"{'AVX-512 VNNI' if doc.get('kernel_simd') else 'plain C'}; prefill path: {doc.get('extend_path')}.", "",
             f"Roofline of the same run: copy {roof['copy_gb_s']} GB/s (read + write), GEMM peaks "
             f"BF16 {roof['bf16_gops']} / FP32 {roof['fp32_gops']} / INT8 {roof.get('int8_gops')} GOPS.", "",
             "| phase | shape | batch | context | HACK ms | HACK attn ms | store ms | BF16 ms | FP32 ms | dequant ms "
             "| vs baseline | attn vs baseline | vs dequant | achieved |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    checks = []
    for r in doc["ratios"]:
        ms = _ms(doc["results"], r["phase"], r["shape"], r["batch"], r["context"])
        if r["phase"] == "decode":
            frac = r.get("hack_copy_bw_frac")
            lines.append(f"| decode | {r['shape']} | {r['batch']} | {r['context']} | {_f(ms.get('hack'))} | | "
                         f"| {_f(ms.get('bf16'))} | | {_f(ms.get('dequant'))} | x{r['hack_vs_bf16']:.2f} (BF16) | "
                         f"| x{r['hack_vs_dequant']:.2f} | {_f(frac and 100 * frac, '{:.1f}')}% of copy bw |")
            if r["context"] >= 8192 and frac is not None:
                checks.append(f"decode {r['shape']} batch {r['batch']} {r['context']}: {100 * frac:.1f}% of copy "
                              f"bandwidth (target >= {100 * DECODE_BW_TARGET:.0f}%; "
                              f"{'met' if frac >= DECODE_BW_TARGET else 'missed'})")
        else:
            base = r.get("baseline", "bf16")
            lines.append(f"| prefill | {r['shape']} | 1 | {r['context']} | {_f(ms.get('hack'))} | "
                         f"{_f(ms.get('hack-attn'))} | {_f(ms.get('hack-store'))} | {_f(ms.get('bf16'))} | "
                         f"{_f(ms.get('fp32'))} | {_f(ms.get('dequant'))} | x{r['hack_vs_baseline']:.2f} ({base.upper()}) "
                         f"| x{r['hack_attn_vs_baseline']:.2f} | x{r['hack_vs_dequant']:.2f} | "
                         f"attn {_f(r.get('hack_attn_int8_peak_frac') and 100 * r['hack_attn_int8_peak_frac'], '{:.0f}')}% "
                         f"of INT8 peak; {base.upper()} {100 * r['baseline_gemm_peak_frac']:.0f}% of its peak; store "
                         f"{r['store_input_gb_s']} GB/s |")
            want = PREFILL_TARGET[8192] if r["context"] >= 8192 else PREFILL_TARGET[2048]
            x = r["hack_vs_baseline"]
            checks.append(f"prefill {r['shape']} {r['context']}: HACK (store + attention) x{x:.2f} the faster SDPA "
                          f"(target >= {want:g}x; {'met' if x >= want else f'missed by {100 * (1 - x / want):.0f}%'})")
    store = doc.get("store") or []
    if store:
        lines += ["", "Store rows (one layer of SmolLM2's KV shape; compiled page store vs the PyTorch store):", "",
                  "| case | tokens | compiled ms | compiled GB/s | PyTorch ms | PyTorch GB/s | speedup |",
                  "|---|---|---|---|---|---|---|"]
        for s in store:
            fast = s["fast"]
            lines.append(f"| store {s['case']} | {s['tokens']} | {s['ms'][fast]:.3f} | {s['gb_per_s'][fast]:.3f} | "
                         f"{s['ms']['torch']:.3f} | {s['gb_per_s']['torch']:.4f} | x{s['speedup']:.1f} |")
    lines += ["", *[f"- {c}" for c in checks]]
    return "\n".join(lines)


def write(doc: dict, command: str, date: str) -> None:
    replace_block(DOC, BLOCK, render(doc, command, date), heading="### Measured (CPU)")
