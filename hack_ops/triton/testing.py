"""Reference inputs for the kernel tests: pages filled straight from hack_ops.quantize.

`fill_sequence` writes what the serving cache holds after a sequence of L tokens was stored,
computed densely with the reference quantizer and the layout's section views — an oracle that
shares no code with the Triton store (and lets the attention kernels be tested on their own).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import PageLayout
from ..packing import pack
from ..quant import quantize

_META = {"float16": torch.float16, "float32": torch.float32}

def require_interpreter() -> None:
    """Fail clearly unless the kernels run in Triton's CPU interpreter (tests/conftest.py turns
    it on before triton is imported; TRITON_INTERPRET=1 does the same from the shell)."""
    import triton

    from .decode_kernel import hack_decode_kernel

    if not triton.knobs.runtime.interpret or type(hack_decode_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("the Triton kernels need the interpreter here (no GPU): set TRITON_INTERPRET=1 "
                           "before triton is imported")


def fill_sequence(layout: PageLayout, bufs: dict[str, Tensor], k: Tensor, v: Tensor, pages: list[int],
                  tail_row: int, sink_slot: int) -> None:
    """Store a whole sequence k, v [L, H, D] into `pages` (its page table), the FP16 tail row(s)
    and the sink slot, like incremental stores would leave them (round to nearest). K, and V
    when it has a tail, are quantized from their FP16 values (what the tails hold)."""
    cfg = layout.config
    if cfg.orientation != "channel_k":
        raise NotImplementedError("fill_sequence builds channel_k pages")
    p, sk = cfg.partition_size, cfg.sink_tokens
    n, h, d = k.shape
    gd = cfg.head_group(d)
    ng = d // gd
    meta = _META[cfg.meta_dtype]
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
            qv = quantize(v_src[lo:hi], cfg.kv_bits, dim=-1, group_size=gd, meta_dtype=meta, **rs)
            kv["v_codes"][page, :, :cnt] = pack(qv.codes.masked_fill(sink, 0).permute(1, 0, 2).contiguous(), cfg.kv_bits)
            kv["v_minimum"][page, :, : cnt * ng] = qv.minimum.masked_fill(sink, 0).permute(1, 0, 2).reshape(h, cnt * ng)
            kv["v_scale"][page, :, : cnt * ng] = qv.scale.masked_fill(sink, 0).permute(1, 0, 2).reshape(h, cnt * ng)
        if closed:  # K per channel over the page's non-sink tokens
            qk = quantize(k16[lo:hi], cfg.kv_bits, dim=0, group_size=p, meta_dtype=meta, mask=~sink.expand(p, h, d), **rs)
            kv["k_codes"][page] = pack(qk.codes.permute(1, 0, 2).contiguous(), cfg.kv_bits)
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


def dense_reference(q: Tensor, k: Tensor, v: Tensor, layout: PageLayout, mode: str = "hack",
                    scale: float | None = None) -> Tensor:
    """hack_ops.attention for one sequence: q [Sq, Hq, D] (the last Sq positions), k/v [L, H, D]
    -> [Sq, Hq, D] float32."""
    from ..attention import attention

    out = attention(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
                    layout.config, mode=mode, causal=True, scale=scale)
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


def reference_error(out: Tensor, ref: Tensor) -> dict:
    """Max and mean absolute error."""
    err = (out.float() - ref.float()).abs()
    return {"max": float(err.max()), "mean": float(err.mean())}


def assert_matches_reference(out: Tensor, ref: Tensor, what: str = "") -> dict:
    e = reference_error(out, ref)
    assert e["max"] <= TOL_MAX_ABS and e["mean"] <= TOL_MEAN_ABS, f"{what}: {e}"
    return e


def random_batch(layout: PageLayout, prefix_lens: list[int], new_lens: list[int], q_heads: int,
                 seed: int = 0, spare_pages: int = 3, dtype: torch.dtype = torch.float16) -> dict:
    """A batch of requests whose first prefix_lens[i] tokens are already stored (by
    fill_sequence) and which add new_lens[i] tokens: pages drawn at random from a pool a few
    pages larger than needed (non-contiguous tables), tail rows in reverse order, sinks keyed by
    the first page. K/V values are exact in fp16, so FP16 copies equal the reference's input."""
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
    return {
        "bufs": bufs, "k": ks, "v": vs, "pages": pages, "lens": lens, "prefix": prefix_lens,
        "kv_indptr": torch.tensor(indptr, dtype=torch.int32),
        "kv_indices": torch.tensor([x for pg in pages for x in pg], dtype=torch.int32),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "qo_indptr": torch.tensor(qo, dtype=torch.int32),
        "tail_rows": torch.tensor(rows, dtype=torch.int32),
        "sink_slots": torch.tensor([pg[0] for pg in pages], dtype=torch.int32),
        "k_new": torch.cat([k[pre:] for k, pre in zip(ks, prefix_lens)]).to(dtype),
        "v_new": torch.cat([v[pre:] for v, pre in zip(vs, prefix_lens)]).to(dtype),
        "q": torch.randn(qo[-1], q_heads, d, generator=g).to(dtype),
    }
