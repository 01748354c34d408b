"""The server options the plugin adds to SGLang's command line, and their validation.

`--kv-cache-dtype hack` turns the HACK KV cache on. The `--hack-*` options map onto
hack_ops.HackConfig fields (None = HackConfig's default) or onto EngineSettings. Combinations
that cannot work are refused at startup with one clear sentence, before the model loads.
"""
from __future__ import annotations

import argparse
from typing import Any

from hack_ops import HackConfig
from hack_ops.config import ORIENTATIONS, ROUNDINGS, TAIL_TENSORS, RaisedTensors
from hack_ops.modes import SERVING_MODES, AttentionMode, PrefillMode
from hack_ops.paged.chunk_codes import layout_refusal
from hack_ops.rotation import ROTATION_AUTO, Rotation  # auto: the bit plan's (engine.server_options)
from hack_ops.sparse import SparseConfig
from hack_ops.static_keep import KeepUnit, StaticKeep

from .bit_plans import bits_spec
from .layer_sets import LayerSet, LayerSpec, parse_layer_set
from .settings import BACKEND_NAME, KV_CACHE_DTYPE, EngineSettings
from .sparse_choice import ScoreChoice

# How every --hack-4bit-layers / --4bit-layers flag shows its value: indices or a LayerSet's name.
LAYER_SPEC_METAVAR = "L,L,...|" + "|".join(m.value for m in LayerSet)


class HackArgumentError(ValueError):
    """A server option (or combination) that the HACK plugin refuses."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction, got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {v}")
    return v


def layer_list(text: str) -> LayerSpec:
    """'1,5' -> (1, 5): 0-based layer indices; a set's name ('full') -> that LayerSet, resolved
    from the model's config when the server or command starts (engine.layer_sets)."""
    named = parse_layer_set(text)
    if named is not None:
        return named
    try:
        return tuple(_non_negative_int(t.strip()) for t in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices (integers >= 0) or "
                                         f"{', '.join(repr(m.value) for m in LayerSet)}, got {text!r}") from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


