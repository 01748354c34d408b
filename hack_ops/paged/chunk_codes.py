"""PrefillMode.INT8: the finer codes a prefill chunk reads its own tokens through.

The homomorphic prefill reads every closed page, the chunk's own included, from the pool's 2-bit
codes, as decode will. That is where its fidelity goes: a prompt token attends to the 2-bit codes
of the tokens just before it. The INT8 prefill keeps the kernel and its INT8 arithmetic (Q and P
quantized to 8 bits, dot products on codes, nothing dequantized) but reads the pages from the
prefix's open page on (the tokens this chunk brings, and the prefix tokens that share their first
page) from codes of CHUNK_BITS bits, made here from the same FP16 window the kernel reads the
open partition from, in the pool's own layout (K per channel over a page, V per token and
head_dim group). The cached prefix's closed pages stay 2-bit, as decode reads them; decode is
unchanged (the pool holds the 2-bit pages the store wrote).

6 bits, not 8: every build's INT8 dot products take the page codes as their signed operand,
and the AVX2 build's vpmaddubsw saturates a pair of 8-bit Q codes times codes above 64
(255 * 63 * 2 = 32,130 fits a signed 16-bit word). At 6 bits a code's step is 1/63 of its
range, 21x finer than 2 bits; the kernel's own Q and P rounding (8 bits) dominates the error.

One function makes the codes (`quantize_chunks`); the kernel reads its arrays and the PyTorch
reference reads `request_pages` of them, so both attend to the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .pages import RequestPages, TensorPages

CHUNK_BITS = 6
LEVELS = (1 << CHUNK_BITS) - 1


def layout_refusal(cfg) -> str | None:
    """Why PrefillMode.INT8 cannot read this HackConfig's pages (None: it can). The codes are the
    default layout's (K per channel over a page, V per token), made from FP16 windows that hold
    every token of the prefix's open page: both tensors need their FP16 tail."""
    if cfg.orientation != "channel_k":
        return (f"--hack-prefill int8 reads K per channel and V per token (the default layout); "
                f"--hack-orientation {cfg.orientation} lays pages out otherwise")
    if cfg.tail_tensors != "kv":
        return (f"--hack-prefill int8 reads the open page's tokens from the FP16 tails of K and V (the default); "
                f"--hack-tail-tensors {cfg.tail_tensors} keeps V's as codes")
    return None


@dataclass
class ChunkCodes:
    """Every request's window pages (from page prefix // Π on), stacked: request b's pages are
    rows page0[b] .. page0[b] + count[b] - 1. Codes uint8 [n, H, Π, D]; K's scale and minimum
    [n, H, D] (per channel over the page), K's code sums [n, H, Π, ng]; V's scale and minimum
    [n, H, Π, ng] (per token and head_dim group); all float32."""

    page0: Tensor
    count: Tensor
    k_codes: Tensor
    k_scale: Tensor
    k_min: Tensor
    k_sums: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_min: Tensor

    def request_pages(self, b: int) -> RequestPages:
        """Request b's window pages as the PyTorch path reads pages (float codes, head-major
        [H, n, ...])."""
        lo, hi = int(self.page0[b]), int(self.page0[b] + self.count[b])
        hm = lambda x: x[lo:hi].transpose(0, 1).float().contiguous()  # noqa: E731
        return RequestPages(k=TensorPages(hm(self.k_codes), hm(self.k_scale), hm(self.k_min), hm(self.k_sums)),
                            v=TensorPages(hm(self.v_codes), hm(self.v_scale), hm(self.v_min), None))


def _quantize(x: Tensor, valid: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Min/max quantization of x to LEVELS along `dim` (reduced), only valid elements setting
    the range; masked elements get code 0. Returns (codes uint8, scale, minimum) in float32;
    a flat or empty range gets scale 1 (as hack_ops.quant does)."""
    mn = x.masked_fill(~valid, float("inf")).amin(dim, keepdim=True)
    mx = x.masked_fill(~valid, float("-inf")).amax(dim, keepdim=True)
    empty = ~valid.any(dim, keepdim=True)
    mn = torch.where(empty, torch.zeros_like(mn), mn) + 0.0
    mx = torch.where(empty, torch.zeros_like(mx), mx)
    scale = (mx - mn) / LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - mn) / scale).clamp_(0, LEVELS).masked_fill_(~valid, 0)
    return codes.to(torch.uint8), scale.squeeze(dim), mn.squeeze(dim)


def window_pages(prefix_lens: list[int], seq_lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """Each request's window in ChunkCodes: its first position (the start of the prefix's open
    page), its page count (to the request's end), and its first row (page0)."""
    starts = [(pre // page_size) * page_size for pre in prefix_lens]
    counts = [-(-(seq - st) // page_size) for st, seq in zip(starts, seq_lens)]
    page0 = [sum(counts[:b]) for b in range(len(counts))]
    return starts, counts, page0


def quantize_chunks(k_win: Tensor, v_win: Tensor, win_off: Tensor, prefix_lens: list[int], seq_lens: list[int],
                    page_size: int, group: int, sink_tokens: int) -> ChunkCodes:
    """The codes of each request's FP16 window (k_win/v_win [.., H, D] float16; request b's
    starts at position (prefix // Π) * Π, element offset win_off[b]) by page, as the module
    docstring says. Tokens past a request's end, and the sinks (read in FP16 from the sink
    store, as from a pool page), take no part in a range."""
    h, d = k_win.shape[1], k_win.shape[2]
    p, hd, ng = page_size, h * d, d // group
    starts, counts, page0 = window_pages(prefix_lens, seq_lens, p)
    n = sum(counts)
    ks, vs = [], []
    for b, (start, seq, pages) in enumerate(zip(starts, seq_lens, counts)):
        tokens = seq - start
        off = int(win_off[b]) // hd
        pad = pages * p - tokens
        k = torch.nn.functional.pad(k_win[off:off + tokens].float(), (0, 0, 0, 0, 0, pad))
        v = torch.nn.functional.pad(v_win[off:off + tokens].float(), (0, 0, 0, 0, 0, pad))
        pos = torch.arange(start, start + pages * p)
        valid = ((pos < seq) & (pos >= sink_tokens)).reshape(pages, p, 1, 1)
        ks.append(k.reshape(pages, p, h, d).permute(0, 2, 1, 3))  # [pages, H, Π, D]
        vs.append((v.reshape(pages, p, h, d).permute(0, 2, 1, 3), valid.permute(0, 2, 1, 3)))
    k = torch.cat(ks, 0)
    valid = torch.cat([m for _, m in vs], 0).expand(k.shape)
    kc, k_scale, k_min = _quantize(k, valid, dim=2)  # per channel over the page's tokens
    v = torch.cat([x for x, _ in vs], 0).reshape(n, h, p, ng, group)
    vc, v_scale, v_min = _quantize(v, valid.reshape(v.shape), dim=4)  # per token and group
    k_sums = kc.reshape(n, h, p, ng, group).sum(-1, dtype=torch.int32).float()
    return ChunkCodes(page0=torch.tensor(page0, dtype=torch.int64), count=torch.tensor(counts, dtype=torch.int64),
                      k_codes=kc.contiguous(), k_scale=k_scale.contiguous(), k_min=k_min.contiguous(),
                      k_sums=k_sums.contiguous(), v_codes=vc.reshape(n, h, p, d).contiguous(),
                      v_scale=v_scale.contiguous(), v_min=v_min.contiguous())
