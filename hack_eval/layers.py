"""`hack eval layers`: where a KV format's error sits in a model, layer by layer, K against V.

Teacher-forced over the study's windows (accuracy.run_study), in 'dequant' mode (the layout's
error without the INT8 noise): every layer quantized (the study's row), K alone and V alone in
every layer (the other read in FP16), then each layer alone with every other layer exact. The
per-layer rows do not add up to the whole (errors compound through the layers), but they rank
the layers: a format that spends more bits where the ranking says (HackConfig.four_bit_layers,
`--hack-4bit-layers`) buys the most accuracy per byte.
"""
from __future__ import annotations

import json
from typing import Callable

from hack_ops import HackConfig

from .attention_paths import QuantizedTensors
from .report import report_head
from .runner import EXACT, Variant

ALL = "all layers"


def sweep_variants(num_layers: int, config: HackConfig | None = None) -> list[Variant]:
    """exact, every layer (K and V, K alone, V alone), then each layer alone."""
    cfg = config or HackConfig()
    rows = [EXACT, Variant(ALL, "dequant", cfg),
            Variant(f"{ALL}, K only", "dequant", cfg, tensors=QuantizedTensors.K),
            Variant(f"{ALL}, V only", "dequant", cfg, tensors=QuantizedTensors.V)]
    return rows + [Variant(f"layer {i}", "dequant", cfg, layers=(i,)) for i in range(num_layers)]


def run_layer_sweep(model_name: str, context: int, essays: int, plays: int, threads: int | None = None,
                    log: Callable[[str], None] = print) -> dict:
    """The sweep on `model_name`'s windows; the study's result dict plus 'ranked' (layer rows by
    KL to the exact model, largest first)."""
    from .accuracy import run_study
    from .models import prepare

    config_path = prepare(model_name, log=log) / "config.json"
    num_layers = int(json.loads(config_path.read_text())["num_hidden_layers"])
    res = run_study(context=context, essays=essays, plays=plays, gen_prompts=0, threads=threads, log=log,
                    model_name=model_name, variants=sweep_variants(num_layers))
    layer_rows = [r for r in res["rows"] if r["variant"].startswith("layer ")]
    res["ranked"] = [r["variant"] for r in sorted(layer_rows, key=lambda r: -r["kl"])]
    res["num_layers"] = num_layers
    return res


def render_layers(res: dict, command: str) -> str:
    """The markdown report of a sweep: the whole-model rows, then one row per layer."""
    rows = {r["variant"]: r for r in res["rows"]}
    total_kl = rows[ALL]["kl"]
    lines = report_head(
        "Where the 2-bit error sits, layer by layer",
        f"Model: {res['model']}. Context {res['context']}, windows: {res['windows']['essays']} essays, "
        f"{res['windows']['plays']} plays ({res['predicted_tokens']} predicted tokens). 'dequant' mode "
        f"of the default format; a row names what is quantized, everything else exact.", command) + [
        "| quantized | ppl ratio (min-max) | KL | top-1 | share of the all-layer KL |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if r["variant"] == "exact":
            continue
        share = f"{100 * r['kl'] / total_kl:.0f}%" if total_kl > 0 else "—"
        lines.append(f"| {r['variant']} | x{r['ppl_ratio']:.3f} ({r['ppl_ratio_min']:.2f}-{r['ppl_ratio_max']:.2f}) | "
                     f"{r['kl']:.4f} | {100 * r['top1']:.1f}% | {share} |")
    lines += ["", "Layers by KL, largest first: " + ", ".join(v.removeprefix("layer ") for v in res["ranked"]) + "."]
    return "\n".join(lines) + "\n"
