"""`hack calibrate MODEL`: measure which of a model's K and V codes buy most at 4 bits, layer
by layer, K and V apart, and write the bit plan that spends a byte budget where it buys most.

On calibration items (hack_eval.calibration_text: held-out plays, ShareGPT conversations and
GSM8K problems in turn, each with an access code hidden in it; text no evaluation reads), with
the study's own tools in 'dequant' mode (the layout's error without the INT8 noise), in rounds:
  * a round starts from the plan so far (round 1: every code at 2 bits) and measures, for every
    candidate (layer, tensor), what raising that tensor alone to 4 bits buys: the fall of the KL
    from the exact model's next-token distribution (perplexity's share) and of the answer's
    negative log-likelihood (retrieval's: the access code is one fact far back, as a pass key
    is). Layers below the candidate's are the round's base pass, reused, and the candidate
    layer's attention output is computed once in that pass (runner.override_attention): a
    candidate costs the layers above it only;
  * a candidate's score is the share of the plain format's KL it takes back, plus, until the
    plan keeps retrieval (its answer-NLL rise at most RETRIEVAL_KEPT of the plain format's, or
    under RETRIEVAL_FLOOR nats), the share of the plain format's answer-NLL rise it takes back.
    A few tensors keep the fact; past that, an answer's NLL moves by one item's noise, and
    perplexity's share decides;
  * the round takes candidates by score per byte, up to half the bytes still free (at least
    one), and the next round measures again from there: raised tensors interact (a tensor that
    mattered alone matters less once its neighbour is exact), so gains are measured against the
    plan they join. After round 1 only the SHORTLIST best remaining candidates by score, and the
    SHORTLIST best by KL alone, are measured.
Rounds end when no candidate fits the budget or none buys anything.

Then the rotation (hack_ops.rotation): the plan is scored on the same items with its codes taken
under each candidate rotation (ROTATION_CANDIDATES: Walsh-Hadamard on K and V, the accuracy
study's best), and a rotation is kept where it cuts the plan's KL by at least ROTATION_GAIN and
finds as many access codes. A rotation costs no bytes, but it is model-dependent (it halved
SmolLM2's perplexity excess over its plan and raised Gemma-3's, docs/accuracy.md), so it is
measured per model, like the bits. `--layers-from PLAN` runs this step alone on an earlier plan's
layers (the rounds are the slow part).

Heads or layers: from one exact pass, the relative error each tensor's 2-bit codes put on each
KV head's attention output and the attention mass each head puts on the needle. The per-head
analysis spreads each layer's round-1 score over its KV heads in proportion to that error and
asks how much more of the total score a plan could buy per head than per layer at the same
bytes. The answer is in the plan's measurements and the report; the format stores bits per
layer (docs/accuracy.md says why).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from hack_ops import HackConfig
from hack_ops.bit_plan import BitPlan, model_hash, plan_for_check
from hack_ops.layout import model_bytes_per_token
from hack_ops.rotation import ROTATION_AUTO, Rotation, head_dim_refusal

from .attention_paths import study_attention
from .calibration_text import CalibrationItem, CalibrationText, build_items, describe
from .runner import (EXACT, Variant, hidden_for, load_model, logits_from_hidden, model_geometry, override_attention,
                     probe_attention)

TENSORS = ("k", "v")
KL_STRIDE = 4  # KL is scored at every 4th position (and every answer position): the ranking, not the value
HEAD_GAIN_BAR = 1.25  # per-head bits pay for their machinery only above this much more score per byte
SHORTLIST = 16  # candidates measured again in each round after the first
# Retrieval counts as kept once the plan's answer-NLL rise over the exact model is at most this
# share of the plain format's; from then on candidates are scored by the KL alone (a retrieval
# gain past that point is mostly one item's noise, and it steered picks away from perplexity).
RETRIEVAL_KEPT = 0.25
# ... and retrieval is not scored at all where the plan's answer-NLL rise is under this many nats (a
# mean over the items): the plain format already answers, and what moves is noise (on Gemma-3 the
# plain format's rise was 0.3 nats, and the plans it steered came out "better than exact").
RETRIEVAL_FLOOR = 1.0

# The rotations the calibration tries on the plan it chose (hadamard_kv: the study's best scope;
# its signed and single-tensor variants measured no better, docs/accuracy.md), and the share of the
# plan's KL one must take away to be kept (less is within what the items' choice moves).
ROTATION_CANDIDATES = (Rotation.HADAMARD_KV,)
ROTATION_GAIN = 0.10

Key = tuple[int, str]  # (layer, "k" or "v")


@dataclass(frozen=True)
class CalibrationSettings:
    context: int = 2048
    items: int = 3
    budget_fraction: float = 0.20
    budget_context: int = 4096
    seed: int = 0
    threads: int | None = None
    text: CalibrationText = CalibrationText.MIX
    rotation: str = ROTATION_AUTO  # measure the candidates and keep what pays, or a Rotation value: taken as given

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", CalibrationText(self.text))
        if self.rotation != ROTATION_AUTO:
            object.__setattr__(self, "rotation", Rotation(self.rotation).value)
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget_fraction}")
        if self.context < 256 or self.items < 1 or self.budget_context < 1:
            raise ValueError("calibration needs context >= 256, items >= 1 and budget_context >= 1")


def _ratio(cfg: HackConfig, geo: tuple[int, int, int], context: int) -> float:
    n, h, d = geo
    return model_bytes_per_token(cfg, n, h, d, context)["ratio"]


def _config(picks: list[Key]) -> HackConfig:
    return HackConfig(four_bit_k_layers=tuple(sorted(l for l, t in picks if t == "k")),
                      four_bit_v_layers=tuple(sorted(l for l, t in picks if t == "v")))


def _decoder_layers(model: Any) -> Any:
    return model.model.layers


class _reuse_layers:
    """While active, decoder layers below `first` return the outputs they gave in a recorded pass
    instead of computing them again: a candidate that changes layer `first` alone leaves every
    layer below it as that pass computed it."""

    def __init__(self, model: Any, outputs: list[Any], first: int):
        self.layers, self.outputs, self.first = _decoder_layers(model), outputs, first

    def __enter__(self) -> None:
        for i in range(self.first):
            out = self.outputs[i]
            self.layers[i].forward = lambda *a, _out=out, **k: _out

    def __exit__(self, *exc) -> None:
        for i in range(self.first):
            del self.layers[i].forward


class _record_layers:
    """While active, `outputs[i]` receives decoder layer i's output of each pass."""

    def __init__(self, model: Any, outputs: list[Any]):
        self.layers, self.outputs = _decoder_layers(model), outputs

    def __enter__(self) -> None:
        self.hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: self.outputs.__setitem__(i, out))
                      for i, layer in enumerate(self.layers)]

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


