"""Request checks SGLang 0.5.23 lacks: bad input must get a 4xx, never a 5xx or a dropped
connection, and never reach the scheduler.

In the tokenizer manager (engine.hooks' validation hook, where SGLang's own ValueErrors become
HTTP 400), values that pass SGLang's validation and then crash the scheduler, which takes the
whole server down:
  - out-of-vocabulary `input_ids` (negative or >= vocab size): the embedding lookup;
  - an empty prompt (`"text": ""` with a tokenizer that adds no BOS, or `"input_ids": []`): a
    forward that adds no token (found by schema fuzzing);
  - `top_logprobs_num` (OpenAI: `logprobs` / `top_logprobs`) above the vocabulary: the top-k
    over the logits (found by the fuzz tests, tests/test_fuzz_api.py);
  - `top_k` or `min_new_tokens` above the int32 range: the scheduler's sampling tensors;
  - `stop_token_ids` outside the vocabulary with `min_new_tokens` (OpenAI: `min_tokens`): the
    min-new-tokens penalizer's scatter (found by schema fuzzing);
  - `lora_id` that is not a string: appended to the cache key, and `return_hidden_states` that
    is neither a boolean nor 'last' (found by schema fuzzing);
  - `input_embeds` rows narrower or wider than the model's hidden size, on a server launched with
    --disable-radix-cache (others refuse input_embeds): the first layer norm.
On the HTTP body (engine.http_guard, before SGLang parses it: `body_shape_error`,
`body_field_error`), what SGLang's request handling reads without checking and answers with a
500 (found by schema fuzzing of the server's OpenAPI document; each answer names the field):
  - a body that is JSON but not an object (every generation endpoint);
  - `input_embeds` empty, ragged or nested wrongly (/generate, /vertex_generate: IndexError in
    GenerateReqInput._determine_batch_size, or a dropped connection when streamed);
  - in a batch, a per-prompt list with fewer entries than prompts (IndexError in
    GenerateReqInput.__getitem__; /generate, /v1/completions), and for one prompt a list of
    sampling_params (IndexError or AttributeError; /generate), or a list `rid` sampled once
    (TypeError; /generate, /v1/completions, /v1/chat/completions, /invocations), and `n` below 1
    on a batch (IndexError) or a null `sampling_params.n` (TypeError);
  - /vertex_generate `parameters` that are not /generate fields, or that repeat the instances'
    inputs (TypeError building the request), instances that are not objects, and a built
    request SGLang's /generate schema refuses (a text that is a number: TypeError);
  - a chat `response_format` (or its json_schema's schema) that is not an object
    (/v1/chat/completions, /invocations: AttributeError in the request model's validator);
  - an Anthropic tool whose `type` is not a string (/v1/messages: AttributeError picking its
    variant);
  - /api/chat without messages and Ollama `options` of the wrong type (a 500, or a dropped
    connection when streamed; Ollama's other value errors: engine.ollama_errors).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable


# JSON numbers as Python reads them (a bool is an int there, and not a number in JSON).
def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_input_ids(vocab_size: int, input_ids: Any) -> None:
    if input_ids is None:
        return
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError("input_ids must be a list of integers")
    if not input_ids:  # the scheduler cannot run a forward that adds no token: the server died
        raise ValueError("the prompt is empty (no token after tokenization); at least one token is needed")
    for i, tok in enumerate(input_ids):
        if not _integer(tok):
            raise ValueError(f"input_ids[{i}] is {tok!r}; token ids must be integers")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"input_ids[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")


def check_input_embeds_width(hidden_size: int, input_embeds: Any) -> None:
    """Every embedding row as wide as the model's hidden size: a server launched with
    --disable-radix-cache (the only kind that takes input_embeds) died in its first layer norm on
    a narrower row."""
    if input_embeds is None or not hidden_size:
        return
    shape = getattr(input_embeds, "shape", None)
    if shape is not None:  # a tensor, from the Python engine API
        width = int(shape[-1]) if len(shape) else 0
        if width != hidden_size:
            raise ValueError(f"input_embeds rows have {width} values; this model's embeddings have {hidden_size}")
        return
    for i, row in enumerate(input_embeds):
        if isinstance(row, (list, tuple)) and len(row) != hidden_size:
            raise ValueError(f"input_embeds[{i}] has {len(row)} values; this model's embeddings have "
                             f"{hidden_size} (its hidden size)")


def check_top_logprobs_num(vocab_size: int, top_logprobs_num: Any) -> None:
    """The number of top logprobs asked per position: at most the vocabulary (the top-k over the
    logits cannot return more). Negative values mean none upstream and are left alone."""
    values = top_logprobs_num if isinstance(top_logprobs_num, (list, tuple)) else [top_logprobs_num]
    for k in values:
        if _integer(k) and k > vocab_size:
            raise ValueError(f"top_logprobs_num (OpenAI: logprobs / top_logprobs) is {k}; "
                             f"at most the vocabulary size {vocab_size} can be returned")


INT32_MAX = 2**31 - 1


# Sampling parameters the scheduler puts into int32 tensors (the batch's top_k; the
# min-new-tokens penalizer): a value above that range killed the scheduler (top_k found by
# schema fuzzing; min_new_tokens has no upper bound when max_new_tokens is null).
INT32_SAMPLING_PARAMS = ("top_k", "min_new_tokens")


def check_int32_sampling_params(sampling_params: Any) -> None:
    if not isinstance(sampling_params, dict):
        return
    for name in INT32_SAMPLING_PARAMS:
        value = sampling_params.get(name)
        if _integer(value) and value > INT32_MAX:
            hint = (" (any value at or above the vocabulary size samples from the whole vocabulary)"
                    if name == "top_k" else "")
            raise ValueError(f"{name} is {value}; at most {INT32_MAX}{hint}")


def check_stop_token_ids(vocab_size: int, sampling_params: Any) -> None:
    """`stop_token_ids` must be token ids of the vocabulary: with `min_new_tokens` (OpenAI:
    `min_tokens`) the min-new-tokens penalizer scatters them into a vocabulary-wide tensor, and
    one outside it killed the scheduler (found by schema fuzzing). SGLang checks logit_bias and
    token_ids_logprob this way itself; outside min_new_tokens such an id could never match."""
    ids = sampling_params.get("stop_token_ids") if isinstance(sampling_params, dict) else None
    if not isinstance(ids, (list, tuple, set)):
        return  # absent; SGLang's own parsing refuses other types
    for tok in ids:
        if _integer(tok) and not 0 <= tok < vocab_size:
            raise ValueError(f"stop_token_ids holds {tok}, outside the vocabulary [0, {vocab_size})")


def check_lora_id(lora_id: Any) -> None:
    """`lora_id` (the server sets it from lora_path when LoRA is on; a client's reaches the
    scheduler untouched when it is off) must be a string: the scheduler appends it to the cache
    key, and a list there killed the server (found by schema fuzzing)."""
    if lora_id is not None and not isinstance(lora_id, str):
        raise ValueError(f"lora_id is {lora_id!r}; it must be a string (one per prompt in a batch)")

def check_return_hidden_states(value: Any) -> None:
    """`return_hidden_states` of one prompt, as SGLang's own parser reads it (a boolean or
    'last'): SGLang checks it for a batch, not for one prompt, and the scheduler's check then
    raised and killed the server (found by schema fuzzing)."""
    from sglang.srt.managers.schedule_batch import get_return_hidden_states_mode

    get_return_hidden_states_mode(value)  # raises SGLang's own ValueError

# The generation endpoints a client reaches (HTTP guard: the body must be one JSON object, and
# the field checks below where a path has them): every generation endpoint of SGLang 0.5.23's
# OpenAPI document.
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/invocations",
                              "/v1/messages", "/v1/responses", "/api/chat", "/api/generate",
                              "/vertex_generate"})
_JSON_WHITESPACE = b" \t\r\n"


def body_shape_error(body: bytes) -> str | None:
    """Why a generation request's body cannot be a request, or None. SGLang's chat request
    model reads a body that is JSON but not an object (an array, a string, a number, null) in a
    validator that assumes a dict and answers 500; every generation endpoint gets the same 400
    here. Only the first byte is looked at: an object that is not valid JSON is SGLang's to
    refuse (it answers 400), and an empty body too."""
    head = body.lstrip(_JSON_WHITESPACE)[:1]
    if not head or head == b"{":
        return None
    return "the request body must be a JSON object ({...})"


def body_field_error(path: str, body: bytes) -> str | None:
    """Why the fields of a generation request's JSON object cannot be served, or None (also
    when the body is not valid JSON: SGLang answers that with its own 400)."""
    check = _FIELD_CHECKS.get(path)
    if check is None:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return check(obj) if isinstance(obj, dict) else None


# ---------------------------------------------------------------- /generate

_INPUT_KEYS = ("text", "input_ids", "input_embeds")


def input_embeds_error(value: Any) -> str | None:
    """`input_embeds` must be one prompt's embeddings (a non-empty list of equally long,
    non-empty lists of numbers, the first value a float: SGLang tells one prompt from a batch by
    the type of input_embeds[0][0]) or a non-empty list of those (a batch)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        return ("input_embeds must be a non-empty list: one list of floats per token, or a list "
                "of those per prompt")
    first = value[0]
    if isinstance(first, list) and first and isinstance(first[0], list):  # a batch
        for i, item in enumerate(value):
            error = _embeddings_error(item, f"input_embeds[{i}]")
            if error:
                return error
        return None
    error = _embeddings_error(value, "input_embeds")
    if error is None and not isinstance(value[0][0], float):
        return (f"input_embeds[0][0] is {value[0][0]!r}, not a float: SGLang reads a single "
                "prompt's embeddings only when their first value is a float (write it as 1.0)")
    return error


