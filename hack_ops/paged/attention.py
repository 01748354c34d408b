"""Decode and extend attention on the HACK store (the run step; `HackKVStore.plan` is the plan).

decode(store, layer, plan, q, k, v)   one query per request (q [B, Hq, D]); stores k/v first.
extend(store, layer, plan, q, k, v)   the new tokens of each request (q [N, Hq, D]), causal over
                                      the cached prefix and themselves; stores k/v itself, after
                                      keeping the FP16 tokens of the prefix's open page that the
                                      write may overwrite.
Modes (hack_ops.modes): `mode` is the AttentionMode, 'hack' (homomorphic, decode-time visibility)
or 'dequant' (the same cache dequantized then attended in float: the strawman baseline); extend's
`prefill` is the PrefillMode, 'homomorphic' (the new tokens read through the cache, as decode
will read them), 'exact' (the new tokens attend to each other in FP16; the cached prefix is
read by `mode`, as decode reads it) or 'dense' (extend_strawman: the new tokens in FP16 and the
cached prefix dequantized once, by SDPA).
Backends ('hack' decode): 'torch' (portable), 'cpu' (the compiled kernel, see cpu_kernel.py),
'auto' = the compiled kernel when it is available and applies, else torch. 'dequant' decode
dequantizes to dequant_dtype and calls SDPA (dequant.py); extend runs on the torch path.
Model features, every path: `window` (SGLang's sliding_window_size: a query at t sees keys
t-window..t; pages wholly before that are not read), `logit_cap` (soft-capping of the scaled
scores) and `scale` (the layer's scaling). A kernel that lacks one says so in its why_not and
the call goes to a path that has it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import clock
from .dequant import dense_kv, dequant_decode
from .chunk_codes import ChunkCodes, layout_refusal, quantize_chunks
from .pages import RequestPages, TensorPages, request_pages
from .plan import ForwardPlan
from .sparse import PageSelection, SparseDecode
from .static_keep import StaticKeepPages
from ..attention import check_logit_cap, check_window
from ..sparse import SparseConfig
from ..modes import EXTEND_PREFILL_MODES, SERVING_MODES, AttentionMode, PrefillMode, attention_mode, prefill_mode
from .store import HackKVStore
from .torch_attention import RequestView, attend_request, first_page

def _check_q(store: HackKVStore, q: Tensor, rows: int, what: str) -> int:
    h, d = store.num_heads, store.head_dim
    if not isinstance(q, Tensor) or not q.is_floating_point() or q.dim() != 3:
        raise ValueError(f"q must be a floating-point tensor [{what}, q_heads, head_dim]")
    if q.shape[0] != rows or q.shape[2] != d or q.shape[1] % h:
        raise ValueError(f"q must be [{rows}, a multiple of {h}, {d}], got {tuple(q.shape)}")
    return q.shape[1] // h


def _sinks(store: HackKVStore, layer: int, plan: ForwardPlan, b: int, seq_len: int):
    s = min(store.config.sink_tokens, seq_len)
    if not s:
        return None, None
    slot = int(plan.sink_slot[b])
    return store.sink_k[layer][slot, :s].float(), store.sink_v[layer][slot, :s].float()


def decode(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor | None = None,
           v: Tensor | None = None, mode: AttentionMode | str = AttentionMode.HACK, scale: float | None = None,
           backend: str = "auto",
           generator: torch.Generator | None = None, dequant_dtype: torch.dtype = torch.bfloat16,
           window: int | None = None, logit_cap: float = 0.0,
           sparse: SparseDecode | SparseConfig | StaticKeepPages | None = None) -> Tensor:
    """Decode attention: returns [B, Hq, D] in q's dtype. mode='dequant' dequantizes the
    visible pages to `dequant_dtype` and calls SDPA (the strawman baseline). window /
    logit_cap: the layer's sliding window and soft-cap (module docstring). sparse: read only
    the pages hack_ops.sparse selects for each (request, KV head) from this step's queries
    (a SparseDecode carries the selection across the layers of one forward; the caller decides
    which layers are sparse: 'hack' mode, no window), or the pages static eviction kept
    (StaticKeepPages, decided at prefill)."""
    if isinstance(sparse, SparseConfig):
        sparse = SparseDecode(sparse) if sparse.enabled else None
    window, logit_cap = check_window(window), check_logit_cap(logit_cap)
    mode = attention_mode(mode, SERVING_MODES, "decode mode")
    if not plan.is_decode:
        raise ValueError("decode needs a plan with one new token per request (use extend)")
    if sparse is not None and (mode != AttentionMode.HACK or window is not None):
        raise ValueError("sparse decode reads the codes of the selected pages: 'hack' mode, on a layer without a "
                         "sliding window")
    store._check_layer(layer)
    rep = _check_q(store, q, plan.batch_size, "batch")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (to store them first) or neither")
    if k is not None:
        with clock.phase("quantization"):
            store.write(layer, plan, k, v, generator)
    scale = 1.0 / math.sqrt(store.head_dim) if scale is None else float(scale)
    if mode == AttentionMode.DEQUANT:
        return dequant_decode(store, layer, plan, q, scale, dequant_dtype, window, logit_cap).to(q.dtype)
    with clock.phase("approximation"):  # the selection is part of attending on the codes
        selection = sparse.select(store, layer, plan, q) if sparse is not None else None
        return _decode_on_codes(store, layer, plan, q, rep, mode, scale, backend, generator, window, logit_cap,
                                selection)


def _decode_on_codes(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, rep: int, mode: AttentionMode,
                     scale: float, backend: str, generator: torch.Generator | None,
                     window: int | None = None, logit_cap: float = 0.0,
                     selection: PageSelection | None = None) -> Tensor:
    """Decode on the codes: the compiled kernel where it applies, else the PyTorch path; with a
    selection, each request's shortened sequence of selected pages (per KV head)."""
    from . import cpu_kernel  # late import: the compiled kernel is optional

    if generator is None:  # asked once per plan and store (every layer of a step asks alike)
        key = ("cpu_kernel_usable", id(store), mode, backend)
        usable = plan.memo.get(key)
        if usable is None:
            usable = plan.memo[key] = cpu_kernel.usable(store, mode, backend, window=window, logit_cap=logit_cap)
    else:
        usable = cpu_kernel.usable(store, mode, backend, generator, window=window, logit_cap=logit_cap)
    if usable:
        return cpu_kernel.decode(store, layer, plan, q, scale, window=window, logit_cap=logit_cap,
                                 selection=selection, out_dtype=q.dtype)
    if backend == "cpu":
        raise RuntimeError(f"the compiled CPU kernel is not usable here: {cpu_kernel.why_not(store, mode, generator)}")
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'cpu', got {backend!r}")
    p = store.page_size
    h, d = store.num_heads, store.head_dim
    out = torch.empty(plan.batch_size, h * rep, d, dtype=torch.float32)
    for b, seq_len in enumerate(plan.seq_list):
        row = int(plan.rows[b])
        npg = int(plan.num_pages[b])
        lo = first_page(seq_len - 1, window, p)  # pages before the window are not gathered
        pages = plan.page_table[b, lo:npg]
        if selection is not None:  # the shortened sequence: each KV head its own pages
            seq_len, pages = int(selection.seq_lens[b]), selection.heads_pages(b)
        rp = request_pages(store.layout_for(layer), store.k_pages[layer], store.v_pages[layer], pages.to(store.device))
        win_start = (seq_len // p) * p  # the open page (empty when the page just closed)
        ranges = {name: [(win_start, store.tails[name][layer][row, : seq_len - win_start].float())]
                  for name in store.tails}
        sk, sv = _sinks(store, layer, plan, b, seq_len)
        view = RequestView(seq_len=seq_len, exact_from=seq_len, k16=ranges.get("k", []), v16=ranges.get("v", []),
                           sink_k=sk, sink_v=sv)
        qb = (q[b].float() * scale).reshape(1, h, rep, d)
        t = torch.tensor([seq_len - 1])
        o = attend_request(qb, t, t.add(1).div(p, rounding_mode="floor"), rp, view, store.config_for(layer), mode, generator,
                           window=window, logit_cap=logit_cap, page0=lo)
        out[b] = o.reshape(h * rep, d)
    return out.to(q.dtype)


def extend(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
           mode: AttentionMode | str = AttentionMode.HACK, scale: float | None = None,
           generator: torch.Generator | None = None, backend: str = "auto", window: int | None = None,
           logit_cap: float = 0.0, prefill: PrefillMode | str = PrefillMode.HOMOMORPHIC,
           dense_dtype: torch.dtype | None = None) -> Tensor:
    """Extend (prefill) attention with causal masking; stores k/v. Returns [N, Hq, D] in q's
    dtype. mode / prefill: the AttentionMode and PrefillMode; window / logit_cap: the layer's
    sliding window and soft-cap (module docstring). dense_dtype: what PrefillMode.DENSE attends
    in (None: BF16 for BF16 q, else float32; a server picks float32 on a CPU without AMX-BF16,
    engine.prefill_choice.dense_dtype)."""
    window, logit_cap = check_window(window), check_logit_cap(logit_cap)
    mode = attention_mode(mode, SERVING_MODES, "extend mode")
    prefill = prefill_mode(prefill, EXTEND_PREFILL_MODES, "extend prefill")  # 'auto' is resolved by the server
    exact = prefill == PrefillMode.EXACT
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'cpu', got {backend!r}")
    if prefill == PrefillMode.DENSE:  # the dequantizing prefill; BF16 SDPA for a BF16 model by default
        dtype = dense_dtype or (torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
        return extend_strawman(store, layer, plan, q, k, v, scale, generator, dtype, window, logit_cap)
    store._check_layer(layer)
    n_new = plan.num_new_tokens
    rep = _check_q(store, q, n_new, "new_tokens")
    p = store.page_size
    h, d = store.num_heads, store.head_dim
    snaps = keep_open_tokens(store, layer, plan)
    with clock.phase("quantization"):
        store.write(layer, plan, k, v, generator)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if exact and not plan.has_prefix:
        return _exact_cold(plan, q, k, v, scale, window, logit_cap).to(q.dtype)
    from . import cpu_extend  # late import: the compiled kernels are optional

    # A kernel that lacks a feature the call needs declines (cpu_extend.choose says why).
    path, why = cpu_extend.choose(store, mode, generator, backend, window, logit_cap, prefill)
    if path in cpu_extend.TILED:
        kw, vw, woff = _fp16_windows(store, plan, k, v, snaps)
        chunk = (_chunk_codes(store, layer, plan, kw, vw, woff, cpu_extend.chunk_codes)
                 if prefill == PrefillMode.INT8 else None)
        return cpu_extend.attend(store, layer, plan, q, scale, kw, vw, woff, exact, window=window,
                                 logit_cap=logit_cap, chunk=chunk).to(q.dtype)
    if path == cpu_extend.ExtendPath.PER_QUERY:
        return _extend_kernel(store, layer, plan, q, k, v, snaps, exact, scale, window, logit_cap).to(q.dtype)
    if backend == "cpu":
        raise RuntimeError(f"the compiled CPU kernel is not usable here: {why}")
    new = {"k": k.to(torch.float16).float(), "v": v.to(torch.float16).float()}
    chunk = None
    if prefill == PrefillMode.INT8:
        chunk = _chunk_codes(store, layer, plan, *_fp16_windows(store, plan, k, v, snaps))
    out = torch.empty(n_new, h * rep, d, dtype=torch.float32)
    for b, (seq_len, pre) in enumerate(zip(plan.seq_list, plan.prefix_list)):
        lo, hi = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        npg = int(plan.num_pages[b])
        pg0 = first_page(pre, window, p)  # the first new token's window: earlier pages are not gathered
        rp = request_pages(store.layout_for(layer), store.k_pages[layer], store.v_pages[layer],
                           plan.page_table[b, pg0:npg].to(store.device))
        if chunk is not None:  # pages from the window's first on: the chunk's finer codes
            rp = _with_chunk_pages(rp, chunk, b, pre // p - pg0)
        sk, sv = _sinks(store, layer, plan, b, seq_len)
        ranges = {name: [(pre, x[lo:hi])] for name, x in new.items()}  # the new tokens in FP16
        for name, snap in snaps.items():  # tensors with a tail: the prefix's open page too
            ranges[name] = [((pre // p) * p, torch.cat([snap[b], new[name][lo:hi]], 0))]
        view = RequestView(seq_len=seq_len, exact_from=pre if exact else seq_len, k16=ranges["k"], v16=ranges["v"],
                           sink_k=sk, sink_v=sv)
        t = torch.arange(pre, seq_len)
        nc = torch.full_like(t, pre // p) if exact else (t + 1) // p
        qb = (q[lo:hi].float() * scale).reshape(hi - lo, h, rep, d)
        o = attend_request(qb, t, nc, rp, view, store.config_for(layer), mode, generator,
                           window=window, logit_cap=logit_cap, page0=pg0)
        out[lo:hi] = o.reshape(hi - lo, h * rep, d)
    return out.to(q.dtype)


def _chunk_codes(store: HackKVStore, layer: int, plan: ForwardPlan, kw: Tensor, vw: Tensor,
                 woff: Tensor, make=quantize_chunks) -> ChunkCodes:
    """PrefillMode.INT8's codes of each request's FP16 window (hack_ops.paged.chunk_codes;
    make: its reference, or the compiled cpu_extend.chunk_codes)."""
    cfg = store.config_for(layer)
    refusal = layout_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    with clock.phase("quantization"):
        return make(kw, vw, woff, plan.prefix_list, plan.seq_list, store.page_size, cfg.head_group(store.head_dim),
                    cfg.sink_tokens)


def _with_chunk_pages(rp: RequestPages, chunk: ChunkCodes, b: int, at: int) -> RequestPages:
    """rp (one request's pages) with its pages from index `at` on (its window's first page:
    a layer's sliding window never starts past the prefix's open page) replaced by the chunk's
    codes of the same pages."""
    fine = chunk.request_pages(b)

    def join(old: TensorPages, new: TensorPages) -> TensorPages:
        parts = [None if x is None else torch.cat([x[:, :at], y], 1)
                 for x, y in zip((old.codes, old.scale, old.minimum, old.sums), (new.codes, new.scale, new.minimum,
                                                                                new.sums))]
        return TensorPages(*parts)

    return RequestPages(join(rp.k, fine.k), join(rp.v, fine.v))


def extend_strawman(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
                    scale: float | None = None, generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.bfloat16, window: int | None = None,
                    logit_cap: float = 0.0) -> Tensor:
    """The dequantizing strawman's prefill (KIVI/CacheGen-style systems), stores k/v: the new
    tokens attend to each other in full precision and to the cached prefix dequantized to
    `dtype` (a dense copy, then SDPA). A prompt without cached prefix is plain causal attention.
    This is what such a system runs for a chunk over a cached prefix (a chunked prompt, or a
    radix-cache hit), so the baseline pays no per-token path that it would not have. It is
    also PrefillMode.DENSE's extend (`--hack-prefill dense`)."""
    window, logit_cap = check_window(window), check_logit_cap(logit_cap)
    store._check_layer(layer)
    _check_q(store, q, plan.num_new_tokens, "new_tokens")
    snaps = keep_open_tokens(store, layer, plan)
    with clock.phase("quantization"):
        store.write(layer, plan, k, v, generator)
    return dense_attend(store, layer, plan, q, k, v, snaps, scale, dtype, window, logit_cap)


def dense_attend(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
                 snaps: dict[str, list[Tensor]], scale: float | None, dtype: torch.dtype,
                 window: int | None = None, logit_cap: float = 0.0) -> Tensor:
    """The attention of PrefillMode.DENSE's extend once the chunk is stored: the new tokens
    attend to each other in full precision and to the cached prefix dequantized to `dtype`.
    snaps: keep_open_tokens() taken before the store (which may close the prefix's open page).
    On the device of q (the CPU path after its store, the GPU path after the Triton store);
    returns [N, Hq, D] in q's dtype."""
    scale = 1.0 / math.sqrt(store.head_dim) if scale is None else float(scale)
    if not plan.has_prefix:
        return _exact_cold(plan, q, k, v, scale, window, logit_cap, dtype).to(q.dtype)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, (seq_len, pre) in enumerate(zip(plan.seq_list, plan.prefix_list)):
        lo, hi = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        if pre == 0:  # a cold prompt batched with chunks over a prefix: nothing to dequantize
            out[lo:hi] = _cold_request(q[lo:hi], k[lo:hi], v[lo:hi], scale, window, logit_cap, dtype)
            continue
        with clock.phase("dequantization"):  # the dense copy only, not the attention
            dense = dense_kv(store, layer, plan, b, pre, {n: t[b] for n, t in snaps.items()}, dtype)
        kc, vc = (x[lo:hi].to(torch.float16).to(dtype).transpose(0, 1)[None] for x in (k, v))
        qb = q[lo:hi].to(dtype).transpose(0, 1)[None]
        t = torch.arange(pre, seq_len, device=q.device)
        if window is None and not logit_cap:
            o = prefix_then_causal(qb, dense["k"][None], dense["v"][None], kc, vc, scale)
        else:
            kb, vb = torch.cat([dense["k"][None], kc], 2), torch.cat([dense["v"][None], vc], 2)
            o = masked_dense(qb, kb, vb, scale, window, logit_cap, t)
        out[lo:hi] = o[0].transpose(0, 1).float()
    return out.to(q.dtype)


def prefix_then_causal(q: Tensor, kp: Tensor, vp: Tensor, kc: Tensor, vc: Tensor, scale: float) -> Tensor:
    """Attention of a chunk's queries q [1, Hq, n, D] over a prefix kp/vp [1, H, m, D] that
    every query sees and the chunk's own keys kc/vc [1, H, n, D], causally; float32 [1, Hq, n, D].

    Two flash attentions merged by their log-sum-exp (torch's CPU flash kernel returns it): the
    prefix part without a mask, the chunk part causal, so neither materializes an n x (m + n)
    mask or computes the masked half (~1.7x one masked SDPA at 4K + 4K tokens). Where that
    kernel is missing (another torch), one SDPA with the mask. An empty prefix (m = 0) is the
    chunk's causal attention alone: the flash kernel is never called over zero keys."""
    if q.device.type != "cpu":
        return lower_right_causal(q, torch.cat([kp, kc], 2), torch.cat([vp, vc], 2), scale)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.dtype not in (torch.bfloat16, torch.float32):
        t = torch.arange(kp.shape[2], kp.shape[2] + q.shape[2])
        mask = torch.arange(kp.shape[2] + q.shape[2])[None, :] <= t[:, None]
        return F.scaled_dot_product_attention(q, torch.cat([kp, kc], 2), torch.cat([vp, vc], 2), attn_mask=mask,
                                              scale=scale, enable_gqa=q.shape[1] != kp.shape[1]).float()
    rep = q.shape[1] // kp.shape[1]
    kp, vp, kc, vc = (x.repeat_interleave(rep, 1) if rep > 1 else x for x in (kp, vp, kc, vc))
    o2, l2 = cpu_flash(q, kc, vc, causal=True, scale=scale)
    if kp.shape[2] == 0:
        return o2.float()
    o1, l1 = cpu_flash(q, kp, vp, causal=False, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def cpu_flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """torch's CPU flash attention (q [1, Hq, n, D] over k/v [1, Hq, m, D], heads already
    repeated), returning (output in q's dtype, log-sum-exp float32 [1, Hq, n]); causal is
    top-left aligned, so only n == m is meant. The kernel divides by zero on an empty query or
    key range (SIGFPE: the process dies without a Python error), so every shape is checked
    first and a bad one is refused with a ValueError that names it."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if any(x.dim() != 4 for x in (q, k, v)):
        raise ValueError(f"flash attention takes 4-D [batch, heads, tokens, head_dim] tensors, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] == 0:
        raise ValueError(f"flash attention called with no queries (q {tuple(q.shape)})")
    if k.shape[2] == 0:
        raise ValueError(f"flash attention called with no keys (k {tuple(k.shape)}): an empty key range "
                         "must be handled before the kernel")
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]) or k.shape[2] != v.shape[2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"flash attention needs the same batch and heads (repeated for GQA), as many values "
                         f"as keys and q's head_dim in k: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal flash attention here needs as many queries as keys, got {q.shape[2]} and "
                         f"{k.shape[2]}")
    o, lse = flash(q, k, v, 0.0, causal, scale=scale)[:2]
    return o, lse


def lower_right_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of n queries [1, Hq, n, D] that are the last n of the m keys [1, H, m, D]: query
    i sees keys 0..m-n+i. On a GPU SDPA takes this as torch's lower-right causal bias (no n x m
    mask in memory; flash/memory-efficient kernels), the way the GPU's dense prefill attends a
    chunk over its dequantized prefix. float32 out."""
    from torch.nn.attention.bias import causal_lower_right

    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # the bias path takes no enable_gqa
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          scale=scale).float()


def keep_open_tokens(store: HackKVStore, layer: int, plan: ForwardPlan) -> dict[str, list[Tensor]]:
    """The FP16 tokens of each prefix's open page, per tensor with a tail, kept before the
    write that may close (overwrite) that page."""
    p = store.page_size
    return {name: [tails[layer][int(plan.rows[b]), : pre - (pre // p) * p].float().clone()
                   for b, pre in enumerate(plan.prefix_list)] for name, tails in store.tails.items()}


def _exact_cold(plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor, scale: float,
                window: int | None = None, logit_cap: float = 0.0, dtype: torch.dtype | None = None) -> Tensor:
    """PrefillMode.EXACT extend of requests without a cached prefix: every key is one of the chunk's own
    tokens, in FP16 as stored, so this is causal attention over them (torch SDPA, blocked and
    fast on CPU) instead of a per-token pass over pages. Returns float32 [N, Hq, D]."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(plan.batch_size):
        lo, hi = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        out[lo:hi] = _cold_request(q[lo:hi], k[lo:hi], v[lo:hi], scale, window, logit_cap, dtype)
    return out


def _cold_request(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
                  logit_cap: float = 0.0, dtype: torch.dtype | None = None) -> Tensor:
    """One request without a cached prefix (q [n, Hq, D], its own k/v [n, H, D]): causal
    attention over its own tokens in FP16 as stored; float32 [n, Hq, D]. A dense prefill that
    batches such a request with chunks over a prefix attends it here too, exactly as alone.

    BF16 q/k/v (what a BF16 model serves) take SDPA in BF16 on the stored FP16 values rounded to
    BF16, which gives back the model's own BF16 K/V wherever FP16 holds them exactly (|x| in
    FP16's normal range): the attention SGLang's BF16 backend computes, on AMX where the CPU has
    it (~3x float32 SDPA at 2K-8K tokens, docs/engine.md). Other dtypes take float32, and so does
    any call that names dtype float32 (a dense prefill on a CPU without AMX-BF16, where BF16 SDPA
    runs at about half float32's speed)."""
    work = dtype or (torch.bfloat16 if q.dtype == k.dtype == v.dtype == torch.bfloat16 else torch.float32)
    qb = q.to(work).transpose(0, 1)[None]
    kb, vb = (x.to(torch.float16).to(work).transpose(0, 1)[None] for x in (k, v))
    gqa = qb.shape[1] != kb.shape[1]
    if window is None and not logit_cap:
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        o = masked_dense(qb, kb, vb, scale, window, logit_cap, torch.arange(q.shape[0], device=q.device))
    return o[0].transpose(0, 1).float()


def _fp16_windows(store: HackKVStore, plan: ForwardPlan, k: Tensor, v: Tensor, snaps: dict):
    """Each request's FP16 K and V from the start of the prefix's open page: the tokens kept
    from its tail before the write, then the new tokens (zeros for a tensor without a tail,
    which the kernels then never read). Returns (k_win, v_win, element offset per request)."""
    p = store.page_size
    hd = store.num_heads * store.head_dim
    wins: dict[str, list[Tensor]] = {"k": [], "v": []}
    offs, off = [], 0
    for b, pre in enumerate(plan.prefix_list):
        lo, hi = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        for name, x in (("k", k), ("v", v)):
            head = snaps[name][b].to(torch.float16) if name in snaps else torch.zeros(pre % p, *x.shape[1:], dtype=torch.float16)
            wins[name].append(torch.cat([head, x[lo:hi].to(torch.float16)], 0))
        offs.append(off)
        off += wins["k"][-1].shape[0] * hd
    kw, vw = (torch.cat(wins[n], 0).contiguous() for n in ("k", "v"))
    return kw, vw, torch.tensor(offs, dtype=torch.long)


def masked_dense(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, logit_cap: float,
                  t: Tensor, block: int = 512) -> Tensor:
    """Dense attention [1, Hq, n, D] x [1, H, m, D] for queries at positions t (ascending) over
    keys 0..m-1, with the window and soft-cap (which SDPA does not take as such), float32 out.
    Queries go in blocks, each over the keys its window can reach only, so memory stays
    O(block * window). Inputs are attended in float32, except BF16 inputs without a soft-cap (a
    BF16 model's window layers) go to SDPA in BF16 with the block's window as its mask, the
    dtype the layers without a window attend in (docs/engine.md measures it on Gemma-3)."""
    from ..attention import soft_cap, visible

    rep = q.shape[1] // k.shape[1]
    sdpa = q.dtype == k.dtype == v.dtype == torch.bfloat16 and not logit_cap
    if not sdpa:
        q, k, v = q.float(), k.float(), v.float()
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[2], block):
        tb = t[i:i + block]
        k_lo = 0 if window is None else max(0, int(tb[0]) - window)
        k_hi = int(tb[-1]) + 1
        ok = visible(torch.arange(k_lo, k_hi, device=q.device)[None, :], tb[:, None], window)
        if sdpa:
            out[:, :, i:i + block] = F.scaled_dot_product_attention(
                q[:, :, i:i + block], k[:, :, k_lo:k_hi], v[:, :, k_lo:k_hi], attn_mask=ok, scale=scale,
                enable_gqa=rep > 1).float()
            continue
        s = soft_cap((q[:, :, i:i + block] * scale) @ k[:, :, k_lo:k_hi].transpose(-1, -2), logit_cap)
        out[:, :, i:i + block] = torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ v[:, :, k_lo:k_hi]
    return out


def _extend_kernel(store: HackKVStore, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
                   snaps: dict, exact: bool, scale: float, window: int | None = None,
                   logit_cap: float = 0.0) -> Tensor:
    """Extend on the compiled kernel: one kernel query per new token (position t sees a
    sequence of length t+1). Its open region is read from a window of FP16 tokens per request:
    the prefix's open page (kept before the write) followed by the new tokens."""
    from . import cpu_kernel

    p = store.page_size
    kw, vw, offs = _fp16_windows(store, plan, k, v, snaps)
    starts = [((pre // p) * p, o) for pre, o in zip(plan.prefix_list, offs.tolist())]
    hd = store.num_heads * store.head_dim
    pos = plan.tok_pos
    seq = pos + 1
    if exact:  # the new tokens are read in FP16: only the prefix's closed pages from codes
        n_closed = plan.prefix_lens[plan.tok_req] // p
    else:
        n_closed = seq // p
    wstart = torch.tensor([s for s, _ in starts])[plan.tok_req]
    woff = torch.tensor([o for _, o in starts])[plan.tok_req]
    open_off = woff + (n_closed * p - wstart) * hd
    return cpu_kernel.attend(store, layer, q, scale, seq, n_closed, plan.page_table, plan.tok_req,
                             plan.sink_slot.clamp(min=0)[plan.tok_req], kw, open_off, vw, open_off,
                             window=window, logit_cap=logit_cap)
