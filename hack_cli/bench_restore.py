"""`hack bench restore-sources`: three ways to bring an evicted context's KV back into a HACK
pool, measured side by side on one real document (issue 36's "measure it, do not assume it"):

  recompute  the model's forward over the context, then the HACK store of every layer
  hidden     HCache (seed 002): every layer's input hidden states read back (BF16, as stored),
             K/V rebuilt by the layer's own norm, projections and RoPE
             (hack_eval.hidden_restore), then the HACK store
  pages      the HACK pages themselves read back (codes, side tables, code sums, the open
             page's FP16 tail and the sinks), their digest checked, copied into the pool

Per source: bytes stored per token, milliseconds per restore (best of --runs) split into read,
compute and store, and whether the restored pages equal recompute's byte for byte. BF16 KV's
bytes are listed beside them (what a BF16 tier would store). Files are read from the page cache
(warm): the times are the CPU's; the bytes say what a disk or link adds at any bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engine.prefill_choice import cpu_has_amx_bf16
from hack_ops.paged import offload

from .bench_doc import cpu_name, publish

DEFAULT_OUT = "docs/bench/restore-sources-{model}.json"


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("restore-sources", help="bring an evicted context back: recompute vs HCache's hidden-state "
                                                "restore vs reloading HACK pages (bytes and time per token)")
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (prepared once)")
    p.add_argument("--tokens", default="2048,8192", help="context lengths, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="timing runs per source (best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="write the JSON result here ('' = none; default docs/bench/restore-sources-MODEL.json)")
    p.add_argument("--doc", action="store_true",
                   help="also put the table in docs/engine.md (block bench-restore-MODEL)")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    return run_cli(argparse.Namespace(model="smollm2", tokens="2048,8192", runs=3, threads=0, out=DEFAULT_OUT,
                                      doc=False))


def _document_ids(tok, n: int) -> list[int]:
    from hack_eval.texts import essay_files

    ids: list[int] = []
    for f in essay_files():
        ids += tok(f.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the essays hold {len(ids)} tokens, fewer than --tokens {n}")


class Pool:
    """A HACK store sized for one request of n tokens, its page table and the plan that writes it."""

    def __init__(self, cfg, layers: int, heads: int, dim: int, n: int) -> None:
        from hack_ops.paged import HackKVStore

        p = cfg.partition_size
        self.pages = -(-n // p)
        self.store = HackKVStore(cfg, layers, heads, dim, num_pages=self.pages + 1, num_rows=1)
        # pages 1..: in reverse, so no reader can assume contiguity
        order = torch.arange(self.pages, 0, -1, dtype=torch.int32)
        self.table = (order[:, None] * p + torch.arange(p, dtype=torch.int32)[None]).flatten()[None]
        self.n = n

    def plan(self):
        return self.store.plan(self.table, [0], [self.n], [self.n])

    @property
    def slots(self) -> torch.Tensor:
        return self.table[0, :self.n]

    def request_bytes(self) -> bytes:
        """Every byte of the request's state (hack_ops.paged.offload: pages, open tail rows,
        sinks): what a page tier keeps."""
        return offload.save(self.store, self.slots, 0).to_bytes()

    def load(self, data: bytes | np.ndarray) -> None:
        """Put `request_bytes`' bytes back into the store (ValueError on a wrong byte count)."""
        offload.load(self.store, offload.RequestCopy.from_bytes(self.store, self.n, data), self.slots, 0)


def page_digest(data: bytes | np.ndarray) -> str:
    """What a page tier keeps beside the bytes, to refuse any that changed."""
    return hashlib.blake2b(data if isinstance(data, bytes) else data.tobytes(), digest_size=32).hexdigest()


def check_digest(raw: np.ndarray, digest: str) -> None:
    """RuntimeError when stored pages are not the bytes that were written (a truncated or damaged
    file): a restore refuses them, and the server recomputes the context instead."""
    if page_digest(raw) != digest:
        raise RuntimeError(f"the stored pages ({raw.size:,} bytes) do not match their digest: refused")


