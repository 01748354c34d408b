"""How the accuracy study computes a layer's attention: the dense reference, or the fast paths.

REFERENCE runs hack_ops.attention, the one definition of the math, on every query at once
([q, k] score matrices per head and per page group): every option, but minutes per window at
2K and out of memory at 8K. FAST computes the same quantities the way the server does or in
query blocks, so 8K contexts and many windows fit in an hour on one core:
  * 'exact': float32 attention, torch's fused causal kernel or, with a window or a soft-cap,
    blocks of queries over the keys each block can see;
  * 'hack': the serving path itself, a cold prompt through HackKVStore and
    hack_ops.paged.attention.extend (the compiled page store and the tiled INT8 extend kernel
    where they apply), which the CI tests hold to the reference;
  * 'dequant': decode-time visibility in query blocks: a key is read from its dequantized
    closed page when the query's partition has moved past it (or its tensor is quantized as
    written), else from FP16, exactly the rule of hack_ops.attention.
The fast 'hack' path quantizes K and V as the serving store does, from their FP16 values; the
reference and the fast 'dequant' path quantize the float32 values (on real activations the two
differ by a code flip here and there, below the window-to-window spread). A config the fast
paths cannot express (dense-and-sparse K, the re-quantized open partition of the RQE ablation)
runs on the reference: fast_refusal() names the reason, and the study says which rows ran
where.
"""
from __future__ import annotations

import math
from enum import Enum

import torch
from torch import Tensor

from hack_ops import AttentionMode, HackConfig, attention
from hack_ops.attention import check_logit_cap, check_window, k_page_tables, quantize_kv, soft_cap, visible
from hack_ops.config import OpenMode
from hack_ops.modes import attention_mode
from hack_ops.paged.attention import extend, masked_dense
from hack_ops.paged.store import HackKVStore
from hack_ops.quant import dequantize
from hack_ops.rotation import restore_output, rotate_qkv
from hack_ops.sparse import SparseConfig, row_page_mask

QUERY_BLOCK = 256  # queries per block: a [heads, 256, keys] score block instead of [heads, n, n]


class AttentionPath(str, Enum):
    """Where the study's attention runs (`hack eval accuracy|retrieval --attention-path`)."""

    REFERENCE = "reference"
    FAST = "fast"


class QuantizedTensors(str, Enum):
    """Which of a layer's K and V the study quantizes (the other read in FP16): both, as every
    serving path does, or one alone, to split a format's error between them (dequant, fast path)."""

    KV = "kv"
    K = "k"
    V = "v"


def attention_path(value: AttentionPath | str) -> AttentionPath:
    try:
        return AttentionPath(value)
    except ValueError:
        raise ValueError(f"attention path must be one of {[p.value for p in AttentionPath]}, got {value!r}") from None


def fast_refusal(config: HackConfig | None, mode: AttentionMode | str) -> str | None:
    """Why the fast paths cannot compute this variant (None: they can)."""
    mode = attention_mode(mode)
    if mode == AttentionMode.EXACT or config is None:
        return None
    if config.reference_only():
        return f"{', '.join(config.reference_only())} is implemented in the reference only"
    if OpenMode.REQUANT in (config.open_mode("k"), config.open_mode("v")):
        return "the open partition is re-quantized at every step (RQE off)"
    return None