@dataclass(frozen=True)
class Loss:
    """A variant's distance from the exact model on one item (or a mean over items)."""

    kl: float
    answer_nll: float
    answered: bool = False


class _ItemScorer:
    """One item's exact log-probabilities at the scored positions, and a variant's distance to them."""

    def __init__(self, model: Any, item: CalibrationItem):
        self.model, self.item = model, item
        n = len(item.ids)
        answer = list(range(item.answer_start - 1, n - 1))
        self.rows = torch.tensor(sorted(set(range(KL_STRIDE - 1, n - 1, KL_STRIDE)) | set(answer)))
        self.answer_rows = torch.tensor([int((self.rows == a).nonzero()) for a in answer])
        self.targets = torch.tensor(item.ids[1:])[self.rows]
        self.ref = self._logp(EXACT)
        self.exact_nll = self.answer_nll(self.ref)

    @torch.inference_mode()
    def _logp(self, variant: Variant, reuse: tuple[list[Any], int] | None = None) -> torch.Tensor:
        outputs, first = reuse if reuse is not None else ([], 0)
        with _reuse_layers(self.model, outputs, first):
            hidden = hidden_for(self.model, list(self.item.ids), variant)
        return torch.log_softmax(logits_from_hidden(self.model, hidden[self.rows]), -1)

    def answer_nll(self, logp: torch.Tensor) -> float:
        t = self.targets[self.answer_rows]
        return float(-logp[self.answer_rows].gather(1, t[:, None]).sum())

    def loss(self, logp: torch.Tensor) -> Loss:
        kl = float((self.ref.exp() * (self.ref - logp)).sum(-1).mean())
        answered = bool(torch.equal(logp[self.answer_rows].argmax(-1), self.targets[self.answer_rows]))
        return Loss(kl, self.answer_nll(logp), answered)

    @torch.inference_mode()
    def score(self, variant: Variant) -> Loss:
        return self.loss(self._logp(variant))

    @torch.inference_mode()
    def gains(self, picks: list[Key], candidates: list[Key], n_layers: int) -> tuple[Loss, dict[Key, Loss]]:
        """The plan `picks`' loss on this item, and each candidate's loss with its tensor raised
        to 4 bits on top of the plan: one pass of the plan records every layer's output and
        computes each candidate layer's attention output under the candidate's config; each
        candidate then runs from its layer up."""
        base = Variant("plan", "dequant", _config(picks))
        wanted: dict[int, list[Key]] = {}
        for key in candidates:
            wanted.setdefault(key[0], []).append(key)
        outs: dict[Key, torch.Tensor] = {}

        def probe(layer: int, q: torch.Tensor, k: torch.Tensor, scale: float | None, window: int | None,
                  cap: float, v: torch.Tensor | None = None) -> None:
            for key in wanted.get(layer, ()):
                cfg = _config(picks + [key]).for_layer(layer, n_layers)
                outs[key] = study_attention(q.float(), k.float(), v.float(), cfg, "dequant", scale=scale,
                                            window=window, logit_cap=cap)

        recorded: list[Any] = [None] * n_layers
        with _record_layers(self.model, recorded), probe_attention(probe):
            plan_loss = self.loss(self._logp(base))
        cand: dict[Key, Loss] = {}
        for key in candidates:
            with override_attention(key[0], outs.pop(key)):
                cand[key] = self.loss(self._logp(base, (recorded, key[0])))
        return plan_loss, cand


