"""The variants the accuracy study measures, and the bytes each one costs."""
from __future__ import annotations

import re

from hack_ops import HackConfig
from hack_ops.config import RaisedTensors, raised_tensors
from hack_ops.layout import model_bytes_per_token
from hack_ops.modes import AttentionMode, attention_mode
from hack_ops.rotation import Rotation

from .runner import EXACT, Variant

DEFAULT = HackConfig()
PAPER = HackConfig(orientation="token_k", tail_tensors="per_channel", sink_tokens=0)


def study_variants() -> list[Variant]:
    """Every variant of the full study. 'hack' rows run the homomorphic path (INT8 Q/P);
    'dequant' rows run the same 2-bit cache dequantized before exact attention, which isolates
    the layout's error from the INT8 noise and costs a third of the time."""
    d = DEFAULT
    return [
        EXACT,
        Variant("default", "hack", d),
        Variant("default", "dequant", d),
        Variant("default, plain min/max ranges (no range search)", "dequant", d.replace(range_search=False)),
        Variant("default, stochastic rounding", "dequant", d.replace(rounding="stochastic")),
        Variant("paper layout", "hack", PAPER),
        Variant("paper layout", "dequant", PAPER),
        Variant("paper layout + K/V tails + 1 sink", "dequant", PAPER.replace(tail_tensors="kv", sink_tokens=1)),
        Variant("default, K tail only (V quantized as written)", "dequant", d.replace(tail_tensors="per_channel")),
        Variant("default, no sink", "dequant", d.replace(sink_tokens=0)),
        Variant("default, 4 sinks", "dequant", d.replace(sink_tokens=4)),
        Variant("default, partition 32", "dequant", d.replace(partition_size=32)),
        Variant("default, partition 128", "dequant", d.replace(partition_size=128)),
        Variant("default, 4-bit K/V", "hack", d.replace(kv_bits=4)),
        *rotation_variants(),
        *option_variants(),
    ]


def option_variants() -> list[Variant]:
    """The next options toward the issue's x1.08 target, screened in 'dequant' mode (the layout's
    error alone): more sink tokens, dense-and-sparse K (a page's widest K channels kept in FP16)
    and more bits for the first and last layer, alone and with the K/V rotation (they act on
    different errors: the rotation on outlier channels in every layer, the bits on two layers)."""
    d = DEFAULT
    return [
        Variant("default, 16 sinks", "dequant", d.replace(sink_tokens=16)),
        *(Variant(f"default, K outlier channels {n}", "dequant", d.replace(k_outlier_channels=n)) for n in (1, 2, 4)),
        Variant("default, first and last layer at 4 bits", "dequant", d.replace(edge_layer_bits=4)),
        Variant("default, rotation hadamard_kv, first and last layer at 4 bits", "dequant",
                d.replace(edge_layer_bits=4, rotation=Rotation.HADAMARD_KV)),
    ]


def layer_bits_variants(layers: tuple[int, ...] | list[int], modes: list[str] | None = None,
                        tensors: "list[RaisedTensors | str] | tuple[RaisedTensors | str, ...]" = (RaisedTensors.KV,),
                        rotation: Rotation | str = Rotation.NONE) -> list[Variant]:
    """The default format with `layers` (0-based) at 4 bits and the rest at 2 (HackConfig
    four_bit_layers), in 'hack' and 'dequant' or only the given modes: the layers a model's
    per-layer breakdown (`hack eval layers`) names. One row per entry of `tensors`: K and V
    raised ('kv'), K alone ('k', V stays at 2 bits) or V alone ('v'). rotation: the rows with
    this K/V rotation as well (the two act on different errors: the bits on a few layers, the
    rotation on outlier channels in all). Model-specific, so not in study_variants()."""
    wanted = None if modes is None else {attention_mode(m.strip()) for m in modes if m.strip()}
    rot = Rotation(rotation)
    rows = []
    for t in dict.fromkeys(raised_tensors(t) for t in tensors):
        cfg = DEFAULT.replace(four_bit_layers=tuple(layers), raised_tensors=t, rotation=rot)
        which = {RaisedTensors.KV: "", RaisedTensors.K: " K", RaisedTensors.V: " V"}[t]
        name = f"default, layers {','.join(map(str, cfg.four_bit_layers))}{which} at 4 bits"
        if rot is not Rotation.NONE:
            name += f", rotation {rot.value}"
        rows += [Variant(name, m, cfg) for m in ("hack", "dequant") if wanted is None or attention_mode(m) in wanted]
    return rows


def sparse_variants(budgets: tuple[int, ...] | list[int], modes: list[str] | None = None,
                    refine: int = 1, base: HackConfig = DEFAULT, name: str = "default",
                    score: "PageScore | str" = "bound", refined_only: bool = False) -> list[Variant]:
    """The format `base` (the plain default unless given, e.g. a model's bit plan applied) read
    by sparse decode (hack_ops.sparse, the server's --hack-sparse-budget with its other
    defaults) at each token budget, in 'hack' and 'dequant' or only the given modes; with
    refine > 1, each budget also refined (--hack-sparse-refine), or only refined with
    `refined_only`. `score` ranks the pages (--hack-sparse-score; named in the row unless the
    bound). Every scored position reads as a decode step would: the closed pages its own
    selection keeps (not the first two layers, nor sliding-window ones). `name` starts each
    row's name."""
    from hack_ops.sparse import PageScore, SparseConfig

    score = PageScore(score)
    if refined_only and refine <= 1:
        raise ValueError("refined_only keeps the refined rows: give refine > 1")
    wanted = None if modes is None else {attention_mode(m.strip()) for m in modes if m.strip()}
    kinds = ([] if refined_only else [1]) + ([refine] if refine > 1 else [])
    tag = "" if score == PageScore.BOUND else f", {score.value} score"
    return [Variant(f"{name}, sparse decode {b} tokens{tag}" + (f", refine {r}" if r > 1 else ""), m, base,
                    sparse=SparseConfig(budget_tokens=b, refine=r, score=score))
            for b in budgets for r in kinds for m in ("hack", "dequant") if wanted is None or attention_mode(m) in wanted]


