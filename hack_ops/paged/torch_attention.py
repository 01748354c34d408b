"""Pure-PyTorch attention of one request's queries over its HACK pages (portable path).

The visibility of each query i (position t_i) is described by:
  nc_i        pages 0..nc_i-1 are closed (read quantized from the pages);
  exact_from  keys at positions >= exact_from are read in FP16, K and V (the new tokens of
              a PrefillMode.EXACT extend; = seq_len otherwise, i.e. none);
and the FP16 sources in RequestView: the sinks (positions < S) and ranges of FP16 K / V
(the tails' tokens, the new tokens). A query's open partition (keys of pages >= nc_i, not
sinks, before exact_from) is read per tensor as `HackConfig.open_mode` says: FP16 from the tail, the
per-token codes written as tokens arrive, or the open page re-quantized over its tokens (RQE
ablation). The arithmetic is the dense reference's (hack_ops.attention) step by step; only
the order of float sums differs. One full softmax per query chunk (scores for every key, then
P·V) keeps it simple.

Sliding windows (`window`, SGLang's sliding_window_size: keys t-window..t): a chunk reads only
the pages from the first one any of its queries can see (pages wholly before it are never
unpacked or multiplied); keys before each query's window, on the boundary page, among the
sinks or in the FP16 ranges, are masked per token. `logit_cap` soft-caps the scaled scores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import soft_cap, visible
from ..config import HackConfig, OpenMode
from ..homomorphic import pv_token_v_codes, pv_token_v_min, quantize_qp, scores_channel_k
from ..modes import AttentionMode
from .pages import RequestPages, TensorPages, quantize_open_page


@dataclass
class RequestView:
    """What one request's queries may read, besides its pages."""

    seq_len: int
    exact_from: int
    k16: list[tuple[int, Tensor]]  # (first key position, float [n, H, D]) FP16 K ranges
    v16: list[tuple[int, Tensor]]
    sink_k: Tensor | None  # float [min(S, seq_len), H, D]
    sink_v: Tensor | None
    key0: int = 0  # absolute position of key 0 (> 0 when a window skips the first pages)

    def fp16_at(self, name: str, start: int, count: int) -> Tensor:
        """FP16 tokens [start, start+count) of tensor 'k'/'v' from the range holding them."""
        for st, x in (self.k16 if name == "k" else self.v16):
            if st <= start and start + count <= st + x.shape[0]:
                return x[start - st:start - st + count]
        raise ValueError(f"no FP16 {name} for positions {start}..{start + count - 1}")


def _scores_per_channel(q: Tensor, kp: TensorPages, cfg: HackConfig, mode: AttentionMode, gen) -> Tensor:
    """q [n, H, rep, D] vs K pages quantized per channel -> [n, H, rep, pages * Π]."""
    n, h, rep, d = q.shape
    npg, p = kp.codes.shape[1], kp.codes.shape[2]
    if mode == AttentionMode.DEQUANT:
        kd = kp.codes * kp.scale[:, :, None, :] + kp.minimum[:, :, None, :]
        return torch.einsum("nhrd,hpjd->nhrpj", q, kd).reshape(n, h, rep, npg * p)
    return scores_channel_k(q, kp.codes, kp.scale, kp.minimum, kp.sums, cfg, gen)


def _scores_per_token(q: Tensor, kp: TensorPages, cfg: HackConfig, mode: AttentionMode, gen) -> Tensor:
    """q [n, H, rep, D] vs K quantized per token (head_dim groups): Eq. 4."""
    n, h, rep, d = q.shape
    npg, p = kp.codes.shape[1], kp.codes.shape[2]
    gd = cfg.head_group(d)
    ng = d // gd
    sk = kp.scale.reshape(h, npg * p, ng)
    mk = kp.minimum.reshape(h, npg * p, ng)
    kc = kp.codes.reshape(h, npg * p, ng, gd)
    if mode == AttentionMode.DEQUANT:
        kd = (kc * sk[..., None] + mk[..., None]).reshape(h, npg * p, d)
        return torch.einsum("nhrd,hjd->nhrj", q, kd)
    qq = quantize_qp(q, -1, gd, cfg, gen)
    qc = qq.codes.float().reshape(n, h, rep, ng, gd)
    dot = torch.einsum("nhrgk,hjgk->nhrjg", qc, kc)
    sq, mq, qs = (t[:, :, :, None, :] for t in (qq.scale, qq.minimum, qq.sums.float()))
    s = sq * sk[None, :, None] * dot + sq * mk[None, :, None] * qs
    s = s + mq * sk[None, :, None] * kp.sums.reshape(h, npg * p, ng)[None, :, None] + gd * mq * mk[None, :, None]
    return s.sum(-1)


