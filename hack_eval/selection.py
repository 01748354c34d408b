"""Where sparse decode's page selection puts a pass key (`hack eval selection`): at each decode
step of the answer, does the selection keep the page that holds the needle, and how much of the
exact attention falls on the pages it drops? Scored for the serving bound (a page's per-channel
box) against tighter boxes over fewer tokens of the same page (what a sub-page side table would
give), MPCache's linear stand-in, the refinement (--hack-sparse-refine), the two levels over
groups of pages (--hack-sparse-groups, hack_ops.sparse.kept_group_pages) and two oracles (each
page's true best q.k over its quantized keys, and the exact attention mass it receives): the
measurement that says whether the bound or the page is what loses keys at a small budget.

Read from the exact model's own q and K (post-RoPE, hack_eval.runner.probe_attention), K
quantized per page as the store would (with the model's calibrated bits per layer), the decode
rows being the answer's tokens after the first (the first comes out of prefill, which reads
every page). The selection is the server's (hack_ops.sparse.select_pages, refine_scores).
"""
from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Callable

import torch
from torch import Tensor

from hack_ops.attention import k_pages_quantized, soft_cap, visible
from hack_ops.config import HackConfig
from hack_ops.quant import dequantize
from hack_ops.rotation import rotate_qkv
from hack_ops.sparse import (PageScore, SparseConfig, kept_group_pages, page_best, page_scores, refine_scores,
                             select_pages)

from .retrieval import Item, build_items
from .runner import EXACT, probe_attention, use_variant

NEEDLE_MASS = 0.1  # a KV head is a retrieval head at a step where its group puts this much attention on the needle


class Score(StrEnum):
    PAGE = "page"  # the serving bound over the page's per-channel box (min, min + L * scale)
    BOX32 = "box32"  # the same bound, max over 32-token boxes of the page's codes
    BOX16 = "box16"  # ... over 16-token boxes
    LINEAR = "linear"  # MPCache's stand-in, q.(alpha max + (1 - alpha) min) over the page's box
    REFINE2 = "refine2"  # --hack-sparse-refine 2: the bound's 2x candidates ranked by their own keys
    REFINE4 = "refine4"  # ... 4x
    GROUPS8 = "groups8"  # --hack-sparse-groups 8: pages chosen among the groups their boxes' bound keeps
    GROUPS8_REFINE4 = "groups8-refine4"  # ... and refined four times among those
    ORACLE_MAX = "oracle-max"  # the page's best true q.k over its quantized keys
    ORACLE_MASS = "oracle-mass"  # the exact attention mass the page receives (no page choice keeps more)


REFINE = {Score.REFINE2: 2, Score.REFINE4: 4, Score.GROUPS8_REFINE4: 4}
GROUPED = {Score.GROUPS8: 8, Score.GROUPS8_REFINE4: 8}  # two levels: pages a group
RANKED = (Score.PAGE, Score.BOX16, Score.ORACLE_MAX)  # scores whose needle-page rank is reported


