"""Passage recall through real servers (`hack eval recall`): the recall prompts of
hack_eval.workloads.recall_prompt (a passage, other text, then the passage's start again) sent to
one colocated SGLang server per KV method; each server's greedy continuation is compared with the
BF16 server's, on the prompts where BF16 reproduces the passage. The measure of
tests/test_gemma3_server.py::test_greedy_recall_past_the_window, for any method and layer set.
"""
from __future__ import annotations

from typing import Callable

from hack_eval.workloads import common_prefix, recall_prompt

from .server_methods import METHOD_NAMES, is_method, method_args


def recall_rows(prompts: list, outputs: dict[str, list[list[int]]], capacity: dict[str, int],
                args: dict[str, list[str]], n_new: int) -> tuple[list[int], list[dict]]:
    """The prompts BF16 reproduces (indices) and, per method, its common prefixes with BF16 there
    and their share of the length."""
    ref = outputs["bf16"]
    decisive = [i for i, p in enumerate(prompts) if ref[i] == list(p.source)]
    rows = []
    for m, outs in outputs.items():
        pre = [common_prefix(ref[i], outs[i]) for i in decisive]
        rows.append({"method": m, "config": " ".join(args[m]), "prefixes": pre,
                     "agreement": sum(pre) / (n_new * len(decisive)) if decisive else None,
                     "max_total_num_tokens": capacity.get(m)})
    return decisive, rows


def run_served_recall(model_name: str, methods: list[str], prompts: int = 6, n_new: int = 24,
                      four_bit_layers=None, raised: str = "kv", budget_mb: float = 128.0,
                      log: Callable[[str], None] = print) -> dict:
    """Greedy recall agreement with BF16 of each method's server (bf16 runs first: it is the reference)."""
    from engine.launcher import SGLangServer
    from hack_eval.models import prepare

    unknown = [m for m in methods if not is_method(m)]
    if unknown or not methods:
        raise ValueError(f"--served takes methods of {METHOD_NAMES}, got {methods!r}")
    if prompts < 1 or n_new < 1:
        raise ValueError("need at least one prompt and one new token")
    methods = ["bf16"] + [m for m in dict.fromkeys(methods) if m != "bf16"]
    server_args = {m: method_args(m, four_bit_layers, raised) for m in methods}  # refuses a missing --4bit-layers now
    path = str(prepare(model_name, log=log))
    items = [recall_prompt(path, i, n_new=n_new) for i in range(prompts)]
    outputs: dict[str, list[list[int]]] = {}
    capacity: dict[str, int] = {}
    for m in methods:
        # cold prefills (radix cache off), the same budget and seed for every method
        server = SGLangServer(path, [*server_args[m], "--hack-kv-budget-mb", str(budget_mb), "--random-seed", "0",
                                     "--disable-radix-cache"])
        server.start()
        log(f"[{m}] starting server (log {server.log_path})")
        try:
            server.wait_ready()
            outputs[m] = [list(server.generate(p.ids, n_new)["output_ids"]) for p in items]
            capacity[m] = int(server.kv_usage()["max_total_num_tokens"])
            log(f"[{m}] {len(items)} prompts done")
        finally:
            server.stop()
    decisive, rows = recall_rows(items, outputs, capacity, server_args, n_new)
    return {"model": model_name, "prompts": prompts, "new_tokens": n_new, "budget_mb": budget_mb,
            "distance": items[0].distance, "decisive": decisive, "rows": rows}


def render_recall(res: dict, command: str) -> str:
    lines = ["# Passage recall through real servers", "",
             f"Model {res['model']}, {res['prompts']} recall prompts (a passage, then its first tokens again "
             f"{res['distance']} tokens later), {res['new_tokens']} greedy tokens, KV budget {res['budget_mb']:g} MB "
             f"per server. BF16 reproduces the passage on prompts {res['decisive']}; each method's common prefix "
             "with BF16 there:", "", "```", command, "```", "",
             "| method | config | prefixes | of the length | max total tokens |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        share = "—" if r["agreement"] is None else f"{r['agreement']:.2f}"
        lines.append(f"| {r['method']} | {r['config']} | {', '.join(map(str, r['prefixes']))} | {share} | "
                     f"{r['max_total_num_tokens']} |")
    return "\n".join(lines) + "\n"
