"""Benchmark cases for `hack bench attention --device cuda`: the same context as HACK pages
(filled by the Triton store), as a BF16 cache for the baseline, and dequantized on the fly.

Methods per case, each a callable that runs one layer's attention:
  hack     the Triton kernels on the HACK pages (decode: HackDecodeAttention; prefill:
           HackPrefillAttention.run, which stores the prompt's pages and tails too)
  bf16     the BF16 baseline (`Baseline`): FlashInfer's paged kernels when flashinfer imports,
           else torch SDPA with the flash backend on a contiguous cache (no page gather, so a
           stronger-than-paged baseline); on CPU tensors (tests) plain SDPA
  dequant  the HACK pages dequantized to a BF16 copy with PyTorch ops, then the same SDPA
           (decode); prefill: the store, then SDPA on the prompt's own BF16 K/V
Nothing here needs a GPU except speed: on CPU tensors the kernels run in Triton's interpreter.
"""
from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import HackConfig
from ..layout import PageLayout, page_layout
from .batch import plan_batch
from .decode import HackDecodeAttention
from .prefill import HackPrefillAttention
from .store import cache_kwargs, new_buffers, store

FILL_CHUNK = 8192  # tokens per store launch while filling (bounds the FP16 staging copy)
FLASHINFER_PAGE = 16  # tokens per page of the FlashInfer BF16 cache (a common serving choice)
FLASHINFER_WORKSPACE = 256 << 20


class Baseline(str, Enum):
    FLASHINFER = "flashinfer-paged"  # FlashInfer BatchDecode/BatchPrefill over a paged BF16 cache
    SDPA_FLASH = "sdpa-flash"  # torch SDPA, flash-attention backend, contiguous BF16 cache
    SDPA = "sdpa"  # torch SDPA, any backend (CPU tensors: tests only)


@dataclass(frozen=True)
class AttnShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


def flashinfer_importable() -> bool:
    if importlib.util.find_spec("flashinfer") is None:
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # a broken install (missing CUDA libraries, ABI) counts as absent
        return False
    return True


def choose_baseline(device: torch.device, flashinfer_available: bool) -> Baseline:
    """FlashInfer where it imports on a GPU, else SDPA's flash backend; SDPA on CPU tensors."""
    if device.type != "cuda":
        return Baseline.SDPA
    return Baseline.FLASHINFER if flashinfer_available else Baseline.SDPA_FLASH


# ---- bytes each method must move through memory (the bandwidth numerator) -------------------

def hack_decode_bytes(layout: PageLayout, seq_lens: list[int], q_heads: int, act_bytes: int = 2) -> int:
    """What the decode kernel reads: the closed pages (codes and side tables of K and V), the
    open partition from the FP16 tails (V's page codes instead when V has no tail), the FP16
    sinks, and the queries."""
    cfg = layout.config
    p, h, d = layout.page_size, layout.num_heads, layout.head_dim
    token16 = h * d * 2  # one token of one tensor in FP16
    total = 0
    for n in seq_lens:
        closed, open_ = divmod(n, p)
        total += closed * (layout.k.page_bytes + layout.v.page_bytes)
        if open_:
            total += open_ * token16 * (2 if cfg.v_tail else 1)
            if not cfg.v_tail:
                total += layout.v.page_bytes
        total += 2 * min(cfg.sink_tokens, n) * token16
        total += q_heads * d * act_bytes
    return total


def bf16_decode_bytes(seq_lens: list[int], kv_heads: int, q_heads: int, head_dim: int) -> int:
    """K and V in BF16 for every cached token, plus the queries."""
    return sum(2 * n * kv_heads * head_dim * 2 + q_heads * head_dim * 2 for n in seq_lens)


def dequant_decode_bytes(layout: PageLayout, seq_lens: list[int], q_heads: int) -> int:
    """The pages read once to dequantize, the BF16 copy written, then read by the attention."""
    kv16 = bf16_decode_bytes(seq_lens, layout.num_heads, 0, layout.head_dim)
    return hack_decode_bytes(layout, seq_lens, q_heads) + 2 * kv16


def prefill_bytes(n: int, shape: AttnShape) -> int:
    """The prompt's Q, K, V read and the output written, in BF16: the least any method moves."""
    return 2 * n * shape.head_dim * (2 * shape.q_heads + 2 * shape.kv_heads)


def prefill_flops(n: int, shape: AttnShape) -> float:
    """Causal attention: two matrix products over the lower triangle (n(n+1)/2 pairs)."""
    return 4.0 * shape.q_heads * shape.head_dim * n * (n + 1) / 2


# ---- timing -------------------------------------------------------------------------------------

