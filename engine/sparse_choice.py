"""`--hack-sparse-score auto`: how sparse decode ranks pages when no score is asked for, chosen at
startup from the served model's head width.

Which score keeps the pages a query needs turns with the number of channels a K head has
(docs/sparse.md, measured on both shipped models, `hack eval selection` and served pass keys):
- 64-channel heads (SmolLM2): the exact bound keeps the needle's page in 88 / 98% of the cells at
  a 1K / 2K budget, MPCache's linear stand-in 84 / 93%, and served at 1K the bound found 32 pass
  keys of 50 where linear found 19. So: the bound.
- 256-channel heads (Gemma-3): a sum of 256 per-channel bests bounds q.k loosely, and the order
  reverses: the bound 65 / 91%, linear 92 / 99%; served at 8K with a 2K budget, the bound refined
  twice found 26 keys, linear 39, linear refined twice 42 (dense 44). So: linear, refined twice
  (`--hack-sparse-refine 2`) where no refinement is asked for and the path has one (the CPU path;
  the GPU selection is the score alone). At budgets up to 2K twice is too few: at 1K linear refined
  twice found 37 / 36 keys at 4K / 8K (dense 42 / 44), refined four times 42 / 40; at 2K twice 42 /
  42, four times 42 / 44; so budgets up to 2K take four, larger ones (not measured) twice.
- 128-channel heads have not been measured here: `auto` keeps the bound there (Quest's choice on
  such heads), and the startup log says it is a default, not a measurement.

Resolved once, in the launching process, into the published SparseConfig, like `--hack-bits auto`
(engine.bit_plans): every scheduler process sees plain values. A server whose sparse decode is off
resolves nothing.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from hack_ops.sparse import PageScore

logger = logging.getLogger(__name__)

# From this head width up the linear score ranks pages better than the bound (measured at 256;
# 64 favours the bound; 128, unmeasured, stays with the bound).
LINEAR_FROM_HEAD_DIM = 256
# The refinement the linear score takes on wide heads where none is given, above SMALL_BUDGET_TOKENS
# (not measured there), and the larger one up to it (Gemma-3 at 1K: 42 / 40 keys against 37 / 36 at
# 4K / 8K; at 2K: 42 / 44 against 42 / 42; dense 42 / 44).
WIDE_HEAD_REFINE = 2
SMALL_BUDGET_TOKENS = 2048
SMALL_BUDGET_REFINE = 4


class ScoreChoice(str, enum.Enum):
    AUTO = "auto"  # by head width, below
    BOUND = PageScore.BOUND.value
    LINEAR = PageScore.LINEAR.value


@dataclass(frozen=True)
class SparseChoice:
    """What `auto` resolved to: the score, the refinement (None: as given, or the default), and why."""

    score: PageScore
    refine: int | None
    reason: str


def choose(head_dim: int | None, on_gpu: bool, refine_given: bool, budget: int | None = None) -> SparseChoice:
    """The page score (and refinement) for heads of `head_dim` channels (None: unknown) at a budget
    of `budget` tokens (None: unknown, taken as above SMALL_BUDGET_TOKENS)."""
    if head_dim is None:
        return SparseChoice(PageScore.BOUND, None, "the model's head width is unknown: the bound, the exact one")
    if head_dim >= LINEAR_FROM_HEAD_DIM:
        small = budget is not None and budget <= SMALL_BUDGET_TOKENS
        refine = None if refine_given or on_gpu else (SMALL_BUDGET_REFINE if small else WIDE_HEAD_REFINE)
        how = "" if refine is None else f", refined {refine}x (--hack-sparse-refine {refine})"
        return SparseChoice(PageScore.LINEAR, refine,
                            f"{head_dim}-channel heads: MPCache's linear score{how}, which kept Gemma-3's pass keys "
                            "where the bound lost them (docs/sparse.md)")
    if head_dim > 64:
        return SparseChoice(PageScore.BOUND, None,
                            f"{head_dim}-channel heads: the bound; not measured at this width (the bound is measured "
                            "best at 64 channels, linear at 256): compare --hack-sparse-score linear on pass keys "
                            "(`hack eval retrieval`, docs/sparse.md)")
    return SparseChoice(PageScore.BOUND, None, f"{head_dim}-channel heads: the bound, measured best at this width "
                                               "(docs/sparse.md)")


def resolve_for_namespace(ns: Any) -> None:
    """Replace `--hack-sparse-score auto` (or none given) in a parsed server namespace by the score
    for the served model, and set --hack-sparse-refine where `auto` takes one; logs the choice.
    Nothing happens while sparse decode is off (no budget)."""
    if getattr(ns, "hack_sparse_score", None) == ScoreChoice.AUTO.value:
        ns.hack_sparse_score = None  # `auto` is what none given means
    if getattr(ns, "hack_sparse_score", None) is not None or not getattr(ns, "hack_sparse_budget", None):
        return
    from .bit_plans import model_geometry

    geo = model_geometry(str(getattr(ns, "model_path", "") or ""), bool(getattr(ns, "trust_remote_code", False)))
    choice = choose(None if geo is None else geo[2], _on_gpu(ns), getattr(ns, "hack_sparse_refine", None) is not None,
                    int(ns.hack_sparse_budget))
    ns.hack_sparse_score = choice.score.value
    if choice.refine is not None:
        ns.hack_sparse_refine = choice.refine
    logger.info("sglang-hack: --hack-sparse-score auto = %s: %s", choice.score.value, choice.reason)


def _on_gpu(ns: Any) -> bool:
    """Whether the server will run on a CUDA device (SGLang's --device, else what torch sees)."""
    device = getattr(ns, "device", None)
    if device:
        return str(device).startswith("cuda")
    from .cpu_runtime import gpu_available

    return gpu_available()