def _embeddings_error(rows: Any, name: str) -> str | None:
    if not isinstance(rows, list) or not rows:
        return f"{name} must be a non-empty list of token embeddings (lists of floats)"
    width = None
    for j, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            return f"{name}[{j}] must be a non-empty list of floats (one token's embedding)"
        for x in row:
            if not _number(x):
                return f"{name}[{j}] holds {x!r}; an embedding holds numbers"
        if width is None:
            width = len(row)
        elif len(row) != width:
            return (f"{name}[{j}] has {len(row)} values and {name}[0] has {width}: every token's "
                    "embedding must have the same length")
    return None


# Fields SGLang reads per prompt of a batch (GenerateReqInput.__getitem__: field[i]) when they
# are lists, without checking that a list has one entry per prompt: a shorter one is an
# IndexError, a 500. (Fields SGLang does check, rid or image_data among them, are left to it.)
PER_PROMPT_LISTS = ("sampling_params", "video_data", "audio_data", "return_logprob",
                    "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
                    "sampling_logprobs_mode", "lora_path", "lora_id", "custom_logit_processor",
                    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                    "decode_tp_size", "multi_item_delimiter_indices", "token_indices_to_pool")


def generate_batch_size(body: dict) -> int | None:
    """The number of prompts of a /generate body as SGLang counts them, None for one prompt
    (GenerateReqInput._determine_batch_size: text, else input_ids, else input_embeds)."""
    text, ids, embeds = body.get("text"), body.get("input_ids"), body.get("input_embeds")
    if text is not None:
        return len(text) if isinstance(text, list) else None
    if ids is not None:
        return len(ids) if isinstance(ids, list) and ids and not isinstance(ids[0], int) else None
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0] \
            and isinstance(embeds[0][0], list):
        return len(embeds)
    return None


