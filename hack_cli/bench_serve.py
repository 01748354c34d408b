"""`hack bench serve`: real SGLang servers on this machine, HACK vs BF16 in the same run.

Each method gets its own colocated server on the same model with the same KV byte budget
(`--hack-kv-budget-mb`); all run at once with --sleep-on-idle (an idle server takes no CPU)
and the measurements alternate between them, so load drifts hit every method alike:
  bf16     SGLang's own CPU path: torch_native attention over a BF16 cache (the baseline)
  hack     --kv-cache-dtype hack (homomorphic attention on 2-bit pages; the default prefill,
           --hack-prefill auto: dense on a CPU with AMX-BF16, int8 on other AVX-512 VNNI
           CPUs; the default --hack-bits auto: the model's calibrated bit plan, `hack calibrate`)
  hack-2bit  hack with --hack-4bit-layers none (every layer at 2 bits, no plan; = hack on a
           model without a plan)
  hack-4bit  hack with --hack-kv-bits 4 --hack-bits plain (every code at 4 bits, ~31% of BF16's
           bytes: the format's near-lossless ceiling, for the accuracy studies)
  hack-homomorphic-prefill  hack with --hack-prefill homomorphic on every host
  dequant  --kv-cache-dtype hack --hack-attention dequant (same pages, dequantized first)
  hack-int8-prefill  hack with --hack-prefill int8 (the homomorphic kernel reading a chunk's own
           tokens from 6-bit codes instead of the pool's 2-bit ones)
  hack-exact-prefill  hack with --hack-prefill exact (a chunk's own tokens in FP16; the name
           `hack bench disagg` uses for the same server)
  hack-dense-prefill  hack with --hack-prefill dense (a chunk in FP16 and its cached prefix
           dequantized once, by SDPA; decode on the codes)
  hack-4bit-layers  hack with --hack-4bit-layers from this command's --4bit-layers (the layers
           `hack eval layers` / `hack eval retrieval --needle-attention` chose, at 4 bits)
Measured per server: max total tokens (capacity); batch-1 decode tokens/s and prefill tokens/s
at each context (prefill on a cold cache; decode from the first to the last streamed token,
best of a cold and a cached-prompt run);
throughput and latency of a fixed number of requests at a fixed concurrency.
Ratios are against bf16 measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import requests

from engine.args import LAYER_SPEC_METAVAR, layer_list
from engine.layer_sets import resolve_for_model_path
from hack_eval.models import MODELS
from hack_ops.config import RaisedTensors
from .server_methods import METHOD_NAMES, is_method, method_args, sparse_budget
from hack_metrics import rundir

from .bench_doc import DOCS, command_line, replace_block

def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="real servers: capacity, decode/prefill speed, throughput (HACK vs BF16)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="contexts 128 and 2K, fewer tokens and requests")
    p.add_argument("--methods", default="bf16,hack", help=f"comma-separated, of {', '.join(METHOD_NAMES)}")
    p.add_argument("--contexts", default=None, help="comma-separated prompt lengths (default 128,2048,8000)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens generated per decode run (default 32)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--decode-batch", type=int, default=0, metavar="N",
                   help="also measure decode tokens/s of N requests decoding together at each context (the "
                        "context's cached prompt, N streams at once; 0: off, the default)")
    p.add_argument("--requests", type=int, default=None, help="requests of the throughput run (default 16)")
    p.add_argument("--budget-mb", type=float, default=256.0, help="KV byte budget of every server")
    p.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    p.add_argument("--4bit-layers", dest="four_bit_layers", type=layer_list, default=None, metavar=LAYER_SPEC_METAVAR,
                   help="0-based layers the hack-4bit-layers method holds at 4 bits, or 'full' (the model's "
                        "layers without a sliding window) or 'auto' (the server's default set)")
    p.add_argument("--4bit-tensors", dest="four_bit_tensors", choices=[t.value for t in RaisedTensors], default="kv",
                   help="which tensors of the --4bit-layers layers the hack-4bit-layers method holds at 4 bits: "
                        "kv (K and V, default), k (K alone, V at 2 bits) or v (V alone; --hack-4bit-tensors)")
    p.add_argument("--context-length", type=int, default=None, metavar="N",
                   help="serve the model at N positions where its config says fewer (every server alike, through "
                        "SGLang's --json-model-override-args max_position_embeddings): decode speed at a context "
                        "past what the model was trained on, whose answers degrade there (default: the model's own)")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/engine.md")
    p.set_defaults(func=run)


def run_default(args: argparse.Namespace) -> int:
    return run(argparse.Namespace(json=False, quick=False, methods="bf16,hack,dequant", contexts=None,
                                  decode_tokens=None, concurrency=8, decode_batch=0, requests=None,
                                  budget_mb=256.0, model="smollm2", four_bit_layers=None, four_bit_tensors="kv", out=None,
                                  no_doc=False, context_length=None))


def _throughput(url: str, prompts: list[list[int]], n: int, concurrency: int) -> dict:
    lat: list[float] = []
    out_tokens = [0]
    errors: list[str] = []
    todo = list(prompts)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                ids = todo.pop()
            body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n,
                                                          "ignore_eos": True}}
            t0 = time.perf_counter()
            try:
                r = requests.post(url + "/generate", json=body, timeout=3600)
                r.raise_for_status()
                got = r.json()["meta_info"]["completion_tokens"]
            except Exception as exc:  # reported in the result, the run goes on
                errors.append(str(exc)[:200])
                continue
            with lock:
                lat.append(time.perf_counter() - t0)
                out_tokens[0] += got

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {"requests": len(prompts), "concurrency": concurrency, "errors": errors,
            "output_tok_s": out_tokens[0] / wall, "wall_s": wall,
            "latency_mean_s": statistics.mean(lat) if lat else None,
            "latency_p50_s": lat[len(lat) // 2] if lat else None,
            "latency_p90_s": lat[min(len(lat) - 1, int(len(lat) * 0.9))] if lat else None}


def _measure_all(methods: list[str], model_path: str, cfg: dict, say, run_meta: dict | None = None) -> dict:
    """All servers up at once (--sleep-on-idle: an idle one takes no CPU); measurements
    alternate between them so that load drifts on a shared machine hit every method alike."""
    from engine.launcher import SGLangServer
    from hack_eval.workloads import essay_ids

    # Each context's prompt (the third essay that long, else cut from the essays joined), built
    # before any server starts so a context the essays cannot fill stops the run at once.
    context_prompts = {c: essay_ids(model_path, c, index=2) for c in cfg["contexts"]}
    # One run directory per method (the dashboard compares two runs side by side).
    runs = {m: rundir.create_run(f"bench-serve-{m}", m, extra={"model_path": model_path, "bench": "serve",
                                                                **(run_meta or {})}) for m in methods}
    servers = {m: SGLangServer(model_path, [*method_args(m, cfg.get("four_bit_layers"), cfg.get("four_bit_tensors", "kv")),
                                            "--hack-kv-budget-mb", str(cfg["budget_mb"]),
                                            "--sleep-on-idle", *cfg.get("server_args", [])], env=metrics_env(runs[m]))
               for m in methods}
    res: dict[str, dict] = {m: {"contexts": {}} for m in methods}
    try:
        for m, s in servers.items():
            s.start()
            rundir.register_server(runs[m], "colocated-0", "colocated", s.url, pid=s.proc.pid)
            say(f"[{m}] starting server (log {s.log_path}, run directory {runs[m]})")
        for m, s in servers.items():
            s.wait_ready()
            res[m]["max_total_num_tokens"] = s.kv_usage()["max_total_num_tokens"]
            s.timed_stream(essay_ids(model_path, 128), 4)  # warm-up
        for c in cfg["contexts"]:
            ids = context_prompts[c]
            for m, s in servers.items():
                s.flush_cache()
                cold = s.timed_stream(ids, cfg["decode_tokens"])  # prefill (cold) and decode
                res[m]["contexts"][str(c)] = cold
            for m, s in servers.items():  # a second decode run (prompt cached), keep the best
                again = s.timed_stream(ids, cfg["decode_tokens"])
                cell = res[m]["contexts"][str(c)]
                cell["decode_tok_s"] = max(cell["decode_tok_s"], again["decode_tok_s"])
                say(f"[{m}] context {c}: decode {cell['decode_tok_s']:.2f} tok/s, "
                    f"prefill {cell['prefill_tok_s']:.0f} tok/s")
            if cfg.get("decode_batch"):
                for m, s in servers.items():  # the prompt is cached: the streams share its pages
                    try:
                        got = s.timed_streams(ids, cfg["decode_tokens"], cfg["decode_batch"])
                    except RuntimeError as exc:  # one method's failed cell is a result; the others still run
                        got = {"batch": cfg["decode_batch"], "decode_tok_s": None, "why": str(exc)[:300]}
                    res[m]["contexts"][str(c)]["batch_decode"] = got
                    say(f"[{m}] context {c}: {cfg['decode_batch']} requests decoding together: "
                        + (f"{got['decode_tok_s']:.2f} tok/s" if got["decode_tok_s"] else got["why"]))
        for m, s in servers.items():
            try:
                s.flush_cache()
            except requests.RequestException as exc:  # a server gone (its watchdog): no throughput, the rest goes on
                res[m]["throughput"] = {"requests": cfg["requests"], "concurrency": cfg["concurrency"],
                                        "errors": [f"{type(exc).__name__}: {exc}"[:200]], "output_tok_s": 0.0,
                                        "wall_s": 0.0, "latency_mean_s": None, "latency_p50_s": None,
                                        "latency_p90_s": None}
                say(f"[{m}] throughput: not measured, the server is gone ({type(exc).__name__})")
                continue
            prompts = [essay_ids(model_path, cfg["tp_prompt"], index=i % 8) for i in range(cfg["requests"])]
            res[m]["throughput"] = _throughput(s.url, prompts, cfg["tp_tokens"], cfg["concurrency"])
            say(f"[{m}] throughput {res[m]['throughput']['output_tok_s']:.2f} tok/s at concurrency "
                f"{cfg['concurrency']}")
        return res
    finally:
        for s in servers.values():
            s.stop()
        for run_dir in runs.values():
            rundir.mark_finished(run_dir)


def metrics_env(run_dir: Path) -> dict[str, str]:
    """The environment that makes a colocated server write its metrics streams in `run_dir`
    (the same recording for every method: its cost is in every row alike)."""
    return {"HACK_METRICS_RUN_DIR": str(run_dir), "HACK_METRICS_ROLE": "colocated",
            "HACK_METRICS_INSTANCE": "0", "HACK_METRICS_PROMETHEUS": "0"}


CONTEXT_ROOM = 92  # positions a context cell leaves for the decode and throughput tokens


def model_positions(model_path: str) -> int:
    """The model's own context: max_position_embeddings of its config (SmolLM2: 8192)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("text_config", cfg).get("max_position_embeddings", 8192))


