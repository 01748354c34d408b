"""Tokens per second at equal KV memory: `python -m hack_cli.bench_decode_model` (issue 33's
model-level decode benchmark).

A decoder with a real model's shapes (Llama-3-8B by default) and random BF16 weights decodes
one token per request per step, every request at the same context (32K by default), with the
largest batch whose KV cache fits the same memory budget (70 GiB by default, less where the GPU
cannot hold it beside the weights) in each format:
  bf16  a contiguous BF16 cache per layer, the new token written in place, torch SDPA (flash)
  hack  HACK pages, FP16 tails and sinks per layer (the serving default format), the new token
        stored by the Triton store, decode attention by the CUDA kernel (or `--hack-kernel triton`)
Per step and layer: RMSNorm, the QKV GEMM, RoPE, the attention above, the output GEMM, RMSNorm,
the SwiGLU MLP (cuBLAS); then the final norm, the LM head and argmax. The step is captured in a
CUDA graph (as a serving engine decodes) and replayed; the caches are filled with random codes
and values (the work does not depend on them). A benchmark harness, not a second engine: its
outputs mean nothing, its time is the time of the work a decode step does.
BF16 attends over the whole preallocated context each step (SDPA's shape is fixed in a graph:
at most `--steps` keys more than the true context, <0.1% at 32K); HACK's kernels read the live
lengths. The JSON (`--out`) holds the batch, tokens/s and step time of each format and their
ratio against the target (HACK >= 3x BF16).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    def weight_bytes(self) -> int:
        h, d = self.hidden, self.head_dim
        per_layer = h * (self.q_heads + 2 * self.kv_heads) * d + self.q_heads * d * h + 3 * h * self.intermediate + 2 * h
        return 2 * (2 * self.vocab * h + self.layers * per_layer + h)


SHAPES = {
    "llama3-8b": ModelShape("llama3-8b", 128256, 4096, 32, 32, 8, 128, 14336),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 152064, 3584, 28, 28, 4, 128, 18944, rope_theta=1e6, eps=1e-6),
    # for the CPU test of the harness
    "tiny": ModelShape("tiny", 512, 256, 2, 4, 2, 64, 512),
}


def bf16_bytes_per_request(shape: ModelShape, tokens: int) -> int:
    return shape.layers * 2 * tokens * shape.kv_heads * shape.head_dim * 2


def hack_bytes_per_request(shape: ModelShape, tokens: int) -> int:
    """Pages for `tokens`, the FP16 tails (K and V, one row) and sinks, every layer."""
    from hack_ops import HackConfig
    from hack_ops.layout import page_layout

    lay = page_layout(HackConfig(), shape.kv_heads, shape.head_dim)
    row = lay.page_size * shape.kv_heads * shape.head_dim * 2
    sinks = 2 * max(1, lay.config.sink_tokens) * shape.kv_heads * shape.head_dim * 2
    return shape.layers * (-(-tokens // lay.page_size) * lay.page_bytes + 2 * row + sinks)


def largest_batch(budget: int, per_request: int) -> int:
    return max(0, budget // per_request)


class Weights:
    def __init__(self, shape: ModelShape, device: torch.device, gen: torch.Generator) -> None:
        s, dt = shape, torch.bfloat16

        def w(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dt)

        h, d = s.hidden, s.head_dim
        self.embed = w(s.vocab, h)
        self.lm_head = w(h, s.vocab)
        self.norm = torch.ones(h, device=device, dtype=dt)
        self.layers = [dict(qkv=w(h, (s.q_heads + 2 * s.kv_heads) * d), o=w(s.q_heads * d, h), gate_up=w(h, 2 * s.intermediate),
                            down=w(s.intermediate, h), n1=torch.ones(h, device=device, dtype=dt),
                            n2=torch.ones(h, device=device, dtype=dt)) for _ in range(s.layers)]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, D]; cos/sin [B, D/2] (rotate-half convention)."""
    x1, x2 = x.float().chunk(2, -1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)