def per_prompt_lists_error(body: dict, prompts: int | None, fields: tuple[str, ...]) -> str | None:
    """In a batch of `prompts`, each of `fields` given as a list must have one entry per prompt."""
    if prompts is None:
        return None
    for name in fields:
        value = body.get(name)
        if name == "token_ids_logprob" and not (isinstance(value, list) and value
                                                and isinstance(value[0], list)):
            continue  # one list of ids for every prompt
        if isinstance(value, list) and len(value) < prompts:
            return (f"{name} has {len(value)} entries for a batch of {prompts} prompts: a list "
                    "there needs one entry per prompt")
    return None


def single_prompt_sampling_error(body: dict, prompts: int | None) -> str | None:
    """One prompt's `sampling_params` must be one object: SGLang keeps a list as it is and
    then reads it as a dict (`[]`: IndexError, `[{}]`: AttributeError; both a 500, found by
    the fuzz tests)."""
    if prompts is not None:
        return None  # a batch (per_prompt_lists_error), or no prompt (0: SGLang refuses it)
    if isinstance(body.get("sampling_params"), list):
        return ("sampling_params is a list, but the request has one prompt: give one object "
                "(a list, one object per prompt, is for a batch)")
    return None


def n_error(n: Any, name: str = "n") -> str | None:
    """The number of samples per prompt must be at least 1: SGLang's request handling divides
    by it or indexes a list it sizes by it (n = 0 on a batch: IndexError, a 500; on one prompt a
    400 that reads "range() arg 3 must not be zero"; found by schema fuzzing)."""
    if _integer(n) and n < 1:
        return f"{name} is {n}; at least 1 sample per prompt"
    return None