@torch.inference_mode()
def _head_probe(model: Any, item: CalibrationItem, geo: tuple[int, int, int], cfg: HackConfig) -> dict:
    """Per layer and KV head, from one exact pass: the relative error of the head's attention
    output with K alone (V alone) at 2 bits (dequantized, the other read in FP16, as
    study_attention's 'dequant' path computes it), and the attention mass of the answer positions
    on the needle (the most of the head's query heads)."""
    from hack_ops.attention import soft_cap, visible

    from .attention_paths import _blocked, dequant_views

    n_layers, h_kv, _ = geo
    err = {t: torch.zeros(n_layers, h_kv) for t in TENSORS}
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
            err[t][layer] = (((out - exact).pow(2).sum((-1, -2)) / denom)[0]).view(h_kv, rep).mean(-1)
        kf = k[0].repeat_interleave(rep, 0)
        s = soft_cap(q[0, :, rows] @ kf.transpose(-1, -2) * sc, cap)
        s = s.masked_fill(~visible(torch.arange(kf.shape[1])[None, :], rows[:, None], window), float("-inf"))
        mass = torch.softmax(s, -1)[..., item.needle_start:item.needle_start + item.needle_len].sum(-1).mean(-1)
        needle[layer] = mass.view(h_kv, rep).max(-1).values

    with probe_attention(probe):
        hidden_for(model, list(item.ids), EXACT)
    return {"err": err, "needle": needle}


def _source_counts(items: list[CalibrationItem]) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        out[it.source.value] = out.get(it.source.value, 0) + 1
    return out


def _mean(losses: list[Loss]) -> Loss:
    n = len(losses)
    return Loss(sum(x.kl for x in losses) / n, sum(x.answer_nll for x in losses) / n,
                sum(x.answered for x in losses) * 2 > n)


