"""Prefill fidelity through real servers (`hack eval fidelity`): ShareGPT first user turns (text
no calibration, study or tuning reads) sent to one colocated server per KV method; each
method's greedy continuation is compared with the BF16 server's, as the common prefix's share of
the length. The measure docs/engine.md and the server log quote for each --hack-prefill mode.
"""
from __future__ import annotations

from typing import Callable

from hack_eval.workloads import common_prefix, encode, sharegpt_pairs, tokenizer

from .server_methods import METHOD_NAMES, is_method, method_args


def fidelity_prompts(model_path: str, count: int, min_tokens: int = 256, max_tokens: int = 2048) -> list[list[int]]:
    """The first `count` ShareGPT first turns of min_tokens..max_tokens tokens, in file order."""
    tok = tokenizer(model_path)
    out = []
    for question, _ in sharegpt_pairs(4000):
        ids = encode(tok, question)
        if min_tokens <= len(ids) <= max_tokens:
            out.append(ids)
            if len(out) == count:
                return out
    raise ValueError(f"only {len(out)} ShareGPT turns hold {min_tokens}..{max_tokens} tokens")


def run_served_fidelity(model_name: str, methods: list[str], prompts: int = 6, n_new: int = 32,
                        budget_mb: float = 256.0, log: Callable[[str], None] = print) -> dict:
    """Greedy agreement with BF16 of each method's server (bf16 runs first: it is the reference)."""
    from engine.launcher import SGLangServer
    from hack_eval.models import prepare

    unknown = [m for m in methods if not is_method(m)]
    if unknown or not methods:
        raise ValueError(f"--served takes methods of {METHOD_NAMES}, got {methods!r}")
    methods = ["bf16"] + [m for m in dict.fromkeys(methods) if m != "bf16"]
    args = {m: method_args(m, None) for m in methods}
    path = str(prepare(model_name, log=log))
    items = fidelity_prompts(path, prompts)
    outputs: dict[str, list[list[int]]] = {}
    for m in methods:
        server = SGLangServer(path, [*args[m], "--hack-kv-budget-mb", str(budget_mb), "--random-seed", "0",
                                     "--disable-radix-cache"])
        server.start()
        log(f"[{m}] starting server (log {server.log_path})")
        try:
            server.wait_ready()
            outputs[m] = [list(server.generate(p, n_new, ignore_eos=True)["output_ids"]) for p in items]
            log(f"[{m}] {len(items)} prompts done")
        finally:
            server.stop()
    return {"model": model_name, "prompts": prompts, "prompt_tokens": [len(p) for p in items],
            "new_tokens": n_new, "budget_mb": budget_mb, "rows": fidelity_rows(outputs, args, n_new)}


def fidelity_rows(outputs: dict[str, list[list[int]]], args: dict[str, list[str]], n_new: int) -> list[dict]:
    """Per method, its common prefixes with the BF16 server's continuations and their share of the
    length; where the fp32 server ran, the same against its continuations as well
    ('agreement_fp32'): how far each method, BF16 included, stays from unrounded arithmetic."""
    rows = []
    for m, outs in outputs.items():
        row = {"method": m, "config": " ".join(args[m])}
        for ref, key in (("bf16", ""), ("fp32", "_fp32")):
            if ref in outputs:
                pre = [common_prefix(r, o) for r, o in zip(outputs[ref], outs)]
                row["prefixes" + key] = pre
                row["agreement" + key] = sum(pre) / (n_new * len(outs)) if outs else 0.0
        rows.append(row)
    return rows


def render_fidelity(res: dict, command: str) -> str:
    fp32 = all("agreement_fp32" in r for r in res["rows"])
    lines = ["# Prefill fidelity through real servers", "",
             f"Model {res['model']}, {res['prompts']} ShareGPT first turns ({', '.join(map(str, res['prompt_tokens']))} "
             f"tokens), {res['new_tokens']} greedy tokens, KV budget {res['budget_mb']:g} MB per server, radix cache "
             "off. Each method's common prefix with the BF16 server's continuation:", "", "```", command, "```", "",
             "| method | config | prefixes | of the length |"
             + (" of the length, against fp32 |" if fp32 else ""),
             "|---|---|---|---|" + ("---|" if fp32 else "")]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['config']} | {', '.join(map(str, r['prefixes']))} | {r['agreement']:.2f} |"
                     + (f" {r['agreement_fp32']:.2f} |" if fp32 else ""))
    if fp32:
        lines += ["", "fp32 is the same model in float32 weights and KV cache: the bf16 row's share against fp32 "
                  "is how far BF16's own rounding takes greedy decoding from unrounded arithmetic, the yardstick "
                  "for any lossy KV format's row."]
    return "\n".join(lines) + "\n"
