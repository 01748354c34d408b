"""Every SGLang symbol the project touches, in one table (review it on a version bump).

Pinned upstream: sglang==0.5.23. The table has three kinds of rows, each with its reason:
  Hook   an upstream function or method wrapped through SGLang's HookRegistry (BEFORE, AFTER,
         AROUND, REPLACE: sglang.srt.plugins.hook_registry.HookType);
  Use    an upstream symbol imported or read without a hook (registries, base classes and the
         methods our subclasses override, accessors, constants);
  Patch  an attribute the project sets that upstream reads: on an upstream class, or on one of
         our objects that an upstream function inspects (`owner` names that function).
The engine's rows are below (ENGINE). A package above the engine adds its own rows with
`register_extension` (disagg.connector does, for prefill/decode disaggregation): the engine
never imports it; the plugin entry point (disagg.plugin) imports both and registers the whole
table with SGLang. tests/test_engine_hooks.py resolves every row against the installed SGLang
and fails on an upstream import in the source that no row names.

Hook bodies stay thin: they delegate to the module that owns the concern.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .server_state import state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hook:
    target: str  # dotted upstream symbol
    kind: str  # HookType member name: BEFORE, AFTER, AROUND, REPLACE
    fn: Callable
    why: str


@dataclass(frozen=True)
class Use:
    symbol: str  # dotted upstream symbol, used without a hook
    why: str


@dataclass(frozen=True)
class Patch:
    owner: str  # dotted upstream class that holds `attr`, or upstream function that reads it
    attr: str
    why: str


@dataclass(frozen=True)
class HookSet:
    """One package's rows of the table."""

    name: str
    hooks: tuple[Hook, ...]
    uses: tuple[Use, ...] = ()
    patches: tuple[Patch, ...] = ()


_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"

