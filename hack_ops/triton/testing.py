"""Reference inputs for the kernel tests: pages filled straight from hack_ops.quantize.

`fill_sequence` writes what the serving cache holds after a sequence of L tokens was stored,
computed densely with the reference quantizer and the layout's section views — an oracle that
shares no code with the Triton store (and lets the attention kernels be tested on their own).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import PageLayout, page_layout
from ..modes import AttentionMode
from ..packing import pack
from ..quant import quantize

_META = {"float16": torch.float16, "float32": torch.float32}

def require_kernel_device(device: torch.device) -> None:
    """Fail clearly unless the kernels run where the tests put their tensors: compiled on a
    CUDA GPU for device 'cuda', in Triton's CPU interpreter for 'cpu' (tests/conftest.py
    chooses, see hack_ops/kernel_device.py, before triton is imported)."""
    import triton

    from .decode_kernel import hack_decode_kernel

    interpreted = bool(triton.knobs.runtime.interpret) and type(hack_decode_kernel).__name__ == "InterpretedFunction"
    if device.type == "cuda":
        if interpreted or not torch.cuda.is_available():
            raise RuntimeError("CUDA kernel tests need a GPU and Triton in compiled mode: unset TRITON_INTERPRET "
                               "(and HACK_KERNEL_DEVICE=interpreter)")
    elif device.type == "cpu":
        if not interpreted:
            raise RuntimeError("the Triton kernels need the interpreter on CPU tensors: set TRITON_INTERPRET=1 "
                               "before triton is imported (tests/conftest.py does when there is no GPU)")
    else:
        raise RuntimeError(f"the Triton kernels run on cuda or (interpreted) cpu tensors, not {device.type}")


def to_device(x, device: torch.device):
    """A tensor, or the tensors of a dict/list (None kept), on `device`."""
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [to_device(v, device) for v in x]
    return x


def fill_sequence(layout: PageLayout, bufs: dict[str, Tensor], k: Tensor, v: Tensor, pages: list[int],
                  tail_row: int, sink_slot: int) -> None:
    """Store a whole sequence k, v [L, H, D] into `pages` (its page table), the FP16 tail row(s)
    and the sink slot, like incremental stores would leave them (round to nearest). K, and V
    when it has a tail, are quantized from their FP16 values (what the tails hold); K's codes
    with cfg.bits('k') bits, V's with cfg.bits('v')."""
    cfg = layout.config
    if cfg.orientation != "channel_k":
        raise NotImplementedError("fill_sequence builds channel_k pages")
    p, sk = cfg.partition_size, cfg.sink_tokens
    n, h, d = k.shape
    gd = cfg.head_group(d)
    ng = d // gd
    meta = _META[cfg.meta_dtype]
    kb, vb = cfg.bits("k"), cfg.bits("v")
    if len(pages) < -(-n // p):
        raise ValueError(f"{n} tokens need {-(-n // p)} pages, got {len(pages)}")
    kv = {"k_" + s: layout.k.view(bufs["k_buf"], s) for s in ("codes", "minimum", "scale", "sums")}
    kv.update({"v_" + s: layout.v.view(bufs["v_buf"], s) for s in ("codes", "minimum", "scale")})
    k16 = k.half().float()
    rs = {"range_search": True} if getattr(cfg, "range_search", False) else {}  # the store's range search
    v_src = v.half().float() if cfg.v_tail else v.float()
    for i, page in enumerate(pages[: -(-n // p)]):
        lo, hi = i * p, min(n, (i + 1) * p)
        cnt = hi - lo
        closed = cnt == p
        sink = (torch.arange(lo, hi) < sk)[:, None, None]
        if closed or not cfg.v_tail:  # V per token in head_dim groups; sinks: code 0, min 0, scale 0
            qv = quantize(v_src[lo:hi], vb, dim=-1, group_size=gd, meta_dtype=meta, **rs)
            kv["v_codes"][page, :, :cnt] = pack(qv.codes.masked_fill(sink, 0).permute(1, 0, 2).contiguous(), vb)
            kv["v_minimum"][page, :, : cnt * ng] = qv.minimum.masked_fill(sink, 0).permute(1, 0, 2).reshape(h, cnt * ng)
            kv["v_scale"][page, :, : cnt * ng] = qv.scale.masked_fill(sink, 0).permute(1, 0, 2).reshape(h, cnt * ng)
        if closed:  # K per channel over the page's non-sink tokens
            qk = quantize(k16[lo:hi], kb, dim=0, group_size=p, meta_dtype=meta, mask=~sink.expand(p, h, d), **rs)
            kv["k_codes"][page] = pack(qk.codes.permute(1, 0, 2).contiguous(), kb)
            kv["k_minimum"][page] = qk.minimum[0]
            kv["k_scale"][page] = qk.scale[0]
            ksum = qk.codes.reshape(p, h, ng, gd).sum(-1, dtype=torch.int32)  # [Π, H, ng]
            kv["k_sums"][page] = ksum.permute(1, 0, 2).reshape(h, p * ng).to(kv["k_sums"].dtype)
        else:  # the open partition stays FP16
            bufs["tail_k"][tail_row, :cnt] = k[lo:hi].half()
            if cfg.v_tail:
                bufs["tail_v"][tail_row, :cnt] = v[lo:hi].half()
    if sk:
        m = min(sk, n)
        bufs["sink_k"][sink_slot, :m] = k[:m].half()
        bufs["sink_v"][sink_slot, :m] = v[:m].half()


def dense_reference(q: Tensor, k: Tensor, v: Tensor, layout: PageLayout, mode: AttentionMode | str = AttentionMode.HACK,
                    scale: float | None = None, window: int | None = None, logit_cap: float = 0.0) -> Tensor:
    """hack_ops.attention for one sequence: q [Sq, Hq, D] (the last Sq positions), k/v [L, H, D]
    -> [Sq, Hq, D] float32; window / logit_cap: the layer's sliding window and soft-cap."""
    from ..attention import attention

    out = attention(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
                    layout.config, mode=mode, causal=True, scale=scale, window=window, logit_cap=logit_cap)
    return out[0].permute(1, 0, 2)


# Tolerances of the kernels against hack_ops.attention (mode 'hack'). The kernels compute the
# same integer products exactly; what differs is float round-off (summation order, the online
# softmax's running maximum instead of the final one). That can move an INT8 code of P across
# a rounding tie, which shifts the outputs of one (row, head_dim group) by at most one P step:
# max|P'| / 255 times a V code (<= 3) times V's per-token scale (<= range / 3), over the softmax
# sum (>= 1), i.e. at most range(V) / 255. Such flips are rare (a few per 10^4 P codes), so
# the mean error stays at float round-off level.
TOL_MAX_ABS = 0.03  # one INT8 P step for |V| <= ~3.8 (randn data): the worst single element
TOL_MEAN_ABS = 2e-5  # float round-off is ~1e-7; rare flips add ~1e-6


def chunked_reference(q: Tensor, k: Tensor, v: Tensor, layout: PageLayout, rows: int = 256, **kw) -> Tensor:
    """dense_reference in blocks of `rows` query rows, each over the keys up to its last row
    (what those rows see is the same: decode-time visibility depends only on a row's own
    position), so long prompts need memory for `rows` rows at a time, not all of them."""
    n, total = q.shape[0], k.shape[0]
    outs = []
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        end = total - n + hi  # keys 0..end-1: the last query row of this block sits at end-1
        outs.append(dense_reference(q[lo:hi], k[:end], v[:end], layout, **kw))
    return torch.cat(outs)


def reference_error(out: Tensor, ref: Tensor) -> dict:
    """Max and mean absolute error (on the CPU, where the reference is)."""
    err = (out.detach().float().cpu() - ref.float().cpu()).abs()
    return {"max": float(err.max()), "mean": float(err.mean())}


def assert_matches_reference(out: Tensor, ref: Tensor, what: str = "") -> dict:
    e = reference_error(out, ref)
    assert e["max"] <= TOL_MAX_ABS and e["mean"] <= TOL_MEAN_ABS, f"{what}: {e}"
    return e


def random_batch(layout: PageLayout, prefix_lens: list[int], new_lens: list[int], q_heads: int,
                 seed: int = 0, spare_pages: int = 3, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu") -> dict:
    """A batch of requests whose first prefix_lens[i] tokens are already stored (by
    fill_sequence) and which add new_lens[i] tokens: pages drawn at random from a pool a few
    pages larger than needed (non-contiguous tables), tail rows in reverse order, sinks keyed by
    the first page. K/V values are exact in fp16, so FP16 copies equal the reference's input.
    Everything is built on the CPU (same data on every device); the kernels' inputs are then
    moved to `device`, while "k"/"v" (the reference's inputs) stay on the CPU."""
    g = torch.Generator().manual_seed(seed)
    p, h, d = layout.page_size, layout.num_heads, layout.head_dim
    lens = [a + n for a, n in zip(prefix_lens, new_lens)]
    n_pages = [-(-L // p) for L in lens]
    total = sum(n_pages) + spare_pages
    from .store import new_buffers

    bufs = new_buffers(layout, total, len(lens) + 1, total)
    perm = torch.randperm(total, generator=g).tolist()
    pages, indptr, rows = [], [0], list(range(len(lens), 0, -1))
    ks, vs = [], []
    for i, (pre, L) in enumerate(zip(prefix_lens, lens)):
        pg, perm = perm[: n_pages[i]], perm[n_pages[i]:]
        k = torch.randn(L, h, d, generator=g).to(dtype).float()
        v = torch.randn(L, h, d, generator=g).to(dtype).float()
        if pre:
            fill_sequence(layout, bufs, k[:pre], v[:pre], pg, rows[i], pg[0])
        pages.append(pg)
        indptr.append(indptr[-1] + len(pg))
        ks.append(k)
        vs.append(v)
    qo = [0]
    for n in new_lens:
        qo.append(qo[-1] + n)
    dev = torch.device(device)
    return {
        "bufs": to_device(bufs, dev), "k": ks, "v": vs, "pages": pages, "lens": lens, "prefix": prefix_lens,
        "kv_indptr": torch.tensor(indptr, dtype=torch.int32).to(dev),
        "kv_indices": torch.tensor([x for pg in pages for x in pg], dtype=torch.int32).to(dev),
        "seq_lens": torch.tensor(lens, dtype=torch.int32).to(dev),
        "qo_indptr": torch.tensor(qo, dtype=torch.int32).to(dev),
        "tail_rows": torch.tensor(rows, dtype=torch.int32).to(dev),
        "sink_slots": torch.tensor([pg[0] for pg in pages], dtype=torch.int32).to(dev),
        "k_new": torch.cat([k[pre:] for k, pre in zip(ks, prefix_lens)]).to(dev, dtype),
        "v_new": torch.cat([v[pre:] for v, pre in zip(vs, prefix_lens)]).to(dev, dtype),
        "q": torch.randn(qo[-1], q_heads, d, generator=g).to(dev, dtype),
    }


def per_head_selection(layout: PageLayout, lens: list[int], keep: list[int], q_heads: int, seed: int = 3,
                       device: torch.device | str = "cpu") -> dict:
    """A random_batch whose KV heads each read their own subset of the closed pages, as sparse
    decode's selection gives them (the first page always, keep[i] closed pages for every head of
    request i, then the open page): the batch plus "selection" (hack_ops.paged.sparse.PageSelection)
    and "positions" (per request and head, the page positions read, as lists)."""
    from ..paged.sparse import PageSelection

    p, heads = layout.page_size, layout.num_heads
    b = random_batch(layout, lens, [0] * len(lens), q_heads, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 2)
    positions, tables, seqs = [], [], []
    for i, (n, c) in enumerate(zip(lens, keep)):
        closed, pages = n // p, b["pages"][i]
        per_head = [[0] + sorted((torch.randperm(closed - 1, generator=g)[:c - 1] + 1).tolist()) for _ in range(heads)]
        pos = [row + [closed] * (max(keep) + 1 - len(row)) for row in per_head]  # the open page, then padding
        positions.append(pos)
        tables.append([[pages[min(x, len(pages) - 1)] for x in row] for row in pos])
        seqs.append(c * p + n % p)
    b["selection"] = PageSelection(page_size=p, positions=torch.tensor(positions), table=torch.tensor(tables),
                                   n_closed=torch.tensor(keep), seq_lens=torch.tensor(seqs),
                                   resident=torch.tensor([n // p for n in lens]))
    b["positions"] = positions
    return b


def per_head_reference(q: Tensor, b: dict, layout: PageLayout, keep: list[int], mode: AttentionMode | str) -> Tensor:
    """dense_reference of each (request, KV head) over the tokens its selected pages hold, in
    order, then the open partition's: [B, Hq, D] float32 on the CPU."""
    p, heads = layout.page_size, layout.num_heads
    rep = q.shape[1] // heads
    one = page_layout(layout.config, 1, layout.head_dim)
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, n in enumerate(b["lens"]):
        for h in range(heads):
            toks = torch.cat([torch.arange(x * p, x * p + p) for x in b["positions"][i][h][:keep[i]]]
                             + [torch.arange(n - n % p, n)])
            kh, vh = b["k"][i][toks, h:h + 1], b["v"][i][toks, h:h + 1]
            out[i, h * rep:(h + 1) * rep] = dense_reference(q[i:i + 1, h * rep:(h + 1) * rep].float().cpu(), kh, vh,
                                                            one, mode=mode)[0]
    return out