# dest -> (flag, argparse kwargs). Defaults are None so that "given" and "defaulted" differ.
HACK_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "hack_partition_size": ("--hack-partition-size", dict(
        type=_positive_int, metavar="N",
        help="HACK partition size = KV page size in tokens (multiple of 16, 16..256).")),
    "hack_rounding": ("--hack-rounding", dict(
        choices=list(ROUNDINGS), help="Rounding of K/V codes and INT8 Q/P.")),
    "hack_disable_summation_elimination": ("--hack-disable-summation-elimination", dict(
        action="store_true", default=None,
        help="Ablation: recompute code sums at every attention step instead of storing them.")),
    "hack_disable_requant_elimination": ("--hack-disable-requant-elimination", dict(
        action="store_true", default=None,
        help="Ablation: re-quantize the open partition at every step instead of keeping it FP16.")),
    "hack_disable_range_search": ("--hack-disable-range-search", dict(
        action="store_true", default=None,
        help="Quantize pages over their plain min/max range instead of the least-squared-error "
             "clipped range (faster page quantization, less accurate).")),
    "hack_prefill": ("--hack-prefill", dict(
        choices=[m.value for m in PrefillMode],
        help="Extend (prefill) attention: auto (default: dense on a CPU with AMX-BF16 serving a BF16 "
             "model, on a CPU without AVX-512 VNNI and on a GPU; int8 elsewhere; the server log says which "
             "and why), homomorphic (the chunk's own tokens through the 2-bit codes, as decode reads "
             "them), int8 (the same INT8 kernel reading the chunk's own tokens from 6-bit codes: the "
             "homomorphic prefill's speed, about dense's fidelity; CPU only), exact (the chunk's own "
             "tokens in FP16, a cached prefix through the codes; CPU only) or dense (the chunk in FP16 "
             "and a cached prefix dequantized once, both by SDPA; float32 on a CPU without AMX-BF16). "
             "Decode reads the codes in every mode.")),
    "hack_orientation": ("--hack-orientation", dict(
        choices=list(ORIENTATIONS),
        help="channel_k: K per channel over the page, V per token (default); token_k: the paper's.")),
    "hack_tail_tensors": ("--hack-tail-tensors", dict(
        choices=list(TAIL_TENSORS),
        help="Which tensors keep the open partition in FP16 until it fills: kv (default) or "
             "per_channel (the paper's scope).")),
    "hack_sink_tokens": ("--hack-sink-tokens", dict(
        type=_non_negative_int, metavar="N",
        help="First N tokens of every sequence kept in FP16 (attention sinks).")),
    "hack_rotation": ("--hack-rotation", dict(
        choices=[ROTATION_AUTO, *(r.value for r in Rotation)],
        help="Orthogonal Walsh-Hadamard rotation per head before quantization (head_dim a power "
             "of two): auto (default) takes the bit plan's (--hack-bits: hadamard_kv in SmolLM2's "
             "shipped plan, where it cut perplexity's excess by half at no bytes; none in Gemma-3's, "
             "and with no plan); none; hadamard_k rotates Q and K; hadamard_v rotates V and the "
             "output back; hadamard_kv both; signed_* adds a fixed seeded random sign diagonal. "
             "Given, it overrides the plan's.")),
    "hack_k_outlier_channels": ("--hack-k-outlier-channels", dict(
        type=_non_negative_int, metavar="N",
        help="Dense-and-sparse K: keep each page's N widest K channels per head in FP16 outside the "
             "codes (default 0). Measured by `hack eval accuracy`; the serving paths refuse N > 0.")),
    "hack_edge_layer_bits": ("--hack-edge-layer-bits", dict(
        type=int, choices=[2, 4],
        help="Bits per K/V code of the first and last layer (default: --hack-kv-bits); those layers' "
             "pages are laid out with their own bits.")),
    "hack_four_bit_layers": ("--hack-4bit-layers", dict(
        type=layer_list, metavar=LAYER_SPEC_METAVAR,
        help="0-based indices of the layers whose K/V codes use 4 bits (the few layers where a model's "
             "2-bit error sits or its retrieval heads read: `hack eval layers`, `hack eval retrieval "
             "--needle-attention`), or 'full': the layers without a sliding window, read from the "
             "model's config (Gemma-3-270M: 5,11,17); each such layer's pages are laid out with 4 bits, "
             "the others keep --hack-kv-bits. Given, it overrides --hack-bits (the calibrated plan). "
             "'auto': 'full' where a model mixes window and full-attention layers and the full ones are at "
             "most a quarter of its layers (Gemma-3: they alone read past the window), else none; 'none': "
             "no layer raised. The server log says what it resolved to. Indices "
             "beyond the model's layers, and 'full' on a model without both kinds of layer, are "
             "refused at startup.")),
    "hack_bits": ("--hack-bits", dict(
        type=bits_spec, metavar="auto|plain|PLAN.json",
        help="Where the per-layer K and V bits come from: auto (default): the bit plan `hack calibrate MODEL` "
             "measured for the served model's weights (beside the model folder, else shipped with the project "
             "for SmolLM2-135M and Gemma-3-270M; found by the model's hash), and the plain format (every code at "
             "--hack-kv-bits) for a model without one, which the startup log says; plain: no plan; a path: that "
             "plan file, refused when it was measured on other weights. --hack-4bit-layers and "
             "--hack-edge-layer-bits are the manual override: given, no plan is read.")),
    "hack_four_bit_tensors": ("--hack-4bit-tensors", dict(
        choices=[t.value for t in RaisedTensors],
        help="Which tensors of the --hack-4bit-layers (and --hack-edge-layer-bits) layers take their "
             "bits: kv (K and V, default), k (K alone, V keeps --hack-kv-bits: fewer bytes where K "
             "carries the error) or v (V alone); `hack eval accuracy|retrieval --4bit-tensors`. Each "
             "layer's pages are laid out with its K and V bits.")),
    "hack_kv_bits": ("--hack-kv-bits", dict(
        type=int, choices=[2, 4], help="Bits per K/V code.")),
    "hack_k_bits": ("--hack-k-bits", dict(
        type=int, choices=[2, 4],
        help="Bits per K code where they differ from V's (default: --hack-kv-bits for both; "
             "--hack-kv-bits then sets V's).")),
    "hack_attention": ("--hack-attention", dict(
        choices=[m.value for m in SERVING_MODES],
        help="hack: homomorphic attention on codes (default); dequant: the strawman baseline "
             "that dequantizes the same pages before attention.")),
    "hack_sparse_budget": ("--hack-sparse-budget", dict(
        type=_non_negative_int, metavar="TOKENS",
        help="Sparse decode: each decode step reads, per request and KV head, at most this many tokens of "
             "closed pages, chosen by the upper bound of q.k that K's per-page min and scale give (plus the "
             "first page, the recent pages and the FP16 open page). 0 (default): every page. Layers with a "
             "sliding window and the first --hack-sparse-dense-layers always read every page. "
             "--hack-attention hack and --hack-orientation channel_k only; on a GPU the bound alone (no "
             "--hack-sparse-refine or --hack-sparse-groups); refused otherwise at startup. On a CPU each "
             "decoding request's K min and scale are copied in page order beside the pool for the selection "
             "(~10% of its pages' bytes, outside the KV budget, at most ~10% of the pool's).")),
    "hack_sparse_recent": ("--hack-sparse-recent", dict(
        type=_non_negative_int, metavar="TOKENS",
        help="Sparse decode: the most recent closed tokens always read, within the budget (default 256).")),
    "hack_sparse_dense_layers": ("--hack-sparse-dense-layers", dict(
        type=_non_negative_int, metavar="N",
        help="Sparse decode: the first N layers read every page (default 2; their attention is broad).")),
    "hack_sparse_share_layers": ("--hack-sparse-share-layers", dict(
        type=_positive_int, metavar="K",
        help="Sparse decode: a layer's selection is reused by the next K-1 sparse layers (MPCache's "
             "layer-wise index sharing; default 1: every layer selects its own).")),
    "hack_sparse_score": ("--hack-sparse-score", dict(
        choices=[s.value for s in ScoreChoice],
        help="Sparse decode: how a page is scored: auto (default: by the model's head width, chosen at startup "
             "and logged: the bound on heads of up to 128 channels, linear on wider ones, refined four times at "
             "budgets up to 2048 tokens and twice above; "
             "engine/sparse_choice.py), bound (the exact upper bound of q.k over the page; the better on "
             "64-channel heads such as SmolLM2's) or linear (MPCache's stand-in, q.(0.6 max + 0.4 min); the "
             "better on 256-channel heads such as Gemma-3's, refined: docs/sparse.md).")),
    "hack_sparse_groups": ("--hack-sparse-groups", dict(
        type=_non_negative_int, metavar="PAGES",
        help="Sparse decode: score groups of this many pages first (their boxes kept per request, computed "
             "once a group closes) and choose pages within the best groups (MPCache's two levels; default 0: "
             "one level).")),
    "hack_sparse_refine": ("--hack-sparse-refine", dict(
        type=_positive_int, metavar="R",
        help="Sparse decode: the bound keeps R times the budget's free pages as candidates, and the budget goes "
             "to the candidates whose own keys score highest (the decode kernel's scores of each candidate "
             "page; default 1: the bound alone). Costs reading the candidates' K codes; with --hack-sparse-groups, "
             "the candidates come from the kept groups.")),
    "hack_static_keep": ("--hack-static-keep", dict(
        type=fraction, metavar="FRACTION",
        help="Look-once static eviction (MPCache): after a prompt is prefilled, its last queries (the last "
             "--hack-static-observe of the prompt) vote with their attention, and every later decode step reads "
             "only this fraction of the prompt's closed pages per layer (the first page, the window's own and the "
             "best-voted rest), plus every page written since and the FP16 open page. Saves decode reads, not "
             "memory. Over PD give it to both servers: the prefill server decides (its fraction counts) and "
             "leaves each layer's dropped pages off the wire (with --hack-kv-codec hack-pages). 1 (default): off. "
             "CPU path, --hack-attention hack only; refused otherwise at startup.")),
    "hack_static_observe": ("--hack-static-observe", dict(
        type=fraction, metavar="FRACTION",
        help="Static eviction: the last fraction of the prompt whose queries vote (default 0.01, at least one "
             "row: the question at the end of a document; 0.15, MPCache's, lost pass keys in the study).")),
    "hack_static_unit": ("--hack-static-unit", dict(
        choices=[u.value for u in KeepUnit],
        help="Static eviction: page (default) keeps or drops a layer's page for all its KV heads; head lets "
             "each KV head keep its own pages.")),
    "hack_page_tier": ("--hack-page-tier", dict(
        metavar="DIR",
        help="Keep the radix cache's pages in DIR too (the page tier): a prefix evicted from the pool comes back "
             "from disk instead of being recomputed. Every page SGLang's radix cache inserts is written through "
             "SGLang's unified-cache linker and its file storage backend; records are verified (size and digest, "
             "a first page's sinks too) before a hit is reported, else recomputed. Any --kv-cache-dtype (HACK "
             "pages, or BF16 pages as the baseline); not on a PD decode server, without the radix cache or with "
             "--tp-size/--pp-size above 1.")),
    "hack_page_tier_size": ("--hack-page-tier-size", dict(
        metavar="SIZE",
        help="Cap of the page tier on disk (e.g. 4G, 512M; least recently used records go first). "
             "Default: no cap.")),
    "hack_kv_budget_mb": ("--hack-kv-budget-mb", dict(
        type=_positive_float, metavar="MB",
        help="Size the KV pool from this fixed budget instead of free memory (any "
             "--kv-cache-dtype; for comparing capacities under the same budget).")),
}

