"""`hack bench hack-wire`: the bytes of one HACK request on the wire with and without the
`hack-pages` transform, on real pages, and its cost on one core.

Real KV of the model (transformers, BF16 weights) for one long-document prompt of N tokens is
written into a HACK store by the store itself (the compiled page store, as the server does).
Then, per request:
  - bytes: every page as stored (hack-full-pages) vs the transform (no open page; the pages as
    one run whose last page leaves its K code sums home), plus the FP16 tail and sinks both send;
    the ratio to the same request's BF16;
  - what the SplitZip FP16 codec would save on the parts still 16-bit: the min/scale tables of
    every page, the FP16 tail and the sinks (coded size / raw, the model's codebook) - the
    measurement that decides whether they are coded;
  - time on one thread: the prefill side's block list (nothing is copied) and the decode side's
    rebuild of K's code sums, for the whole request, best of N runs; SplitZip on the tables,
    for comparison.
The end-to-end bytes through the wire meter come from `hack bench disagg --methods
hack-full-pages,hack` (docs/disagg.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from .bench_timing import best_of
from .bench_doc import command_line, publish


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("hack-wire", help="HACK request bytes with/without the hack-pages transform, on real pages, "
                                          "and its encode/decode time on one core")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=7500, help="prompt tokens (a long document of the essays)")
    p.add_argument("--runs", type=int, default=5, help="timing runs (best is reported)")
    p.add_argument("--out", default="docs/bench/hack-wire.json", help="write the JSON result here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/disagg.md")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    return run_cli(argparse.Namespace(model="smollm2", tokens=7500, runs=5, out="docs/bench/hack-wire.json",
                                      no_doc=False))




def _real_kv(folder: Path, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(K, V)] per layer, [n, heads, dim] BF16, for the first n tokens of the essays."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.cpu_dtype import weights_dtype
    from hack_eval.texts import essay_files

    from .codec_kv import _layers

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids: list[int] = []
    for f in essay_files():
        ids += tok(f.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than --tokens {n}")
    # the weights in the dtype a server here runs them in (float32 on a CPU without BF16
    # arithmetic), the KV in BF16 as a server's cache holds it
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=weights_dtype()).eval()
    with torch.no_grad():
        cache = model(torch.tensor([ids[:n]]), use_cache=True).past_key_values
    return [(k[0].transpose(0, 1).to(torch.bfloat16).contiguous(), v[0].transpose(0, 1).to(torch.bfloat16).contiguous())
            for k, v in _layers(cache)]


def measure(model: str, n: int, runs: int) -> dict:
    from disagg.hack_wire import HackWire
    from hack_eval.models import prepare
    from hack_ops import HackConfig, page_wire
    from hack_ops.codec import cpu
    from hack_ops.codec import codebook as cb
    from hack_ops.codec.format import FloatFormat
    from hack_ops.paged import HackKVStore

    torch.set_num_threads(1)
    folder = prepare(model, log=lambda m: print(m, file=sys.stderr))
    kv = _real_kv(Path(folder), n)
    layers, heads, dim = len(kv), kv[0][0].shape[1], kv[0][0].shape[2]
    cfg = HackConfig()
    p = cfg.partition_size
    num_pages = -(-n // p) + 1
    table = torch.arange(p, num_pages * p, dtype=torch.int32)[None]  # pages 1.. in sequence order
    store = HackKVStore(cfg, layers, heads, dim, num_pages=num_pages, num_rows=1)
    _write_all(store, table, kv)
    lay = store.layout
    pages = [int(x) // p for x in table[0, :n:p]]
    sent = pages[: n // p] if page_wire.open_page_unread(cfg) else pages
    fp16_tok = heads * dim * 2
    tail = (n % p) * len(lay.tail_tensors) * layers * fp16_tok
    sinks = 2 * layers * cfg.sink_tokens * fp16_tok
    full = page_wire.request_bytes(lay, layers, n, hack_pages=False)
    wire = page_wire.request_bytes(lay, layers, n)
    bf16 = len(pages) * p * layers * 2 * fp16_tok
    # SplitZip FP16 on what is still 16-bit
    book = cb.for_model(folder).get(FloatFormat.FP16)
    idx = torch.tensor(sent)
    tables = [tl.view(buf, name)[idx] for layer in range(layers)
              for tl, buf in ((lay.k, store.k_pages[layer]), (lay.v, store.v_pages[layer])) for name in ("minimum", "scale")]
    coded = sum(cpu.encode(t[i].contiguous(), book).numel() for t in tables for i in range(len(sent)))
    raw = sum(t.nbytes for t in tables)
    per_page_table_s = best_of(lambda: [cpu.encode(t[i].contiguous(), book) for t in tables for i in range(len(sent))], runs)
    tails = [t[0, : n % p] for name in sorted(store.tails) for t in store.tails[name]]
    tail_coded = sum(cpu.encode(t.contiguous(), book).numel() for t in tails if t.numel())
    sink_t = [t[0] for t in store.sink_k + store.sink_v if t.numel()]
    sink_coded = sum(cpu.encode(t.contiguous(), book).numel() for t in sink_t)
    # time of the transform, one thread
    pool = SimpleNamespace(store=store, page_size=p, k_buffer=store.k_pages, v_buffer=store.v_pages)
    bufs = store.k_pages + store.v_pages
    w = HackWire(pool, [b.data_ptr() for b in bufs], [b[0].nbytes for b in bufs])
    dst_ptrs = [b.data_ptr() for b in bufs]
    send_s = best_of(lambda: w.blocks(sent, dst_ptrs, sent), runs)
    before = [b.clone() for b in store.k_pages]
    for b in store.k_pages:
        lay.k.view(b, "sums")[idx] = 0
    rebuild_s = best_of(lambda: w.rebuild(sent), runs)
    if not all(torch.equal(a, b) for a, b in zip(before, store.k_pages)):
        raise RuntimeError("the rebuilt K pages differ from the stored ones")
    return {"model": model, "tokens": n, "layers": layers, "kv_heads": heads, "head_dim": dim,
            "page_bytes": lay.page_bytes, "wire_page_bytes": page_wire.wire_page_bytes(lay),
            "pages": len(pages), "pages_sent": len(sent), "tail_bytes": tail, "sink_bytes": sinks,
            "bytes_full_pages": full, "bytes_hack_pages": wire, "bytes_bf16": bf16,
            "splitzip_fp16": {"codebook": book.exponents, "tables_raw": raw, "tables_coded": coded,
                              "tables_encode_s": per_page_table_s,
                              "tail_raw": sum(t.nbytes for t in tails), "tail_coded": tail_coded,
                              "sinks_raw": sum(t.nbytes for t in sink_t), "sinks_coded": sink_coded},
            "send_blocks_s": send_s, "rebuild_s": rebuild_s, "threads": torch.get_num_threads()}


def _write_all(store, table: torch.Tensor, kv: list) -> None:
    """Store every layer's K and V of one request (the store's own write path, in one chunk)."""
    n = kv[0][0].shape[0]
    plan = store.plan(table, [0], [n], [n])
    for layer, (k, v) in enumerate(kv):
        store.write(layer, plan, k.float(), v.float())


def render(r: dict, command: str) -> str:
    sz = r["splitzip_fp16"]
    saved = (sz["tables_raw"] - sz["tables_coded"]) + (sz["tail_raw"] - sz["tail_coded"]) + \
        (sz["sinks_raw"] - sz["sinks_coded"])
    return "\n".join([
        f"Command: `{command}`  ",
        f"Measured: {r['date']} on this project's CPU host (one thread; 2 cores shared with other work).", "",
        f"One {r['tokens']}-token request of {r['model']} ({r['pages']} pages, {r['layers']} layers), real KV "
        "written by the store:", "",
        "| what travels | bytes/request | vs full pages | vs BF16 |", "|---|---|---|---|",
        f"| every page as stored (`hack-full-pages`) | {r['bytes_full_pages'] / 1e6:.2f} MB | 100.00% | "
        f"{100 * r['bytes_full_pages'] / r['bytes_bf16']:.2f}% |",
        f"| `hack-pages` (no open page, one run without its last page's K sums) | {r['bytes_hack_pages'] / 1e6:.2f} MB | "
        f"{100 * r['bytes_hack_pages'] / r['bytes_full_pages']:.2f}% | {100 * r['bytes_hack_pages'] / r['bytes_bf16']:.2f}% |",
        "",
        f"- SplitZip FP16 on the min/scale tables of the sent pages: {100 * sz['tables_coded'] / sz['tables_raw']:.2f}% "
        f"of {sz['tables_raw'] / 1e6:.2f} MB (one stream per table and page, {sz['tables_encode_s'] * 1e3:.0f} ms to "
        f"encode); on the FP16 tail {100 * sz['tail_coded'] / max(1, sz['tail_raw']):.2f}% of "
        f"{sz['tail_raw'] / 1e6:.2f} MB; on the sinks {100 * sz['sinks_coded'] / max(1, sz['sinks_raw']):.2f}% of "
        f"{sz['sinks_raw'] / 1e3:.1f} KB: {saved / 1e6:.3f} MB in all "
        f"({100 * saved / r['bytes_hack_pages']:.2f}% of the request)",
        f"- transform time per request, one thread: prefill block list {r['send_blocks_s'] * 1e3:.2f} ms "
        f"(no copy), decode rebuild of K's code sums {r['rebuild_s'] * 1e3:.2f} ms",
    ])


def run_cli(args: argparse.Namespace) -> int:
    if args.tokens < 64 or args.runs < 1:
        raise ValueError("--tokens must be >= 64 and --runs >= 1")
    res = measure(args.model, args.tokens, args.runs)
    res["date"] = time.strftime("%Y-%m-%d")
    command = command_line("hack-wire")
    res["command"] = command
    body = render(res, command)
    publish(res, body, args.out, args.model, "hack-wire", not args.no_doc, page="disagg.md")
    print(body)
    return 0
