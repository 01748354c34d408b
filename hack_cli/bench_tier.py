"""`hack bench restore`: multi-turn conversations over shared documents, with a KV pool too small to
keep them, against real servers: what the page tier (`--hack-page-tier`) saves against recompute.

Workload (deterministic): `--conversations` conversations, each over one of the `--docs` documents
(essay cuts, 2K-6K tokens by default: SmolLM2 reads 8K), `--turns` turns each. Turn t's prompt is the document, then
every earlier question and answer of its conversation, then question t (a short essay cut of its
own); answers are the server's greedy `--answer-tokens` tokens. Turns are sent one at a time,
round-robin over the conversations, so the next turn of a conversation comes after every other
conversation's: with `--pool-tokens` smaller than the documents together its prefix has been
evicted by then. A returning turn is any turn whose document an earlier request read.

Methods, one server each (same model, same pool in tokens, one after another, each tier empty at
its start):
  recompute   --kv-cache-dtype hack: an evicted prefix is computed again
  tier        --kv-cache-dtype hack --hack-page-tier DIR: it comes back from DIR (HACK pages)
  bf16-tier   SGLang's BF16 pool (torch_native, 64-token pages like HACK's) with --hack-page-tier DIR:
              the same tier holding BF16 pages
Per method: mean TTFT of first and returning turns, tokens restored from the tier, the tier's bytes
on disk and bytes per stored token. Ratios: TTFT of returning turns, tier vs recompute; tokens a
byte of tier holds, HACK vs BF16 (= conversations per GB of tier, same conversations).
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .bench_doc import cpu_name, publish

DEFAULT_OUT = "docs/bench/restore-multiturn-{model}.json"
METHODS = {
    "recompute": ["--kv-cache-dtype", "hack"],
    "tier": ["--kv-cache-dtype", "hack"],  # + --hack-page-tier
    # the same 64-token pages as HACK's (SGLang's CPU default is 1: a record per token)
    "bf16-tier": ["--kv-cache-dtype", "auto", "--attention-backend", "torch_native", "--page-size", "64"],
}
TIERED = ("tier", "bf16-tier")
TTFT_TARGET = 0.2  # returning turns' mean TTFT with the tier, x recompute's (issue target)
BYTES_TARGET = 5.0  # tokens per byte of tier, HACK x BF16


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("restore", help="multi-turn conversations over shared documents with a small pool: "
                                        "TTFT of returning turns with the page tier vs recompute")
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (prepared once)")
    p.add_argument("--docs", default="2048,4096,6144", help="document lengths in tokens, comma-separated")
    p.add_argument("--conversations", type=int, default=6, help="conversations (spread over the documents)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--pool-tokens", type=int, default=10240,
                   help="KV pool of every server, in tokens (--max-total-tokens): smaller than the documents together")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result ('' = none)")
    p.add_argument("--doc", action="store_true", help="also put the table in docs/engine.md (block restore-multiturn-MODEL)")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    return run_cli(argparse.Namespace(model="smollm2", docs="2048,4096,6144", conversations=6, turns=4,
                                      question_tokens=32, answer_tokens=16, pool_tokens=10240,
                                      methods=",".join(METHODS), out=DEFAULT_OUT, doc=False))


def workload(model_path: str, docs: list[int], conversations: int, turns: int, q_tokens: int) -> dict:
    """Documents and questions (token ids), and which document each conversation reads."""
    from hack_eval.workloads import essay_ids

    documents = [essay_ids(model_path, n, index=i) for i, n in enumerate(docs)]
    questions = [[essay_ids(model_path, q_tokens, index=len(docs) + c * turns + t) for t in range(turns)]
                 for c in range(conversations)]
    return {"documents": documents, "questions": questions, "doc_of": [c % len(docs) for c in range(conversations)]}


def run_method(method: str, model_path: str, work: dict, turns: int, answer_tokens: int, pool_tokens: int,
               tier_dir: Path | None, say=print) -> dict:
    from disagg.replay import generate
    from engine.launcher import SGLangServer

    # One pool for every layer: HACK needs it on a model with sliding-window layers (Gemma-3), and the
    # BF16 baseline gets the same so both tiers store the same layers (a no-op on SmolLM2).
    args = [*METHODS[method], "--max-total-tokens", str(pool_tokens), "--chunked-prefill-size", "4096",
            "--disable-hybrid-swa-memory", "--sleep-on-idle"]
    if tier_dir is not None:
        args += ["--hack-page-tier", str(tier_dir)]
    server = SGLangServer(model_path, args)
    server.start()
    try:
        server.wait_ready()
        generate(server.url, list(range(100, 164)), 2, stream=False)  # warm-up, sharing no prefix
        server.flush_cache()
        history = [list() for _ in work["doc_of"]]
        seen_docs: set[int] = set()
        turns_out = []
        for t in range(turns):
            for c, d in enumerate(work["doc_of"]):
                prompt = work["documents"][d] + history[c] + work["questions"][c][t]
                r = generate(server.url, prompt, answer_tokens, stream=True)
                if not r.ok:
                    raise RuntimeError(f"{method}: conversation {c} turn {t} failed: {r.error}")
                history[c] += work["questions"][c][t] + r.output_ids
                turns_out.append({"conversation": c, "turn": t, "document": d, "prompt_tokens": len(prompt),
                                  "returning": d in seen_docs, "ttft_s": r.ttft_s, "cached_tokens": r.cached_tokens,
                                  "from_tier": r.cached_from_store or 0})
                seen_docs.add(d)
            say(f"[{method}] turn {t + 1}/{turns} done")
        time.sleep(1.2)  # the tier rescans its size on disk at most once a second after writes
        usage = server.kv_usage()
    finally:
        server.stop()
    first = [x["ttft_s"] for x in turns_out if not x["returning"]]
    back = [x["ttft_s"] for x in turns_out if x["returning"]]
    out = {"turns": turns_out, "max_total_num_tokens": usage["max_total_num_tokens"],
           "ttft_first_s": statistics.fmean(first) if first else None,
           "ttft_returning_s": statistics.fmean(back) if back else None,
           "returning_turns": len(back), "tokens_from_tier": sum(x["from_tier"] for x in turns_out),
           "tokens_computed": sum(x["prompt_tokens"] - (x["cached_tokens"] or 0) for x in turns_out),
           "page_tier": usage.get("page_tier")}
    tier = out["page_tier"]
    if tier:
        stored_tokens = tier["offloaded_pages"] * tier["page_size"]
        out["tier_bytes_per_token"] = tier["bytes_on_disk"] / stored_tokens if stored_tokens else None
    return out


def ratios(results: dict) -> dict:
    out = {}
    rec, tier, bf16 = results.get("recompute"), results.get("tier"), results.get("bf16-tier")
    if rec and tier and rec["ttft_returning_s"] and tier["ttft_returning_s"] is not None:
        out["ttft_returning_tier_vs_recompute"] = tier["ttft_returning_s"] / rec["ttft_returning_s"]
    if tier and bf16 and tier.get("tier_bytes_per_token") and bf16.get("tier_bytes_per_token"):
        out["tier_tokens_per_byte_hack_vs_bf16"] = bf16["tier_bytes_per_token"] / tier["tier_bytes_per_token"]
    return out


def table(doc: dict) -> str:
    lines = [f"`{doc['command']}` ({doc['date']}; {doc['cpu']}, AMX {'yes' if doc['amx'] else 'no'}; "
             f"{doc['conversations']} conversations x {doc['turns']} turns over documents of {doc['docs']} tokens, "
             f"pool {doc['pool_tokens']} tokens)", "",
             "| method | TTFT first turns (s) | TTFT returning turns (s) | tokens from tier | tokens computed "
             "| tier on disk (MB) | tier bytes/token | refused records |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r in doc["results"].items():
        t = r.get("page_tier") or {}
        bpt = r.get("tier_bytes_per_token")
        lines.append(f"| {m} | {r['ttft_first_s']:.2f} | {r['ttft_returning_s']:.2f} | {r['tokens_from_tier']:,} "
                     f"| {r['tokens_computed']:,} | {t.get('bytes_on_disk', 0) / 1e6:.1f} | "
                     f"{f'{bpt:,.0f}' if bpt else '-'} | {t.get('refused_records', '-')} |")
    rt = doc["ratios"]
    lines.append("")
    if "ttft_returning_tier_vs_recompute" in rt:
        v = rt["ttft_returning_tier_vs_recompute"]
        lines.append(f"Returning turns' TTFT with the tier: x{v:.2f} recompute's (target <= x{TTFT_TARGET}: "
                     f"{'met' if v <= TTFT_TARGET else 'missed'}).")
    if "tier_tokens_per_byte_hack_vs_bf16" in rt:
        v = rt["tier_tokens_per_byte_hack_vs_bf16"]
        lines.append(f"Tokens (so conversations) a byte of tier holds, HACK vs BF16: x{v:.2f} (target >= "
                     f"x{BYTES_TARGET}: {'met' if v >= BYTES_TARGET else 'missed'}).")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    from engine.prefill_choice import cpu_has_amx_bf16
    from hack_eval.models import prepare

    methods = [m for m in str(args.methods).split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    try:
        docs = [int(x) for x in str(args.docs).split(",") if x.strip()]
    except ValueError:
        docs = []
    if bad or not methods or not docs or min(docs) < 64 or args.turns < 2 or args.conversations < 1:
        print(f"hack bench restore: --methods of {', '.join(METHODS)}, --docs integers >= 64, --turns >= 2, "
              "--conversations >= 1", file=sys.stderr)
        return 2
    model_path = str(prepare(args.model, log=lambda *a, **k: None))
    work = workload(model_path, docs, args.conversations, args.turns, args.question_tokens)
    results = {}
    with tempfile.TemporaryDirectory(prefix="hack-tier-") as tmp:
        for m in methods:
            tier_dir = Path(tmp) / m if m in TIERED else None
            results[m] = run_method(m, model_path, work, args.turns, args.answer_tokens, args.pool_tokens, tier_dir)
            if tier_dir is not None:
                shutil.rmtree(tier_dir, ignore_errors=True)
            r = results[m]
            print(f"[{m}] TTFT first {r['ttft_first_s']:.2f} s, returning {r['ttft_returning_s']:.2f} s, "
                  f"{r['tokens_from_tier']:,} tokens from the tier, {r['tokens_computed']:,} computed", flush=True)
    doc = {"command": "hack bench restore " + " ".join(
               f"--{k.replace('_', '-')} {getattr(args, k)}" for k in
               ("model", "docs", "conversations", "turns", "answer_tokens", "pool_tokens", "methods")),
           "date": datetime.date.today().isoformat(), "cpu": cpu_name(), "amx": cpu_has_amx_bf16(), "docs": args.docs,
           "conversations": args.conversations, "turns": args.turns, "pool_tokens": args.pool_tokens,
           "results": results, "ratios": ratios(results)}
    print(table(doc))
    publish(doc, table(doc), args.out, args.model, f"restore-multiturn-{args.model}", args.doc,
            heading="## Bringing an evicted context back")
    refused = [m for m, r in results.items() if (r.get("page_tier") or {}).get("refused_records")]
    if refused:
        print(f"hack bench restore: the tier refused records in {refused} (see the server logs)", file=sys.stderr)
        return 1
    return 0