class Bf16Cache:
    """Contiguous BF16 K and V per layer, [B, H, max_tokens, D]."""

    def __init__(self, shape: ModelShape, batch: int, max_tokens: int, device: torch.device) -> None:
        dims = (batch, shape.kv_heads, max_tokens, shape.head_dim)
        self.k = [torch.empty(dims, dtype=torch.bfloat16, device=device).normal_() for _ in range(shape.layers)]
        self.v = [torch.empty(dims, dtype=torch.bfloat16, device=device).normal_() for _ in range(shape.layers)]

    def attend(self, layer: int, pos: torch.Tensor, q, k, v, scale: float) -> torch.Tensor:
        self.k[layer].index_copy_(2, pos, k[:, :, None])
        self.v[layer].index_copy_(2, pos, v[:, :, None])
        b, hq, d = q.shape
        if q.device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q[:, :, None], self.k[layer], self.v[layer], scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q[:, :, None], self.k[layer], self.v[layer], scale=scale, enable_gqa=True)
        return o.reshape(b, hq, d)


class HackCache:
    """HACK pages, FP16 tails and sinks per layer (hack_ops.triton.store.new_buffers), filled with
    random codes and finite side tables; one plan for every layer, advanced on the device."""

    def __init__(self, shape: ModelShape, batch: int, context: int, max_tokens: int, device: torch.device,
                 kernel: str, gen: torch.Generator) -> None:
        from hack_ops import HackConfig
        from hack_ops.layout import page_layout
        from hack_ops.triton.store import new_buffers

        self.layout = lay = page_layout(HackConfig(), shape.kv_heads, shape.head_dim)
        per = -(-max_tokens // lay.page_size)
        self.bufs = []
        for _ in range(shape.layers):
            b = new_buffers(lay, batch * per, batch, batch, device=device)
            for name, t in b.items():
                if t is None:
                    continue
                if t.dtype == torch.uint8:
                    t.random_(0, 256, generator=gen)
                else:
                    t.normal_(generator=gen)
            for tl_, buf in ((lay.k, b["k_buf"]), (lay.v, b["v_buf"])):
                tl_.view(buf, "minimum").uniform_(-1.0, 0.0, generator=gen)
                tl_.view(buf, "scale").uniform_(0.01, 0.1, generator=gen)
            self.bufs.append(b)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        indptr = torch.arange(0, batch * per + 1, per, dtype=torch.int32, device=device)
        indices = torch.randperm(batch * per, generator=gen, device=device).to(torch.int32)
        lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)  # the step's new token included
        if kernel == "cuda":
            from hack_ops.cuda import CudaDecodeAttention

            self.att = CudaDecodeAttention(lay, shape.q_heads)
        else:
            from hack_ops.triton.decode import HackDecodeAttention

            self.att = HackDecodeAttention(lay, shape.q_heads)
        self.att.plan(indptr, indices, lens, rows, rows)

    def attend(self, layer: int, pos: torch.Tensor, q, k, v, scale: float) -> torch.Tensor:
        from hack_ops.triton.store import cache_kwargs, store

        cache = cache_kwargs(self.bufs[layer])
        store(self.layout, self.att.batch, k, v, **cache, phase="all")
        self.att.sm_scale = scale
        return self.att.run(q, **cache)

    def advance(self) -> None:
        """One token more per request, on the device (inside the captured step)."""
        self.att.batch.seq_lens.add_(1)
        self.att.batch.prefix_lens.add_(1)


