"""`hack calibrate MODEL`: measure where a model's 2-bit error sits, layer by layer and KV head
by KV head, K and V apart, and write the bit plan that spends a byte budget where it buys most.

On calibration items (hack_eval.calibration_text: GSM8K problems with an access code hidden in
them, text no evaluation reads), with the study's own tools in 'dequant' mode (the layout's
error without the INT8 noise):
  * per (layer, tensor), that tensor alone at 2 bits, every other read exact (`hack eval
    layers`' sweep, K and V apart): the mean KL from the exact model's next-token distribution
    (perplexity's share) and the rise in the answer's negative log-likelihood (retrieval's
    share: the access code is one fact far back, as a pass key is). The layer's 2-bit output is
    computed once, by the probe below, and fed back in (runner.override_attention); the layers
    below it are the exact pass's, reused: one pass costs the layers above it only;
  * per (layer, KV head, tensor), from one exact pass: the relative error that tensor's 2-bit
    codes put on that head's attention output, and the attention mass the head's queries put on
    the needle (`hack eval retrieval --needle-attention`, per head).
A (layer, tensor)'s score is the mean of its KL share and its retrieval share; the plan takes
tensors by score per byte until the next one would pass the budget (bytes per token at
budget_context, tails and sinks included, hack_ops.layout.model_bytes_per_token).

Heads or layers: the per-head analysis spreads each layer's score over its KV heads in
proportion to their attention-output error and asks how much more of the total score a plan
could buy per head than per layer at the same bytes. The answer is in the plan's measurements
and the report; the format stores bits per layer (docs/accuracy.md says why).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hack_ops import HackConfig
from hack_ops.bit_plan import BitPlan, model_hash
from hack_ops.layout import model_bytes_per_token

from .attention_paths import study_attention
from .calibration_text import CalibrationItem, build_items, text_path
from .runner import (EXACT, Variant, hidden_for, load_model, logits_from_hidden, model_geometry, override_attention,
                     probe_attention)

TENSORS = ("k", "v")
KL_STRIDE = 4  # KL is scored at every 4th position (and every answer position): the ranking, not the value
HEAD_GAIN_BAR = 1.25  # per-head bits pay for their machinery only above this much more score per byte


@dataclass(frozen=True)
class CalibrationSettings:
    context: int = 1024
    items: int = 2
    budget_fraction: float = 0.20
    budget_context: int = 4096
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget_fraction}")
        if self.context < 256 or self.items < 1 or self.budget_context < 1:
            raise ValueError("calibration needs context >= 256, items >= 1 and budget_context >= 1")


def _ratio(cfg: HackConfig, geo: tuple[int, int, int], context: int) -> float:
    n, h, d = geo
    return model_bytes_per_token(cfg, n, h, d, context)["ratio"]


def _config(picks: list[tuple[int, str]]) -> HackConfig:
    return HackConfig(four_bit_k_layers=tuple(l for l, t in picks if t == "k"),
                      four_bit_v_layers=tuple(l for l, t in picks if t == "v"))


def _decoder_layers(model: Any) -> Any:
    return model.model.layers


class _reuse_exact_layers:
    """While active, decoder layers below `first` return the outputs they gave in the exact pass
    instead of computing them again: a variant that quantizes layer `first` alone leaves every
    layer below it exact, so their outputs are those (half the compute of the per-layer sweep)."""

    def __init__(self, model: Any, outputs: list[Any], first: int):
        self.layers, self.outputs, self.first = _decoder_layers(model), outputs, first

    def __enter__(self) -> None:
        for i in range(self.first):
            out = self.outputs[i]
            self.layers[i].forward = lambda *a, _out=out, **k: _out

    def __exit__(self, *exc) -> None:
        for i in range(self.first):
            del self.layers[i].forward


class _ItemScorer:
    """One item's exact log-probabilities at the scored positions (and each decoder layer's exact
    output), and a variant's distance to them."""

    def __init__(self, model: Any, item: CalibrationItem):
        self.model, self.item = model, item
        n = len(item.ids)
        answer = list(range(item.answer_start - 1, n - 1))
        self.rows = torch.tensor(sorted(set(range(KL_STRIDE - 1, n - 1, KL_STRIDE)) | set(answer)))
        self.answer_rows = torch.tensor([int((self.rows == a).nonzero()) for a in answer])
        self.targets = torch.tensor(item.ids[1:])[self.rows]
        layers = _decoder_layers(model)
        self.outputs: list[Any] = [None] * len(layers)
        hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: self.outputs.__setitem__(i, out))
                 for i, layer in enumerate(layers)]
        try:
            self.ref = self._logp(EXACT)
        finally:
            for h in hooks:
                h.remove()

    @torch.inference_mode()
    def _logp(self, variant: Variant, first: int = 0) -> torch.Tensor:
        with _reuse_exact_layers(self.model, self.outputs, first):
            hidden = hidden_for(self.model, list(self.item.ids), variant)
        return torch.log_softmax(logits_from_hidden(self.model, hidden[self.rows]), -1)

    def answer_nll(self, logp: torch.Tensor) -> float:
        t = self.targets[self.answer_rows]
        return float(-logp[self.answer_rows].gather(1, t[:, None]).sum())

    def answered(self, logp: torch.Tensor) -> bool:
        return bool(torch.equal(logp[self.answer_rows].argmax(-1), self.targets[self.answer_rows]))

    @torch.inference_mode()
    def score(self, variant: Variant, override: tuple[int, torch.Tensor] | None = None) -> dict:
        """KL and answer NLL of `variant`, or of the exact model with layer override[0]'s attention
        output replaced by override[1] (the layers below it reused from the exact pass)."""
        if override is not None:
            with override_attention(*override):
                logp = self._logp(EXACT, override[0])
        else:
            logp = self._logp(variant, min(variant.layers) if variant.layers else 0)
        kl = float((self.ref.exp() * (self.ref - logp)).sum(-1).mean())
        return {"kl": kl, "answer_nll": self.answer_nll(logp), "answered": self.answered(logp)}