def scores_from_gains(plain: Loss, exact_nll: float, base: Loss, cands: dict[Key, Loss]) -> dict[Key, dict]:
    """Each candidate's KL fall and answer-NLL fall from `base` (the plan it would join), and its
    score: the share of the plain format's KL it takes back, plus, while the plan has not kept
    retrieval (RETRIEVAL_KEPT), the share of the plain format's answer-NLL rise over the exact
    model it takes back (none where the plain format lost nothing of the answer)."""
    kl_loss = max(plain.kl, 1e-12)
    nll_loss = plain.answer_nll - exact_nll
    retrieving = not retrieval_kept(plain, exact_nll, base)  # and then nll_loss >= RETRIEVAL_FLOOR
    out = {}
    for key, c in cands.items():
        kl_gain, nll_gain = base.kl - c.kl, base.answer_nll - c.answer_nll
        score = kl_gain / kl_loss + (nll_gain / nll_loss if retrieving else 0.0)
        out[key] = {"kl_gain": kl_gain, "answer_nll_gain": nll_gain, "score": score}
    return out


def retrieval_kept(plain: Loss, exact_nll: float, base: Loss) -> bool:
    """Whether `base` holds the answer: its answer-NLL rise over the exact model is at most
    RETRIEVAL_KEPT of the plain format's, or it or the plain format's is under RETRIEVAL_FLOOR nats."""
    rise, plain_rise = base.answer_nll - exact_nll, plain.answer_nll - exact_nll
    return min(rise, plain_rise) < RETRIEVAL_FLOOR or rise <= RETRIEVAL_KEPT * plain_rise


def choose_rotation(plan: dict, rotated: dict[str, dict]) -> str:
    """The rotation (a Rotation value) to keep from the plan's measured rows on the items (each
    {'kl', 'answer_nll', 'answered'}): the one with the lowest KL among those that take at least
    ROTATION_GAIN of the unrotated plan's KL away and find as many codes; 'none' when none does."""
    paying = [(row["kl"], name) for name, row in rotated.items()
              if row["kl"] <= (1 - ROTATION_GAIN) * plan["kl"] and row["answered"] >= plan["answered"]]
    return min(paying)[1] if paying else Rotation.NONE.value


def choose(scores: dict[Key, float], geo: tuple[int, int, int], budget: float, context: int,
           picks: list[Key] | tuple[Key, ...] = (), spend: float | None = None) -> list[Key]:
    """The (layer, tensor) pairs to add to `picks`, by score per byte, largest first, while the
    format stays within `budget` of BF16's bytes at `context` tokens (a pair that would pass it is
    skipped) and, with `spend`, while the added pairs cost at most `spend` of BF16's bytes (the
    first pair that fits is always taken). Pairs scoring <= 0 buy nothing and are not taken."""
    base = _ratio(_config(list(picks)), geo, context)
    cost = {key: _ratio(_config(list(picks) + [key]), geo, context) - base for key in scores}
    taken: list[Key] = []
    spent = 0.0
    for key in sorted(scores, key=lambda k: (-scores[k] / max(cost[k], 1e-12), k)):
        if scores[key] <= 0:
            break
        if key in picks:
            continue
        if _ratio(_config(list(picks) + taken + [key]), geo, context) > budget + 1e-9:
            continue
        if spend is not None and taken and spent + cost[key] > spend + 1e-12:
            break
        taken.append(key)
        spent += cost[key]
    return sorted(taken)


def head_analysis(scores: dict[Key, float], err: dict[str, torch.Tensor],
                  needle: torch.Tensor, picks: list[Key]) -> dict:
    """How much of the total score a per-head plan would buy against the per-layer plan, at the
    per-layer plan's bytes (a head's bytes are 1/H of its layer's). A (layer, tensor)'s score is
    spread over its KV heads by their share of its attention-output error."""
    scores = {k: max(0.0, s) for k, s in scores.items()}
    h = err["k"].shape[1]
    per_head = []
    for (layer, t), s in scores.items():
        e = err[t][layer]
        share = e / e.sum() if float(e.sum()) > 0 else torch.full_like(e, 1.0 / h)
        per_head += [float(s * share[i]) for i in range(h)]
    total = sum(scores.values())
    layer_take = sum(scores.get(k, 0.0) for k in picks) / total if total > 0 else 0.0
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