# Options that apply to every --kv-cache-dtype, not only to hack.
DTYPE_FREE_OPTIONS = ("--hack-kv-budget-mb", "--hack-page-tier", "--hack-page-tier-size")

# HackConfig fields set from options (boolean ablations are inverted below).
_CONFIG_FIELDS = {
    "hack_partition_size": "partition_size",
    "hack_rounding": "rounding",
    "hack_orientation": "orientation",
    "hack_tail_tensors": "tail_tensors",
    "hack_sink_tokens": "sink_tokens",
    "hack_kv_bits": "kv_bits",
    "hack_k_bits": "k_bits",
    "hack_four_bit_tensors": "raised_tensors",
    "hack_rotation": "rotation",
    "hack_k_outlier_channels": "k_outlier_channels",
    "hack_edge_layer_bits": "edge_layer_bits",
    "hack_four_bit_layers": "four_bit_layers",
}

# SparseConfig fields set from options.
_SPARSE_FIELDS = {
    "hack_sparse_budget": "budget_tokens",
    "hack_sparse_recent": "recent_tokens",
    "hack_sparse_dense_layers": "dense_layers",
    "hack_sparse_share_layers": "share_layers",
    "hack_sparse_score": "score",
    "hack_sparse_groups": "group_pages",
    "hack_sparse_refine": "refine",
}