def box_bounds(q: Tensor, codes: Tensor, minimum: Tensor, scale: Tensor, page: int, box: int) -> Tensor:
    """The max over a page's `box`-token boxes of the upper bound of q.k: q [R, S, D] (a group's
    query heads at S rows), codes [N * page, D] (the pages' codes), minimum / scale [N, D] ->
    [R, S, N]. A box's channel c spans the codes lo..hi its keys take, so q.k <= sum_c
    max(q_c (min_c + lo_c s_c), q_c (min_c + hi_c s_c)), never looser than the page's box."""
    n, d = minimum.shape
    c = codes[:n * page].float().reshape(n, page // box, box, d)
    lo = minimum[:, None] + c.amin(2) * scale[:, None]  # [N, B, D]
    hi = minimum[:, None] + c.amax(2) * scale[:, None]
    qq = q[:, :, None, None, :]  # [R, S, 1, 1, D]
    return torch.maximum(qq * lo, qq * hi).sum(-1).amax(-1)


def scores_of(kind: Score, q: Tensor, kq: Tensor, codes: Tensor, minimum: Tensor, scale: Tensor, bits: int,
              page: int, probs: Tensor) -> Tensor:
    """Scores [S, N] of the N closed pages for one KV head's group (the max over its R heads): q
    [R, S, D], kq [N * page, D] the quantized keys, probs [R, S, n] the exact attention. The
    serving scores are hack_ops.sparse's own; the refinements are scored by refine_scores from
    PAGE and ORACLE_MAX (the caller's)."""
    n = minimum.shape[0]
    rows = q.transpose(0, 1)  # [S, R, D]: each decode row's group
    if kind in (Score.PAGE, Score.LINEAR):
        return page_scores(rows, minimum, scale, bits, PageScore.BOUND if kind == Score.PAGE else PageScore.LINEAR)
    if kind == Score.ORACLE_MAX:
        return page_best(rows, kq[:n * page], page)
    if kind in (Score.BOX32, Score.BOX16):
        s = box_bounds(q, codes, minimum, scale, page, 32 if kind == Score.BOX32 else 16)
    elif kind == Score.ORACLE_MASS:
        s = probs[..., :n * page].reshape(*q.shape[:2], n, page).sum(-1)
    else:
        raise ValueError(f"{kind} is a refinement: refine_scores over PAGE and ORACLE_MAX")
    return s.amax(0)


class _Tally:
    """Counts per (score, budget): needle cells kept / seen, dropped attention mass; per layer;
    and the needle page's rank among the candidates (RANKED scores)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, int], list[float]] = {}
        self.layers: dict[tuple[str, int, int], list[int]] = {}
        self.ranks: dict[str, list[int]] = {}

    def rows(self) -> list[dict]:
        return [{"score": kind, "budget": budget, "needle_kept": kept / max(cells, 1), "needle_cells": int(cells),
                 "dropped_mass": mass / max(mcells, 1)}
                for (kind, budget), (kept, cells, mass, mcells) in sorted(self.cells.items())]

    def layer_rows(self) -> list[dict]:
        return [{"score": kind, "budget": budget, "layer": layer, "needle_kept": kept / max(cells, 1),
                 "needle_cells": cells} for (kind, budget, layer), (kept, cells) in sorted(self.layers.items())]

    def rank_rows(self) -> list[dict]:
        out = []
        for kind, rs in sorted(self.ranks.items()):
            t = torch.tensor(rs, dtype=torch.float)
            out.append({"score": kind, "cells": len(rs), "median": float(t.median()), "p90": float(t.quantile(0.9)),
                        "top10": float((t < 10).float().mean())})
        return out


def run_selection(model_name: str, context: int, per_cell: int, budgets: list[int], seed: int = 0,
                  scores: list[Score] | None = None, threads: int | None = None,
                  log: Callable[[str], None] = print) -> dict:
    """Per score and budget over `per_cell` pass-key items at `context` tokens: the share of
    (item, sparse layer, KV head, decode row) cells with a retrieval head (its group's exact
    attention on the needle >= NEEDLE_MASS) whose selection keeps a needle page, and the exact
    attention mass (mean over every sparse layer's query heads and decode rows) on the pages
    the selection drops."""
    from hack_ops.bit_plan import find_plan

    from .models import prepare
    from .runner import load_model

    scores = list(scores or Score)
    base = SparseConfig(budget_tokens=max(budgets))  # the server's recent pages and dense layers
    folder = prepare(model_name)
    model, tok = load_model(folder, threads=threads)
    found = find_plan(folder)
    cfg = found[0].apply(HackConfig()) if found else HackConfig()
    n_layers = int(model.config.num_hidden_layers)
    p = cfg.partition_size
    items = build_items(tok, [context], per_cell, seed)
    tally = _Tally()
    current: dict[str, Any] = {}

    def probe(layer: int, q: Tensor, k: Tensor, scale: float | None, window: int | None, cap: float,
              v: Tensor | None = None) -> None:
        item: Item = current["item"]
        rows = torch.arange(item.answer_start, len(item.ids) - 1)
        if not base.layer_is_sparse(layer, window) or not len(rows):
            return
        # the plan's rotation, as the server applies it before the store: pages of rotated keys
        # (the scores q.k are the same, the codes and their boxes are not)
        q, k, _ = rotate_qkv(q.float(), k.float(), k.float(), cfg.rotation)
        lc = cfg.for_layer(layer, n_layers) if cfg.per_layer else cfg
        bits = lc.bits("k")
        h, rep = k.shape[1], q.shape[1] // k.shape[1]
        kf = k[0].float()  # [H, n, D]
        npg = kf.shape[1] // p
        qt = k_pages_quantized(kf, lc)  # every head's pages, as the store quantizes them
        kq_all = dequantize(qt)
        sm = q.shape[-1] ** -0.5 if scale is None else scale
        keys = torch.arange(kf.shape[1])
        needle = (torch.arange(item.needle_start, item.needle_start + item.needle_len) // p).unique()
        n_closed = (rows + 1) // p  # pages closed at each decode step
        for head in range(h):
            kq, mn, scl = kq_all[head], qt.minimum[head].float(), qt.scale[head].float()
            qg = q[0, head * rep:(head + 1) * rep, rows].float()  # [R, S, D]
            s = soft_cap(qg @ kf[head].T * sm, cap)
            s = s.masked_fill(~visible(keys[None, :], rows[:, None], window), float("-inf"))
            probs = torch.softmax(s, -1)  # [R, S, n]
            needle_mass = probs[..., item.needle_start:item.needle_start + item.needle_len].sum(-1).amax(0)  # [S]
            plain = {kind: scores_of(kind, qg, kq, qt.codes[head], mn, scl, bits, p, probs)
                     for kind in {*[kd for kd in scores if kd not in REFINE and kd not in GROUPED], Score.PAGE,
                                  Score.ORACLE_MAX}}
            for budget in budgets:
                bp = SparseConfig(budget_tokens=budget).budget_pages(p)
                recent_from = n_closed - min(base.recent_pages(p), bp - 1)
                for kind in scores:
                    sc = plain[kind] if kind not in REFINE and kind not in GROUPED else plain[Score.PAGE]
                    if kind in GROUPED:  # the first level: the pages of the kept groups, as served
                        two = SparseConfig(budget_tokens=budget, group_pages=GROUPED[kind])
                        kept_pages = kept_group_pages(qg.transpose(0, 1)[:, None], mn[None, None], scl[None, None],
                                                      bits, n_closed, two, p)[:, 0]  # [S, N]
                        sc = sc.masked_fill(~kept_pages, float("-inf"))
                    if kind in REFINE:
                        sc = refine_scores(sc[:, None], plain[Score.ORACLE_MAX][:, None], n_closed, bp, recent_from,
                                           REFINE[kind])[:, 0]
                    idx, count = select_pages(sc[:, None, :], n_closed, bp, recent_from)
                    kept = torch.zeros(len(rows), npg + 1, dtype=torch.bool)
                    for r in range(len(rows)):
                        kept[r, idx[r, 0, :int(count[r])]] = True
                        kept[r, int(n_closed[r]):] = True  # the open partition
                    kept_keys = kept.repeat_interleave(p, -1)[:, :probs.shape[-1]]
                    dropped = (probs * ~kept_keys[None]).sum(-1)  # [R, S]
                    c = tally.cells.setdefault((kind.value, budget), [0, 0, 0.0, 0])
                    c[2] += float(dropped.sum())
                    c[3] += dropped.numel()
                    for r in range(len(rows)):
                        if needle_mass[r] < NEEDLE_MASS:
                            continue
                        hit = int(kept[r, needle].any())
                        c[0] += hit
                        c[1] += 1
                        lay = tally.layers.setdefault((kind.value, budget, layer), [0, 0])
                        lay[0] += hit
                        lay[1] += 1
            for kind in [kd for kd in RANKED if kd in plain]:  # the needle page's rank among the candidates
                for r in range(len(rows)):
                    nc = int(n_closed[r])
                    cand = torch.arange(1, max(1, nc - min(base.recent_pages(p), nc - 1)))
                    inside = [int(g) for g in needle if 1 <= int(g) < 1 + len(cand)]
                    if needle_mass[r] < NEEDLE_MASS or not inside:
                        continue
                    row = plain[kind][r]
                    best = max(float(row[g]) for g in inside)
                    tally.ranks.setdefault(kind.value, []).append(int((row[cand] > best).sum()))

    t0 = time.perf_counter()
    with probe_attention(probe), use_variant(EXACT), torch.inference_mode():
        for n, item in enumerate(items):
            current["item"] = item
            model.model(input_ids=torch.tensor([item.ids]), use_cache=False)
            log(f"selection: item {n + 1}/{len(items)} done ({time.perf_counter() - t0:.0f} s)")
    return {"model": model_name, "context": context, "items": per_cell, "seed": seed, "budgets": budgets,
            "page_size": p, "recent_tokens": base.recent_tokens, "dense_layers": base.dense_layers,
            "k_bits": f"calibrated plan {found[1].name}" if found else "2 everywhere", "needle_mass": NEEDLE_MASS,
            "rows": tally.rows(), "ranks": tally.rank_rows(), "layers": tally.layer_rows(),
            "seconds": round(time.perf_counter() - t0, 1)}


DESCRIPTIONS = {
    Score.PAGE: "the bound over the page's box (served default)",
    Score.BOX32: "the bound over 32-token boxes (a finer side table, not stored)",
    Score.BOX16: "the bound over 16-token boxes (not stored)",
    Score.LINEAR: "MPCache's linear stand-in",
    Score.REFINE2: "`--hack-sparse-refine 2`",
    Score.REFINE4: "`--hack-sparse-refine 4`",
    Score.GROUPS8: "`--hack-sparse-groups 8` (two levels)",
    Score.GROUPS8_REFINE4: "`--hack-sparse-groups 8 --hack-sparse-refine 4`",
    Score.ORACLE_MAX: "oracle: each page's true best q.k",
    Score.ORACLE_MASS: "oracle: each page's exact attention mass",
}


def render_selection(res: dict, command: str) -> str:
    """The markdown report of run_selection's result."""
    budgets = res["budgets"]
    lines = [f"# Sparse selection against the pass key: {res['model']}, {res['context']} tokens", "",
             f"{res['items']} pass-key items (seed {res['seed']}), pages of {res['page_size']} tokens, the first page "
             f"and {res['recent_tokens']} recent tokens always kept, the first {res['dense_layers']} layers dense; K bits: "
             f"{res['k_bits']}. A cell is (item, sparse layer, KV head, decode step) where the group's exact attention "
             f"puts >= {res['needle_mass']} on the needle sentence; 'kept' counts the cells whose selection reads a "
             f"needle page. 'dropped' is the exact attention mass on the pages a selection leaves out (mean over every "
             f"sparse layer's query heads and decode steps). {res['seconds']:.0f} s.", "", "Produced by:", "", "```",
             command, "```", "",
             "| score | " + " | ".join(f"kept at {b} | dropped at {b}" for b in budgets) + " |",
             "|---|" + "---|---|" * len(budgets)]
    by = {(r["score"], r["budget"]): r for r in res["rows"]}
    for kind in Score:
        if (kind.value, budgets[0]) not in by:
            continue
        cells = " | ".join(f"{100 * by[(kind.value, b)]['needle_kept']:.1f}% | {100 * by[(kind.value, b)]['dropped_mass']:.1f}%"
                           for b in budgets)
        lines.append(f"| {kind.value}: {DESCRIPTIONS[kind]} | {cells} |")
    cells = {r["score"]: r for r in res["rows"]}
    n_cells = next(iter(cells.values()))["needle_cells"] if cells else 0
    lines += ["", f"({n_cells} needle cells per column.) Rank of the best needle page among the pages a selection "
              "chooses from (0 = first):", "", "| score | cells | median | 90th percentile | in the top 10 |",
              "|---|---|---|---|---|"]
    for r in res["ranks"]:
        lines.append(f"| {r['score']} | {r['cells']} | {r['median']:.0f} | {r['p90']:.0f} | {100 * r['top10']:.1f}% |")
    return "\n".join(lines) + "\n"