def study_attention(q: Tensor, k: Tensor, v: Tensor, config: HackConfig | None, mode: AttentionMode | str,
                    scale: float | None = None, window: int | None = None, logit_cap: float = 0.0,
                    path: AttentionPath | str = AttentionPath.FAST,
                    tensors: QuantizedTensors | str = QuantizedTensors.KV,
                    sparse: SparseConfig | None = None, static: tuple[Tensor, int] | None = None) -> Tensor:
    """Causal self-attention of one sequence, q [1, Hq, m, D] (the last m positions), k/v
    [1, H, n, D]; returns float32 [1, Hq, m, D] as hack_ops.attention does for the same
    arguments. On the reference for AttentionPath.REFERENCE, when fast_refusal() says so, or
    for m < n (a generation step). tensors: K or V alone quantized (the other read in FP16),
    'dequant' mode on the fast path only. sparse: every query reads the pages its sparse
    decode selection keeps (hack_ops.sparse): 'dequant' on the fast path, 'hack' on the
    reference (the serving extend kernel has no per-query selection). static: (kept [H, N], the
    prompt's length): positions from the prompt's length on (decode steps) read only the
    prompt's closed pages kept (hack_ops.static_keep); 'dequant' on the fast path, whole
    sequences, no window."""
    mode, path, tensors = attention_mode(mode), attention_path(path), QuantizedTensors(tensors)
    if sparse is not None and not sparse.enabled:
        sparse = None
    if tensors != QuantizedTensors.KV and (mode != AttentionMode.DEQUANT or path != AttentionPath.FAST
                                           or q.shape[2] != k.shape[2] or fast_refusal(config, mode)):
        raise ValueError(f"K or V alone ({tensors.value}) is computed by the fast 'dequant' path over whole "
                         "sequences only")
    window, logit_cap = check_window(window), check_logit_cap(logit_cap)
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError("study_attention takes one sequence: q [1, heads, len, head_dim]")
    cfg = config or HackConfig()
    # Fewer queries than keys (a generation step over transformers' cache) is the reference's
    # bottom-right case; the fast paths take whole sequences.
    whole = q.shape[2] == k.shape[2]
    if static is not None and (mode != AttentionMode.DEQUANT or path != AttentionPath.FAST or not whole
                               or window is not None or fast_refusal(config, mode) is not None or sparse is not None):
        raise ValueError("static eviction is studied in 'dequant' mode on the fast path, over whole sequences "
                         "of layers without a window, without sparse decode")
    if (path == AttentionPath.REFERENCE or not whole or fast_refusal(config, mode) is not None
            or (sparse is not None and mode == AttentionMode.HACK)):
        return attention(q, k, v, cfg, mode=mode, causal=True, scale=scale, window=window, logit_cap=logit_cap,
                         sparse=sparse)
    if sparse is not None and (mode != AttentionMode.DEQUANT or tensors != QuantizedTensors.KV):
        raise ValueError("sparse decode is studied in 'hack' and 'dequant' modes with K and V quantized")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mode == AttentionMode.EXACT:
        q, k, v = q.float(), k.float(), v.float()
        if window is None and not logit_cap:  # torch's fused causal kernel
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return masked_dense(q, k, v, scale, window, logit_cap, torch.arange(q.shape[2]), block=QUERY_BLOCK)
    q, k, v = rotate_qkv(q.float(), k.float(), v.float(), cfg.rotation)
    if mode == AttentionMode.HACK:
        out = _serving_extend(q, k, v, cfg, scale, window, logit_cap)
    else:
        kc, ko, vc, vo = dequant_views(k, v, cfg)
        if tensors == QuantizedTensors.K:  # V as the FP16 cache would hold it
            vc = vo = v.half().float()
        elif tensors == QuantizedTensors.V:
            kc = ko = k.half().float()
        pages = None
        if sparse is not None:
            if window is not None or cfg.orientation != "channel_k":
                raise ValueError("sparse decode: orientation 'channel_k' and no sliding window")
            pages = (sparse, *k_page_tables(k, cfg), cfg.bits("k"))
        out = _blocked(q * scale, kc, ko, vc, vo, cfg.partition_size, window, logit_cap, pages, static)
    return restore_output(out, cfg.rotation)