# StaticKeep fields set from options.
_STATIC_FIELDS = {
    "hack_static_keep": "keep",
    "hack_static_observe": "observe",
    "hack_static_unit": "unit",
}

# HackConfig fields only the dense reference implements (HackConfig.reference_only) -> flag.
_REFERENCE_ONLY_FLAGS = {
    "k_outlier_channels": "--hack-k-outlier-channels",
}


def reference_only_refusal(cfg: HackConfig) -> str | None:
    """The startup refusal for options that no serving path implements (only hack_ops.attention,
    the reference the accuracy study runs, does), or None."""
    fields = cfg.reference_only()
    if not fields:
        return None
    shown = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v  # noqa: E731  as typed
    flags = ", ".join(f"{_REFERENCE_ONLY_FLAGS[f]} {shown(getattr(cfg, f))}" for f in fields)
    return (f"{flags}: implemented in the reference attention only (hack_ops.attention, measured by "
            "`hack eval accuracy`); the compiled CPU store and kernels, the Triton kernels and the paged "
            "PyTorch path do not implement it yet. Drop the option to serve")


def sparse_refusal(settings: EngineSettings) -> str | None:
    """Why the sparse decode options cannot run with the rest of the settings, or None."""
    sp, cfg = settings.sparse, settings.config
    given = [f for d, f in _SPARSE_FIELDS.items() if getattr(sp, f) != getattr(SparseConfig(), f)]
    if not sp.enabled:
        if given:
            return ("the --hack-sparse-* options shape sparse decode, which is off: set --hack-sparse-budget "
                    "TOKENS (> 0) to turn it on")
        return None
    if settings.attention != AttentionMode.HACK:
        return (f"--hack-sparse-budget reads the selected pages' codes homomorphically; --hack-attention "
                f"{settings.attention.value} (the strawman baseline) does not take it")
    if cfg.orientation != "channel_k":
        return (f"--hack-sparse-budget scores pages from K's per-channel min and scale; --hack-orientation "
                f"{cfg.orientation} quantizes K per token. Use channel_k (the default)")
    if sp.budget_tokens < 2 * cfg.partition_size:
        return (f"--hack-sparse-budget {sp.budget_tokens} is under two pages of {cfg.partition_size} tokens: the "
                "first page and one more are always read")
    return None


