"""Test-only fault injection on the receiving side of a transfer.

Off unless the decode server was started with HACK_DISAGG_FAULT_FILE=<path> (`hack up` sets
it on its decode servers; the e2e tests use that). The switch is read once, when the plugin
registers its hooks: without it the injection is no hook at all and costs nothing per request.
When it is on and that file exists and holds `corrupt` or `truncate`, the next request whose KV lands is damaged as the
wire would have damaged it, and the file is removed (one fault per trigger; SGLang's health
probes, which the PD router sends every few seconds and which carry no transferred KV, are
skipped):
  corrupt   one byte (byte 200) of the first received page (in sequence order) of layer 0's K
            is flipped;
  truncate  the first received page of every layer is zeroed, as if its bytes never arrived
            (the open partition's page holds no codes yet, so it would not show a loss).
The digest check (SGLang's --disaggregation-enable-kv-checksum, computed on the CPU by
disagg.checksum) must then fail the request instead of decoding from damaged pages.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

FAULT_FILE_ENV = "HACK_DISAGG_FAULT_FILE"
KINDS = ("corrupt", "truncate")


def enabled() -> bool:
    """The startup switch: a trigger file path was given."""
    return bool(os.environ.get(FAULT_FILE_ENV))


def take_trigger() -> str | None:
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            kind = f.read().strip()
        os.unlink(path)
    except OSError:
        return None
    if kind not in KINDS:
        logger.error("fault trigger %s holds %r; expected one of %s", path, kind, KINDS)
        return None
    return kind


def received_pages(scheduler: Any, req: Any) -> list[int]:
    page = scheduler.token_to_kv_pool_allocator.page_size
    row = int(req.kv.req_pool_idx)
    start = int(getattr(req.kv, "cache_protected_len", 0) or 0)
    locs = scheduler.req_to_token_pool.req_to_token[row, start:len(req.origin_input_ids):page]
    return [int(x) // page for x in locs.tolist()]  # sequence order: the first one was sent


def inject_receive_fault(scheduler: Any, req: Any) -> str | None:
    kind = take_trigger()
    if kind is None:
        return None
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    pages = received_pages(scheduler, req)
    if not pages:
        return None
    # A HACK buffer has one row per page; SGLang's BF16/FP16 buffers one row per token.
    rows = 1 if hasattr(pool, "store") else scheduler.token_to_kv_pool_allocator.page_size
    if kind == "corrupt":
        buf = pool.k_buffer[0]
        page_bytes = rows * buf[0].numel() * buf.element_size()
        # Byte 200 of the page: inside the codes, or the coded planes of a --hack-kv-codec page.
        buf.view(torch.uint8).view(-1)[pages[0] * page_bytes + 200] ^= 0x5A
    else:
        for buf in list(pool.k_buffer) + list(pool.v_buffer):
            buf[pages[0] * rows:(pages[0] + 1) * rows].zero_()
    logger.warning("fault injection: %s the received KV of request %s", kind, req.rid)
    return kind


def is_probe(req: Any) -> bool:
    """SGLang's own health probe (what the PD router's health checks send every few seconds):
    no KV is transferred for it, so damaging it would test nothing."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    return (str(getattr(req, "rid", "")).startswith(HEALTH_CHECK_RID_PREFIX)
            or getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST)


def before_verify(scheduler: Any, batch: Any, *a: Any, **kw: Any) -> None:
    """BEFORE the decode side's digest check (registered only when `enabled()` at startup).
    The trigger is kept for the next real transfer when only health probes land."""
    for req in batch.reqs:
        if req.kv.req_pool_idx is not None and not is_probe(req):
            inject_receive_fault(scheduler, req)
    return None