@torch.inference_mode()
def _head_probe(model: Any, item: CalibrationItem, geo: tuple[int, int, int], cfg: HackConfig) -> dict:
    """Per layer and KV head, from one exact pass: the relative error of the head's attention
    output with K alone (V alone) at 2 bits (dequantized, the other read in FP16, as
    study_attention's 'dequant' path computes it), and the attention mass of the answer positions
    on the needle (the most of the head's query heads). Also each layer's two 2-bit outputs, which
    the per-layer sweep feeds back in (runner.override_attention) instead of quantizing again."""
    from hack_ops.attention import soft_cap, visible

    from .attention_paths import _blocked, dequant_views

    n_layers, h_kv, _ = geo
    err = {t: torch.zeros(n_layers, h_kv) for t in TENSORS}
    outs: dict[tuple[int, str], torch.Tensor] = {}
    needle = torch.zeros(n_layers, h_kv)
    rows = torch.arange(item.answer_start - 1, len(item.ids) - 1)

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, scale: float | None, window: int | None,
              cap: float, v: torch.Tensor | None = None) -> None:
        q, k, v = q.float(), k.float(), v.float()
        rep = q.shape[1] // k.shape[1]
        sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
        exact = study_attention(q, k, v, None, "exact", scale=scale, window=window, logit_cap=cap)
        denom = exact.pow(2).sum((-1, -2)).clamp_min(1e-12)  # [1, Hq]
        kc, ko, vc, vo = dequant_views(k, v, cfg)
        k16, v16 = k.half().float(), v.half().float()
        for t, views in (("k", (kc, ko, v16, v16)), ("v", (k16, k16, vc, vo))):
            out = _blocked(q * sc, *views, cfg.partition_size, window, cap)
            outs[(layer, t)] = out
            err[t][layer] = (((out - exact).pow(2).sum((-1, -2)) / denom)[0]).view(h_kv, rep).mean(-1)
        kf = k[0].repeat_interleave(rep, 0)
        s = soft_cap(q[0, :, rows] @ kf.transpose(-1, -2) * sc, cap)
        s = s.masked_fill(~visible(torch.arange(kf.shape[1])[None, :], rows[:, None], window), float("-inf"))
        mass = torch.softmax(s, -1)[..., item.needle_start:item.needle_start + item.needle_len].sum(-1).mean(-1)
        needle[layer] = mass.view(h_kv, rep).max(-1).values

    with probe_attention(probe):
        hidden_for(model, list(item.ids), EXACT)
    return {"err": err, "needle": needle, "outs": outs}


