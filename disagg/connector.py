"""The prefill/decode side of a HACK server, as one object: `PdConnector`.

In the spirit of a KV connector (vLLM v1's, for instance), it owns what disaggregation adds to
a server, at the points of a request's life where SGLang lets it act:
  attach       both sides, at startup: describe the pool's per-request state (FP16 tails,
               sinks) to SGLang's transfer engine and register the format fingerprint;
  stage        prefill, before the last chunk is sent: the request's sinks into its row, and
               under static eviction its kept set (disagg.static_wire), whose dropped pages
               the last chunk then leaves out;
  send         prefill: the pages travel coded when --hack-kv-codec asks for it (splitzip:
               disagg.transfer_codec; hack-pages: disagg.hack_wire, which also leaves the
               unread open page out of the last chunk);
  install      decode, once the KV landed and before the first step: sinks into a slot, the
               kept set into the attention backend's (static eviction), coded pages decoded
               or K's code sums rebuilt (before SGLang's digest check);
  fingerprint  the page layout + model string both sides compare at bootstrap; a mismatch
               fails the pairing's requests with one sentence (`check_pairing`).
`rows()` is its part of the project's hook table (engine.hooks: Hook/Use/Patch rows, each with
its reason); `register()` hands them to the engine (disagg -> engine, never the other way).
Every body is a no-op for a pool that is not HACK (BF16 servers go through SGLang untouched)
except the request guard, which protects any disaggregated server, and the wire meter, which
counts any transfer. Test-only fault injection (disagg.faults) is a row only when its switch
was set at startup.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from engine.hooks import Hook, HookSet, Patch, Use, option_error, register_extension

from . import checksum as cpu_checksum
from . import faults, hack_wire, pd_state, static_wire, transfer_codec, wire_meter
from .request_guard import check_bootstrap_fields, check_input_embeds, check_parallel_sampling, note_radix_cache_flag

logger = logging.getLogger(__name__)

_SENDER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
_PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
_DECODE = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin"
_ENGINE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
_DSA_TAIL_READER = "sglang.srt.disaggregation.utils.get_dsa_tail_state_indices"


def _kv_pool(scheduler: Any) -> Any:
    return scheduler.token_to_kv_pool_allocator.get_kvcache()


def _received_pages(scheduler: Any, req: Any) -> list[int]:
    """The pages prefill sent for `req`, in sequence order: [cache_protected_len, prompt
    length) of its row."""
    page = scheduler.token_to_kv_pool_allocator.page_size
    start = int(getattr(req.kv, "cache_protected_len", 0) or 0)
    row = scheduler.req_to_token_pool.req_to_token[int(req.kv.req_pool_idx), start:len(req.origin_input_ids)]
    return [int(x) // page for x in row[::page].tolist()]


class PdConnector:
    """The PD side of one server process; see the module docstring."""

    # ---- attach (both sides, startup) ------------------------------------------------------

    def attach(self, result: Any, kv_args: Any, token_to_kv_pool: Any, *a: Any, **kw: Any) -> None:
        """AFTER setup_state_kv_args: what travels besides the pages, and the fingerprint."""
        if not torch.cuda.is_available():
            # The sender would stage its page indices in pinned host memory, which needs CUDA.
            from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

            MooncakeKVSender.supports_host_tensor_indices = False
        if pd_state.is_hack_pool(token_to_kv_pool):
            req_to_token_pool = kw.get("req_to_token_pool", a[2] if len(a) > 2 else None)
            width = getattr(req_to_token_pool, "req_to_token", None)
            max_pages = None if width is None else -(-int(width.shape[1]) // int(token_to_kv_pool.page_size))
            pd_state.attach(kv_args, token_to_kv_pool, max_pages)
            if transfer_codec.active() is transfer_codec.KvCodec.HACK_PAGES:
                hack_wire.attach(kv_args, token_to_kv_pool)
        elif transfer_codec.active() is transfer_codec.KvCodec.SPLITZIP:
            transfer_codec.attach(kv_args, token_to_kv_pool, pd_state.model_path())

    @staticmethod
    def fingerprint(pool: Any) -> str:
        """The format string both sides compare at bootstrap (disagg.pd_state)."""
        return pd_state.layout_fingerprint(pool)

    def state_indices(self, original: Callable, scheduler: Any, req: Any, seq_len: int,
                      *a: Any, **kw: Any) -> Any:
        """AROUND the checksum's state indices: a HACK request's state is its request row."""
        pool = _kv_pool(scheduler)
        if pd_state.is_hack_pool(pool):
            return pd_state.state_indices(pool, int(req.kv.req_pool_idx), int(seq_len))
        return original(scheduler, req, seq_len, *a, **kw)

    @staticmethod
    def checksum(original: Callable, computer: Any, kv_page_indices: Any,
                 state_indices: Any = None) -> int:
        """AROUND the digest: computed on the CPU for CPU tensors (disagg.checksum). With
        hack-pages, the open page that was not sent is not digested (on both sides)."""
        wire = hack_wire.current()
        if wire is not None and hasattr(state_indices, "live") and kv_page_indices is not None:
            keep = len(wire.digest_pages(list(range(len(kv_page_indices))), int(state_indices.live)))
            kv_page_indices = kv_page_indices[:keep]
        if isinstance(kv_page_indices, torch.Tensor) and kv_page_indices.is_cuda:
            return original(computer, kv_page_indices, state_indices)
        # static eviction: each layer's buffers digest the pages it sent (both sides read the
        # kept set from the request's staging row, which the digest covers too)
        per_layer = static_wire.digest_filter(state_indices, kv_page_indices)
        return cpu_checksum.compute(computer, kv_page_indices, state_indices, per_layer)

    # ---- stage and send (prefill) --------------------------------------------------------------

    def stage(self, scheduler: Any, req: Any, last_chunk: bool = False, *a: Any, **kw: Any) -> None:
        """BEFORE send_kv_chunk: the request's sinks into its row, just before the last chunk."""
        if not last_chunk:
            return None
        pool = _kv_pool(scheduler)
        if pd_state.is_hack_pool(pool) and req.kv.req_pool_idx is not None:
            row = int(req.kv.req_pool_idx)
            pd_state.stage_sinks_for_send(pool, scheduler.req_to_token_pool.req_to_token, row)
            static_wire.stage_for_send(pool, row, getattr(req, "bootstrap_room", None))
        return None

    @staticmethod
    def send(original: Callable, manager: Any, session_id: str, prefill_kv_indices: Any,
             dst_kv_ptrs: list, dst_kv_indices: Any, *a: Any, **kw: Any) -> int:
        """AROUND send_kvcache: with --hack-kv-codec the pages travel coded; else unchanged."""
        wire = hack_wire.current()
        if wire is not None:
            return wire.send(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)
        codec = transfer_codec.current()
        if codec is None:
            return original(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **kw)
        return codec.send(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)

    # ---- install (decode) ----------------------------------------------------------------------

    def install(self, scheduler: Any, batch: Any, *a: Any, **kw: Any) -> None:
        """BEFORE _verify_kv_checksums: runs once on every batch of requests whose KV just
        landed, before their first step."""
        pool = _kv_pool(scheduler)
        hack = pd_state.is_hack_pool(pool)
        codec = transfer_codec.current()
        wire = hack_wire.current()
        if not hack and codec is None:
            return None
        req_to_token = scheduler.req_to_token_pool.req_to_token
        for req in batch.reqs:
            if req.kv.req_pool_idx is None:
                continue
            if hack:
                pd_state.install_received_sinks(pool, req_to_token, int(req.kv.req_pool_idx))
                static_wire.install_received(pool, int(req.kv.req_pool_idx), getattr(req, "rid", "?"))
            if wire is not None:
                # Before SGLang digests the pages: K's code sums were not sent.
                wire.rebuild(_received_pages(scheduler, req))
            if codec is not None:
                # Before SGLang digests the pages: the digest covers the decoded bytes.
                failed = codec.decode_pages(_received_pages(scheduler, req))
                if failed:
                    logger.error("request %s: %d coded KV pages could not be decoded; the digest "
                                 "check fails it", getattr(req, "rid", "?"), failed)
        return None

    def check_pairing(self, original: Callable, queue: Any, addr_to_reqs: dict) -> Any:
        """AROUND _ensure_prefill_info: a prefill whose KV format differs fails its requests
        with the reason, once per request, instead of stopping the decode scheduler (SGLang
        raises RuntimeError on a dtype mismatch)."""
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

    # ---- server options and the HTTP entry -----------------------------------------------------

    @staticmethod
    def add_arguments(result: Any, parser: Any, *a: Any, **kw: Any) -> None:
        transfer_codec.add_arguments(parser)

    @staticmethod
    def check_options(cls: Any, ns: Any, *a: Any, **kw: Any) -> None:
        """Refuse a --hack-kv-codec combination that cannot work, before the model loads."""
        try:
            codec = transfer_codec.check_options(ns)
        except ValueError as exc:
            option_error(str(exc))
            raise
        transfer_codec.publish(codec)
        note_radix_cache_flag(getattr(ns, "disable_radix_cache", False))
        return None

    @staticmethod
    def guard_request(manager: Any, obj: Any, *a: Any, **kw: Any) -> None:
        check_bootstrap_fields(manager, obj)
        check_input_embeds(manager, obj)
        check_parallel_sampling(manager, obj)
        return None

    # ---- the connector's rows of the hook table ------------------------------------------------

    def rows(self, with_faults: bool | None = None) -> HookSet:
        """Hooks, uses and patches, in registration order. `with_faults` (default: the
        switch read at startup, disagg.faults) adds the test-only fault injection row."""
        hooks = [
            Hook("sglang.srt.disaggregation.utils.setup_state_kv_args", "AFTER", self.attach,
                 "PD: FP16 tails (live slots) and sinks travel as state components; layout fingerprint"),
            Hook("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", self.add_arguments,
                 "add --hack-kv-codec (lossless KV transfer codec)"),
            Hook("sglang.srt.server_args.ServerArgs.from_cli_args", "BEFORE", self.check_options,
                 "refuse a --hack-kv-codec combination that cannot work; publish the codec to children; note "
                 "whether --disable-radix-cache was asked for (SGLang forces it on decode servers)"),
            Hook("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache", "AROUND",
                 self.send, "PD prefill with --hack-kv-codec: send the pages coded (SplitZip + header table, "
                 "or HACK pages without derived bytes)"),
            Hook("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.add_transfer_request", "AROUND",
                 hack_wire.around_add_transfer_request,
                 "PD prefill with --hack-kv-codec hack-pages: the last chunk leaves out the unread open page, and "
                 "under static eviction each layer's dropped pages"),
            Hook("sglang.srt.disaggregation.checksum.state_indices_for_request", "AROUND",
                 self.state_indices, "PD checksum: a HACK request's state is its request row"),
            Hook("sglang.srt.disaggregation.checksum.KvChecksumComputer.compute", "AROUND",
                 self.checksum, "PD checksum computed on the CPU"),
            Hook(f"{_PREFILL}.send_kv_chunk", "BEFORE", self.stage,
                 "PD prefill: stage the request's FP16 sinks (and static eviction's kept set) into its row before "
                 "the last chunk"),
            Hook(f"{_DECODE}._verify_kv_checksums", "BEFORE", self.install,
                 "PD decode: install received sinks (and static eviction's kept sets), decode coded pages / "
                 "rebuild K's code sums before the digest and the first step"),
            Hook("sglang.srt.disaggregation.decode.DecodePreallocQueue._ensure_prefill_info", "AROUND",
                 self.check_pairing, "PD decode: a format mismatch fails the pairing's requests with a clear reason"),
            Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "BEFORE",
                 self.guard_request,
                 "PD: 400 for a request without bootstrap fields (it would crash the decode scheduler), and for "
                 "input_embeds on a decode server whose prefill refuses them (the decode would wait for KV), and "
                 "for n > 1 (SGLang's samples share one bootstrap room: the transfer never pairs)"),
            Hook(f"{_ENGINE}.batch_transfer_sync", "AROUND", wire_meter.around_batch_transfer,
                 "PD: count bytes on the wire"),
            Hook(f"{_ENGINE}.transfer_sync", "AROUND", wire_meter.around_transfer, "PD: count bytes on the wire"),
            Hook("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_aux", "AROUND",
                 wire_meter.around_send_aux, "PD: attribute the counted bytes to the request"),
        ]
        if faults.enabled() if with_faults is None else with_faults:
            # Registered after `install`, so it wraps it and damages the pages first.
            hooks.append(Hook(f"{_DECODE}._verify_kv_checksums", "BEFORE", faults.before_verify,
                              "test-only: damage received KV on a trigger file (HACK_DISAGG_FAULT_FILE)"))
        uses = (
            Use("sglang.srt.disaggregation.base.conn.StateType",
                "DSA_TAIL carries the FP16 tails, REQUEST_ROW the sinks (disagg.pd_state)"),
            Use("sglang.srt.disaggregation.base.conn.StateType.DSA_TAIL", "the tails' state component"),
            Use("sglang.srt.disaggregation.base.conn.StateType.REQUEST_ROW",
                "the sinks' state component, and the kept sets' under static eviction"),
            Use("sglang.srt.disaggregation.utils.append_state_component",
                "describe the tail and sink buffers to the transfer engine"),
            Use("sglang.srt.runtime_context.get_model", "the served model's folder (fingerprint, codebook)"),
            Use("sglang.srt.constants.HEALTH_CHECK_RID_PREFIX", "fault injection skips health probes"),
            Use("sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST",
                "SGLang's own health probe passes the request guard"),
            Use(_SENDER, "its host-tensor staging is switched off without CUDA"),
            Use("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._transfer_data",
                "the coded sends (splitzip, hack-pages) write their blocks through it in batches"),
        )
        patches = (
            Patch(_SENDER, "supports_host_tensor_indices",
                  "False without CUDA: the sender would stage page indices in pinned host memory"),
            Patch(_DSA_TAIL_READER, "kpool_use_compress", "set on the HACK pool: its tails are a live subrange"),
            Patch(_DSA_TAIL_READER, "index_kpool", "set on the HACK pool: the partition size Π"),
            Patch(_DSA_TAIL_READER, "tail_extra_slots", "set on the HACK pool: 0 (a row holds Π slots)"),
        )
        return HookSet("disagg", tuple(hooks), uses, patches)


def incompatible_reason(message: str, addr: str) -> str:
    """SGLang's bootstrap mismatch message, as one sentence about what differs and what to do."""
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
            "Start both with the same model and the same --kv-cache-dtype/--hack-* options (and the same bit plan: "
            "--hack-bits, which each server's log names, with its rotation: --hack-rotation)")


CONNECTOR = PdConnector()


def register() -> None:
    """Add the connector's rows to the engine's hook table (idempotent)."""
    register_extension(CONNECTOR.rows())