def context_override(model_path: str, length: int | None) -> list[str]:
    """Server arguments that let `length` positions in where the model's config says fewer
    (SGLang sizes its rotary tables and context from max_position_embeddings); [] otherwise."""
    if length is None or length <= model_positions(model_path):
        return []
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    if "text_config" in cfg:
        raise ValueError("--context-length past the model's own context needs a model with a flat config")
    return ["--json-model-override-args", json.dumps({"max_position_embeddings": length})]


def run(args: argparse.Namespace) -> int:
    from hack_eval.models import prepare

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if not is_method(m)]
    if bad or "bf16" not in methods:
        raise ValueError(f"--methods must include bf16 and only name {METHOD_NAMES}, got {args.methods!r}")
    contexts = ([int(x) for x in args.contexts.split(",")] if args.contexts
                else ([128, 2048] if args.quick else [128, 2048, 8000]))
    if min(contexts) <= 0:
        raise ValueError("contexts must be positive")
    cfg = {"contexts": contexts, "decode_tokens": args.decode_tokens or (16 if args.quick else 32),
           "concurrency": args.concurrency, "decode_batch": getattr(args, "decode_batch", 0),
           "requests": args.requests or (8 if args.quick else 16),
           "tp_prompt": 256 if args.quick else 512, "tp_tokens": 32 if args.quick else 64,
           "budget_mb": args.budget_mb}
    layers = getattr(args, "four_bit_layers", None)
    if "hack-4bit-layers" in methods:
        method_args("hack-4bit-layers", layers)  # refuses a missing --4bit-layers before any server starts
    elif getattr(args, "four_bit_tensors", "kv") != "kv":
        raise ValueError("--4bit-tensors sets the hack-4bit-layers method's tensors; add it to --methods")
    if cfg["decode_tokens"] < 2 or cfg["concurrency"] < 1 or cfg["requests"] < 1 or cfg["decode_batch"] < 0:
        raise ValueError("--decode-tokens must be >= 2, --concurrency and --requests >= 1, --decode-batch >= 0")
    say = (lambda *a: None) if args.json else print
    model_path = str(prepare(args.model, log=say))
    length = getattr(args, "context_length", None)
    if length is not None and length < 2 * CONTEXT_ROOM:
        raise ValueError(f"--context-length must be at least {2 * CONTEXT_ROOM}")
    cfg["context_length"] = length or model_positions(model_path)
    cfg["server_args"] = context_override(model_path, length)
    limit = cfg["context_length"] - CONTEXT_ROOM
    if max(contexts) > limit:
        raise ValueError(f"contexts must be at most {limit} for {args.model} at {cfg['context_length']} positions "
                         "(less room for the generated ones; --context-length serves more)")
    if "hack-4bit-layers" in methods:  # 'full' as the model's indices, for the record and the servers
        cfg["four_bit_layers"] = list(resolve_for_model_path(layers, model_path))
        cfg["four_bit_tensors"] = getattr(args, "four_bit_tensors", "kv")
    result = {"bench": "serve", "model": args.model, "machine": platform.processor() or platform.machine(),
              "config": cfg, "methods": {}}
    result["methods"] = _measure_all(methods, model_path, cfg, say,
                                     {"model": args.model, "command": command_line("serve")})
    base = result["methods"]["bf16"]
    ratios = {}
    for m, r in result["methods"].items():
        if m == "bf16":
            continue
        ratios[m] = {
            "capacity": r["max_total_num_tokens"] / base["max_total_num_tokens"],
            "decode": _decode_ratios(r, base),
            "prefill": {c: r["contexts"][c]["prefill_tok_s"] / base["contexts"][c]["prefill_tok_s"] for c in r["contexts"]},
            "throughput": (r["throughput"]["output_tok_s"] / base["throughput"]["output_tok_s"]
                           if base["throughput"]["output_tok_s"] else None),
        }
        batch = _batch_ratios(r, base)
        if batch:
            ratios[m]["batch_decode"] = batch
    result["ratios_vs_bf16"] = ratios
    if "hack" in result["methods"]:  # sparse decode is judged against the dense HACK server
        dense = result["methods"]["hack"]
        result["ratios_vs_hack"] = {
            m: {"decode": _decode_ratios(r, dense), "batch_decode": _batch_ratios(r, dense)}
            for m, r in result["methods"].items() if sparse_budget(m) is not None}
    result["date"] = time.strftime("%Y-%m-%d")
    result["command"] = command_line("serve")
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    if not getattr(args, "no_doc", False):
        # one block per model: SmolLM2's is "serve", another model's "serve-<model>"
        replace_block(DOCS / "engine.md", "serve" if args.model == "smollm2" else f"serve-{args.model}",
                      render(result))
    if args.json:
        print(text)
    else:
        print(render(result))
    return 0