USES: tuple[Use, ...] = (
    Use("sglang.launch_server", "engine.server_zygote imports it once and runs it as __main__ in each server it "
        "forks, as `python -m sglang.launch_server` does"),
    Use("sglang.srt.layers.attention.attention_registry.register_attention_backend",
        "register the 'hack' attention backend"),
    Use("sglang.srt.arg_groups.choices.add_attention_backend_choices",
        "'hack' among the --attention-backend choices"),
    Use("sglang.srt.platforms.cpu.CpuSRTPlatform", "base class of engine.platform.HackCpuPlatform"),
    Use("sglang.srt.platforms.cuda.CudaSRTPlatform", "base class of engine.platform.HackCudaPlatform"),
    Use("sglang.srt.platforms.interface.SRTPlatform.apply_server_args_defaults",
        "overridden: float32 weights and a BF16 KV cache on a CPU without BF16 arithmetic (engine.cpu_dtype)"),
    Use("sglang.srt.platforms.cpu.CpuSRTPlatform.get_kv_pool_cls",
        "overridden: HackKVPool for MHA models under --kv-cache-dtype hack"),
    Use(_POOL, "base class of engine.pool.HackKVPool"),
    Use(f"{_POOL}._create_buffers", "overridden: HACK pages, FP16 tails and sinks (HackKVStore)"),
    Use(f"{_POOL}._kv_tokens_per_row", "overridden: a buffer row is a whole page"),
    Use(f"{_POOL}.get_kv_size_bytes", "overridden: pages plus tails and sinks"),
    Use(f"{_POOL}._get_key_buffer", "overridden: raw page bytes (never viewed as K)"),
    Use(f"{_POOL}._get_value_buffer", "overridden: raw page bytes (never viewed as V)"),
    Use(f"{_POOL}.set_kv_buffer", "overridden: refused (writes go through the backend)"),
    Use(f"{_POOL}.move_kv_cache", "overridden: refused"),
    Use(f"{_POOL}.get_cpu_copy", "overridden: a retracted request's pages, tail rows and sinks to the CPU "
        "(hack_ops.paged.offload; PD decode's cpu_tensor retraction backup calls it with req_pool_index)"),
    Use(f"{_POOL}.load_cpu_copy", "overridden: that copy into the request's new slots, row and sink slot"),
    Use(f"{_POOL}._build_kv_buffer_descs",
        "overridden: a descriptor per buffer from its own shape (layers may differ in page bytes)"),
    Use("sglang.srt.mem_cache.memory_pool.KvBufferDesc", "HackKVPool._build_kv_buffer_descs builds them"),
    Use(f"{_POOL}._init_data_ptrs_and_strides", "called by HackKVPool._create_buffers"),
    Use("sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
        "base class of engine.backend's attention backend"),
    Use("sglang.srt.plugins.hook_registry.HookRegistry", "where the table's hooks are registered"),
    Use("sglang.srt.plugins.hook_registry.HookType", "the kinds of hooks (Hook.kind)"),
    Use("sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE", "memory-saver region of the pool"),
    Use("sglang.srt.runtime_context.get_parallel", "attention TP/DCP size when sizing the pool"),
    Use("sglang.srt.runtime_context.get_schedule", "--max-running-requests when sizing the pool"),
    Use("sglang.srt.runtime_context.get_disagg",
        "a PD decode server's pre-allocation rows (disaggregation_decode_extra_slots) hold FP16 tails too"),
    Use("sglang.srt.model_executor.forward_batch_info.ForwardBatch",
        "what the backend is handed each forward; its fields in DIRECT_FIELDS"),
    Use("sglang.srt.configs.model_config.is_hybrid_swa_model", "startup refusal (engine.model_checks)"),
    Use("sglang.srt.layers.radix_attention.RadixAttention",
        "layers checked at startup; LAYER_ATTRS read by the backend"),
    Use("sglang.srt.layers.radix_attention.AttentionType",
        "decoder / encoder-only / bidirectional layers"),
    Use("sglang.srt.mem_cache.base_prefix_cache.EvictParams",
        "engine.sink_reclaim evicts cached sequences when sink slots run short"),
    Use("sglang.srt.managers.scheduler.Scheduler", "engine.sink_reclaim reads tree_cache and the allocator"),
    Use("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.pre_alloc_size",
        "engine.usage counts a request pool's rows as size + pre_alloc_size (0 here)"),
    Use("sglang.srt.disaggregation.decode.DecodeReqToTokenPool.available_size",
        "engine.usage: a PD decode pool's free rows include its pre-allocation rows (pre_alloc_size)"),
    # The tree a server builds by default (mem_cache.registry.create_unified_radix_cache).
    Use("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict",
        "engine.sink_reclaim: least recently used first"),
    Use("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evictable_size",
        "engine.sink_reclaim: what can go"),
    # The page tier (engine.page_tier): SGLang's external-store interface of the unified radix cache,
    # over its own file storage backend; turned on by setting the server arguments below.
    Use("sglang.srt.mem_cache.unified_cache.unified_cache_linker.UnifiedCacheLinker",
        "base class of engine.page_tier.linker.PageTierLinker (built by the 'dynamic' linker backend)"),
    Use("sglang.srt.mem_cache.unified_cache.unified_cache_linker.LayerWiseLoadCounter",
        "the tier's layer counter (loads complete before the forward)"),
    Use("sglang.srt.mem_cache.hicache_storage.HiCacheFile", "the tier's storage backend (files, LRU cap)"),
    Use("sglang.srt.mem_cache.hicache_storage.HiCacheFile._get_suffixed_key",
        "the file name of a refused record, removed so that its page is written again (no delete in the API)"),
    Use("sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig", "how HiCacheFile is configured"),
    Use("sglang.srt.mem_cache.hicache_storage.PoolName", "the KV transfer among a linker call's transfers"),
    Use("sglang.srt.mem_cache.hicache_storage.PoolTransfer", "keys and token slots of a linker call"),
    Use("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
        "the BF16 baseline's pool: engine.page_tier.page_bytes.TokenPages reads and writes its k_buffer/v_buffer rows"),
    Use("sglang.srt.runtime_context.get_model", "the served model's path names the tier's records"),
    Use("sglang.srt.managers.schedule_batch.Req",
        "engine.timeline reads cached_tokens, cached_tokens_host and cached_tokens_storage at a prefill's end "
        "(the prompt tokens not computed, and those restored from the page tier)"),
    Use("sglang.srt.utils.common.human_readable_int", "--hack-page-tier-size parsed as SGLang's evictor does"),
    Use("sglang.srt.entrypoints.http_server.app", "SGLang's FastAPI app: the /hack/* routes go there"),
    Use("sglang.srt.managers.io_struct.GenerateReqInput",
        "its field names: what /vertex_generate's parameters may hold (engine.request_checks)"),
    Use("sglang.srt.managers.schedule_batch.get_return_hidden_states_mode",
        "SGLang's own parser of return_hidden_states, run per prompt before the scheduler does"),
    Use("sglang.srt.entrypoints.api_contract.generate_contract_error",
        "SGLang's /generate schema check, run on the request /vertex_generate builds (engine.request_checks)"),
)