def _pv_per_token(pr: Tensor, w: Tensor, vp: TensorPages, cfg: HackConfig, mode: AttentionMode, gen) -> Tensor:
    """P·V over keys w [n, Kp] with V quantized per token (head_dim groups)."""
    n, h, rep, kp_ = pr.shape
    d = vp.codes.shape[3]
    gd = cfg.head_group(d)
    ng = d // gd
    pw = pr * w[:, None, None, :]
    sv = vp.scale.reshape(h, kp_, ng)
    mv = vp.minimum.reshape(h, kp_, ng)
    if mode == AttentionMode.DEQUANT:
        vd = (vp.codes.reshape(h, kp_, ng, gd) * sv[..., None] + mv[..., None]).reshape(h, kp_, d)
        return torch.einsum("nhrj,hjd->nhrd", pw, vd)
    return pv_token_v_codes(pw, vp.codes, sv, cfg, gen) + pv_token_v_min(pw, mv, gd)


def _pv_per_channel(pr: Tensor, w: Tensor, vp: TensorPages, cfg: HackConfig, mode: AttentionMode, gen) -> Tensor:
    """P·V over keys w [n, pages*Π] with V quantized per channel over each page: Eq. 4 with P's
    minimum 0 (so neither V's code sums nor the min·min term appear)."""
    n, h, rep, kp_ = pr.shape
    npg, p = vp.codes.shape[1], vp.codes.shape[2]
    pw = (pr * w[:, None, None, :]).reshape(n, h, rep, npg, p)
    if mode == AttentionMode.DEQUANT:
        vd = vp.codes * vp.scale[:, :, None, :] + vp.minimum[:, :, None, :]
        return torch.einsum("nhrpj,hpjd->nhrd", pw, vd)
    qp = quantize_qp(pw, -1, p, cfg, gen, zero_min=True)
    dot = torch.einsum("nhrpj,hpjd->nhrpd", qp.codes.float(), vp.codes)
    sp, ps = qp.scale, qp.sums.float()  # [n, H, rep, pages, 1]
    sv, mv = vp.scale[None, :, None], vp.minimum[None, :, None]  # [1, H, 1, pages, D]
    return (sp * sv * dot + sp * mv * ps).sum(3)


def _fill_range(x: Tensor, start: int, length: int, s_min: int) -> tuple[int, int]:
    """Key range [start, start+length) minus the sinks [0, s_min): (first index into x, key start)."""
    skip = max(0, s_min - start)
    return skip, start + skip


def attend_request(q: Tensor, t: Tensor, nc: Tensor, rp: RequestPages, view: RequestView, cfg: HackConfig,
                   mode: AttentionMode, gen: torch.Generator | None = None, chunk: int = 64,
                   window: int | None = None, logit_cap: float = 0.0, page0: int = 0) -> Tensor:
    """q [n, H, rep, D] float (already scaled), positions t [n], closed pages nc [n] ->
    float32 [n, H, rep, D]. window / logit_cap: see the module docstring (None / 0: none).
    page0: rp holds the request's pages from page0 on (a window's caller gathers no earlier ones)."""
    if page0:
        t, nc, view = t - page0 * cfg.partition_size, nc - page0, _shift_view(view, page0 * cfg.partition_size)
    outs = [_attend_chunk(q[i:i + chunk], t[i:i + chunk], nc[i:i + chunk], rp, view, cfg, mode, gen,
                          window, logit_cap)
            for i in range(0, q.shape[0], chunk)]
    return torch.cat(outs, 0)


def first_page(t_min: int, window: int | None, page_size: int) -> int:
    """The first page a query at position >= t_min can see (0 without a window)."""
    return 0 if window is None else max(0, t_min - window) // page_size


def _from_page(tp: TensorPages, lo: int) -> TensorPages:
    return tp if not lo else TensorPages(*(None if x is None else x[:, lo:] for x in
                                           (tp.codes, tp.scale, tp.minimum, tp.sums)))