def _best(fn, runs: int) -> tuple[float, object]:
    """The fastest of `runs` calls and that call's result (its own split of the time)."""
    best, out = float("inf"), None
    for _ in range(runs):
        t0 = time.perf_counter()
        res = fn()
        took = time.perf_counter() - t0
        if took < best:
            best, out = took, res
    return best, out


def _same_pages(a: Pool, b: Pool) -> bool:
    return a.request_bytes() == b.request_bytes()


@torch.inference_mode()
def measure(model_name: str, n: int, runs: int, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hack_eval.hidden_restore import capture_layer_inputs, decoder_layers, restore_layer_kv
    from hack_eval.models import prepare
    from hack_ops import HackConfig
    from hack_ops.bit_plan import find_plan

    folder = prepare(model_name, log=lambda m: print(m, file=sys.stderr))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor(_document_ids(tok, n))
    layers = decoder_layers(model)
    attn = layers[0].self_attn
    heads, dim = attn.k_proj.out_features // attn.head_dim, attn.head_dim
    found = find_plan(folder)
    cfg = found[0].apply(HackConfig()) if found else HackConfig()
    positions = torch.arange(n)

    # recompute: the forward pass, then every layer stored
    def recompute() -> tuple[Pool, list, float]:
        t0 = time.perf_counter()
        hidden, cache = capture_layer_inputs(model, ids)
        fwd = time.perf_counter() - t0
        pool = Pool(cfg, len(layers), heads, dim, n)
        plan = pool.plan()
        for i in range(len(layers)):
            lay = cache.layers[i]
            pool.store.write(i, plan, lay.keys[0].transpose(0, 1).contiguous(), lay.values[0].transpose(0, 1).contiguous())
        return pool, hidden, fwd

    t_recompute, (ref, hidden, fwd_s) = _best(recompute, runs)

    # what each tier stores, written once
    hid_file, page_file = workdir / "hidden.bin", workdir / "pages.bin"
    with hid_file.open("wb") as f:
        for h in hidden:
            f.write(h.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    page_bytes = ref.request_bytes()
    page_file.write_bytes(page_bytes)
    digest = page_digest(page_bytes)
    hidden_size = hidden[0].shape[1]

    def from_hidden() -> tuple[Pool, dict]:
        parts = {}
        t0 = time.perf_counter()
        raw = np.fromfile(hid_file, dtype=np.uint8)
        parts["read_s"] = time.perf_counter() - t0
        per = n * hidden_size * 2
        pool = Pool(cfg, len(layers), heads, dim, n)
        plan = pool.plan()
        comp = store = 0.0
        for i in range(len(layers)):
            t1 = time.perf_counter()
            h = torch.from_numpy(raw[i * per:(i + 1) * per]).view(torch.bfloat16).view(n, hidden_size)
            k, v = restore_layer_kv(model, i, h, positions)
            t2 = time.perf_counter()
            pool.store.write(i, plan, k, v)
            comp += t2 - t1
            store += time.perf_counter() - t2
        parts.update(project_s=comp, store_s=store)
        return pool, parts

    def from_pages() -> tuple[Pool, dict]:
        parts = {}
        t0 = time.perf_counter()
        raw = np.fromfile(page_file, dtype=np.uint8)
        t1 = time.perf_counter()
        check_digest(raw, digest)
        t2 = time.perf_counter()
        pool = Pool(cfg, len(layers), heads, dim, n)
        pool.load(raw)
        parts.update(read_s=t1 - t0, digest_s=t2 - t1, copy_s=time.perf_counter() - t2)
        return pool, parts

    t_hidden, (hid_pool, hid_parts) = _best(from_hidden, runs)
    t_pages, (page_pool, page_parts) = _best(from_pages, runs)
    bf16_per_token = len(layers) * 2 * heads * dim * 2
    sources = {
        "recompute": {"bytes_per_token": 0, "ms": t_recompute * 1e3, "forward_ms": fwd_s * 1e3, "pages_equal": True},
        "hidden": {"bytes_per_token": hidden_bytes(len(layers), hidden_size), "ms": t_hidden * 1e3,
                   **{k.replace("_s", "_ms"): v * 1e3 for k, v in hid_parts.items()},
                   "pages_equal": _same_pages(hid_pool, ref)},
        "pages": {"bytes_per_token": len(page_bytes) / n, "ms": t_pages * 1e3,
                  **{k.replace("_s", "_ms"): v * 1e3 for k, v in page_parts.items()},
                  "pages_equal": _same_pages(page_pool, ref)},
    }
    for s in sources.values():
        s["us_per_token"] = s["ms"] * 1e3 / n
        s["vs_recompute"] = t_recompute * 1e3 / s["ms"]
    return {"model": model_name, "tokens": n, "layers": len(layers), "kv_heads": heads, "head_dim": dim,
            "hidden_size": hidden_size, "format": cfg.label(), "bit_plan": found is not None,
            "bf16_kv_bytes_per_token": bf16_per_token, "sources": sources}


def hidden_bytes(layers: int, hidden_size: int) -> int:
    """BF16 hidden states per token, every layer (what HCache stores)."""
    return layers * hidden_size * 2


def table(doc: dict) -> str:
    lines = [f"`{doc['command']}` ({doc['date']}; {doc['cpu']}, AMX {'yes' if doc['amx'] else 'no'}, "
             f"{doc['threads']} threads; files read warm from the page cache; best of {doc['runs']})", "",
             "| model | tokens | source | bytes/token | vs BF16 KV bytes | ms | us/token | vs recompute | pages equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        for name, s in r["sources"].items():
            share = f"{100 * s['bytes_per_token'] / r['bf16_kv_bytes_per_token']:.1f}%" if s["bytes_per_token"] else "-"
            lines.append(f"| {r['model']} | {r['tokens']} | {name} | {s['bytes_per_token']:,.0f} | {share} | {s['ms']:.1f} "
                         f"| {s['us_per_token']:.1f} | x{s['vs_recompute']:.2f} | {'yes' if s['pages_equal'] else 'NO'} |")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        tokens = [int(x) for x in str(args.tokens).split(",") if x.strip()]
    except ValueError:
        print(f"hack bench restore-sources: --tokens must be comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    if not tokens or min(tokens) < 64 or args.runs < 1:
        print("hack bench restore-sources: --tokens must be >= 64 each and --runs >= 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="hack-restore-") as tmp:
        for n in tokens:
            r = measure(args.model, n, args.runs, Path(tmp))
            results.append(r)
            for name, s in r["sources"].items():
                print(f"{args.model} {n} tokens, {name}: {s['bytes_per_token']:,.0f} B/token, {s['ms']:.1f} ms "
                      f"(x{s['vs_recompute']:.2f} recompute's speed), pages equal: {s['pages_equal']}", flush=True)
    doc = {"command": f"hack bench restore-sources --model {args.model} --tokens {args.tokens} --runs {args.runs}"
                      + (f" --threads {args.threads}" if args.threads else ""),
           "date": datetime.date.today().isoformat(), "cpu": cpu_name(), "amx": cpu_has_amx_bf16(),
           "threads": torch.get_num_threads(), "runs": args.runs, "results": results}
    print(table(doc))
    publish(doc, table(doc), args.out, args.model, f"restore-{args.model}", getattr(args, "doc", False),
            heading="## Bringing an evicted context back")
    bad = [(r["tokens"], k) for r in results for k, s in r["sources"].items() if not s["pages_equal"]]
    if bad:
        print(f"hack bench restore-sources: restored pages differ from recompute's at {bad}", file=sys.stderr)
        return 1
    return 0