def static_variants(base: list[Variant], keeps: "tuple | list") -> list[Variant]:
    """Each 'dequant' row of `base` (with a config, no sparse decode) again under every static
    eviction of `keeps` (hack_ops.static_keep.StaticKeep): the prompt's last queries choose the
    closed pages every decode step reads. ValueError when `base` has no such row."""
    rows = [Variant(f"{v.name}, {st.label()}", AttentionMode.DEQUANT, v.config, static=st)
            for v in base if v.mode == AttentionMode.DEQUANT and v.config is not None and v.sparse is None
            and v.layers is None and v.static is None for st in keeps]
    if keeps and not rows:
        raise ValueError("static eviction is studied on 'dequant' rows: select some (e.g. --modes dequant)")
    return rows


def rotation_variants() -> list[Variant]:
    """The default layout with each rotation scope (hack_ops.rotation): K alone (with Q), V
    alone (output rotated back), both, and V with random signs; 'dequant' isolates the layout's
    error, 'hack' adds the INT8 Q/P noise on the same rotated layouts (V alone and both)."""
    d = DEFAULT
    rows = [(Rotation.HADAMARD_K, "dequant"), (Rotation.HADAMARD_V, "dequant"), (Rotation.HADAMARD_KV, "dequant"),
            (Rotation.SIGNED_HADAMARD_V, "dequant"), (Rotation.HADAMARD_V, "hack"), (Rotation.HADAMARD_KV, "hack")]
    return [Variant(f"default, rotation {r.value}", mode, d.replace(rotation=r)) for r, mode in rows]


def split_patterns(value: str) -> list[str]:
    """A --variants flag as its patterns: split at each comma not followed by a space, since
    variant names hold ', ' ('=default, 4-bit K/V' is one whole-name pattern)."""
    return re.split(r",(?!\s)", value)


def select_variants(variants: list[Variant], patterns: list[str], modes: list[str] | None = None) -> list[Variant]:
    """The exact baseline and every variant whose name or config label contains one of the
    patterns (case-insensitive); a pattern starting with '=' matches a whole name instead
    ('=default': the default rows only). modes: keep only rows in these AttentionModes ('hack',
    'dequant'; None: all). ValueError when a pattern or a mode matches nothing."""
    pats = [p.strip().lower() for p in patterns if p.strip()]
    if not pats:
        raise ValueError("--variants needs at least one non-empty pattern")
    if modes is not None:
        wanted = {attention_mode(m.strip()) for m in modes if m.strip()}
        picked = [v for v in select_variants(variants, patterns) if v is EXACT or v.mode in wanted]
        if len(picked) == 1 or not wanted:
            raise ValueError(f"--modes {','.join(modes)} keeps none of the rows --variants selects")
        return picked

    def hits(v: Variant, p: str) -> bool:
        if p.startswith("="):
            return v.name.lower() == p[1:].strip()
        return p in v.name.lower() or (v.config is not None and p in v.config.label().lower())

    for p in pats:
        if not any(hits(v, p) for v in variants if v is not EXACT):
            raise ValueError(f"--variants {p!r} matches no variant; known: "
                             + "; ".join(sorted({v.name for v in variants if v is not EXACT})))
    return [EXACT] + [v for v in variants if v is not EXACT and any(hits(v, p) for p in pats)]


CORE = {
    ("exact", "exact"), ("hack", "default"), ("dequant", "default"),
    ("dequant", "default, plain min/max ranges (no range search)"),
    ("dequant", "default, K tail only (V quantized as written)"), ("dequant", "default, no sink"),
    ("hack", "paper layout"), ("hack", "default, 4-bit K/V"),
}


def core_variants() -> list[Variant]:
    """The rows that carry the decisions, for a shorter run: the default (hack and dequant),
    what each of its choices buys, the paper's layout and the 4-bit option."""
    return [v for v in study_variants() if (v.mode, v.name) in CORE]


def quick_variants() -> list[Variant]:
    """A few variants on a few tokens: keeps the study's code path working in the tests."""
    return [EXACT, Variant("default", "hack", DEFAULT), Variant("paper layout", "dequant", PAPER)]


def generation_variants() -> list[Variant]:
    return [EXACT, Variant("default", "hack", DEFAULT), Variant("paper layout", "hack", PAPER),
            Variant("default, 4-bit K/V", "hack", DEFAULT.replace(kv_bits=4))]


def byte_ratio(config: HackConfig | None, kv_heads: int, head_dim: int, context: int, num_layers: int = 1) -> float:
    """Bytes per element relative to BF16 at `context` tokens (tails and sinks included,
    averaged over the open partition's fill, and over the model's `num_layers` layers for a
    per-layer config)."""
    if config is None:
        return 1.0
    if config.per_layer and num_layers < 3:
        raise ValueError(f"{config.label()} differs per layer: give the model's num_layers")
    return model_bytes_per_token(config, num_layers, kv_heads, head_dim, context)["ratio"]