def _attend_chunk(q, t, nc, rp: RequestPages, view: RequestView, cfg: HackConfig, mode: AttentionMode, gen,
                  window: int | None = None, logit_cap: float = 0.0) -> Tensor:
    n, h, rep, d = q.shape
    p = cfg.partition_size
    lo = first_page(int(t.min()), window, p)
    if lo:  # pages wholly before every query's window are not read at all
        rp = RequestPages(_from_page(rp.k, lo), _from_page(rp.v, lo))
        nc = nc - lo
        t = t - lo * p
        view = _shift_view(view, lo * p)
    npg = rp.k.codes.shape[1]
    kp_ = npg * p
    k0 = view.key0  # absolute position of key 0; the sinks are absolute positions 0..S-1
    s_n = max(0, min(cfg.sink_tokens, view.seq_len + k0) - k0)
    j = torch.arange(kp_)
    valid = visible(j[None, :], t[:, None], window)
    sink = (j < s_n)[None, :]
    closed = (j // p)[None, :] < nc[:, None]
    exact = (j >= view.exact_from)[None, :]
    cached = valid & ~sink & ~exact
    open_c = cached & ~closed  # the cached open partition, sinks excluded
    kmode, vmode = cfg.open_mode("k"), cfg.open_mode("v")
    fp16_open = lambda m: open_c if m == OpenMode.FP16 else torch.zeros_like(open_c)  # noqa: E731
    k16_mask = valid & (sink | exact | fp16_open(kmode))
    v16_mask = valid & (sink | exact | fp16_open(vmode))
    # ---- scores
    s = torch.full((n, h, rep, kp_), float("-inf"))
    if cfg.k_per_token:
        kq = cached & (closed | (open_c if kmode == OpenMode.QUANT else torch.zeros_like(open_c)))
        s = torch.where(kq[:, None, None], _scores_per_token(q, rp.k, cfg, mode, gen), s)
    else:
        n_closed = int(nc.max())
        if n_closed:
            sub = TensorPages(*(x[:, :n_closed] for x in (rp.k.codes, rp.k.scale, rp.k.minimum, rp.k.sums)))
            sc = _scores_per_channel(q, sub, cfg, mode, gen)
            m = (cached & closed)[:, None, None, : n_closed * p]
            s[..., : n_closed * p] = torch.where(m, sc, s[..., : n_closed * p])
    if kmode == OpenMode.REQUANT:
        s = _requant_open(q, t, nc, s, view, cfg, mode, gen, open_c, None)
    s16 = torch.zeros((n, h, rep, kp_))
    for start, x in view.k16:
        skip, st = _fill_range(x, start, x.shape[0], s_n)
        s16[..., st:start + x.shape[0]] = torch.einsum("nhrd,jhd->nhrj", q, x[skip:])
    if s_n:
        s16[..., :s_n] = torch.einsum("nhrd,jhd->nhrj", q, view.sink_k[k0:k0 + s_n])
    s = torch.where(k16_mask[:, None, None], s16, s)
    s = soft_cap(s, logit_cap).masked_fill(~valid[:, None, None], float("-inf"))
    pr = torch.exp(s - s.amax(-1, keepdim=True))
    denom = pr.sum(-1, keepdim=True)
    # ---- P·V
    if cfg.v_per_token:
        w = cached & (closed | (open_c if vmode == OpenMode.QUANT else torch.zeros_like(open_c)))
        o = _pv_per_token(pr, w, rp.v, cfg, mode, gen)
    else:
        o = _pv_per_channel(pr, cached & closed, rp.v, cfg, mode, gen)
    if vmode == OpenMode.REQUANT:
        o = o + _requant_open(q, t, nc, None, view, cfg, mode, gen, open_c, pr)
    pv16 = pr * v16_mask[:, None, None]
    for start, x in view.v16:
        skip, st = _fill_range(x, start, x.shape[0], s_n)
        o = o + torch.einsum("nhrj,jhd->nhrd", pv16[..., st:start + x.shape[0]], x[skip:])
    if s_n:
        o = o + torch.einsum("nhrj,jhd->nhrd", pv16[..., :s_n], view.sink_v[k0:k0 + s_n])
    return o / denom


def _shift_view(view: RequestView, k0: int) -> RequestView:
    """The view with key positions counted from k0 (the first page read): FP16 ranges are cut
    to the keys from k0 on; sinks before k0 are dropped (fp16 sinks after: see s_n)."""
    def cut(ranges):
        out = []
        for st, x in ranges:
            skip = max(0, k0 - st)
            if skip < x.shape[0]:
                out.append((st + skip - k0, x[skip:]))
        return out

    return RequestView(seq_len=view.seq_len - k0, exact_from=max(0, view.exact_from - k0), k16=cut(view.k16),
                       v16=cut(view.v16), sink_k=view.sink_k, sink_v=view.sink_v, key0=view.key0 + k0)


def _requant_open(q, t, nc, s, view: RequestView, cfg: HackConfig, mode: AttentionMode, gen, open_c, pr):
    """Requantization-elimination ablation: each query's open page, quantized per channel over
    the tokens it holds (grouped by page and count). Scores (pr None) or P·V (pr given)."""
    p = cfg.partition_size
    count = torch.minimum(t + 1, torch.full_like(t, view.exact_from)) - nc * p
    out = None if pr is None else torch.zeros(*pr.shape[:-1], q.shape[-1])
    keys = {(int(a), int(b)) for a, b in zip(nc.tolist(), count.tolist()) if b > 0}
    is_k = pr is None
    for page, r in sorted(keys):
        x = view.fp16_at("k" if is_k else "v", page * p, r)
        tp = quantize_open_page(x, r, page * p + view.key0 == 0, cfg, is_k, gen)
        sel = open_c & ((nc == page) & (count == r))[:, None]
        cols = slice(page * p, (page + 1) * p)
        if is_k:
            sc = _scores_per_channel(q, tp, cfg, mode, gen)
            s[..., cols] = torch.where(sel[:, None, None, cols], sc, s[..., cols])
        else:
            out = out + _pv_per_channel(pr[..., cols], sel[:, cols], tp, cfg, mode, gen)
    return s if is_k else out
