"""`--hack-bits`: where a HACK server's per-layer K and V bits come from.

`auto` (the default): the bit plan `hack calibrate` measured for the served model's weights
(hack_ops.bit_plan: beside the model folder, else shipped in hack_ops/plans/), found by the
model's hash; a model without one is served in the plain format (every code at --hack-kv-bits)
and the log says so, with the command that writes one. `plain`: no plan. A path: that plan
file, refused with a sentence when it was measured on other weights or another geometry.
`--hack-4bit-layers` and `--hack-edge-layer-bits` stay the manual override: given, they set the
raised layers and no plan is read. Resolved once, in the launching process; the plan reaches
every scheduler process inside the published HackConfig (four_bit_k_layers/four_bit_v_layers),
so the store, the kernels, the capacity sizing and the PD fingerprint all see it.
"""
from __future__ import annotations

import argparse
import enum
import logging
import os
from pathlib import Path
from typing import Any

from hack_ops.bit_plan import HASH_CHARS, SHIPPED_DIR, BitPlan, find_plan, load_plan, model_hash, plan_for_check

logger = logging.getLogger(__name__)


class BitsSource(str, enum.Enum):
    AUTO = "auto"  # the model's calibrated plan, else the plain format
    PLAIN = "plain"  # every code at --hack-kv-bits


BitsSpec = BitsSource | Path


def bits_spec(text: str) -> BitsSpec:
    """'auto' / 'plain' -> the BitsSource; anything else is a plan file's path."""
    try:
        return BitsSource(text.strip().lower())
    except ValueError:
        path = Path(text)
        if not path.suffix == ".json":
            raise argparse.ArgumentTypeError(f"expected auto, plain or a bit plan file (.json), got {text!r}") from None
        return path


class PlanRefusal(ValueError):
    """A --hack-bits choice the server refuses at startup (one sentence)."""


def model_geometry(model_path: str, trust_remote_code: bool) -> tuple[int, int, int] | None:
    """(layers, KV heads, head_dim) from a local model folder's HF config, or None when it cannot
    be read (or the path is no local folder: nothing is fetched)."""
    from transformers import AutoConfig

    from .model_checks import text_config

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    try:
        cfg = text_config(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    except (ValueError, OSError, KeyError):
        return None
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return int(cfg.num_hidden_layers), heads, head_dim


def resolve_plan(spec: BitsSpec | None, model_path: str | None, manual: bool, uniform_bits: int | None,
                 trust_remote_code: bool = False) -> BitPlan | None:
    """The plan a HACK server applies, or None (with the log line that says why). `manual`: the
    raised layers were given by --hack-4bit-layers/--hack-edge-layer-bits; `uniform_bits`: the
    bits --hack-kv-bits / --hack-k-bits put on every code when other than 2 (a plan raises 2-bit
    codes)."""
    explicit = spec is not None
    spec = BitsSource.AUTO if spec is None else spec
    if spec is BitsSource.PLAIN:
        logger.info("sglang-hack: --hack-bits plain: every code at --hack-kv-bits, no bit plan")
        return None
    if manual:
        if explicit:
            raise PlanRefusal(f"--hack-bits {spec if isinstance(spec, Path) else spec.value} and --hack-4bit-layers/"
                              "--hack-edge-layer-bits both choose the 4-bit layers; give one of them")
        logger.info("sglang-hack: --hack-bits auto: not used, the layers given by --hack-4bit-layers/"
                    "--hack-edge-layer-bits decide (the manual override)")
        return None
    if uniform_bits is not None:
        if explicit:
            raise PlanRefusal(f"a bit plan raises 2-bit codes to 4 bits, and --hack-kv-bits/--hack-k-bits put "
                              f"{uniform_bits} bits on every code; drop --hack-bits or those options")
        logger.info("sglang-hack: --hack-bits auto: no bit plan, every code at %d bits", uniform_bits)
        return None
    local = bool(model_path) and os.path.isfile(os.path.join(str(model_path), "config.json"))
    if isinstance(spec, Path):
        if not local:
            raise PlanRefusal(f"--hack-bits {spec} checks the plan against the model folder's weights, and "
                              f"{model_path!r} is not a local model folder")
        try:
            plan = load_plan(spec)
        except (OSError, ValueError) as exc:
            raise PlanRefusal(f"--hack-bits {spec}: {exc}") from None
        digest = model_hash(model_path)
        if plan.model_hash != digest:
            raise PlanRefusal(f"--hack-bits {spec} was measured on model {plan.short_hash} ({plan.model}), and "
                              f"{model_path} is model {digest[:HASH_CHARS]}; run `hack calibrate {model_path}`")
        where = spec
    else:
        if not local:
            logger.info("sglang-hack: --hack-bits auto: %r is not a local model folder, so no bit plan is "
                        "looked up: plain format, every code at 2 bits", model_path)
            return None
        try:
            found = find_plan(model_path)
        except ValueError as exc:
            raise PlanRefusal(f"--hack-bits auto: {exc}") from None
        if found is None:
            logger.info("sglang-hack: --hack-bits auto: no bit plan for model %s (looked in %s and %s): plain "
                        "format, every code at 2 bits; `hack calibrate %s` measures one",
                        model_hash(model_path)[:HASH_CHARS], model_path, SHIPPED_DIR, model_path)
            return None
        plan, where = found
    geo = model_geometry(str(model_path), trust_remote_code)
    reason = plan_for_check(plan, *geo) if geo is not None else None
    if reason:
        raise PlanRefusal(f"--hack-bits: {reason}; run `hack calibrate {model_path}`")
    logger.info("sglang-hack: --hack-bits %s = plan %s (%s, calibrated %s): %s",
                spec if isinstance(spec, Path) else spec.value, where, plan.model,
                plan.calibration.get("date", "?"), plan.summary())
    return plan


def resolve_for_namespace(ns: Any) -> BitPlan | None:
    """resolve_plan for a parsed server namespace (the --hack-* options as given)."""
    manual = getattr(ns, "hack_four_bit_layers", None) is not None or getattr(ns, "hack_edge_layer_bits", None) is not None
    kv, k = getattr(ns, "hack_kv_bits", None), getattr(ns, "hack_k_bits", None)
    uniform = None
    if kv not in (None, 2) or k not in (None, 2):
        uniform = max(kv or 2, k or 2)
    return resolve_plan(getattr(ns, "hack_bits", None), getattr(ns, "model_path", None), manual, uniform,
                        bool(getattr(ns, "trust_remote_code", False)))