def _decode_ratios(r: dict, base: dict) -> dict[str, float]:
    """Batch-1 decode tokens/s of method result r over base's, per context."""
    return {c: r["contexts"][c]["decode_tok_s"] / base["contexts"][c]["decode_tok_s"] for c in r["contexts"]}


def _batch_ratios(r: dict, base: dict) -> dict[str, float]:
    """Batched decode tokens/s of method result r over base's, per context where both ran together."""
    out = {}
    for c, cell in r["contexts"].items():
        mine, theirs = cell.get("batch_decode", {}), base["contexts"][c].get("batch_decode", {})
        if mine.get("decode_tok_s") and theirs.get("decode_tok_s"):
            out[c] = mine["decode_tok_s"] / theirs["decode_tok_s"]
    return out


CAPACITY_TARGET = 5.0  # tokens a HACK pool holds, x BF16's, in the same KV budget (the product's target)


def _batch_cell(cell: dict) -> str:
    got = cell.get("batch_decode") or {}
    return f"{got['decode_tok_s']:.1f}" if got.get("decode_tok_s") else "n/a"


def render(result: dict) -> str:
    """The result as the markdown docs/engine.md quotes."""
    cfg, res, rat = result["config"], result["methods"], result["ratios_vs_bf16"]
    ctx = [str(c) for c in cfg["contexts"]]
    nb = cfg.get("decode_batch", 0)
    lines = [f"Command: `{result['command']}`  ",
             f"Measured: {result['date']} on this project's CPU host ({result['machine']}, 2 cores "
             f"shared with other work), KV budget {cfg['budget_mb']:g} MB per server"
             + (f", every server at {cfg['context_length']:,} positions (past the model's own context: "
                "speed, not answers)" if cfg.get("server_args") else "") + ".", "",
             "| method | max total tokens | " + " | ".join(f"decode tok/s @{c}" for c in ctx) + " | "
             + "".join(f"decode tok/s @{c}, {nb} together | " for c in ctx if nb)
             + " | ".join(f"prefill tok/s @{c}" for c in ctx)
             + f" | throughput tok/s ({cfg['requests']} req, conc. {cfg['concurrency']}) | p50 latency |",
             "|---" * (4 + (3 if nb else 2) * len(ctx)) + "|"]
    for m, r in res.items():
        tp = r["throughput"]
        lines.append(f"| {m} | {r['max_total_num_tokens']:,} | "
                     + " | ".join(f"{r['contexts'][c]['decode_tok_s']:.1f}" for c in ctx) + " | "
                     + "".join(f"{_batch_cell(r['contexts'][c])} | " for c in ctx if nb)
                     + " | ".join(f"{r['contexts'][c]['prefill_tok_s']:.0f}" for c in ctx)
                     + f" | {tp['output_tok_s']:.1f} | "
                     + ("n/a" if tp["latency_p50_s"] is None else f"{tp['latency_p50_s']:.1f}s") + " |")
    lines.append("")
    for m, r in rat.items():
        dec = ", ".join(f"@{c} x{v:.2f}" for c, v in r["decode"].items())
        pre = ", ".join(f"@{c} x{v:.2f}" for c, v in r["prefill"].items())
        bat = "".join(f"; {nb} together @{c} x{v:.2f}" for c, v in r.get("batch_decode", {}).items())
        tp = "n/a (no BF16 throughput)" if r["throughput"] is None else f"x{r['throughput']:.2f}"
        lines.append(f"- {m} vs bf16: capacity x{r['capacity']:.2f}; decode {dec}{bat}; prefill {pre}; "
                     f"throughput {tp}")
    for m, r in result.get("ratios_vs_hack", {}).items():
        dec = ", ".join(f"@{c} x{v:.2f}" for c, v in r["decode"].items())
        bat = "".join(f"; {nb} together @{c} x{v:.2f}" for c, v in r["batch_decode"].items())
        lines.append(f"- {m} vs hack (dense decode): decode {dec}{bat}")
    for m, r in rat.items():
        gap = r["capacity"] - CAPACITY_TARGET
        verdict = "met" if gap >= 0 else f"**missed** by {-gap:.2f}"
        lines.append(f"- capacity target (>= x{CAPACITY_TARGET:g} BF16's tokens in the same budget), {m}: {verdict}")
    return "\n".join(lines)