def _row(rows: list[Loss]) -> dict:
    mean = _mean(rows)
    return {"kl": mean.kl, "answer_nll": mean.answer_nll, "answered": sum(r.answered for r in rows)}


def calibrate(model_path: str | Path, model_name: str, settings: CalibrationSettings = CalibrationSettings(),
              command: str = "", log: Callable[[str], None] = print, layers_from: BitPlan | None = None) -> BitPlan:
    """Measure the model in `model_path` and return its bit plan (not written: BitPlan.write).
    layers_from: an earlier plan for the same weights whose layers are kept as they are (its
    rounds and per-layer measurements are carried over); only the rotation step and the check run."""
    t_start = time.time()
    if layers_from is not None and layers_from.model_hash != model_hash(model_path):
        raise ValueError(f"--layers-from: the plan was measured on model {layers_from.short_hash}, not the "
                         f"weights in {model_path}")
    torch.manual_seed(settings.seed)
    model, tok = load_model(Path(model_path), threads=settings.threads)
    geo = model_geometry(model)
    n_layers, _, _ = geo
    mismatch = plan_for_check(layers_from, *geo) if layers_from is not None else None
    if mismatch:
        raise ValueError(f"--layers-from: {mismatch}")
    refusal = head_dim_refusal(settings.rotation, geo[2]) if settings.rotation != ROTATION_AUTO else None
    if refusal:
        raise ValueError(refusal)
    items = build_items(tok, settings.context, settings.items, settings.seed, settings.text)
    cfg = HackConfig()
    err = {t: torch.zeros(n_layers, geo[1]) for t in TENSORS}
    needle = torch.zeros(n_layers, geo[1])
    scorers = []
    for item in items:
        scorers.append(_ItemScorer(model, item))
        if layers_from is not None:  # its per-head analysis is carried over
            continue
        probe = _head_probe(model, item, geo, cfg)
        for t in TENSORS:
            err[t] += probe["err"][t] / len(items)
        needle += probe["needle"] / len(items)
    exact_nll = sum(s.exact_nll for s in scorers) / len(scorers)
    log(f"calibrate: {len(items)} items of {settings.context} tokens, exact passes ({time.time() - t_start:.0f} s)")
    budget, ctx = settings.budget_fraction, settings.budget_context
    picks: list[Key] = []
    rounds: list[dict] = []
    first: dict[Key, dict] = {}
    plain: Loss | None = None
    candidates = [(layer, t) for layer in range(n_layers) for t in TENSORS]
    if layers_from is not None:  # the layers are the earlier plan's: no rounds
        picks = sorted([(l, "k") for l in layers_from.k_layers] + [(l, "v") for l in layers_from.v_layers])
        candidates = []
    while candidates:
        candidates = [k for k in candidates if k not in picks and _ratio(_config(picks + [k]), geo, ctx) <= budget + 1e-9]
        if not candidates:
            break
        per_item = [s.gains(picks, candidates, n_layers) for s in scorers]
        base = _mean([b for b, _ in per_item])
        cand = {k: _mean([c[k] for _, c in per_item]) for k in candidates}
        by_source = {src: {f"{l}{t}": round(sum(b.kl - c[(l, t)].kl for (b, c), it in zip(per_item, items)
                                                 if it.source.value == src) / n, 6) for l, t in candidates}
                     for src, n in _source_counts(items).items()}
        plain = plain or base
        scored = scores_from_gains(plain, exact_nll, base, cand)
        if not rounds:
            first = scored
        here = _ratio(_config(picks), geo, ctx)
        taken = choose({k: v["score"] for k, v in scored.items()}, geo, budget, ctx, picks, spend=(budget - here) / 2)
        cost = {k: _ratio(_config(picks + [k]), geo, ctx) - here for k in candidates}
        ranked = sorted(candidates, key=lambda k: (-scored[k]["score"] / max(cost[k], 1e-12), k))
        rounds.append({"base": {"kl": base.kl, "answer_nll": base.answer_nll}, "measured": len(candidates),
                       "retrieval_scored": not retrieval_kept(plain, exact_nll, base),
                       "taken": [f"{l}{t}" for l, t in taken],
                       "ranked": [{"tensor": f"{l}{t}", **{f: round(v, 6) for f, v in scored[(l, t)].items()}}
                                  for l, t in ranked],
                       "kl_gain_by_text": by_source})
        log(f"calibrate: round {len(rounds)}, {len(candidates)} candidates from KL {base.kl:.4f}, answer NLL "
            f"{base.answer_nll:.3f}: raises {', '.join(f'{l}{t}' for l, t in taken) or 'nothing'} "
            f"({time.time() - t_start:.0f} s)")
        if not taken:
            break
        picks = sorted(picks + taken)
        # the next round measures the best remaining by this round's score and by the KL alone (the
        # score the next round uses once retrieval is kept)
        by_kl = sorted(candidates, key=lambda k: (-scored[k]["kl_gain"] / max(cost[k], 1e-12), k))
        candidates = list(dict.fromkeys([k for k in ranked if k not in taken][:SHORTLIST]
                                        + [k for k in by_kl if k not in taken][:SHORTLIST]))
    plan_cfg = _config(picks)
    planned = _row([s.score(Variant("plan", "dequant", plan_cfg)) for s in scorers])
    plain_rows = [s.score(Variant("plain", "dequant", cfg)) for s in scorers]
    tried = ([r for r in ROTATION_CANDIDATES if head_dim_refusal(r, geo[2]) is None]
             if settings.rotation == ROTATION_AUTO else
             [Rotation(settings.rotation)] if settings.rotation != Rotation.NONE.value else [])
    rotated = {r.value: _row([s.score(Variant("plan", "dequant", plan_cfg.replace(rotation=r))) for s in scorers])
               for r in tried}
    chosen = choose_rotation(planned, rotated) if settings.rotation == ROTATION_AUTO else settings.rotation
    log(f"calibrate: rotation {chosen} (plan KL {planned['kl']:.4f}; "
        + ", ".join(f"{name} {row['kl']:.4f}" for name, row in rotated.items()) + f") ({time.time() - t_start:.0f} s)")
    rotation_step = {"tried": {Rotation.NONE.value: planned, **rotated}, "chosen": chosen,
                     "rule": (f"kept where it takes >= {ROTATION_GAIN:.0%} of the plan's KL away and finds as "
                              "many codes" if settings.rotation == ROTATION_AUTO else "given (--rotation)"),
                     "mode": "dequant"}
    check = {"exact_answer_nll": exact_nll, "plain": _row(plain_rows), "plan": rotation_step["tried"][chosen],
             "items": len(items), "mode": "dequant", "sources": [i.source.value for i in items]}
    final_cfg = plan_cfg.replace(rotation=Rotation(chosen))
    calibration = {"text": describe(settings.text), "text_kind": settings.text.value,
                   "context": settings.context, "items": settings.items, "seed": settings.seed,
                   "seconds": round(time.time() - t_start, 1),
                   "date": datetime.date.today().isoformat(), "command": command}
    if layers_from is not None:  # the layers' own calibration stays the plan's record; this step beside it
        measurements = {**layers_from.measurements, "check": check, "rotation": rotation_step}
        return replace(layers_from, rotation=chosen, bytes_ratio=_ratio(final_cfg, geo, settings.budget_context),
                       calibration={**layers_from.calibration, "rotation_step": calibration},
                       measurements=measurements)
    heads = head_analysis({k: v["score"] for k, v in first.items()}, err, needle, picks)
    measurements = {
        "method": "rounds of marginal gains from the plan so far (hack_eval.calibrate)",
        "per_layer": [{"layer": layer,
                       **{f"{t}_{name}": round(float(first.get((layer, t), {}).get(name, 0.0)), 6)
                          for t in TENSORS for name in ("kl_gain", "answer_nll_gain", "score")},
                       **{f"{t}_head_err": [round(float(x), 5) for x in err[t][layer]] for t in TENSORS},
                       "needle_mass": [round(float(x), 4) for x in needle[layer]]}
                      for layer in range(n_layers)],
        "rounds": rounds,
        "heads": heads,
        "check": check,
        "rotation": rotation_step,
    }
    return BitPlan(
        model_hash=model_hash(model_path), model=model_name, num_layers=n_layers, num_kv_heads=geo[1],
        head_dim=geo[2], k_layers=tuple(l for l, t in picks if t == "k"),
        v_layers=tuple(l for l, t in picks if t == "v"), budget_fraction=settings.budget_fraction,
        budget_context=settings.budget_context, bytes_ratio=_ratio(final_cfg, geo, settings.budget_context),
        plain_bytes_ratio=_ratio(cfg, geo, settings.budget_context), calibration=calibration,
        measurements=measurements, rotation=chosen)


