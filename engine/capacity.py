"""KV pool sizing for the HACK cache: SGLang sizes the pool as budget / bytes-per-token, so the
compressed pages must report their true size or the saving never becomes capacity.

Per token: the pages' codes and side tables of K and V over all layers, plus the pages' share
of the sink slots of cached sequences (engine.pool_geometry).
Per request row: the FP16 tails and a sink slot, reserved out of the same budget before the
pages are sized, so `max_total_num_tokens` is what really fits.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from . import settings as settings_mod
from .pool_geometry import UnitBytes, bf16_bytes_per_token, row_bytes, token_bytes, unit_bytes
from .server_state import Reservation, state

logger = logging.getLogger(__name__)

# Without --max-running-requests, at most this share of the budget goes to request rows.
DEFAULT_ROW_SHARE = 0.125
MAX_DEFAULT_ROWS = 4096


def units_for(model_config: Any, attn_tp: int = 1, dcp: int = 1) -> UnitBytes | None:
    """Byte units of one layer for a model config, or None when HACK is off."""
    s = settings_mod.active()
    if s is None:
        return None
    if model_config.head_dim != model_config.v_head_dim:
        raise ValueError(
            f"--kv-cache-dtype hack needs equal K and V head dims, got {model_config.head_dim} "
            f"and {model_config.v_head_dim}")
    heads = model_config.get_num_kv_heads(attn_tp, dcp)
    return unit_bytes(s.config, heads, model_config.head_dim, int(model_config.num_hidden_layers))


def _units(kvc: Any) -> UnitBytes | None:
    if settings_mod.active() is None:
        return None
    if kvc.use_mla_backend:
        raise ValueError("--kv-cache-dtype hack supports multi-head (MHA/GQA) attention, not MLA")
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return units_for(kvc.model_config, par.attn_tp_size, par.attn_dcp_size)


def cell_size_bytes(kvc: Any, num_layers: int) -> int | None:
    """Bytes per token of the HACK pool over all layers (None when HACK is off)."""
    u = _units(kvc)
    return None if u is None else token_bytes(u, num_layers)


def kv_budget_bytes(kvc: Any, profile: Callable[[], int]) -> int:
    """The byte budget SGLang sizes the token pool from: the fixed budget if one was given,
    else the profiled free memory; with HACK, minus the per-request-row reservation."""
    fixed = settings_mod.budget_bytes()
    budget = fixed if fixed is not None else int(profile())
    if fixed is not None:
        logger.info("sglang-hack: KV budget fixed at %.1f MB", fixed / (1 << 20))
    u = _units(kvc)
    if u is None:
        return budget
    per_row = row_bytes(u, kvc.layer_info.num_effective_layers)
    rows = _requested_rows(kvc)
    if rows is None:
        rows = max(1, min(MAX_DEFAULT_ROWS, int(budget * DEFAULT_ROW_SHARE) // per_row))
    # SGLang's request table has one row more than the requests it admits (a padding row), and
    # on a PD decode server pre-allocation rows for requests still arriving; each row holds FP16
    # tails (the pool is built with one per row of the table: engine.hooks).
    extra = _decode_pre_alloc_rows()
    reserve = (rows + extra + 1) * per_row
    if reserve >= budget:
        raise ValueError(
            f"the KV budget ({budget / (1 << 20):.1f} MB) cannot hold the FP16 tails of {rows + extra} "
            f"request rows ({rows} running{f', {extra} pre-allocated for arriving transfers' if extra else ''}; "
            f"{per_row / (1 << 20):.2f} MB each); lower --max-running-requests"
            f"{' or --disaggregation-decode-extra-slots' if extra else ''}, or raise the budget")
    # The configurator has __slots__: the decision waits in the server state for
    # resolve_max_num_reqs and the pool build.
    state().reserve(kvc, Reservation(rows=rows, budget=budget))
    logger.info("sglang-hack: %d request rows%s reserve %.1f MB for FP16 tails/sinks; %.1f MB left "
                "for pages", rows, f" (+{extra} pre-allocated for arriving transfers)" if extra else "",
                reserve / (1 << 20), (budget - reserve) / (1 << 20))
    return budget - reserve


def _decode_pre_alloc_rows() -> int:
    """Rows a PD decode server's request table holds beyond the running requests, for requests
    still arriving (SGLang's --disaggregation-decode-extra-slots: by default 2x the running
    batch when --max-running-requests is at most 32 per worker, else 0)."""
    from sglang.srt.runtime_context import get_disagg

    try:
        d = get_disagg()
    except ValueError:  # no server published its PD settings (an engine built in process): not PD
        return 0
    if d.disaggregation_mode != "decode" and not getattr(d, "enable_pd_role_switch", False):
        return 0
    return int(d.disaggregation_decode_extra_slots or 0)


def _requested_rows(kvc: Any) -> int | None:
    from sglang.srt.runtime_context import get_schedule

    n = get_schedule().max_running_requests
    if n is None:
        return None
    return max(1, n // max(1, kvc.attn_dp_size))


def cap_max_num_reqs(kvc: Any, n: int) -> int:
    """Request rows may not exceed the rows whose tails were reserved."""
    res = state().reservation(kvc)
    rows = None if res is None else res.rows
    if rows is None or n <= rows:
        return n
    logger.info("sglang-hack: max running requests %d -> %d (rows with reserved tails)", n, rows)
    return rows


def reserved_budget(kvc: Any) -> int | None:
    res = state().reservation(kvc)
    return None if res is None else res.budget


def capacity_report(u: UnitBytes, num_layers: int, heads: int, head_dim: int, max_tokens: int,
                    budget: int | None) -> dict:
    """The HACK pool's capacity next to what a BF16 pool would hold (logged at startup)."""
    hack_cell = token_bytes(u, num_layers)
    bf16_cell = bf16_bytes_per_token(num_layers, heads, head_dim)
    info = {
        "hack_bytes_per_token": hack_cell,
        "bf16_bytes_per_token": bf16_cell,
        "max_total_num_tokens": int(max_tokens),
        "page_capacity_ratio_vs_bf16": round(bf16_cell / hack_cell, 3),
    }
    if budget is not None:
        info["budget_bytes"] = int(budget)
        info["bf16_tokens_same_budget"] = int(budget // bf16_cell)
        info["capacity_ratio_same_budget"] = round(max_tokens / max(1, budget // bf16_cell), 3)
    logger.info("sglang-hack: capacity %s", info)
    return info