def dequant_views(k: Tensor, v: Tensor, cfg: HackConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense float views [1, H, n, D] of what the cache returns for each key: (K closed, K open,
    V closed, V open). 'Closed' is what a query reads once the key's page has closed (the
    page's codes dequantized), 'open' what it reads while the key is in the query's own open
    partition (FP16 from the tail, or the per-token codes of a tensor quantized as written).
    Sink tokens read FP16 in both. The quantization is hack_ops.attention's (its quantize_kv,
    the same masks and groups)."""
    n, p = k.shape[-2], cfg.partition_size
    npad = -(-n // p) * p
    j = torch.arange(npad)
    not_sink = (j >= cfg.sink_tokens) & (j < n)
    full_page = (j // p + 1) * p <= n
    pad = (0, 0, 0, npad - n)
    views = []
    for name, x in (("k", k), ("v", v)):
        xp = torch.nn.functional.pad(x.float(), pad)
        per_token = cfg.k_per_token if name == "k" else cfg.v_per_token
        # Per token: groups along head_dim, each token on its own; per channel: over whole pages.
        keep = not_sink if per_token else not_sink & full_page
        dim, group = (-1, cfg.head_group(x.shape[-1])) if per_token else (-2, p)
        deq = dequantize(quantize_kv(xp, dim, group, cfg, None, keep[:, None].expand(xp.shape), name)) * keep[:, None]
        exact16 = xp.half().float()
        sink = ~not_sink[:, None] & (j < n)[:, None]
        closed = torch.where(sink, exact16, deq)
        opened = exact16 if cfg.open_mode(name) == OpenMode.FP16 else closed
        views += [closed[..., :n, :], opened[..., :n, :]]
    return views[0], views[1], views[2], views[3]


def _blocked(qs: Tensor, kc: Tensor, ko: Tensor, vc: Tensor, vo: Tensor, page: int,
             window: int | None, logit_cap: float, sparse: tuple | None = None,
             static: tuple[Tensor, int] | None = None) -> Tensor:
    """Attention of scaled queries qs [1, Hq, n, D] over keys 0..t (and the window) in blocks of
    queries. Key j is read from the closed views (kc, vc) when j < ((t+1) // page) * page, the
    keys the query's partition has moved past, else from the open views (ko, vo). Keys before the block's first partition are closed and unmasked (but for the
    window) for every query of the block, so only the block's own partitions pay for the
    choice and the causal mask. Memory O(heads * QUERY_BLOCK * keys). sparse: (SparseConfig,
    K's page minimum, scale [1, H, pages, D], K bits): each query reads only the closed pages
    its selection keeps (hack_ops.sparse.row_page_mask). static: (kept [H, N], prompt length):
    queries at or past the prompt's length read only the kept pages of the prompt's first N
    (no window here either)."""
    n, rep = qs.shape[2], qs.shape[1] // kc.shape[1]
    dropped = None
    if static is not None:  # [Hq, N * page] keys of the prompt's dropped pages
        kept, plen = static
        dropped = ~kept.repeat_interleave(page, -1)
        dropped = dropped.repeat_interleave(rep, 0) if rep > 1 else dropped
    heads = (lambda x: x.repeat_interleave(rep, 1)) if rep > 1 else (lambda x: x)
    kc, ko, vc, vo = heads(kc), heads(ko), heads(vc), heads(vo)
    out = torch.empty(qs.shape[:3] + (vc.shape[-1],), dtype=torch.float32)
    for lo in range(0, n, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, n)
        t = torch.arange(lo, hi)
        k_lo = 0 if window is None else max(0, lo - window)
        d_lo = max(k_lo, (lo // page) * page)  # the block's own partitions
        d = d_lo - k_lo
        jd = torch.arange(d_lo, hi)
        qb = qs[:, :, lo:hi]
        s = qb @ kc[:, :, k_lo:hi].transpose(-1, -2)
        open_key = jd[None, :] >= (((t + 1) // page) * page)[:, None]  # [queries, keys from d_lo]
        s[..., d:] = torch.where(open_key, qb @ ko[:, :, d_lo:hi].transpose(-1, -2), s[..., d:])
        s = soft_cap(s, logit_cap)
        if sparse is not None:  # no window here: keys 0..hi-1
            cfg_sp, mn, sc, bits = sparse
            h = kc.shape[1] // rep
            keys = (kc[:, ::rep] if rep > 1 else kc) if cfg_sp.refine > 1 else None  # the pages' own keys
            keep = row_page_mask(qb.reshape(1, h, rep, hi - lo, qb.shape[-1]), mn, sc, bits, (t + 1) // page,
                                 cfg_sp, page, keys)  # [1, H, rows, pages]
            keep = torch.nn.functional.pad(keep, (0, max(0, -(-hi // page) - keep.shape[-1])), value=True)
            keep = keep.repeat_interleave(page, -1)[..., :hi]
            s.masked_fill_(~(keep.repeat_interleave(rep, 1) if rep > 1 else keep), float("-inf"))
        if dropped is not None and hi > plen:  # no window here: keys 0..hi-1
            dec = t >= plen
            w = min(dropped.shape[-1], hi)
            s[:, :, dec, :w] = s[:, :, dec, :w].masked_fill(dropped[None, :, None, :w], float("-inf"))
        if window is None:
            s[..., d:].masked_fill_(jd[None, :] > t[:, None], float("-inf"))
        else:
            s.masked_fill_(~visible(torch.arange(k_lo, hi)[None, :], t[:, None], window), float("-inf"))
        pr = torch.softmax(s, -1)
        pd = pr[..., d:]
        po = pd * open_key
        out[:, :, lo:hi] = (pr[..., :d] @ vc[:, :, k_lo:d_lo] + (pd - po) @ vc[:, :, d_lo:hi]
                            + po @ vo[:, :, d_lo:hi])
    return out


def _serving_extend(q: Tensor, k: Tensor, v: Tensor, cfg: HackConfig, scale: float, window: int | None,
                    logit_cap: float) -> Tensor:
    """One cold prompt of n tokens through the serving store and extend (one layer, one row)."""
    n, h, d = k.shape[2], k.shape[1], k.shape[3]
    pages = -(-n // cfg.partition_size)
    store = HackKVStore(cfg, num_layers=1, num_heads=h, head_dim=d, num_pages=pages, num_rows=1)
    req_to_token = torch.arange(pages * cfg.partition_size)[None]  # token slot j -> page j // P
    lens = torch.tensor([n])
    plan = store.plan(req_to_token, [0], lens, lens)
    tok = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731  [1, H, n, D] -> [n, H, D]
    out = extend(store, 0, plan, tok(q), tok(k), tok(v), mode=AttentionMode.HACK, scale=scale,
                 window=window, logit_cap=logit_cap)
    return out.float().transpose(0, 1)[None]
