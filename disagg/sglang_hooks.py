"""Bodies of the SGLang hooks that prefill/decode disaggregation with HACK pages needs.

They are registered, each next to the upstream symbol it touches, in engine/hooks.py (the
project's single hook registry); this module holds what they do. Every body is a no-op for a
pool that is not HACK (BF16 servers go through SGLang untouched) except the request guard,
which protects any disaggregated server, and the wire meter, which counts any transfer.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from . import checksum as cpu_checksum
from . import pd_state, transfer_codec
from .faults import inject_receive_fault

logger = logging.getLogger(__name__)


def _kv_pool(scheduler: Any) -> Any:
    return scheduler.token_to_kv_pool_allocator.get_kvcache()


# ---- transfer description (both sides) ----------------------------------------------------

def after_setup_state_kv_args(result: Any, kv_args: Any, token_to_kv_pool: Any, *a: Any, **kw: Any) -> None:
    if not torch.cuda.is_available():
        # The sender would stage its page indices in pinned host memory, which needs CUDA.
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        MooncakeKVSender.supports_host_tensor_indices = False
    if pd_state.is_hack_pool(token_to_kv_pool):
        pd_state.attach(kv_args, token_to_kv_pool)
    elif transfer_codec.active() is transfer_codec.KvCodec.SPLITZIP:
        transfer_codec.attach(kv_args, token_to_kv_pool, pd_state.model_path())


def around_state_indices_for_request(original: Callable, scheduler: Any, req: Any, seq_len: int,
                                     *a: Any, **kw: Any) -> Any:
    pool = _kv_pool(scheduler)
    if pd_state.is_hack_pool(pool):
        return pd_state.state_indices(pool, int(req.kv.req_pool_idx), int(seq_len))
    return original(scheduler, req, seq_len, *a, **kw)


def around_checksum_compute(original: Callable, computer: Any, kv_page_indices: Any,
                            state_indices: Any = None) -> int:
    if isinstance(kv_page_indices, torch.Tensor) and kv_page_indices.is_cuda:
        return original(computer, kv_page_indices, state_indices)
    return cpu_checksum.compute(computer, kv_page_indices, state_indices)


# ---- prefill ------------------------------------------------------------------------------

def before_prefill_send_kv_chunk(scheduler: Any, req: Any, last_chunk: bool = False, *a: Any, **kw: Any) -> None:
    if not last_chunk:
        return None
    pool = _kv_pool(scheduler)
    if pd_state.is_hack_pool(pool) and req.kv.req_pool_idx is not None:
        pd_state.stage_sinks_for_send(pool, scheduler.req_to_token_pool.req_to_token,
                                      int(req.kv.req_pool_idx))
    return None


def around_send_kvcache(original: Callable, manager: Any, session_id: str, prefill_kv_indices: Any,
                        dst_kv_ptrs: list, dst_kv_indices: Any, *a: Any, **kw: Any) -> int:
    """With --hack-kv-codec the pages travel coded (disagg.transfer_codec); else unchanged."""
    codec = transfer_codec.current()
    if codec is None:
        return original(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **kw)
    return codec.send(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)


# ---- decode -------------------------------------------------------------------------------

def before_decode_verify_kv_checksums(scheduler: Any, batch: Any, *a: Any, **kw: Any) -> None:
    """Runs once on every batch of requests whose KV just landed, before their first step."""
    pool = _kv_pool(scheduler)
    hack = pd_state.is_hack_pool(pool)
    codec = transfer_codec.current()
    req_to_token = scheduler.req_to_token_pool.req_to_token
    for req in batch.reqs:
        if req.kv.req_pool_idx is None:
            continue
        inject_receive_fault(scheduler, req)
        if hack:
            pd_state.install_received_sinks(pool, req_to_token, int(req.kv.req_pool_idx))
        if codec is not None:
            # Before SGLang digests the pages: the digest covers the decoded bytes.
            pages = _received_pages(scheduler, req)
            failed = codec.decode_pages(pages)
            if failed:
                logger.error("request %s: %d coded KV pages could not be decoded; the digest "
                             "check fails it", getattr(req, "rid", "?"), failed)
    return None


def _received_pages(scheduler: Any, req: Any) -> list[int]:
    """The pages prefill sent for `req`: [cache_protected_len, prompt length) of its row."""
    page = scheduler.token_to_kv_pool_allocator.page_size
    start = int(getattr(req.kv, "cache_protected_len", 0) or 0)
    row = scheduler.req_to_token_pool.req_to_token[int(req.kv.req_pool_idx), start:len(req.origin_input_ids)]
    return [int(x) // page for x in row[::page].tolist()]


def around_ensure_prefill_info(original: Callable, queue: Any, addr_to_reqs: dict) -> Any:
    """A prefill whose KV format differs fails its requests with the reason, once per request,
    instead of stopping the decode scheduler (SGLang raises RuntimeError on a dtype mismatch)."""
    failed: list = []
    keep: dict = {}
    for addr, reqs in addr_to_reqs.items():
        try:
            queue.kv_manager.try_ensure_parallel_info(addr)
        except RuntimeError as exc:
            reason = incompatible_reason(str(exc), addr)
            logger.error(reason)
            for dreq in reqs:
                room = dreq.req.bootstrap_room
                queue.kv_manager.record_failure(room, reason)
                if dreq.kv_receiver is not None:
                    dreq.kv_receiver.abort()
                    queue.kv_manager.record_failure(room, reason)
            failed.extend(reqs)
            continue
        keep[addr] = reqs
    ready, remaining = original(queue, keep)
    return ready, remaining + failed


def incompatible_reason(message: str, addr: str) -> str:
    if "kv_cache_dtype=" not in message:
        return f"incompatible prefill {addr}: {message}"
    try:
        pre = message.split("prefill server has kv_cache_dtype=", 1)[1].split(", but", 1)[0]
        dec = message.split("decode server has kv_cache_dtype=", 1)[1].split(".", 1)[0]
    except IndexError:
        return f"incompatible prefill {addr}: {message}"
    (pre, pre_codec), (dec, dec_codec) = transfer_codec.split_fingerprint(pre), transfer_codec.split_fingerprint(dec)
    if pre == dec and pre_codec != dec_codec:
        return (f"incompatible prefill/decode pairing with {addr}: prefill uses "
                f"{transfer_codec.describe(pre_codec)}, decode uses {transfer_codec.describe(dec_codec)}. "
                "Start both with the same --hack-kv-codec and the same model folder (kv_codebook.json)")
    return (f"incompatible prefill/decode pairing with {addr}: prefill has "
            f"{pd_state.describe_fingerprint(pre)}; decode has {pd_state.describe_fingerprint(dec)}. "
            "Start both with the same model and the same --kv-cache-dtype/--hack-* options")


# ---- server options ----

def after_add_cli_args(result: Any, parser: Any, *a: Any, **kw: Any) -> None:
    transfer_codec.add_arguments(parser)


def before_from_cli_args(cls: Any, ns: Any, *a: Any, **kw: Any) -> None:
    """Refuse a --hack-kv-codec combination that cannot work, before the model loads."""
    try:
        codec = transfer_codec.check_options(ns)
    except ValueError as exc:
        from engine.hooks import option_error

        option_error(str(exc))
        raise
    transfer_codec.publish(codec)
    return None


# ---- HTTP entry (any disaggregated server) ------------------------------------------------

def before_validate_one_request(manager: Any, obj: Any, *a: Any, **kw: Any) -> None:
    from .request_guard import check_bootstrap_fields

    check_bootstrap_fields(manager, obj)
    return None


def enabled() -> bool:
    return os.environ.get("HACK_DISAGG_HOOKS", "1") != "0"
