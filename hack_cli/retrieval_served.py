"""Passkey retrieval through real servers (`hack eval retrieval --served METHODS`): the study's
items (hack_eval.retrieval.build_items: the same seed and --contexts list give the same items, as
items_digest shows) sent to one colocated SGLang server per KV method, each answer decoded
greedily by the server and matched exactly.

Where the study scores a format on the HF model with the cache emulated per layer, this runs
what a user runs: SGLang's scheduler, chunked prefill, the HACK pool and kernels (or BF16's), so
a row here is what a deployment of that method would answer. Servers run one after another (a
small host holds one comfortably); each gets the same KV budget and seed.
"""
from __future__ import annotations

import time
from typing import Callable

from hack_eval.retrieval import ANSWER, DEPTHS, INTRO, NEEDLE, QUESTION, Item, build_items, items_digest
from hack_eval.workloads import tokenizer

from .server_methods import METHOD_NAMES, is_method, method_args

SERVED_MODE = "served"


def _ask(server, item: Item) -> bool:
    """Whether the server's greedy continuation of the item's prompt is exactly its answer."""
    answer = list(item.ids[item.answer_start:])
    out = server.generate(list(item.ids[:item.answer_start]), len(answer))
    return list(out["output_ids"])[:len(answer)] == answer


def context_limit(model_path) -> int | None:
    """The model's context length (max_position_embeddings of its config; None if it names none)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_path))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def served_rows(method: str, args: list[str], items: list[Item], answers: list[bool], seconds: float) -> list[dict]:
    """The retrieval rows (hack_eval.retrieval's schema) of one method's answers, per context."""
    rows = []
    for context in dict.fromkeys(item.context for item in items):
        got = [(item.depth, ok) for item, ok in zip(items, answers) if item.context == context]
        by_depth = {}
        for d in sorted({d for d, _ in got}):
            at = [ok for dd, ok in got if dd == d]
            by_depth[str(d)] = sum(at) / len(at)
        rows.append({"variant": method, "mode": SERVED_MODE, "config": " ".join(args), "context": context,
                     "items": len(got), "accuracy": sum(ok for _, ok in got) / len(got), "by_depth": by_depth,
                     "seconds": seconds * len(got) / len(items), "attention_path": "server"})
    return rows


def run_served_retrieval(model_name: str, contexts: list[int], per_cell: int, methods: list[str], seed: int = 0,
                         four_bit_layers: tuple[int, ...] | None = None, budget_mb: float = 256.0,
                         log: Callable[[str], None] = print, raised: str = "kv") -> dict:
    """Exact-match accuracy of each method's server on the study's items (see the module)."""

    from engine.launcher import SGLangServer
    from hack_eval.accuracy import MODEL_TITLES
    from hack_eval.models import prepare

    unknown = [m for m in methods if not is_method(m)]
    if unknown or not methods:
        raise ValueError(f"--served takes methods of {METHOD_NAMES}, got {methods!r}")
    server_args = {m: method_args(m, four_bit_layers, raised) for m in methods}  # refuses a missing --4bit-layers now
    path = prepare(model_name, log=log)
    limit = context_limit(path)
    if limit is not None and max(contexts) >= limit:
        # SGLang refuses a prompt whose length plus the tokens asked for reaches the context length
        raise ValueError(f"--contexts {max(contexts)}: a prompt and its answer must stay under {model_name}'s "
                         f"context length of {limit} tokens for a server to take them; use {limit - 192} or less")
    items = build_items(tokenizer(path), contexts, per_cell, seed)
    longest = max(len(item.ids) for item in items)
    rows: list[dict] = []
    for m in methods:
        # one chunk per prompt, as the study reads it; the pool sized from the same budget for all
        extra = ["--hack-kv-budget-mb", str(budget_mb), "--random-seed", str(seed),
                 "--chunked-prefill-size", str(max(4096, longest))]
        server = SGLangServer(str(path), [*server_args[m], *extra])
        server.start()
        log(f"[{m}] starting server (log {server.log_path})")
        try:
            server.wait_ready()
            t0 = time.time()
            answers = []
            for n, item in enumerate(items):
                answers.append(_ask(server, item))
                log(f"[{m}] item {n + 1}/{len(items)} (context {item.context}, depth {item.depth}): "
                    f"{'found' if answers[-1] else 'missed'}")
            rows += served_rows(m, server_args[m], items, answers, time.time() - t0)
        finally:
            server.stop()
    # the servers load the model in its config's dtype (BF16 here), not the study's float32
    title = MODEL_TITLES.get(model_name, model_name).replace("float32", "served in BF16")
    return {"model": title, "contexts": contexts, "items_per_context": per_cell,
            "seed": seed, "items_digest": items_digest(items), "depths": list(DEPTHS),
            "attention_path": "server", "served": True,
            "four_bit_layers": list(four_bit_layers or []), "budget_mb": budget_mb,
            "prompt": {"intro": INTRO, "needle": NEEDLE, "question": QUESTION, "answer": ANSWER},
            "rows": rows, "needle_attention": None}
