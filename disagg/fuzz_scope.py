"""Which operations of SGLang's HTTP API the schema fuzzer (disagg.schema_fuzz) sends requests to.

Every operation of a server's own /openapi.json that takes a JSON body is fuzzed unless its path
is listed below with the reason it is not: an endpoint SGLang adds in a later version joins the
suite by default. What is left out is not a generation or chat endpoint: operator endpoints that
change the server's state (weights, profiling, pausing, the cache), and endpoints of other model
kinds (embeddings, classification, scoring, reranking) or tools around generation (tokenizing,
parsing). `CI_CORE` names the generation endpoints CI fuzzes at the full per-endpoint budget.
"""
from __future__ import annotations

from enum import Enum
from typing import Any


class Reason(str, Enum):
    OPERATOR = "operator endpoint: changes the server's state (weights, memory, profiling, scheduling)"
    OTHER_MODEL_KIND = "serves another model kind (embeddings, classification, scoring, reranking)"
    TOOL = "a tool around generation that generates nothing (tokenize, parse, sessions)"
    FILE_UPLOAD = "a multipart upload (audio), not JSON"


NOT_FUZZED: dict[str, Reason] = {
    "/set_internal_state": Reason.OPERATOR,
    "/scale_elastic_ep": Reason.OPERATOR,
    "/flush_cache": Reason.OPERATOR,
    "/add_external_corpus": Reason.OPERATOR,
    "/remove_external_corpus": Reason.OPERATOR,
    "/hicache/storage-backend/clear": Reason.OPERATOR,
    "/hicache/storage-backend": Reason.OPERATOR,
    "/start_profile": Reason.OPERATOR,
    "/stop_profile": Reason.OPERATOR,
    "/set_trace_level": Reason.OPERATOR,
    "/freeze_gc": Reason.OPERATOR,
    "/start_expert_distribution_record": Reason.OPERATOR,
    "/stop_expert_distribution_record": Reason.OPERATOR,
    "/dump_expert_distribution_record": Reason.OPERATOR,
    "/update_weights_from_disk": Reason.OPERATOR,
    "/init_weights_send_group_for_remote_instance": Reason.OPERATOR,
    "/send_weights_to_remote_instance": Reason.OPERATOR,
    "/init_weights_update_group": Reason.OPERATOR,
    "/destroy_weights_update_group": Reason.OPERATOR,
    "/update_weights_from_tensor": Reason.OPERATOR,
    "/begin_weight_update": Reason.OPERATOR,
    "/end_weight_update": Reason.OPERATOR,
    "/update_weights_from_distributed": Reason.OPERATOR,
    "/update_weights_from_ipc": Reason.OPERATOR,
    "/update_weight_version": Reason.OPERATOR,
    "/get_weights_by_name": Reason.OPERATOR,
    "/release_memory_occupation": Reason.OPERATOR,
    "/resume_memory_occupation": Reason.OPERATOR,
    "/weights_checker": Reason.OPERATOR,
    "/slow_down": Reason.OPERATOR,
    "/pd_role_switch": Reason.OPERATOR,
    "/load_lora_adapter": Reason.OPERATOR,
    "/load_lora_adapter_from_tensors": Reason.OPERATOR,
    "/unload_lora_adapter": Reason.OPERATOR,
    "/configure_logging": Reason.OPERATOR,
    "/abort_request": Reason.OPERATOR,
    "/pause_generation": Reason.OPERATOR,
    "/continue_generation": Reason.OPERATOR,
    "/encode": Reason.OTHER_MODEL_KIND,
    "/classify": Reason.OTHER_MODEL_KIND,
    "/v1/embeddings": Reason.OTHER_MODEL_KIND,
    "/v1/classify": Reason.OTHER_MODEL_KIND,
    "/v1/score": Reason.OTHER_MODEL_KIND,
    "/v1/rerank": Reason.OTHER_MODEL_KIND,
    "/v1/decisions": Reason.OTHER_MODEL_KIND,
    "/v1/systemone": Reason.OTHER_MODEL_KIND,
    "/v1/tokenize": Reason.TOOL,
    "/v1/detokenize": Reason.TOOL,
    "/parse_function_call": Reason.TOOL,
    "/separate_reasoning": Reason.TOOL,
    "/open_session": Reason.TOOL,
    "/close_session": Reason.TOOL,
    "/v1/messages/count_tokens": Reason.TOOL,
    "/api/show": Reason.TOOL,
    "/v1/responses/{response_id}/cancel": Reason.TOOL,
    "/v1/audio/transcriptions": Reason.FILE_UPLOAD,
}

# The generation endpoints CI fuzzes at the full budget (the others at a smaller one there, all
# of them at the full budget in `hack bench fuzz`).
CI_CORE = ("/generate", "/v1/completions", "/v1/chat/completions")

_BODY_METHODS = ("post", "put", "patch")


def fuzzed_operations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, METHOD) of every operation of the OpenAPI document `doc` that takes a JSON body and
    whose path is not in NOT_FUZZED; one method per path (POST where there is one)."""
    out = []
    for path, ops in sorted(doc.get("paths", {}).items()):
        if path in NOT_FUZZED:
            continue
        for method in _BODY_METHODS:
            content = ((ops.get(method) or {}).get("requestBody") or {}).get("content") or {}
            if any(media.startswith("application/json") for media in content):
                out.append((path, method.upper()))
                break
    return out