def render(plan: BitPlan) -> str:
    """A short text report of a plan: what it raises, what it bought on the calibration items,
    the rounds it was chosen in, and the heads-or-layers answer."""
    m, c = plan.measurements, plan.measurements["check"]
    h = m["heads"]
    lines = [f"bit plan for {plan.model} (model {plan.short_hash}): {plan.summary()}",
             f"calibration: {plan.calibration['items']} items of {plan.calibration['context']} tokens, "
             f"{plan.calibration['seconds']:.0f} s; {plan.calibration['text']}",
             *([f"check and rotation step: {step['items']} items of {step['context']} tokens, {step['seconds']:.0f} s, "
                f"{step['date']}; {step['text']}"] if (step := plan.calibration.get("rotation_step")) else []),
             f"on those items ({c['mode']}): KL plain {c['plain']['kl']:.4f} -> plan {c['plan']['kl']:.4f}; "
             f"answer NLL exact {c['exact_answer_nll']:.3f}, plain {c['plain']['answer_nll']:.3f}, plan "
             f"{c['plan']['answer_nll']:.3f}; codes found plain {c['plain']['answered']}/{c['items']}, plan "
             f"{c['plan']['answered']}/{c['items']}",
             ("rounds: " + "; ".join(f"{i + 1}: {', '.join(r['taken']) or 'nothing'}"
                                     for i, r in enumerate(m["rounds"]))
              if "rounds" in m else "rounds: none recorded (a plan ranked once, before rounds)"),
             _render_rotation(m.get("rotation")),
             f"heads vs layers ({h['kv_heads']} KV heads): at the plan's bytes a per-layer plan takes "
             f"{100 * h['layer_plan_score_share']:.1f}% of the round-1 score, a per-head plan would take "
             f"{100 * h['head_plan_score_share']:.1f}% (x{h['head_over_layer']:.2f}; bar x{h['bar']:.2f}): "
             + ("heads matter more" if h["heads_matter_more"] else "per-layer bits")]
    ranked = sorted(m["per_layer"], key=lambda r: -max(r["k_score"], r["v_score"]))[:8]
    lines.append("top layers by round-1 score (K / V): " + "; ".join(
        f"{r['layer']}: {r['k_score']:.3f} / {r['v_score']:.3f}" for r in ranked))
    return "\n".join(lines)


def _render_rotation(step: dict | None) -> str:
    if step is None:
        return "rotation: not measured (a plan written before the rotation step): none"
    tried = ", ".join(f"{name} KL {row['kl']:.4f} ({row['answered']} codes)" for name, row in step["tried"].items())
    return f"rotation: {step['chosen']} ({step['rule']}; {tried})"