def _shares(values: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    total = sum(max(0.0, v) for v in values.values())
    return {k: (max(0.0, v) / total if total > 0 else 0.0) for k, v in values.items()}


def choose(scores: dict[tuple[int, str], float], geo: tuple[int, int, int], budget: float,
           context: int) -> list[tuple[int, str]]:
    """(layer, tensor) pairs by score per byte, largest first, while the format stays within
    `budget` of BF16's bytes at `context` tokens; a pair that would pass it is skipped."""
    base = _ratio(HackConfig(), geo, context)
    cost = {key: _ratio(_config([key]), geo, context) - base for key in scores}
    picks: list[tuple[int, str]] = []
    for key in sorted(scores, key=lambda k: (-scores[k] / cost[k], k)):
        if scores[key] <= 0:
            break
        if _ratio(_config(picks + [key]), geo, context) <= budget + 1e-9:
            picks.append(key)
    return sorted(picks)


def head_analysis(scores: dict[tuple[int, str], float], err: dict[str, torch.Tensor],
                  needle: torch.Tensor, picks: list[tuple[int, str]]) -> dict:
    """How much of the total score a per-head plan would buy against the per-layer plan, at the
    per-layer plan's bytes (a head's bytes are 1/H of its layer's). A (layer, tensor)'s score is
    spread over its KV heads by their share of its attention-output error."""
    h = err["k"].shape[1]
    per_head = []
    for (layer, t), s in scores.items():
        e = err[t][layer]
        share = e / e.sum() if float(e.sum()) > 0 else torch.full_like(e, 1.0 / h)
        per_head += [float(s * share[i]) for i in range(h)]
    total = sum(scores.values())
    layer_take = sum(scores[k] for k in picks) / total if total > 0 else 0.0
    head_take = sum(sorted(per_head, reverse=True)[:len(picks) * h]) / total if total > 0 else 0.0
    # the same question for retrieval alone: the top KV head's share of its layer's needle mass
    top = (needle.max(-1).values / needle.sum(-1).clamp_min(1e-12))
    by_needle = torch.argsort(needle.max(-1).values, descending=True)[:8].tolist()
    return {
        "kv_heads": h,
        "layer_plan_score_share": layer_take,
        "head_plan_score_share": head_take,
        "head_over_layer": head_take / layer_take if layer_take > 0 else float("inf"),
        "bar": HEAD_GAIN_BAR,
        "heads_matter_more": h > 1 and layer_take > 0 and head_take / layer_take >= HEAD_GAIN_BAR,
        "needle_top_head_share": {int(l): float(top[l]) for l in by_needle},
    }


def calibrate(model_path: str | Path, model_name: str, settings: CalibrationSettings = CalibrationSettings(),
              command: str = "", log: Callable[[str], None] = print) -> BitPlan:
    """Measure the model in `model_path` and return its bit plan (not written: BitPlan.write)."""
    t_start = time.time()
    torch.manual_seed(settings.seed)
    model, tok = load_model(Path(model_path), threads=settings.threads)
    geo = model_geometry(model)
    n_layers, _, _ = geo
    items = build_items(tok, settings.context, settings.items, settings.seed)
    cfg = HackConfig()
    keys = [(layer, t) for layer in range(n_layers) for t in TENSORS]
    kl = {k: 0.0 for k in keys}
    rise = {k: 0.0 for k in keys}
    err = {t: torch.zeros(n_layers, geo[1]) for t in TENSORS}
    needle = torch.zeros(n_layers, geo[1])
    exact_nll, plain = [], []
    scorers = []
    for n, item in enumerate(items):
        scorer = _ItemScorer(model, item)
        scorers.append(scorer)
        base_nll = scorer.answer_nll(scorer.ref)
        exact_nll.append(base_nll)
        probe = _head_probe(model, item, geo, cfg)
        for t in TENSORS:
            err[t] += probe["err"][t] / len(items)
        needle += probe["needle"] / len(items)
        plain.append(scorer.score(Variant("plain", "dequant", cfg)))
        for layer, t in keys:  # that tensor alone at 2 bits: its output, measured by the probe, fed back in
            r = scorer.score(EXACT, override=(layer, probe["outs"].pop((layer, t))))
            kl[(layer, t)] += r["kl"] / len(items)
            rise[(layer, t)] += (r["answer_nll"] - base_nll) / len(items)
            if t == "v" and layer % 5 == 4:
                log(f"calibrate: item {n + 1}, layers 0-{layer} measured ({time.time() - t_start:.0f} s)")
        log(f"calibrate: item {n + 1}/{len(items)} measured ({time.time() - t_start:.0f} s)")
    kl_share, ret_share = _shares(kl), _shares(rise)
    scores = {k: 0.5 * (kl_share[k] + ret_share[k]) for k in keys}
    picks = choose(scores, geo, settings.budget_fraction, settings.budget_context)
    plan_cfg = _config(picks)
    planned = [s.score(Variant("plan", "dequant", plan_cfg)) for s in scorers]
    heads = head_analysis(scores, err, needle, picks)
    mean = lambda rows, f: sum(r[f] for r in rows) / len(rows)  # noqa: E731
    measurements = {
        "per_layer": [{"layer": layer, **{f"{t}_{name}": round(float(v[(layer, t)]), 6)
                                          for t in TENSORS for name, v in (("kl", kl), ("answer_nll_rise", rise),
                                                                          ("score", scores))},
                       **{f"{t}_head_err": [round(float(x), 5) for x in err[t][layer]] for t in TENSORS},
                       "needle_mass": [round(float(x), 4) for x in needle[layer]]}
                      for layer in range(n_layers)],
        "heads": heads,
        "check": {"exact_answer_nll": sum(exact_nll) / len(exact_nll),
                  "plain": {"kl": mean(plain, "kl"), "answer_nll": mean(plain, "answer_nll"),
                            "answered": sum(r["answered"] for r in plain)},
                  "plan": {"kl": mean(planned, "kl"), "answer_nll": mean(planned, "answer_nll"),
                           "answered": sum(r["answered"] for r in planned)},
                  "items": len(items), "mode": "dequant"},
    }
    text = text_path()
    return BitPlan(
        model_hash=model_hash(model_path), model=model_name, num_layers=n_layers, num_kv_heads=geo[1],
        head_dim=geo[2], k_layers=tuple(l for l, t in picks if t == "k"),
        v_layers=tuple(l for l, t in picks if t == "v"), budget_fraction=settings.budget_fraction,
        budget_context=settings.budget_context, bytes_ratio=_ratio(plan_cfg, geo, settings.budget_context),
        plain_bytes_ratio=_ratio(cfg, geo, settings.budget_context),
        calibration={"text": f"{text.parent.name}/{text.name} (GSM8K train less the workloads' sample), "
                             "an access code hidden in each item", "context": settings.context,
                     "items": settings.items, "seed": settings.seed, "seconds": round(time.time() - t_start, 1),
                     "date": datetime.date.today().isoformat(), "command": command},
        measurements=measurements)


def render(plan: BitPlan) -> str:
    """A short text report of a plan: what it raises, what it bought on the calibration items,
    and the heads-or-layers answer."""
    m, c = plan.measurements, plan.measurements["check"]
    h = m["heads"]
    lines = [f"bit plan for {plan.model} (model {plan.short_hash}): {plan.summary()}",
             f"calibration: {plan.calibration['items']} items of {plan.calibration['context']} tokens, "
             f"{plan.calibration['seconds']:.0f} s; {plan.calibration['text']}",
             f"on those items ({c['mode']}): KL plain {c['plain']['kl']:.4f} -> plan {c['plan']['kl']:.4f}; "
             f"answer NLL exact {c['exact_answer_nll']:.3f}, plain {c['plain']['answer_nll']:.3f}, plan "
             f"{c['plan']['answer_nll']:.3f}; codes found plain {c['plain']['answered']}/{c['items']}, plan "
             f"{c['plan']['answered']}/{c['items']}",
             f"heads vs layers ({h['kv_heads']} KV heads): at the plan's bytes a per-layer plan takes "
             f"{100 * h['layer_plan_score_share']:.1f}% of the score, a per-head plan would take "
             f"{100 * h['head_plan_score_share']:.1f}% (x{h['head_over_layer']:.2f}; bar x{h['bar']:.2f}): "
             + ("heads matter more" if h["heads_matter_more"] else "per-layer bits")]
    ranked = sorted(m["per_layer"], key=lambda r: -max(r["k_score"], r["v_score"]))[:8]
    lines.append("top layers by score (K / V): " + "; ".join(
        f"{r['layer']}: {r['k_score']:.3f} / {r['v_score']:.3f}" for r in ranked))
    return "\n".join(lines)
