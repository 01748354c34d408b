"""Apply the HACK options to SGLang's server arguments, on both entry paths.

CLI: the parsed namespace is checked and adjusted before ServerArgs is built from it, and the
settings are published (engine.settings) for the scheduler processes.
Offline Engine API (ServerArgs built in Python, no `--hack-*` options): checked right before
SGLang resolves the record; HackConfig defaults are published when nothing was.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from hack_ops.config import HackConfig

from . import page_tier, sparse_choice
from . import settings as settings_mod
from .args import ROTATION_AUTO, HackArgumentError, check_combination, settings_from_options
from .bit_plans import PlanRefusal, resolve_for_namespace, resolve_plan
from .layer_sets import LayerSet, auto_reason, resolve_for_model_path
from .settings import KV_CACHE_DTYPE

logger = logging.getLogger(__name__)


def apply_cli_namespace(ns: Any) -> None:
    """Validate and complete a parsed SGLang namespace in place; publish the settings."""
    enabled = getattr(ns, "kv_cache_dtype", None) == KV_CACHE_DTYPE
    plan = None
    if enabled:
        try:
            plan = resolve_for_namespace(ns)  # before the layer set: --hack-4bit-layers given is the override
        except PlanRefusal as exc:
            raise HackArgumentError(str(exc)) from None
        sparse_choice.resolve_for_namespace(ns)  # `--hack-sparse-score auto` becomes the model's score
    _resolve_layer_set(ns)
    try:
        page_tier.apply(ns)
    except page_tier.TierRefusal as exc:
        raise HackArgumentError(str(exc)) from None
    settings = None
    if enabled or getattr(ns, "hack_kv_budget_mb", None) is not None:
        settings = settings_from_options(ns, enabled=enabled)
    if plan is not None:  # a --hack-rotation given keeps its rotation; auto (the default) takes the plan's
        rotation_given = getattr(ns, "hack_rotation", None) not in (None, ROTATION_AUTO)
        settings = replace(settings, config=plan.apply(settings.config, rotation=not rotation_given))
    for key, value in check_combination(ns, settings).items():
        setattr(ns, key, value)
    if enabled:
        _refuse_unserved_model(ns, settings)
    if settings is not None:
        settings_mod.publish(settings)
        if enabled:
            logger.info("sglang-hack: HACK KV cache %s (prefill %s, attention %s), page size %d",
                        settings.config.label(), settings.prefill, settings.attention,
                        settings.page_size)


def _resolve_layer_set(ns: Any) -> None:
    """`--hack-4bit-layers full|auto|none` becomes plain indices here, in the launching process,
    so that the published settings (and every child) hold them. Given none, the raised layers
    come from --hack-bits (engine.bit_plans), not from a rule about the model's layer kinds."""
    spec = getattr(ns, "hack_four_bit_layers", None)
    if not isinstance(spec, LayerSet):
        return
    try:
        ns.hack_four_bit_layers = resolve_for_model_path(spec, getattr(ns, "model_path", None),
                                                         bool(getattr(ns, "trust_remote_code", False)))
    except ValueError as exc:
        raise HackArgumentError(str(exc)) from None
    _log_layer_set(spec, ns.hack_four_bit_layers)


def _log_layer_set(spec: LayerSet, layers: tuple[int, ...]) -> None:
    why = f" ({auto_reason(layers)})" if spec is LayerSet.AUTO else ""
    logger.info("sglang-hack: --hack-4bit-layers %s = layers %s%s", spec.value, ",".join(map(str, layers)) or "none", why)


def apply_server_args(server_args: Any) -> None:
    """Before resolution: the same page size/backend rules for records not built from the CLI."""
    if getattr(server_args, "_resolution_finished", False):
        return
    if getattr(server_args, "kv_cache_dtype", None) != KV_CACHE_DTYPE:
        published = settings_mod.published()
        if published is not None and published.enabled:
            raise HackArgumentError(
                "HACK settings were published for this process but kv_cache_dtype is "
                f"{server_args.kv_cache_dtype!r}; start a separate process per KV dtype")
        check_combination(server_args, published)
        return
    settings = settings_mod.active()
    if settings is None:  # the defaults, `--hack-bits auto` included
        try:
            plan = resolve_plan(None, getattr(server_args, "model_path", None), manual=False, uniform_bits=None,
                                trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
        except PlanRefusal as exc:
            raise HackArgumentError(str(exc)) from None
        config = plan.apply(HackConfig()) if plan is not None else HackConfig()
        settings = settings_mod.EngineSettings(config=config)
        settings_mod.publish(settings)
    for key, value in check_combination(server_args, settings).items():
        setattr(server_args, key, value)
    _refuse_unserved_model(server_args, settings)


def _refuse_unserved_model(args: Any, settings: settings_mod.EngineSettings) -> None:
    """Refuse, before any process loads the model, attention features HACK does not serve
    (and a head_dim the configured rotation cannot rotate, 4-bit layers the model lacks)."""
    from .model_checks import check_model_path

    reason = check_model_path(getattr(args, "model_path", None), bool(getattr(args, "trust_remote_code", False)),
                              bool(getattr(args, "disable_hybrid_swa_memory", False)),
                              settings.config.rotation, settings.config.four_bit_layers)
    if reason:
        raise HackArgumentError(reason)