# Attributes of every RadixAttention that the backend reads (window, scaling, soft-cap, kind).
LAYER_ATTRS = ("layer_id", "scaling", "logit_cap", "logit_capping_method", "sliding_window_size",
               "is_cross_attention", "attn_type", "qk_head_dim", "v_head_dim")

# Fields of upstream dataclasses read directly (class, field).
DIRECT_FIELDS = (
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "rids"),  # fused phases; group-box cache keys
    ("sglang.srt.managers.io_struct.GenerateReqInput", "top_logprobs_num"),  # request checks
    ("sglang.srt.managers.io_struct.GenerateReqInput", "lora_id"),
    ("sglang.srt.managers.io_struct.GenerateReqInput", "return_hidden_states"),
    ("sglang.srt.managers.io_struct.GenerateReqInput", "sampling_params"),  # stop_token_ids, top_k
)


# ---------------------------------------------------------------- server arguments

def _after_add_cli_args(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    from .args import add_arguments

    add_arguments(parser)
    state().cli_parser = parser  # option errors found later are reported the argparse way


def _around_from_cli_args(original: Callable, cls: Any, ns: Any) -> Any:
    from .args import HackArgumentError
    from .server_options import apply_cli_namespace

    try:
        apply_cli_namespace(ns)
    except HackArgumentError as exc:
        option_error(str(exc))
        raise
    return original(cls, ns)


def option_error(message: str) -> None:
    """Report a refused server option like argparse does (usage + message, exit status 2) when
    SGLang's parser is known; otherwise return, and the caller raises its exception."""
    parser = state().cli_parser
    if parser is not None:
        parser.error(message)


def _before_resolve_once(server_args: Any, *args: Any, **kwargs: Any) -> None:
    from .server_options import apply_server_args

    apply_server_args(server_args)


def _around_configure_kv_cache_dtype(original: Callable, *args: Any, **kwargs: Any) -> Any:
    from .settings import KV_CACHE_DTYPE

    if kwargs.get("server_args_kv_cache_dtype") == KV_CACHE_DTYPE:
        # The pool stores its own byte layout; the dtype SGLang sees is the model's compute
        # dtype (what queries, new K/V and attention outputs use).
        return KV_CACHE_DTYPE, kwargs["model_dtype"]
    return original(*args, **kwargs)


# ---------------------------------------------------------------- KV pool sizing

def _around_compute_cell_size(original: Callable, self: Any, kvc: Any, num_layers: int) -> int:
    from . import capacity

    size = capacity.cell_size_bytes(kvc, num_layers)
    return original(self, kvc, num_layers) if size is None else size


def _around_profile_available_bytes(original: Callable, self: Any, *args: Any, **kwargs: Any) -> int:
    from . import capacity

    return capacity.kv_budget_bytes(self, lambda: original(self, *args, **kwargs))


def _around_resolve_max_num_reqs(original: Callable, self: Any, token_capacity: int) -> int:
    from . import capacity

    return capacity.cap_max_num_reqs(self, original(self, token_capacity))


def _around_build_token_to_kv_pool(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    from . import capacity
    from .pool import pool_build_context

    req_pool = kwargs["req_to_token_pool"]
    with pool_build_context(rows=req_pool.req_to_token.shape[0], budget=capacity.reserved_budget(self)):
        return original(self, *args, **kwargs)


def _around_release_page_ids(original: Callable, self: Any, *page_ids: Any) -> Any:
    from .pool import HackKVPool

    pool = self.get_kvcache()
    if isinstance(pool, HackKVPool):
        pool.on_pages_freed(page_ids)
    return original(self, *page_ids)


def _after_allocator_clear(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from .pool import HackKVPool

    pool = self.get_kvcache()
    if isinstance(pool, HackKVPool):
        pool.on_all_pages_freed()


# ---------------------------------------------------------------- request validation

def _before_validate_one_request(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    from .request_checks import (check_input_embeds_width, check_input_ids, check_lora_id,
                                 check_return_hidden_states, check_int32_sampling_params,
                                 check_stop_token_ids, check_top_logprobs_num)

    check_input_ids(self.model_config.vocab_size, input_ids)
    check_input_embeds_width(getattr(self.model_config, "hidden_size", 0), getattr(obj, "input_embeds", None))
    sampling_params = getattr(obj, "sampling_params", None)
    check_stop_token_ids(self.model_config.vocab_size, sampling_params)
    check_int32_sampling_params(sampling_params)
    check_top_logprobs_num(self.model_config.vocab_size, getattr(obj, "top_logprobs_num", None))
    check_lora_id(getattr(obj, "lora_id", None))
    check_return_hidden_states(getattr(obj, "return_hidden_states", False))


# ---------------------------------------------------------------- observability

def _after_add_memory_usage(result: Any, self: Any, state: dict, *args: Any, **kwargs: Any) -> None:
    from .usage import kv_usage

    state["hack_kv"] = kv_usage(self.scheduler)


def _metrics_call(fn: Callable, *args: Any) -> None:
    """Metrics never break serving: failures are logged (the first three) and counted."""
    try:
        fn(*args)
    except Exception:
        st = state()
        st.metric_failures += 1
        if st.metric_failures <= 3:
            logger.exception("sglang-hack: timeline metrics failed (serving continues)")


def _after_handle_generate_request(result: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    from . import sink_reclaim
    from .timeline import on_arrival

    sink_reclaim.install(self)  # before the request's first forward can need a sink slot
    _metrics_call(on_arrival, self, recv_req)


def _after_process_batch_result(result: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    from .timeline import on_batch_result

    _metrics_call(on_batch_result, self, batch)


def _after_process_batch_result_prebuilt(result: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    from .timeline import on_prebuilt

    _metrics_call(on_prebuilt, batch)


def _around_extend_forward_kwargs(original: Callable, self: Any, forward_batch: Any, *args: Any,
                                  **kwargs: Any) -> dict:
    from .cpu_dtype import embeds_in_model_dtype

    return embeds_in_model_dtype(original(self, forward_batch, *args, **kwargs), forward_batch,
                                 getattr(self, "dtype", None))


def _around_create_abort_task(original: Callable, self: Any, obj: Any) -> Any:
    from .stream_abort import skip_unread

    return skip_unread(original, self, obj)


async def _around_ollama_handler(original: Callable, self: Any, request: Any, raw_request: Any) -> Any:
    from .ollama_errors import answer_errors

    return await answer_errors(original, self, request, raw_request)


async def _around_sigterm_watchdog(original: Callable, self: Any) -> None:
    from .sigterm import notice_then_drain

    await notice_then_drain(original, self)


def _after_set_envs_and_config(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    from .process_start import apply

    apply(server_args)


def _before_setup_and_run_http_server(*args: Any, **kwargs: Any) -> None:
    from sglang.srt.entrypoints import http_server

    from .http_guard import install as install_guard
    from .metrics.http_api import install_routes

    # Before the metrics routes, and not inside their try: a server without the guard would
    # answer some malformed requests with a 500, so a failure here stops the server.
    install_guard(http_server.app)

    try:
        if install_routes(http_server.app):
            logger.info("sglang-hack: /hack/streams, /hack/events, /hack/run installed")
    except Exception:
        logger.exception("sglang-hack: the live /hack/* routes could not be installed "
                         "(serving continues without them)")


# ---------------------------------------------------------------- the table

HOOKS: tuple[Hook, ...] = (  # the engine's own hooks
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", _after_add_cli_args,
         "add --hack-* options, 'hack' to --kv-cache-dtype/--attention-backend, --disagg-mode"),
    Hook("sglang.srt.server_args.ServerArgs.from_cli_args", "AROUND", _around_from_cli_args,
         "validate the HACK options, set page size/backend, publish settings to children; refuse "
         "models with attention features HACK does not serve (engine.model_checks)"),
    Hook("sglang.srt.server_args.ServerArgs.resolve_once", "BEFORE", _before_resolve_once,
         "same checks (options and model features) for ServerArgs built without the CLI (Engine API)"),
    Hook("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", "AROUND",
         _around_configure_kv_cache_dtype, "accept kv_cache_dtype='hack'"),
    Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
         "AROUND", _around_compute_cell_size, "true bytes per token of the HACK pages"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
         "AROUND", _around_profile_available_bytes,
         "fixed budget (--hack-kv-budget-mb); reserve the FP16 tails before sizing pages"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs",
         "AROUND", _around_resolve_max_num_reqs, "request rows limited to the reserved tails"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool",
         "AROUND", _around_build_token_to_kv_pool,
         "tell the HACK pool how many request rows (FP16 tails) to allocate"),
    Hook("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
         "AROUND", _around_release_page_ids, "free the sink slots of freed first pages"),
    Hook("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
         "AFTER", _after_allocator_clear, "a cleared allocator frees every sink slot"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "BEFORE",
         _before_validate_one_request,
         "refuse out-of-vocabulary input_ids, top_logprobs_num above the vocabulary, a lora_id "
         "that is not a string, a return_hidden_states that is neither a boolean nor 'last' and "
         "input_embeds rows not as wide as the hidden size with a 400 (upstream crashes the "
         "scheduler on each)"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs", "AROUND",
         _around_extend_forward_kwargs, "input_embeds in the model's dtype (upstream casts them to BF16: "
         "a float32 model, the default on a CPU without BF16 arithmetic, died in its first linear; "
         "engine.cpu_dtype)"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.create_abort_task", "AROUND",
         _around_create_abort_task, "a streamed request refused before it was read has nothing to "
         "abort (upstream's task raised and the connection was closed; engine.stream_abort)"),
    Hook("sglang.srt.entrypoints.ollama.serving.OllamaServing.handle_chat", "AROUND",
         _around_ollama_handler, "SGLang's own ValueErrors on /api/chat answered 400, also when "
         "streamed (upstream: a 500, or a broken stream; engine.ollama_errors)"),
    Hook("sglang.srt.entrypoints.ollama.serving.OllamaServing.handle_generate", "AROUND",
         _around_ollama_handler, "the same for /api/generate"),
    Hook("sglang.srt.managers.scheduler_components.internal_state."
         "SchedulerInternalStateController._add_memory_usage", "AFTER", _after_add_memory_usage,
         "report pool pages, tails and sinks in use in /server_info (internal_states[].hack_kv)"),
    Hook("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", "AFTER",
         _after_handle_generate_request, "let the HACK pool reclaim sink slots from the radix cache "
         "(engine.sink_reclaim); metrics: arrival, queue start, memory sampler"),
    Hook("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "AFTER",
         _after_process_batch_result, "metrics: queue/prefill ends, first token, decode steps, finish"),
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
         "process_batch_result_prebuilt", "AFTER", _after_process_batch_result_prebuilt,
         "metrics, PD decode: finish of a request whose only token came from prefill"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog", "AROUND",
         _around_sigterm_watchdog,
         "a SIGTERM is noticed within 0.1 s (upstream looks at its flag every 5 s, so each stop of an "
         "idle server waited 2.5 s on average); the upstream watchdog then drains as before"),
    Hook("sglang.srt.entrypoints.engine._set_envs_and_config", "AFTER", _after_set_envs_and_config,
         "a CPU server forks its scheduler and detokenizer (upstream spawns them: each imported SGLang "
         "again, about 20 CPU-seconds; engine.process_start checks that fork is safe first)"),
    Hook("sglang.srt.entrypoints.http_server._setup_and_run_http_server", "BEFORE",
         _before_setup_and_run_http_server,
         "live metrics: add /hack/streams, /hack/events, /hack/run to the server's FastAPI app; "
         "the request guard on the generation endpoints (engine.http_guard: a body that is not a "
         "JSON object, and fields SGLang answers with a 500, get a 400 naming the field)"),
)


ENGINE = HookSet("engine", HOOKS, USES)

_EXTENSIONS: dict[str, HookSet] = {}


def register_extension(rows: HookSet) -> None:
    """Add a package's rows to the table (its hooks are registered after the engine's, in the
    order the packages registered). Registering the same name again replaces its rows."""
    if rows.name == ENGINE.name:
        raise ValueError(f"{rows.name!r} is the engine's own row set")
    _EXTENSIONS[rows.name] = rows


def hook_sets() -> tuple[HookSet, ...]:
    """The whole table: the engine's rows, then each registered extension's."""
    return (ENGINE, *_EXTENSIONS.values())


def all_hooks() -> tuple[Hook, ...]:
    return tuple(h for rows in hook_sets() for h in rows.hooks)


def register_all() -> None:
    """Register every hook of the table with SGLang's HookRegistry, the backend and its CLI
    choice. Called by the plugin entry point in every SGLang process; SGLang applies the hooks.
    For one upstream target, a later row wraps an earlier one (its BEFORE body runs first)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .backend_registry import register_backend

    for h in all_hooks():
        HookRegistry.register(h.target, h.fn, HookType[h.kind])
    register_backend()