def _sampling_n_error(sampling_params: Any) -> str | None:
    rows = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for i, row in enumerate(rows):
        if isinstance(row, dict):
            where = "sampling_params" if rows is not sampling_params else f"sampling_params[{i}]"
            if "n" in row and row["n"] is None:  # SGLang compares it with 1: TypeError, a 500
                return f"{where}.n is null; give an integer of at least 1, or leave it out"
            error = n_error(row.get("n"), f"{where}.n")
            if error:
                return error
    return None


def single_prompt_rid_error(body: dict, prompts: int | None, n: Any) -> str | None:
    """One prompt sampled once takes one request id: SGLang keeps a list `rid` as it is and then
    uses it as a dict key (TypeError: unhashable, a 500; found by schema fuzzing). With n > 1 a
    list is SGLang's to check (one id, or one per sample)."""
    if prompts is not None or not isinstance(body.get("rid"), list):
        return None
    if _integer(n) and n > 1:
        return None
    return "rid is a list, but the request has one prompt sampled once: give one string"


def generate_error(body: dict) -> str | None:
    if body.get("text") is None and body.get("input_ids") is None:
        error = input_embeds_error(body.get("input_embeds"))  # SGLang ignores it otherwise
        if error:
            return error
    prompts = generate_batch_size(body)
    if all(body.get(k) is None for k in _INPUT_KEYS):
        prompts = 0  # no prompt: SGLang refuses the request itself
    sp = body.get("sampling_params")
    return (_sampling_n_error(sp) or single_prompt_sampling_error(body, prompts)
            or single_prompt_rid_error(body, prompts, sp.get("n") if isinstance(sp, dict) else None)
            or per_prompt_lists_error(body, prompts, PER_PROMPT_LISTS + ("token_ids_logprob",)))


# ---------------------------------------------------------------- /v1/completions

# Fields of a completion request handed to the generate request as they are.
COMPLETION_PER_PROMPT = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "lora_path",
                         "custom_logit_processor")


def completion_error(body: dict) -> str | None:
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else None
    return (n_error(body.get("n")) or single_prompt_rid_error(body, batch, body.get("n"))
            or per_prompt_lists_error(body, batch, COMPLETION_PER_PROMPT))


# ---------------------------------------------------------------- /v1/chat/completions, /invocations

def chat_error(body: dict) -> str | None:
    """A chat is one prompt (`n` and `rid` as above). SGLang's chat request reads
    `response_format` before validating it (ChatCompletionRequest.set_json_schema: `.get` on the
    value, on a json_schema format's `schema`, and on that schema's `properties` and
    `properties.strict`): a value that is not an object there was an AttributeError, a 500
    (found by schema fuzzing)."""
    error = n_error(body.get("n")) or single_prompt_rid_error(body, None, body.get("n"))
    if error:
        return error
    fmt = body.get("response_format")
    if not fmt:
        return None  # absent, null or empty: SGLang skips it
    if not isinstance(fmt, dict):
        return f"response_format is {type(fmt).__name__}; it must be an object"
    schema = fmt.get("schema") if fmt.get("type") == "json_schema" and not fmt.get("json_schema") else None
    if not schema:
        return None
    if not isinstance(schema, dict):
        return f"response_format.schema is {type(schema).__name__}; a JSON schema is an object"
    if "properties" in schema and not isinstance(schema["properties"], dict):
        return "response_format.schema.properties must be an object"
    strict = schema.get("properties", {}).get("strict")
    if strict and not isinstance(strict, dict):
        return "response_format.schema.properties.strict must be an object (a JSON schema)"
    return None


# ---------------------------------------------------------------- /v1/messages (Anthropic)

