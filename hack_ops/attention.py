"""Reference attention on dense tensors, in every AttentionMode (hack_ops.modes): 'exact' (no
quantization), 'hack' (homomorphic, no dequantization) and 'dequant' (the paper's strawman: the
same 2-bit cache dequantized before float attention).

The 'hack' and 'dequant' modes reproduce what a query sees in the serving cache, token by token
("decode-time visibility"). With partition size Π and the query at absolute position t (the
cache then holds tokens 0..t):
  * pages whose Π tokens are all present, i.e. page p < (t+1)//Π, are closed and quantized;
  * the open partition (tokens from ((t+1)//Π)*Π to t) is FP16 for the tensors with a tail
    (config.k_tail / config.v_tail: K and V by default); a per-token tensor without a tail is
    quantized as each token is written;
  * the first `sink_tokens` tokens keep FP16 K and V and take no part in page 0's ranges;
  * with requant_elimination=False the open partition is re-quantized over the tokens it
    holds at every step (the paper's HACK/RQE ablation).
So a teacher-forced pass over a whole sequence measures exactly what generation would see.

Model features (all modes): `window` is SGLang's `sliding_window_size` (HF sliding_window - 1):
the query at position t sees keys t-window..t, i.e. window+1 keys including itself, the same
rule for sinks, the FP16 open partition and the quantized pages. `logit_cap` > 0 soft-caps the
scaled scores (cap * tanh(s / cap)) before the softmax, as SGLang's kernels do. `scale` is the
layer's scaling (e.g. query_pre_attn_scalar ** -0.5).

Rotation (config.rotation, hack_ops.rotation): Q/K and/or V are rotated by an orthogonal
Walsh-Hadamard matrix R before anything else and the output is rotated back by Rᵀ after, in
every mode; the paged paths receive the same rotated tensors from the serving backend.

Dense-and-sparse K (config.k_outlier_channels = n, 'channel_k'): each closed page keeps its n
widest K channels per head in FP16 outside the codes (hack_ops.quant.widest_channels); the
scores add Q·K_sparse exactly to the homomorphic (or dequantized) product of the rest.
Per-layer configs (config.edge_layer_bits) are resolved by the caller with config.for_layer().

Homomorphic steps ('hack'):
  channel_k: S = Σ_g sq*(Qq·Kq) + mq*ΣKq + Q·m_K, where Q' = Q ⊙ s_K(page) is quantized to
      INT8 per (query, page, head_dim group) — K's per-channel scale folded into Q, and ΣKq
      are K's stored per-token code sums (summation elimination).
      O = Σ_p sp*(Pq·Vq) + Σ_j P_j m_V(j), where P' = P ⊙ s_V(token) is quantized to INT8 per
      (query, page, head_dim group) — V's per-token scale folded into P.
  token_k: Eq. 4 for Q·K^T (Q INT8 per head_dim group, K per token); for P·V, Eq. 4 with
      P per (query, page) and V per channel over the page.
P is the unnormalized softmax numerator exp(S - max). P >= 0, so its INT8 range is [0, max]
(zero minimum): Eq. 4's terms with P's minimum vanish and V needs no stored code sums. Min/max
INT8 quantization is invariant to the running-max rescaling of an online softmax, so this
equals what a flash kernel computes tile by tile.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import HackConfig
from .homomorphic import homomorphic_matmul_q, pv_token_v_codes, pv_token_v_min, quantize_qp, scores_channel_k
from .modes import AttentionMode, attention_mode
from .quant import QTensor, dequantize, quantize, widest_channels
from .rotation import restore_output, rotate_qkv
from .sparse import SparseConfig, row_page_mask

MODES = tuple(AttentionMode)


def _check(q: Tensor, k: Tensor, v: Tensor, mode: AttentionMode | str) -> AttentionMode:
    mode = attention_mode(mode)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq, head_dim]")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if k.shape[2] == 0:
        raise ValueError("k/v must hold at least one token")
    return mode


def _positions(sq: int, sk: int, causal: bool) -> Tensor:
    if not causal:
        return torch.full((sq,), sk - 1, dtype=torch.long)
    if sq > sk:
        raise ValueError(f"causal attention needs len(q) <= len(k), got {sq} > {sk}")
    return torch.arange(sk - sq, sk, dtype=torch.long)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: HackConfig | None = None,
    mode: AttentionMode | str = AttentionMode.EXACT,
    causal: bool = True,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    window: int | None = None,
    logit_cap: float = 0.0,
    sparse: SparseConfig | None = None,
) -> Tensor:
    """Attention over dense [batch, heads, seq, head_dim] tensors; GQA when k/v have fewer
    heads. Queries are the last len(q) positions of the sequence (causal, bottom-right).
    window: sliding window (keys t-window..t visible; None or -1: none); logit_cap: soft-cap
    of the scaled scores (0: none). sparse: every query reads only the closed pages its
    selection keeps (hack_ops.sparse, as a decode step would: 'hack' or 'dequant' mode,
    'channel_k', no window). Returns float32 [batch, q_heads, len(q), head_dim]."""
    mode = _check(q, k, v, mode)
    window = check_window(window)
    logit_cap = check_logit_cap(logit_cap)
    cfg = config or HackConfig()
    d = q.shape[-1]
    if mode != AttentionMode.EXACT and (d % cfg.head_group(d) or (d * min(cfg.bits("k"), cfg.bits("v"))) % 8):
        raise ValueError(f"head_dim {d} must be a multiple of the head_dim group {cfg.head_group(d)}")
    if mode != AttentionMode.EXACT and cfg.per_layer:
        raise ValueError(f"{cfg.label()} differs per layer: pass config.for_layer(layer, num_layers)")
    if mode != AttentionMode.EXACT and cfg.k_outlier_channels >= d:
        raise ValueError(f"k_outlier_channels ({cfg.k_outlier_channels}) must be below head_dim {d}")
    if sparse is not None and sparse.enabled and (mode == AttentionMode.EXACT or window is not None
                                                  or cfg.orientation != "channel_k"):
        raise ValueError("sparse decode selects closed pages from K's per-channel side tables: a quantized "
                         "mode, orientation 'channel_k', no sliding window")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rep = q.shape[1] // k.shape[1]
    pos = _positions(q.shape[2], k.shape[2], causal)
    # The rotation wraps everything below, as the serving backend wraps its kernels.
    q, k, v = rotate_qkv(q.float(), k.float(), v.float(), cfg.rotation)
    qs = q * scale
    if mode == AttentionMode.EXACT:
        kf = k.repeat_interleave(rep, 1)
        vf = v.repeat_interleave(rep, 1)
        s = soft_cap(qs @ kf.transpose(-1, -2), logit_cap)
        valid = visible(torch.arange(k.shape[2])[None, :], pos[:, None], window)
        s = s.masked_fill(~valid, float("-inf"))
        out = torch.softmax(s, -1) @ vf
    else:
        keep = None
        if sparse is not None and sparse.enabled:
            keep = sparse_key_mask(qs, k, cfg, sparse, pos)
        out = _quantized_attention(qs, k, v, cfg, mode, pos, rep, generator, window, logit_cap, keep)
    return restore_output(out, cfg.rotation)


def k_pages_quantized(k: Tensor, cfg: HackConfig) -> QTensor:
    """Every whole page of k [B, H, n, D] quantized per channel as the store does it ('channel_k':
    the sinks out of page 0's range)."""
    p = cfg.partition_size
    npg = k.shape[-2] // p
    j = torch.arange(npg * p)
    kp = k[..., :npg * p, :].float()
    mask = (j >= cfg.sink_tokens)[:, None].expand(kp.shape)
    return quantize_kv(kp, dim=-2, group=p, cfg=cfg, gen=None, mask=mask, name="k")


def k_page_tables(k: Tensor, cfg: HackConfig) -> tuple[Tensor, Tensor]:
    """K's per-channel minimum and scale of every whole page of k [B, H, n, D] as the store
    quantizes them ('channel_k': sinks out of page 0's range), float [B, H, n // Π, D]."""
    qt = k_pages_quantized(k, cfg)
    return qt.minimum.float(), qt.scale.float()


def sparse_key_mask(qs: Tensor, k: Tensor, cfg: HackConfig, sparse: SparseConfig, pos: Tensor) -> Tensor:
    """The keys each query reads under sparse decode: bool [B, Hq, Sq, Skp] (keys padded to
    whole pages), False on the closed pages its selection drops (hack_ops.sparse.row_page_mask
    over the pages' K minimum and scale)."""
    p = cfg.partition_size
    b, hq, sq, d = qs.shape
    h = k.shape[1]
    mn, sc = k_page_tables(k, cfg)
    npg_all = -(-k.shape[-2] // p)
    keys = dequantize(k_pages_quantized(k, cfg)) if sparse.refine > 1 else None  # the refinement's page_best
    keep = row_page_mask(qs.reshape(b, h, hq // h, sq, d), mn, sc, cfg.bits("k"), (pos + 1) // p, sparse, p, keys)
    if keep.shape[-1] < npg_all:  # the last, partial page is never closed
        keep = torch.nn.functional.pad(keep, (0, npg_all - keep.shape[-1]), value=True)
    return _heads(keep.repeat_interleave(p, -1), hq // h)


def check_window(window: int | None) -> int | None:
    """None for no window (SGLang's -1 too); else the window as an int >= 0."""
    if window is None or window == -1:
        return None
    if isinstance(window, bool) or int(window) != window or window < 0:
        raise ValueError(f"window must be None, -1 or an integer >= 0, got {window!r}")
    return int(window)


def check_logit_cap(cap: float | None) -> float:
    cap = 0.0 if cap is None else float(cap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"logit_cap must be a finite number >= 0, got {cap!r}")
    return cap


def visible(j: Tensor, t: Tensor, window: int | None) -> Tensor:
    """Key positions j visible to queries at positions t (broadcast): causal, and within the
    sliding window when there is one (t - window <= j, SGLang's inclusive rule)."""
    ok = j <= t
    return ok if window is None else ok & (j >= t - window)


def soft_cap(s: Tensor, cap: float) -> Tensor:
    """Logit soft-capping of scaled scores (cap * tanh(s / cap)); identity for cap 0."""
    return s if not cap else cap * torch.tanh(s / cap)


class _Cache:
    """Index masks describing what the serving cache holds for each query."""

    def __init__(self, pos: Tensor, sk: int, cfg: HackConfig, window: int | None = None):
        p = cfg.partition_size
        self.p = p
        self.skp = -(-sk // p) * p  # padded to whole pages
        j = torch.arange(self.skp)
        self.page = j // p
        # Keys outside the window are masked out; the pages and open partition are what the
        # store holds whatever the window (the window only narrows what a query reads).
        self.valid = visible(j[None, :], pos[:, None], window) & (j[None, :] < sk)  # [Sq, Skp]
        self.sink = j < cfg.sink_tokens
        self.n_closed = (pos + 1) // p  # closed pages per query
        self.closed = self.page[None, :] < self.n_closed[:, None]  # [Sq, Skp]
        self.in_k = j < sk
        self.full_page = (self.page + 1) * p <= sk  # pages complete within k
        self.open_count = (pos + 1) % p  # tokens in each query's open partition
        # pages a query reads when its open partition is quantized too
        self.with_open = torch.clamp(self.n_closed + (self.open_count > 0).long(), max=self.skp // p)


def _pad(x: Tensor, n: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[-2])) if n > x.shape[-2] else x


def quantize_kv(x: Tensor, dim: int, group: int, cfg: HackConfig, gen, mask: Tensor, name: str) -> QTensor:
    """K or V (`name` 'k' or 'v') quantized as the format says (its bits, rounding, meta dtype,
    range search), in groups of `group` along `dim`, over the elements where `mask` is True."""
    meta = torch.float16 if cfg.meta_dtype == "float16" else torch.float32
    return quantize(x, cfg.bits(name), dim=dim, group_size=group, rounding=cfg.rounding,
                    generator=gen, meta_dtype=meta, mask=mask, range_search=cfg.range_search)


def _heads(t: Tensor, rep: int) -> Tensor:
    return t.repeat_interleave(rep, 1) if rep > 1 else t


def _row_groups(reach: Tensor):
    """(rows, n) for every distinct number n > 0 of pages that some queries need: causal
    queries only read the pages closed before them, so each group computes on n pages."""
    for n in torch.unique(reach).tolist():
        if n > 0:
            yield torch.nonzero(reach == n).squeeze(1), int(n)


def _scores_channel_k(qs: Tensor, k: Tensor, kmask: Tensor, cfg: HackConfig, mode: AttentionMode, rep: int, gen,
                      reach: Tensor) -> Tensor:
    """Scores against K quantized per channel over each page (tokens where kmask is True);
    query t gets scores for the first reach[t] pages (the rest of its row is left 0)."""
    p, dd = cfg.partition_size, k.shape[-1]
    ng = dd // cfg.head_group(dd)
    npg = k.shape[-2] // p
    qk, k_out = _quantize_channel_k(k, kmask, cfg, gen)
    if mode == AttentionMode.DEQUANT:
        kd = dequantize(qk) * kmask[:, None] + k_out
        return qs @ _heads(kd, rep).transpose(-1, -2)
    sk_ = _heads(qk.scale.float(), rep)  # [B, H, npg, D]
    mk_ = _heads(qk.minimum.float(), rep)
    codes = _heads(qk.codes, rep).float().reshape(*qs.shape[:2], npg, p, dd)
    ksum = codes.reshape(*codes.shape[:-1], ng, -1).sum(-1)  # [B, H, npg, P, ng]: code sums per token and group
    out = qs.new_zeros(*qs.shape[:3], npg * p)
    for rows, n in _row_groups(reach):
        out[:, :, rows, : n * p] = scores_channel_k(qs[:, :, rows], codes[:, :, :n], sk_[:, :, :n], mk_[:, :, :n],
                                                    ksum[:, :, :n], cfg, gen, check=False)
    if cfg.k_outlier_channels:  # the sparse FP16 channels, an exact float product
        out = out + qs @ _heads(k_out, rep).transpose(-1, -2)
    return out


def _quantize_channel_k(k: Tensor, kmask: Tensor, cfg: HackConfig, gen) -> tuple[QTensor, Tensor]:
    """K per channel over each page (tokens where kmask [Skp] is True). With
    k_outlier_channels = n (dense-and-sparse), each page's n widest channels per head are left
    out of the codes (code 0, min 0, scale 0: nothing of them reaches Q's INT8 range) and
    returned in FP16 as a dense [B, H, Skp, D] tensor that is zero elsewhere."""
    p = cfg.partition_size
    mask = kmask[:, None].expand(k.shape)
    n = cfg.k_outlier_channels
    if not n:
        return quantize_kv(k, dim=-2, group=p, cfg=cfg, gen=gen, mask=mask, name="k"), torch.zeros(())
    wide = widest_channels(k, n, p, mask)  # [B, H, npg, D]
    sparse = wide.repeat_interleave(p, -2) & mask
    qk = quantize_kv(k, dim=-2, group=p, cfg=cfg, gen=gen, mask=mask & ~sparse, name="k")
    qk.scale = qk.scale.masked_fill(wide, 0)
    return qk, k.half().float() * sparse

def _scores_token_k(qs: Tensor, k: Tensor, kmask: Tensor, cfg: HackConfig, mode: AttentionMode, rep: int, gen) -> Tensor:
    """Scores against K quantized per token in head_dim groups (Eq. 4 directly)."""
    gd = cfg.head_group(k.shape[-1])
    kt = k.transpose(-1, -2)
    qk = quantize_kv(kt, dim=-2, group=gd, cfg=cfg, gen=gen, mask=kmask[None, :].expand(kt.shape), name="k")
    if mode == AttentionMode.DEQUANT:
        return qs @ _heads(dequantize(qk), rep)
    qq = quantize_qp(qs, -1, gd, cfg, gen, check=False)
    qk_h = QTensor(_heads(qk.codes, rep), _heads(qk.scale, rep), _heads(qk.minimum, rep),
                   _heads(qk.sums, rep), qk.bits, qk.dim, qk.group_size)
    return homomorphic_matmul_q(qq, qk_h, cfg.summation_elimination)


def _pv_token_v(pr: Tensor, w: Tensor, v: Tensor, vmask: Tensor, cfg: HackConfig, mode: AttentionMode, rep: int, gen,
                reach: Tensor) -> Tensor:
    """P·V with V quantized per token in head_dim groups, over the keys where w [Sq, Skp]
    (all within the first reach[t] pages of query t)."""
    p, dd = cfg.partition_size, v.shape[-1]
    gd = cfg.head_group(dd)
    pw = pr * w
    qv = quantize_kv(v, dim=-1, group=gd, cfg=cfg, gen=gen, mask=vmask[:, None].expand(v.shape), name="v")
    if mode == AttentionMode.DEQUANT:
        return pw @ _heads(dequantize(qv) * vmask[:, None], rep)
    b, h, sq, skp = pw.shape
    sv = _heads(qv.scale.float(), rep)  # [B, H, Skp, ng]
    mv = _heads(qv.minimum.float(), rep)
    vc = _heads(qv.codes, rep).float().reshape(b, h, skp // p, p, dd)
    out = pv_token_v_min(pw, mv, gd)  # over every row at once
    for rows, n in _row_groups(reach):
        out[:, :, rows] += pv_token_v_codes(pw[:, :, rows, : n * p], vc[:, :, :n], sv[:, :, : n * p], cfg, gen,
                                            check=False)
    return out


def _pv_channel_v(pr: Tensor, w: Tensor, v: Tensor, vmask: Tensor, cfg: HackConfig, mode: AttentionMode, rep: int, gen) -> Tensor:
    """P·V with V quantized per channel over each page (Eq. 4, groups along the sequence)."""
    p = cfg.partition_size
    pw = pr * w
    qv = quantize_kv(v, dim=-2, group=p, cfg=cfg, gen=gen, mask=vmask[:, None].expand(v.shape), name="v")
    if mode == AttentionMode.DEQUANT:
        return pw @ _heads(dequantize(qv) * vmask[:, None], rep)
    qp = quantize_qp(pw, -1, p, cfg, gen, zero_min=True, check=False)
    qv_h = QTensor(_heads(qv.codes, rep), _heads(qv.scale, rep), _heads(qv.minimum, rep),
                   _heads(qv.sums, rep), qv.bits, qv.dim, qv.group_size)
    # P's minimum is 0, so only sp*sv*ΣPqVq + sp*mv*ΣPq remain; ΣPq comes from P's own codes.
    return homomorphic_matmul_q(qp, qv_h, cfg.summation_elimination)


def _quantized_attention(qs, k, v, cfg: HackConfig, mode: AttentionMode, pos: Tensor, rep: int, gen,
                         window: int | None = None, logit_cap: float = 0.0, keep: Tensor | None = None) -> Tensor:
    sk = k.shape[-2]
    c = _Cache(pos, sk, cfg, window)
    k = _pad(k, c.skp)
    v = _pad(v, c.skp)
    not_sink = ~c.sink & c.in_k
    # Scores: quantized keys go through the homomorphic product, the rest read FP16 K.
    if cfg.k_per_token:
        s_q = _scores_token_k(qs, k, not_sink, cfg, mode, rep, gen)
        q_k = c.valid & not_sink
        if cfg.k_tail and cfg.requant_elimination:
            q_k = q_k & c.closed
    else:
        s_q = _scores_channel_k(qs, k, not_sink & c.full_page, cfg, mode, rep, gen, c.n_closed)
        q_k = c.valid & not_sink & c.closed
        if not cfg.requant_elimination:
            s_q = _requant_open_scores(qs, k, s_q, c, not_sink, cfg, mode, rep, gen)
            q_k = c.valid & not_sink
    s = torch.where(q_k, s_q, qs @ _heads(k.half().float(), rep).transpose(-1, -2))
    s = soft_cap(s, logit_cap).masked_fill(~c.valid, float("-inf"))
    if keep is not None:  # sparse decode: the closed pages a query's selection drops
        s = s.masked_fill(~keep, float("-inf"))
    pr = torch.exp(s - s.amax(-1, keepdim=True))  # unnormalized numerator; masked -> 0
    denom = pr.sum(-1, keepdim=True)
    # Values: same split.
    if cfg.v_per_token:
        if cfg.v_tail and cfg.requant_elimination:
            q_v, vmask, reach = c.valid & not_sink & c.closed, not_sink & c.full_page, c.n_closed
        else:  # quantized as written (or re-quantized every step: per token, the same thing)
            q_v, vmask, reach = c.valid & not_sink, not_sink, c.with_open
        o = _pv_token_v(pr, q_v, v, vmask, cfg, mode, rep, gen, reach)
    else:
        q_v = c.valid & not_sink & c.closed
        o = _pv_channel_v(pr, q_v, v, not_sink & c.full_page, cfg, mode, rep, gen)
        if not cfg.requant_elimination:
            o = o + _requant_open_pv(pr, v, c, not_sink, cfg, mode, rep, gen)
            q_v = c.valid & not_sink
    o = o + (pr * (c.valid & ~q_v)) @ _heads(v.half().float(), rep)
    return o / denom


def _open_mask(c: _Cache, r: int, not_sink: Tensor) -> Tensor:
    """Keys that an open partition holding r tokens covers, in every page."""
    return not_sink & ((torch.arange(c.skp) % c.p) < r)


def _requant_open_scores(qs, k, s_q, c: _Cache, not_sink, cfg, mode, rep, gen) -> Tensor:
    """HACK/RQE ablation: the open K partition is re-quantized over its r tokens at each step."""
    is_open = c.valid & ~c.closed
    for r in sorted(set(c.open_count.tolist()) - {0}):
        s_r = _scores_channel_k(qs, k, _open_mask(c, r, not_sink), cfg, mode, rep, gen, c.with_open)
        s_q = torch.where(is_open & (c.open_count == r)[:, None], s_r, s_q)
    return s_q


def _requant_open_pv(pr, v, c: _Cache, not_sink, cfg, mode, rep, gen) -> Tensor:
    """HACK/RQE ablation, paper layout: the open V partition re-quantized at each step."""
    out = torch.zeros(*pr.shape[:-1], v.shape[-1])
    is_open = c.valid & ~c.closed & not_sink
    for r in sorted(set(c.open_count.tolist()) - {0}):
        sel = is_open & (c.open_count == r)[:, None]
        out = out + _pv_channel_v(pr, sel, v, _open_mask(c, r, not_sink), cfg, mode, rep, gen)
    return out