def decode_step(shape: ModelShape, w: Weights, cache, tokens: torch.Tensor, pos: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:
    """One decode step for every request; returns the next tokens (argmax) in `tokens`' place."""
    s = shape
    b = tokens.shape[0]
    scale = 1.0 / math.sqrt(s.head_dim)
    ang = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().expand(b, -1), ang.sin().expand(b, -1)
    x = w.embed[tokens]
    for i, lw in enumerate(w.layers):
        h = rms_norm(x, lw["n1"], s.eps)
        qkv = h @ lw["qkv"]
        q, k, v = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        q = rope(q.reshape(b, s.q_heads, s.head_dim), cos, sin)
        k = rope(k.reshape(b, s.kv_heads, s.head_dim), cos, sin)
        v = v.reshape(b, s.kv_heads, s.head_dim)
        o = cache.attend(i, pos, q.contiguous(), k.contiguous(), v.contiguous(), scale)
        x = x + o.reshape(b, -1).to(x.dtype) @ lw["o"]
        h = rms_norm(x, lw["n2"], s.eps)
        gate, up = (h @ lw["gate_up"]).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ lw["down"]
    logits = rms_norm(x, w.norm, s.eps) @ w.lm_head
    return logits.argmax(-1)


def measure(fmt: str, shape: ModelShape, w: Weights, batch: int, context: int, steps: int, device: torch.device,
            kernel: str, gen: torch.Generator) -> dict:
    """Tokens/s of `steps` decode steps (after one warm-up), captured in a CUDA graph on a GPU."""
    max_tokens = context + steps + 2
    cache = (Bf16Cache(shape, batch, max_tokens, device) if fmt == "bf16"
             else HackCache(shape, batch, context, max_tokens, device, kernel, gen))
    tokens = torch.randint(0, shape.vocab, (batch,), generator=gen, device=device)
    pos = torch.full((1,), context, dtype=torch.long, device=device)
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, device=device).float() / shape.head_dim))

    def step() -> None:
        tokens.copy_(decode_step(shape, w, cache, tokens, pos, inv_freq))
        pos.add_(1)
        if fmt == "hack":
            cache.advance()

    if device.type != "cuda":
        step()
        return {"format": fmt, "batch": batch, "steps": 1}
    step()  # warm-up: builds, autotunes, allocates outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / steps
    del graph, cache
    torch.cuda.empty_cache()
    return {"format": fmt, "batch": batch, "steps": steps, "step_ms": round(ms, 3),
            "tokens_per_s": round(batch * 1000.0 / ms, 1)}


def plan(shape: ModelShape, context: int, steps: int, kv_budget: int) -> dict[str, int]:
    """The largest batch of each format whose KV fits `kv_budget` bytes."""
    tokens = context + steps + 2
    return {"bf16": largest_batch(kv_budget, bf16_bytes_per_request(shape, tokens)),
            "hack": largest_batch(kv_budget, hack_bytes_per_request(shape, tokens))}


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    if args.layers:
        shape = ModelShape(**{**asdict(shape), "layers": args.layers})
    gen = torch.Generator(device=device).manual_seed(0)
    budget = int(args.kv_gib * GIB)
    note = None
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        room = free - shape.weight_bytes() - int(args.headroom_gib * GIB)
        if room < budget:
            note = (f"KV budget {args.kv_gib:.0f} GiB does not fit beside {shape.weight_bytes() / GIB:.1f} GiB of weights "
                    f"on this GPU: {room / GIB:.1f} GiB used for both formats")
            budget = room
    batches = plan(shape, args.context, args.steps, budget)
    if args.batch:
        batches = {k: min(v, args.batch) for k, v in batches.items()}
    w = Weights(shape, device, gen)
    doc = {"shape": asdict(shape), "context": args.context, "kv_budget_gib": round(budget / GIB, 2), "note": note,
           "hack_kernel": args.hack_kernel, "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "command": args.command_line, "results": []}
    for fmt in args.formats.split(","):
        if batches[fmt] < 1:
            doc["results"].append({"format": fmt, "batch": 0, "skipped": "no request fits the budget"})
            continue
        doc["results"].append(measure(fmt, shape, w, batches[fmt], args.context, args.steps, device, args.hack_kernel, gen))
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["results"][-1]), flush=True)
    by = {r["format"]: r for r in doc["results"]}
    if "tokens_per_s" in by.get("bf16", {}) and "tokens_per_s" in by.get("hack", {}):
        ratio = by["hack"]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
        doc["hack_vs_bf16"] = round(ratio, 2)
        doc["target_3x"] = "met" if ratio >= 3.0 else "missed"
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack_cli.bench_decode_model", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (0: all)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kv-gib", type=float, default=70.0, help="KV memory both formats get")
    ap.add_argument("--headroom-gib", type=float, default=6.0, help="memory left for activations and the graph")
    ap.add_argument("--batch", type=int, default=0, help="cap on the batch (0: the largest that fits)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--formats", default="bf16,hack")
    ap.add_argument("--hack-kernel", default="cuda", choices=("cuda", "triton"))
    ap.add_argument("--out", default="decode-model.json")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.command_line = " ".join(["python -m hack_cli.bench_decode_model", *argv])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_decode_model needs a CUDA GPU, and torch sees none here (--device cpu runs the harness on a "
              "tiny shape, for tests)", file=sys.stderr)
        return 2
    doc = run(args)
    print(json.dumps({k: v for k, v in doc.items() if k != "results"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