def messages_error(body: dict) -> str | None:
    """SGLang picks each Anthropic tool's variant by calling `.startswith` on its `type`
    (anthropic.protocol._tool_discriminator) before validating it: a `type` that is not a
    string was an AttributeError, a 500, and the connection it came on was dropped for the
    next request (found by 5,000-request schema fuzzing)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None  # absent, or refused by SGLang's request model
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind and not isinstance(kind, str):
            return f"tools[{i}].type is {type(kind).__name__}; it must be a string"
    return None


# ---------------------------------------------------------------- /vertex_generate

@functools.lru_cache(maxsize=1)
def _generate_fields() -> frozenset[str]:
    import dataclasses

    from sglang.srt.managers.io_struct import GenerateReqInput

    return frozenset(f.name for f in dataclasses.fields(GenerateReqInput))


def vertex_error(body: dict, fields: Callable[[], frozenset[str]] = _generate_fields) -> str | None:
    """Vertex's instances each give a prompt (text, input_ids or input_embeds: the first kind
    instances[0] gives, SGLang reads that kind from every instance), and `parameters` are more
    /generate fields, handed to the request as keywords beside the inputs and image_data."""
    instances, params = body.get("instances"), body.get("parameters")
    if not isinstance(instances, list) or not instances:
        return None  # SGLang refuses a missing or non-list instances itself, answers [] to []
    for i, inst in enumerate(instances):
        if not isinstance(inst, dict):
            return f"instances[{i}] is {type(inst).__name__}; each instance is an object"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return None  # SGLang refuses it itself
    kind = next((k for k in _INPUT_KEYS if instances[0].get(k)), None)
    known = fields()
    for key in params:
        if key not in known:
            return f"parameters.{key} is not a field of a /generate request"
        if key == "image_data":
            return "parameters.image_data: images belong in the instances"
        if key == kind:
            return f"parameters.{key}: the instances already give {kind}"
    if kind is not None:
        for i, inst in enumerate(instances):
            if inst.get(kind) is None:
                return f"instances[{i}] has no {kind} (instances[0] gives {kind}; every instance must)"
            if kind == "input_embeds":
                error = _embeddings_error(inst[kind], f"instances[{i}].input_embeds")
                if error:
                    return error
    # The /generate request SGLang builds (the parameters alone when no instance gives an input)
    # skips the schema check /generate applies to its body: a text that is a number was a 500.
    request = params if kind is None else {**params, kind: [inst[kind] for inst in instances]}
    error = generate_error(request)
    if error:
        return error
    contract = _generate_contract_error(request)
    return None if contract is None else f"the /generate request of these instances and parameters: {contract}"


def _generate_contract_error(body: dict) -> str | None:
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return generate_contract_error(body)


# ---------------------------------------------------------------- Ollama: /api/chat, /api/generate

# Ollama options SGLang maps onto sampling parameters, with the JSON type each must have.
OLLAMA_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_number, "a number"), "top_p": (_number, "a number"),
    "top_k": (_integer, "an integer"), "num_predict": (_integer, "an integer"),
    "presence_penalty": (_number, "a number"), "frequency_penalty": (_number, "a number"),
    "seed": (_integer, "an integer"),
    "stop": (lambda x: isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x)),
             "a string or a list of strings"),
}


def ollama_options_error(body: dict) -> str | None:
    options = body.get("options")
    if not isinstance(options, dict):
        return None  # absent, or refused by SGLang's request model
    for key, (ok, kind) in OLLAMA_OPTIONS.items():
        if key in options and options[key] is not None and not ok(options[key]):
            return f"options.{key} is {options[key]!r}; it must be {kind}"
    return None


def ollama_chat_error(body: dict) -> str | None:
    if isinstance(body.get("messages"), list) and not body["messages"]:
        return "messages is empty: a chat needs at least one message"
    return ollama_options_error(body)


_FIELD_CHECKS: dict[str, Callable[[dict], str | None]] = {
    "/generate": generate_error,
    "/v1/completions": completion_error,
    "/v1/chat/completions": chat_error,
    "/invocations": chat_error,  # SageMaker's route takes a chat request
    "/v1/messages": messages_error,
    "/vertex_generate": vertex_error,
    "/api/chat": ollama_chat_error,
    "/api/generate": ollama_options_error,
}
