"""The colocated server of each KV method that `hack bench serve` and `hack eval retrieval
--served` start: the SGLang options that make the method (the rest of each command line is the
caller's: budget, model, sleep on idle). See hack_cli/bench_serve.py for what each measures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from disagg.server_cmd import STATIC_PREFIX, static_keep_of

if TYPE_CHECKING:
    from engine.layer_sets import LayerSet

METHODS = {
    "bf16": ["--attention-backend", "torch_native"],
    # the same model with float32 weights and KV: what the BF16 server computes, without its
    # rounding (the yardstick for how far BF16 itself stays from exact arithmetic)
    "fp32": ["--attention-backend", "torch_native", "--dtype", "float32"],
    "hack": ["--kv-cache-dtype", "hack"],  # the server's defaults, --hack-bits auto (the calibrated plan) included
    "hack-2bit": ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "none"],  # every layer at 2 bits (no plan)
    # every code at 4 bits (no plan): ~31% of BF16's bytes, the format's near-lossless ceiling
    "hack-4bit": ["--kv-cache-dtype", "hack", "--hack-kv-bits", "4", "--hack-bits", "plain"],
    "dequant": ["--kv-cache-dtype", "hack", "--hack-attention", "dequant"],
    "hack-homomorphic-prefill": ["--kv-cache-dtype", "hack", "--hack-prefill", "homomorphic"],
    "hack-int8-prefill": ["--kv-cache-dtype", "hack", "--hack-prefill", "int8"],
    "hack-exact-prefill": ["--kv-cache-dtype", "hack", "--hack-prefill", "exact"],
    "hack-dense-prefill": ["--kv-cache-dtype", "hack", "--hack-prefill", "dense"],
    "hack-4bit-layers": ["--kv-cache-dtype", "hack"],  # + --hack-4bit-layers (method_args)
    # the default server with the Walsh-Hadamard rotation of K and V (Q too, the output back), and
    # without any (--hack-rotation auto, the default, takes the bit plan's: SmolLM2's rotates)
    "hack-rotation": ["--kv-cache-dtype", "hack", "--hack-rotation", "hadamard_kv"],
    "hack-no-rotation": ["--kv-cache-dtype", "hack", "--hack-rotation", "none"],
}


# hack-sparse-TOKENS: the default server with sparse decode at that budget (--hack-sparse-budget);
# suffixes: -shareK, one selection serving K layers (--hack-sparse-share-layers K); -refineR, R
# candidates per free page ranked by their own keys (--hack-sparse-refine R); -groupsG, two levels
# over groups of G pages (--hack-sparse-groups G); -linear, MPCache's linear page score instead of
# the bound (--hack-sparse-score linear); -auto, the score (and, on wide heads, the refinement) the
# server picks for the model (--hack-sparse-score auto). Without -linear or -auto the method names
# the bound (--hack-sparse-score bound), what it named before `auto` became the server's default.
SPARSE_PREFIX = "hack-sparse-"
SHARE_SUFFIX, REFINE_SUFFIX, GROUPS_SUFFIX, LINEAR_SUFFIX, AUTO_SUFFIX = "share", "refine", "groups", "linear", "auto"
# hack-static-FRACTION: the default server with look-once static eviction keeping that fraction of
# each prompt's closed pages (--hack-static-keep FRACTION), as disagg.server_cmd names the PD
# cluster's methods (STATIC_PREFIX)
METHOD_NAMES = [*METHODS,
                f"{SPARSE_PREFIX}TOKENS[-{SHARE_SUFFIX}K][-{REFINE_SUFFIX}R][-{GROUPS_SUFFIX}G][-{LINEAR_SUFFIX}|-{AUTO_SUFFIX}]",
                f"{STATIC_PREFIX}FRACTION"]


def _sparse_args(method: str) -> tuple[int, list[str]] | None:
    """(budget, server options) of a hack-sparse-TOKENS[-shareK][-refineR][-groupsG][-linear|-auto]
    method (None: not one)."""
    if not method.startswith(SPARSE_PREFIX):
        return None
    budget, *rest = method[len(SPARSE_PREFIX):].split("-")
    if not budget.isdigit() or int(budget) <= 0:
        return None
    opts = ["--hack-sparse-budget", str(int(budget))]
    if rest and rest[0].startswith(SHARE_SUFFIX):
        k = rest.pop(0)[len(SHARE_SUFFIX):]
        if not k.isdigit() or int(k) < 1:
            return None
        opts += ["--hack-sparse-share-layers", k] if int(k) > 1 else []
    if rest and rest[0].startswith(REFINE_SUFFIX):
        r = rest.pop(0)[len(REFINE_SUFFIX):]
        if not r.isdigit() or int(r) < 1:
            return None
        opts += ["--hack-sparse-refine", r] if int(r) > 1 else []
    if rest and rest[0].startswith(GROUPS_SUFFIX):
        g = rest.pop(0)[len(GROUPS_SUFFIX):]
        if not g.isdigit() or int(g) < 1:
            return None
        opts += ["--hack-sparse-groups", g]
    score = "bound"
    if rest and rest[0] in (LINEAR_SUFFIX, AUTO_SUFFIX):
        score = "linear" if rest.pop(0) == LINEAR_SUFFIX else ""
    opts += ["--hack-sparse-score", score] if score else []
    return None if rest else (int(budget), opts)


def sparse_budget(method: str) -> int | None:
    """The token budget a hack-sparse-TOKENS[...] method names (None: not such a method)."""
    parsed = _sparse_args(method)
    return None if parsed is None else parsed[0]


def static_keep(method: str) -> float | None:
    """The fraction a hack-static-FRACTION method keeps (None: not such a method)."""
    return static_keep_of(method)


def is_method(method: str) -> bool:
    return method in METHODS or sparse_budget(method) is not None or static_keep(method) is not None


def method_args(method: str, four_bit_layers: "tuple[int, ...] | LayerSet | None", raised: str = "kv") -> list[str]:
    """The server options of a method (hack-4bit-layers takes its layers from --4bit-layers: indices,
    or a set's name that the server resolves from the model's config; raised 'k' or 'v' gives
    only that tensor of those layers 4 bits: --hack-4bit-tensors; hack-sparse-TOKENS is the
    default server with --hack-sparse-budget TOKENS; -shareK adds --hack-sparse-share-layers K,
    -refineR --hack-sparse-refine R, -groupsG --hack-sparse-groups G, -linear --hack-sparse-score
    linear, -auto no score (the server's auto), neither --hack-sparse-score bound; hack-static-FRACTION the
    default server with --hack-static-keep FRACTION)."""
    from engine.layer_sets import LayerSet
    from hack_ops.config import RaisedTensors, raised_tensors

    parsed = _sparse_args(method)
    if parsed is not None:
        return [*METHODS["hack"], *parsed[1]]
    keep = static_keep(method)
    if keep is not None:
        return [*METHODS["hack"], "--hack-static-keep", f"{keep:g}"]
    if method not in METHODS:
        raise ValueError(f"unknown KV method {method!r}: choose from {', '.join(METHOD_NAMES)}")
    if method != "hack-4bit-layers":
        return list(METHODS[method])
    if four_bit_layers is None or four_bit_layers is LayerSet.NONE:
        raise ValueError("--methods hack-4bit-layers needs --4bit-layers L,L,...|full|auto (the layers to hold at 4 bits)")
    if not four_bit_layers:  # a set's name resolved to no layer of this model
        raise ValueError("--4bit-layers names no layer of this model (its 'auto' set is empty where it has no "
                         "sliding-window layers): give the layers as indices, or measure method hack-2bit")
    shown = four_bit_layers.value if isinstance(four_bit_layers, LayerSet) else ",".join(map(str, four_bit_layers))
    tensors = raised_tensors(raised)
    extra = [] if tensors == RaisedTensors.KV else ["--hack-4bit-tensors", tensors.value]
    return [*METHODS[method], "--hack-4bit-layers", shown, *extra]