class Timer:
    """Milliseconds of one call: CUDA events on a GPU (the device time of the kernels it
    launches), the wall clock on CPU tensors."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def median_ms(methods: dict[str, Callable[[], object]], repeats: int, warmup: int, timer: Timer,
              flush: Callable[[], object] | None = None) -> dict[str, float]:
    """Median time per method. Warm-up calls first (compilation, autotuning, allocator); then
    the methods take turns in every round, each after `flush` (evicts the L2 cache, so small
    contexts are not served from it), which is not timed."""
    if repeats <= 0 or warmup < 0:
        raise ValueError("repeats must be positive and warmup non-negative")
    for _ in range(warmup):
        for fn in methods.values():
            fn()
    timer.sync()
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m, fn in methods.items():
            if flush is not None:
                flush()
            times[m].append(timer(fn))
    return {m: statistics.median(t) for m, t in times.items()}


def l2_flush(device: torch.device, nbytes: int = 256 << 20) -> Callable[[], object] | None:
    """A callable that overwrites `nbytes` (more than any GPU's L2) on a GPU; None on CPU."""
    if device.type != "cuda":
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return lambda: buf.zero_()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting the bytes read and
    written (2 x nbytes per copy): the ceiling the kernels' bandwidth is compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms({"copy": lambda: dst.copy_(src)}, repeats, 2, Timer(device))["copy"]
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


# ---- data ---------------------------------------------------------------------------------------

def _kv(n: int, h: int, d: int, g: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    """K with uneven channel ranges (as real keys have) and V, in fp16 on `device`."""
    chan = 1.0 + (torch.arange(d, device=device) % 7).float()
    k = (torch.randn(n, h, d, generator=g, device=device) * chan).half()
    v = torch.randn(n, h, d, generator=g, device=device).half()
    return k, v


def _unpack(packed: Tensor, bits: int) -> Tensor:
    """hack_ops.packing.unpack on any device (codes little-endian within a byte), uint8 out."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def dequantize_pages(layout: PageLayout, k_buf: Tensor, v_buf: Tensor, table: Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """Whole pages -> dense K and V [B, H, n_pages * Π, D] in `dtype`; table [B, n_pages] holds
    each request's page ids in sequence order. PyTorch ops (gather, unpack, scale, add min)."""
    p, h, d = layout.page_size, layout.num_heads, layout.head_dim
    gd = layout.config.head_group(d)
    b, npg = table.shape
    out = []
    for tl_, buf in ((layout.k, k_buf), (layout.v, v_buf)):
        codes = _unpack(tl_.view(buf, "codes")[table], tl_.bits)[..., :d].to(dtype)  # [B, npg, H, Π, D], own bits
        sc = tl_.view(buf, "scale")[table].to(dtype)
        mn = tl_.view(buf, "minimum")[table].to(dtype)
        if tl_.per_channel:  # [B, npg, H, D]
            x = codes * sc[:, :, :, None, :] + mn[:, :, :, None, :]
        else:  # [B, npg, H, Π*ng]: per token and head_dim group
            ng = d // gd
            x = (codes.reshape(b, npg, h, p, ng, gd) * sc.reshape(b, npg, h, p, ng, 1)
                 + mn.reshape(b, npg, h, p, ng, 1)).reshape(b, npg, h, p, d)
        out.append(x.permute(0, 2, 1, 3, 4).reshape(b, h, npg * p, d))
    return out[0], out[1]


def _sdpa(baseline: Baseline, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """q [B, Hq, Sq, D], k/v [B, H, L, D] (GQA by enable_gqa, no repeated copy)."""
    gqa = q.shape[1] != k.shape[1]
    if baseline is Baseline.SDPA_FLASH:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class _FlashInferCache:
    """A paged BF16 cache [pages, 2, FLASHINFER_PAGE, H, D] (NHD) with scattered pages, and the
    CSR page table FlashInfer's wrappers take."""

    def __init__(self, k: Tensor, v: Tensor, g: torch.Generator) -> None:
        b, h, n, d = k.shape  # contiguous [B, H, L, D]
        ps = FLASHINFER_PAGE
        per = -(-n // ps)
        dev = k.device
        self.pages = torch.zeros(b * per, 2, ps, h, d, dtype=torch.bfloat16, device=dev)
        order = torch.randperm(b * per, generator=g, device=dev).to(torch.int32)
        table = order.reshape(b, per)
        for i in range(b):
            for j, t in enumerate((k, v)):
                x = torch.zeros(per * ps, h, d, dtype=torch.bfloat16, device=dev)
                x[:n] = t[i].transpose(0, 1)
                self.pages[table[i].long(), j] = x.reshape(per, ps, h, d)
        self.indptr = torch.arange(0, b * per + 1, per, dtype=torch.int32, device=dev)
        self.indices = table.reshape(-1).contiguous()
        self.last_len = torch.full((b,), n - (per - 1) * ps, dtype=torch.int32, device=dev)
        self.workspace = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=dev)


class DecodeCase:
    """`batch` requests of `context` tokens each; one query token per request."""

    def __init__(self, shape: AttnShape, batch: int, context: int, baseline: Baseline, device: torch.device,
                 config: HackConfig | None = None, seed: int = 0) -> None:
        cfg = config or HackConfig()
        self.layout = lay = page_layout(cfg, shape.kv_heads, shape.head_dim)
        self.shape, self.baseline, self.device = shape, baseline, device
        self.seq_lens = [context] * batch
        p, h, d = lay.page_size, shape.kv_heads, shape.head_dim
        per = -(-context // p)
        g = torch.Generator(device=device).manual_seed(seed)
        self.bufs = new_buffers(lay, batch * per, batch, batch, device=device)
        self.table = torch.randperm(batch * per, generator=g, device=device).reshape(batch, per)  # scattered pages
        self.k16 = torch.empty(batch, h, context, d, dtype=torch.bfloat16, device=device)
        self.v16 = torch.empty_like(self.k16)
        cache = cache_kwargs(self.bufs)
        for b in range(batch):  # one request at a time, in chunks: bounded staging memory
            pages = self.table[b].to(torch.int32)
            for lo in range(0, context, FILL_CHUNK):
                hi = min(context, lo + FILL_CHUNK)
                k, v = _kv(hi - lo, h, d, g, device)
                self.k16[b, :, lo:hi] = k.transpose(0, 1)
                self.v16[b, :, lo:hi] = v.transpose(0, 1)
                step = plan_batch(torch.tensor([0, per], device=device), pages, torch.tensor([hi], device=device), p,
                                  qo_indptr=torch.tensor([0, hi - lo], device=device),
                                  tail_rows=torch.tensor([b], device=device), sink_slots=torch.tensor([b], device=device))
                store(lay, step, k, v, **cache)
        self.q = torch.randn(batch, shape.q_heads, d, generator=g, device=device).to(torch.bfloat16)
        self.out = torch.empty_like(self.q)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        self.hack = HackDecodeAttention(lay, shape.q_heads)
        self.hack.plan(torch.arange(0, batch * per + 1, per, dtype=torch.int32, device=device),
                       self.table.reshape(-1).to(torch.int32), torch.tensor(self.seq_lens, device=device), rows, rows)
        self.flashinfer = None
        if baseline is Baseline.FLASHINFER:
            self._plan_flashinfer(g)

    def _plan_flashinfer(self, g: torch.Generator) -> None:
        import flashinfer

        s = self.shape
        c = _FlashInferCache(self.k16, self.v16, g)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(c.workspace, "NHD",
                                                          use_tensor_cores=s.q_heads // s.kv_heads >= 4)
        w.plan(c.indptr, c.indices, c.last_len, s.q_heads, s.kv_heads, s.head_dim, FLASHINFER_PAGE,
               pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self.flashinfer = (w, c)
        self.k16 = self.v16 = None  # the paged copy replaces the contiguous one

    def run_hack(self) -> Tensor:
        return self.hack.run(self.q, **cache_kwargs(self.bufs), out=self.out)

    def run_bf16(self) -> Tensor:
        if self.flashinfer is not None:
            w, c = self.flashinfer
            return w.run(self.q, c.pages)
        b, hq, d = self.q.shape
        return _sdpa(self.baseline, self.q.reshape(b, hq, 1, d), self.k16, self.v16, causal=False).reshape(b, hq, d)

    def run_dequant(self) -> Tensor:
        """Dequantize every page (the context is whole pages plus the FP16 sinks), then SDPA."""
        k, v = dequantize_pages(self.layout, self.bufs["k_buf"], self.bufs["v_buf"], self.table)
        s = min(self.layout.config.sink_tokens, self.seq_lens[0])
        if s:
            k[:, :, :s] = self.bufs["sink_k"][:, :s].transpose(1, 2)
            v[:, :, :s] = self.bufs["sink_v"][:, :s].transpose(1, 2)
        b, hq, d = self.q.shape
        base = Baseline.SDPA_FLASH if self.baseline is Baseline.FLASHINFER else self.baseline
        return _sdpa(base, self.q.reshape(b, hq, 1, d), k, v, causal=False).reshape(b, hq, d)

    def methods(self) -> dict[str, Callable[[], Tensor]]:
        if self.seq_lens[0] % self.layout.page_size:
            raise ValueError("the dequant method dequantizes whole pages: use a context that is a multiple of Π")
        return {"hack": self.run_hack, "bf16": self.run_bf16, "dequant": self.run_dequant}

    def bytes(self) -> dict[str, int]:
        s = self.shape
        return {"hack": hack_decode_bytes(self.layout, self.seq_lens, s.q_heads),
                "bf16": bf16_decode_bytes(self.seq_lens, s.kv_heads, s.q_heads, s.head_dim),
                "dequant": dequant_decode_bytes(self.layout, self.seq_lens, s.q_heads)}

    def release(self) -> None:
        self.bufs = self.k16 = self.v16 = self.flashinfer = self.hack = None


class PrefillCase:
    """One fresh prompt of n tokens (no cached prefix), causal."""

    def __init__(self, shape: AttnShape, n: int, baseline: Baseline, device: torch.device,
                 config: HackConfig | None = None, seed: int = 0) -> None:
        cfg = config or HackConfig()
        self.layout = lay = page_layout(cfg, shape.kv_heads, shape.head_dim)
        self.shape, self.baseline, self.n = shape, baseline, n
        per = -(-n // lay.page_size)
        g = torch.Generator(device=device).manual_seed(seed)
        self.bufs = new_buffers(lay, per, 1, 1, device=device)
        pages = torch.randperm(per, generator=g, device=device).to(torch.int32)
        self.k, self.v = _kv(n, shape.kv_heads, shape.head_dim, g, device)
        self.q = torch.randn(n, shape.q_heads, shape.head_dim, generator=g, device=device).to(torch.bfloat16)
        self.hack = HackPrefillAttention(lay, shape.q_heads)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.hack.plan(torch.tensor([0, n], device=device), torch.tensor([0, per], device=device), pages,
                       torch.tensor([n], device=device), zero, zero)
        self.step = self.hack.batch
        self.out = torch.empty_like(self.q)
        self.q4 = self.q.transpose(0, 1)[None]
        self.k4 = self.k.transpose(0, 1)[None].to(torch.bfloat16)
        self.v4 = self.v.transpose(0, 1)[None].to(torch.bfloat16)
        self.flashinfer = None
        if baseline is Baseline.FLASHINFER:
            self._plan_flashinfer(g)

    def _plan_flashinfer(self, g: torch.Generator) -> None:
        import flashinfer

        s = self.shape
        c = _FlashInferCache(self.k4, self.v4, g)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(c.workspace, "NHD")
        qo = torch.tensor([0, self.n], dtype=torch.int32, device=self.q.device)
        w.plan(qo, c.indptr, c.indices, c.last_len, s.q_heads, s.kv_heads, s.head_dim, FLASHINFER_PAGE,
               causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self.flashinfer = (w, c)

    def run_hack(self) -> Tensor:
        return self.hack.run(self.q, self.k, self.v, **cache_kwargs(self.bufs), out=self.out)

    def run_bf16(self) -> Tensor:
        if self.flashinfer is not None:
            w, c = self.flashinfer
            return w.run(self.q, c.pages)
        return _sdpa(self.baseline, self.q4, self.k4, self.v4, causal=True)

    def run_dequant(self) -> Tensor:
        """The strawman quantizes for storage only; the prompt attends over its own BF16 K/V."""
        store(self.layout, self.step, self.k, self.v, **cache_kwargs(self.bufs))
        base = Baseline.SDPA_FLASH if self.baseline is Baseline.FLASHINFER else self.baseline
        return _sdpa(base, self.q4, self.k4, self.v4, causal=True)

    def methods(self) -> dict[str, Callable[[], Tensor]]:
        return {"hack": self.run_hack, "bf16": self.run_bf16, "dequant": self.run_dequant}

    def bytes(self) -> dict[str, int]:
        b = prefill_bytes(self.n, self.shape)
        return {m: b for m in ("hack", "bf16", "dequant")}

    def release(self) -> None:
        self.bufs = self.k4 = self.v4 = self.flashinfer = self.hack = None


def decode_max_abs_diff(case: DecodeCase) -> float:
    """HACK against dequantize-then-attend on the same pages: a sanity number (they differ by
    the INT8 quantization of Q' and P': max ~0.07 at batch 1 x 2K on these inputs, mean ~0.01,
    the same in the interpreter and on an H200; the max grows with the outputs compared),
    recorded next to the timings."""
    a = case.run_hack().float()
    b = case.run_dequant().float()
    return float((a - b).abs().max())


def bf16_kv_bytes(shape: AttnShape, tokens: int) -> int:
    """K and V of `tokens` tokens in BF16."""
    return 2 * tokens * shape.kv_heads * shape.head_dim * 2