def static_refusal(settings: EngineSettings, ns: Any = None) -> str | None:
    """Why the static eviction options cannot run with the rest of the settings (and, given the
    namespace, SGLang's own options), or None."""
    st = settings.static
    if not st.enabled:
        if st.observe != StaticKeep().observe or st.unit != StaticKeep().unit:
            return ("--hack-static-observe and --hack-static-unit shape static eviction, which is off: set "
                    "--hack-static-keep FRACTION (< 1) to turn it on")
        return None
    if settings.attention != AttentionMode.HACK:
        return (f"--hack-static-keep reads the kept pages' codes homomorphically; --hack-attention "
                f"{settings.attention.value} (the strawman baseline) does not take it")
    if settings.sparse.enabled:
        return ("--hack-static-keep and --hack-sparse-budget each give decode its own page list; choosing "
                "among the kept pages is not served yet. Give one of them")
    mode = getattr(ns, "disaggregation_mode", None) if ns is not None else None
    if mode == "decode" and getattr(ns, "disaggregation_decode_enable_radix_cache", False):
        return ("--hack-static-keep on a PD decode server leaves the pages prefill did not send unfilled; "
                "--disaggregation-decode-enable-radix-cache would share them with later requests. Drop one of them")
    if ns is not None and getattr(ns, "enable_mixed_chunk", False):
        return ("--hack-static-keep decides a request's pages at its prefill chunks; --enable-mixed-chunk runs "
                "decode requests through extend too. Drop one of them")
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's options to SGLang's parser: `hack` among the --kv-cache-dtype and
    --attention-backend choices, the --hack-* options and --disagg-mode."""
    for action in parser._actions:
        if action.dest in ("kv_cache_dtype", "attention_backend", "prefill_attention_backend",
                           "decode_attention_backend") and action.choices is not None:
            if KV_CACHE_DTYPE not in action.choices:
                action.choices = [*action.choices, KV_CACHE_DTYPE]
    existing = set(parser._option_string_actions)
    group = parser.add_argument_group("HACK KV cache (sglang-hack)")
    for dest, (flag, kwargs) in HACK_OPTIONS.items():
        if flag not in existing:
            group.add_argument(flag, dest=dest, **{"default": None, **kwargs})
    dis = parser._option_string_actions.get("--disaggregation-mode")
    if dis is not None and "--disagg-mode" not in existing:
        # Same dest; SUPPRESS keeps the alias from overwriting the real option's default.
        parser.add_argument("--disagg-mode", dest=dis.dest, choices=dis.choices,
                            default=argparse.SUPPRESS, help="Alias of --disaggregation-mode.")


def given_hack_options(ns: Any) -> list[str]:
    return [flag for dest, (flag, _) in HACK_OPTIONS.items() if getattr(ns, dest, None) is not None]


def settings_from_options(ns: Any, enabled: bool) -> EngineSettings:
    """Build EngineSettings from a namespace holding the hack_* attributes (missing = default)."""
    changes = {f: getattr(ns, d) for d, f in _CONFIG_FIELDS.items()
               if getattr(ns, d, None) not in (None, ROTATION_AUTO)}  # auto: the plan's, applied later
    if getattr(ns, "hack_disable_summation_elimination", None):
        changes["summation_elimination"] = False
    if getattr(ns, "hack_disable_requant_elimination", None):
        changes["requant_elimination"] = False
    if getattr(ns, "hack_disable_range_search", None):
        changes["range_search"] = False
    try:
        cfg = HackConfig().replace(**changes)
    except ValueError as exc:
        raise HackArgumentError(f"invalid HACK option: {exc}") from None
    extra = {}
    for dest, key in (("hack_prefill", "prefill"), ("hack_attention", "attention"),
                      ("hack_kv_budget_mb", "kv_budget_mb")):
        if getattr(ns, dest, None) is not None:
            extra[key] = getattr(ns, dest)
    sparse = {f: getattr(ns, d) for d, f in _SPARSE_FIELDS.items() if getattr(ns, d, None) is not None}
    try:
        extra["sparse"] = SparseConfig(**sparse)
    except ValueError as exc:
        raise HackArgumentError(f"invalid sparse decode option: {exc}") from None
    static = {f: getattr(ns, d) for d, f in _STATIC_FIELDS.items() if getattr(ns, d, None) is not None}
    try:
        extra["static"] = StaticKeep(**static)
    except ValueError as exc:
        raise HackArgumentError(f"invalid static eviction option: {exc}") from None
    return EngineSettings(enabled=enabled, config=cfg, **extra)


def check_combination(ns: Any, settings: EngineSettings | None) -> dict[str, Any]:
    """Validate the SGLang options that must agree with the HACK cache. Returns the values to
    set (page_size, attention_backend); raises HackArgumentError with a clear message."""
    backends = {k: getattr(ns, k, None) for k in
                ("attention_backend", "prefill_attention_backend", "decode_attention_backend")}
    kv_dtype = getattr(ns, "kv_cache_dtype", None)
    if settings is None or not settings.enabled:
        named = [f"--{k.replace('_', '-')} {v}" for k, v in backends.items() if v == BACKEND_NAME]
        if named:
            raise HackArgumentError(
                f"{named[0]} reads HACK-compressed pages and needs --kv-cache-dtype hack "
                f"(got --kv-cache-dtype {kv_dtype})")
        extra = [f for f in given_hack_options(ns) if f not in DTYPE_FREE_OPTIONS]
        if extra:
            raise HackArgumentError(
                f"{', '.join(extra)} only apply with --kv-cache-dtype hack (got {kv_dtype})")
        return {}
    refusal = reference_only_refusal(settings.config)
    if refusal:
        raise HackArgumentError(refusal)
    cfg = settings.config
    if cfg.raised_tensors != RaisedTensors.KV and not (cfg.four_bit_layers or cfg.edge_layer_bits):
        raise HackArgumentError(f"--hack-4bit-tensors {cfg.raised_tensors.value} says which tensors of the raised "
                                "layers take their bits; name those layers with --hack-4bit-layers or "
                                "--hack-edge-layer-bits")
    refusal = sparse_refusal(settings) or static_refusal(settings, ns)
    if refusal:
        raise HackArgumentError(refusal)
    refusal = layout_refusal(cfg) if settings.prefill == PrefillMode.INT8 else None
    if refusal:
        raise HackArgumentError(f"{refusal}. Use --hack-prefill homomorphic, exact or dense, or the default layout")
    out: dict[str, Any] = {}
    page = getattr(ns, "page_size", None)
    if page is None:
        out["page_size"] = settings.page_size
    elif page != settings.page_size:
        raise HackArgumentError(
            f"--page-size {page} conflicts with the HACK partition size {settings.page_size}: "
            f"a KV page holds exactly one partition. Drop --page-size, or set "
            f"--hack-partition-size {page} (a multiple of 16 in 16..256)")
    for key, val in backends.items():
        if val is not None and val != BACKEND_NAME:
            raise HackArgumentError(
                f"--kv-cache-dtype hack stores 2-bit pages that only the '{BACKEND_NAME}' attention "
                f"backend reads; --{key.replace('_', '-')} {val} cannot use them. Drop that option "
                f"or set it to {BACKEND_NAME}")
    if backends["attention_backend"] is None:
        out["attention_backend"] = BACKEND_NAME
    if getattr(ns, "speculative_algorithm", None):
        raise HackArgumentError("--kv-cache-dtype hack does not support speculative decoding yet")
    if getattr(ns, "enable_hierarchical_cache", False):
        raise HackArgumentError("--kv-cache-dtype hack does not support --enable-hierarchical-cache")
    return out
