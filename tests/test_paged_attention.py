"""Paged HACK attention (store + decode + extend) against the dense reference hack_ops.attention.

Tolerances. Where the paged path does the reference's arithmetic in another summation order,
outputs agree to float round-off (~1e-6). The INT8 quantization of Q' and P' rounds values
that come out of such sums, so now and then a value sitting on a rounding boundary flips one
INT8 code; that moves one output row by at most ~1e-2 here (one code step of P' times a 2-bit
V code). So each check asserts: every row within FLIP_TOL, and at least 90% of the rows within
ROUNDOFF_TOL. For scale: 2-bit quantization itself moves outputs by ~0.1-0.5 (checked below).
The 'dequant' baseline has no INT8 step and must match everywhere to ROUNDOFF_TOL.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.paged import HackKVStore, cpu_kernel, decode, extend
from hack_ops.paged.fill import scattered_table

ROUNDOFF_TOL = 5e-5


def make_cfg(**kw) -> HackConfig:
    """A config for these tests. Clipped-range search (when the config has it) makes every
    quantization ~25x dearer in the store and the reference alike without changing what is
    compared, so it is off here except where a test turns it on (test_range_search)."""
    if "range_search" in HackConfig.__dataclass_fields__:
        kw.setdefault("range_search", False)
    return HackConfig(**kw)
FLIP_TOL = 1.5e-2
BACKENDS = ["torch"]


def assert_matches(got: torch.Tensor, ref: torch.Tensor, mode: str, what: str) -> torch.Tensor:
    """Per (query, head) row errors; every row within the tolerance of its mode."""
    err = (got.float() - ref.float()).abs().amax(-1).flatten()
    tol = ROUNDOFF_TOL if mode == "dequant" else FLIP_TOL
    assert float(err.max()) <= tol, f"{what}: max err {float(err.max()):.3g}"
    return err


def assert_mostly_roundoff(errs: list[torch.Tensor], what: str) -> None:
    err = torch.cat(errs)
    frac = float((err <= ROUNDOFF_TOL).float().mean())
    assert frac >= 0.9, f"{what}: only {frac:.0%} of {err.numel()} rows within round-off"


class Case:
    """Sequences with random fp16-representable q/k/v, their reference outputs (decode-time
    visibility, one teacher-forced reference call per sequence), and a store laid out on
    shuffled pages."""

    def __init__(self, cfg: HackConfig, lens, heads=2, rep=3, head_dim=64, seed=0, mode="hack",
                 window=None, logit_cap=0.0, scale=None):
        g = torch.Generator().manual_seed(seed)
        self.cfg, self.lens, self.mode = cfg, list(lens), mode
        # the layer's features (tests/test_window_attention.py); defaults: a plain layer
        self.feat = dict(window=window, logit_cap=logit_cap, scale=scale)
        p = cfg.partition_size
        b = len(lens)
        self.rows = [b + 4 - i for i in range(b)]  # reversed, not starting at row 0
        n_pages = sum(-(-n // p) for n in lens) + 4
        self.store = HackKVStore(cfg, 2, heads, head_dim, num_pages=n_pages, num_rows=b + 5)
        self.table = scattered_table(self.lens, p, b + 5, self.rows, n_pages, generator=g)
        chan = (1 + torch.arange(head_dim) % 7).float()  # uneven channel ranges, as real K has
        self.q = [torch.randn(n, heads * rep, head_dim, generator=g).half().float() for n in lens]
        self.k = [(torch.randn(n, heads, head_dim, generator=g) * chan).half().float() for n in lens]
        self.v = [torch.randn(n, heads, head_dim, generator=g).half().float() for n in lens]
        self.ref = [self._reference(i, mode) for i in range(b)]
        self.done = [0] * b
        self.errs: list[torch.Tensor] = []

    def _reference(self, i: int, mode: str) -> torch.Tensor:
        t = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [L, H, D] -> [1, H, L, D]
        return attention(t(self.q[i]), t(self.k[i]), t(self.v[i]), self.cfg, mode=mode, **self.feat)[0].transpose(0, 1)

    def extend(self, upto, mode=None, layer=0, backend="torch", prefill="homomorphic"):
        """Extend every request i to length upto[i] (mode: the AttentionMode, default the case's;
        prefill: the PrefillMode); returns per-request outputs."""
        act = [i for i in range(len(self.lens)) if upto[i] > self.done[i]]
        ext = [upto[i] - self.done[i] for i in act]
        plan = self.store.plan(self.table, [self.rows[i] for i in act], [upto[i] for i in act], ext)
        cat = lambda xs: torch.cat([xs[i][self.done[i]:upto[i]] for i in act])  # noqa: E731
        o = extend(self.store, layer, plan, cat(self.q), cat(self.k), cat(self.v), mode=mode or self.mode,
                   backend=backend, prefill=prefill, **self.feat)
        outs, off = {}, 0
        for i, e in zip(act, ext):
            outs[i] = o[off:off + e]
            off += e
            self.done[i] = upto[i]
        return outs

    def decode(self, which=None, backend="torch", layer=0, sparse=None):
        act = [i for i in (which or range(len(self.lens))) if self.done[i] < self.lens[i]]
        plan = self.store.plan(self.table, [self.rows[i] for i in act], [self.done[i] + 1 for i in act])
        pick = lambda xs: torch.stack([xs[i][self.done[i]] for i in act])  # noqa: E731
        if backend == "portable":  # the compiled kernel built without SIMD intrinsics
            self.store.write(layer, plan, pick(self.k), pick(self.v))
            d = self.store.head_dim
            scale = self.feat["scale"] or d ** -0.5
            o = cpu_kernel.decode(self.store, layer, plan, pick(self.q), scale, variant="portable",
                                  window=self.feat["window"], logit_cap=self.feat["logit_cap"])
        else:
            o = decode(self.store, layer, plan, pick(self.q), pick(self.k), pick(self.v), mode=self.mode,
                       backend=backend, dequant_dtype=torch.float32, sparse=sparse, **self.feat)
        outs = {}
        for j, i in enumerate(act):
            outs[i] = o[j]
            self.done[i] += 1
        return outs

    def check(self, outs, what):
        for i, o in outs.items():
            ref = self.ref[i][self.done[i] - o.shape[0]:self.done[i]] if o.dim() == 3 else self.ref[i][self.done[i] - 1]
            self.errs.append(assert_matches(o, ref, self.mode, f"{what} request {i}"))

    def finish(self):
        assert_mostly_roundoff(self.errs, "all checks")


CONFIGS = [
    dict(orientation="channel_k", sink_tokens=1, tail_tensors="kv"),
    dict(orientation="token_k", sink_tokens=1, tail_tensors="kv"),
    dict(orientation="channel_k", sink_tokens=4, tail_tensors="kv", requant_elimination=False),
    dict(orientation="token_k", sink_tokens=4, tail_tensors="kv", requant_elimination=False),
    dict(orientation="channel_k", sink_tokens=4, tail_tensors="per_channel"),
    dict(orientation="channel_k", sink_tokens=0, tail_tensors="per_channel"),
    dict(orientation="token_k", sink_tokens=4, tail_tensors="per_channel"),
    dict(orientation="token_k", sink_tokens=0, tail_tensors="per_channel"),
    dict(orientation="channel_k", sink_tokens=4, tail_tensors="per_channel", requant_elimination=False),
    dict(orientation="token_k", sink_tokens=4, tail_tensors="per_channel", requant_elimination=False),
    dict(orientation="channel_k", sink_tokens=4, kv_bits=4),
    dict(orientation="token_k", sink_tokens=0, kv_bits=4),
    dict(orientation="channel_k", sink_tokens=1, k_bits=4),  # K at 4 bits, V at 2
    dict(orientation="token_k", sink_tokens=2, kv_bits=4, k_bits=2),  # K at 2 bits, V at 4
    dict(orientation="channel_k", sink_tokens=0, tail_tensors="per_channel", kv_bits=4, k_bits=2),
]


# (lengths, first extend, second extend): the RQE ablation's reference re-quantizes the open
# page for every open-partition length, so its sequences are kept shorter.
LENS = {True: ([75, 41, 100], [20, 3, 45], [62, 37, 90]), False: ([45, 41, 70], [20, 3, 40], [40, 37, 62])}


@pytest.mark.parametrize("mode", ["hack", "dequant"])
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: make_cfg(partition_size=32, **kw).label())
def test_chunked_prefill_then_decode(kw, mode):
    """Two extend chunks (the second starts mid-page and crosses pages, so the prefix's FP16
    open page must survive the write), then decode steps across a page boundary, for a
    mixed-length batch on shuffled pages."""
    cfg = make_cfg(partition_size=32, **kw)
    lens, ext1, ext2 = LENS[cfg.requant_elimination]
    case = Case(cfg, lens=lens, mode=mode)
    case.check(case.extend(ext1), "extend 1")
    case.check(case.extend(ext2), "extend 2")
    for step in range(4):
        case.check(case.decode(), f"decode {step}")
    case.finish()


@pytest.mark.parametrize("kw", [CONFIGS[0], CONFIGS[1], CONFIGS[4]], ids=["channel_k", "token_k", "channel_k-tail-per_channel"])
def test_decode_every_tail_length(kw):
    """One decode batch whose requests hold every open-partition length 0..Π-1 after the write."""
    p = 32
    cfg = make_cfg(partition_size=p, **kw)
    lens = [40 + i for i in range(p)]
    case = Case(cfg, lens=[n + 1 for n in lens], heads=1, rep=2, seed=1)
    case.extend(lens)
    outs = case.decode()
    assert sorted((case.done[i] % p) for i in outs) == list(range(p))
    case.check(outs, "decode")
    case.finish()


@pytest.mark.parametrize("p,rep,head_dim", [(32, 1, 128), (64, 3, 64), (64, 4, 256), (128, 4, 128), (128, 1, 64)])
@pytest.mark.parametrize("orientation", ["channel_k", "token_k"])
def test_shapes(p, rep, head_dim, orientation):
    """Partition sizes 32/64/128, GQA ratios 1/3/4, head_dim 64/128/256."""
    cfg = make_cfg(partition_size=p, orientation=orientation)
    case = Case(cfg, lens=[p + p // 2 + 3, 2 * p + 1], heads=2, rep=rep, head_dim=head_dim, seed=2)
    case.check(case.extend([p + p // 2 + 1, 2 * p - 1]), "extend")
    case.check(case.decode(), "decode 1")
    case.check(case.decode(), "decode 2")
    case.finish()


def test_tolerance_is_meaningful():
    """2-bit quantization moves the outputs far more than the tolerances allow."""
    cfg = make_cfg(partition_size=32)
    case = Case(cfg, lens=[96], seed=3)
    out = case.extend([96])[0]
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    exact = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact")[0].transpose(0, 1)
    gap = (out - exact).abs().amax(-1)[40:]  # past the first page, where quantization starts
    assert float(gap.mean()) > 10 * FLIP_TOL


def test_layers_are_independent():
    cfg = make_cfg(partition_size=32)
    case = Case(cfg, lens=[50], seed=4)
    case.extend([49], layer=1)
    assert all(int(b.count_nonzero()) == 0 for b in (case.store.k_pages[0], case.store.tails["k"][0]))
    case.done = [0]
    case.check(case.extend([49], layer=0), "layer 0")


def _exact_reference(case: Case, i: int, prefix: int) -> torch.Tensor:
    """'exact' prefill with a cached prefix, built from dense pieces: the new tokens attend to
    each other in FP16; the prefix's closed pages are dequantized (the paged path reads them
    homomorphically, so it differs by INT8 Q'/P' rounding only); the prefix's open page is
    FP16 (default config: K and V tails)."""
    cfg = case.cfg
    p, s = cfg.partition_size, cfg.sink_tokens
    q, k, v = case.q[i][prefix:], case.k[i], case.v[i]
    ln = k.shape[0]
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    # the dense 'dequant' reference at the last prefix position gives the cache's view of K/V
    from hack_ops.quant import dequantize, quantize
    from test_paged_store import store_quant_kw
    nc = prefix // p
    kd, vd = k.clone(), v.clone()
    ns = torch.arange(ln) >= s
    for pg in range(nc):
        sl = slice(pg * p, (pg + 1) * p)
        m = ns[sl][:, None, None].expand(p, *k.shape[1:])
        kd[sl] = torch.where(m, dequantize(quantize(k[sl], cfg.bits("k"), 0, p, mask=m, **store_quant_kw(cfg))), k[sl])
    c = nc * p
    m = ns[:c][:, None, None].expand(c, *v.shape[1:])
    gd = cfg.head_group(v.shape[-1])
    vd[:c] = torch.where(m, dequantize(quantize(v[:c], cfg.bits("v"), -1, gd, mask=m, **store_quant_kw(cfg))), v[:c])
    return attention(t(q), t(kd), t(vd), cfg, mode="exact")[0].transpose(0, 1)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_exact_prefill(backend):
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=32)
    # no prefix: plain float attention over the FP16 tokens
    case = Case(cfg, lens=[70], seed=5, mode="hack")
    out = case.extend([70], prefill="exact", backend=backend)[0]
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    exact = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact")[0].transpose(0, 1)
    assert float((out - exact).abs().max()) <= ROUNDOFF_TOL
    # a batch of cold requests (the SDPA fast path), each its own causal attention
    case = Case(cfg, lens=[70, 33], seed=9, mode="hack")
    outs = case.extend([70, 33], prefill="exact", backend=backend)
    for i in range(2):
        ref = attention(t(case.q[i]), t(case.k[i]), t(case.v[i]), cfg, mode="exact")[0].transpose(0, 1)
        assert float((outs[i] - ref).abs().max()) <= ROUNDOFF_TOL
    # one new token that does not close its page: exact prefill sees what decode sees
    case = Case(cfg, lens=[70], seed=6)
    case.extend([69])
    case.check(case.extend([70], prefill="exact", backend=backend), "exact one token")
    # a prefix with closed pages and an open page, then many new tokens
    case = Case(cfg, lens=[120], seed=7)
    case.extend([45])
    out = case.extend([120], prefill="exact", backend=backend)[0]
    ref = _exact_reference(case, 0, 45)
    full = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact")[0].transpose(0, 1)[45:]
    err, gap = (out - ref).abs().amax(-1), (full - ref).abs().amax(-1)
    assert float(err.max()) < 0.3 and float(err.mean()) < 0.1 * float(gap.mean()), (float(err.mean()), float(gap.mean()))


def test_exact_prefill_bf16_is_sdpa_in_bf16():
    """BF16 q/k/v without a cached prefix (what a BF16 model serves): 'exact' prefill is SDPA
    in BF16 on the stored values, the attention SGLang's BF16 backend computes: equal to it
    bit for bit, and within BF16 round-off of float32 attention over the same values."""
    import torch.nn.functional as F

    cfg = make_cfg(partition_size=32)
    g = torch.Generator().manual_seed(11)
    lens, h, rep, d = [70, 33], 2, 3, 64
    n = sum(lens)
    q, k, v = (torch.randn(n, hh, d, generator=g).to(torch.bfloat16) for hh in (h * rep, h, h))
    pages = sum(-(-x // 32) for x in lens) + 2
    store = HackKVStore(cfg, 1, h, d, num_pages=pages, num_rows=2)
    table = scattered_table(lens, 32, 2, [0, 1], pages, generator=g)
    out = extend(store, 0, store.plan(table, [0, 1], lens, lens), q, k, v, prefill="exact")
    assert out.dtype == torch.bfloat16
    lo = 0
    for m in lens:
        qb, kb, vb = (x[lo:lo + m].transpose(0, 1)[None] for x in (q, k, v))
        want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        assert torch.equal(out[lo:lo + m], want)
        ref = attention(qb.float(), kb.float(), vb.float(), cfg, mode="exact")[0].transpose(0, 1)
        # BF16 P and output rounding: 6.7e-3 measured on these values
        assert float((out[lo:lo + m].float() - ref).abs().max()) <= 1.5e-2
        lo += m


def test_bad_input_is_rejected():
    cfg = make_cfg(partition_size=32)
    case = Case(cfg, lens=[40], seed=8)
    case.extend([39])
    plan = case.store.plan(case.table, [case.rows[0]], [40])
    before = [x.clone() for x in (case.store.k_pages[0], case.store.v_pages[0], case.store.tails["k"][0])]
    k = case.k[0][39:40].clone()
    k[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        decode(case.store, 0, plan, case.q[0][39:40], k, case.v[0][39:40])
    with pytest.raises(ValueError, match="q must be"):
        decode(case.store, 0, plan, case.q[0][39:40, :5], case.k[0][39:40], case.v[0][39:40])
    with pytest.raises(ValueError, match="mode"):
        decode(case.store, 0, plan, case.q[0][39:40], mode="exact")
    with pytest.raises(ValueError, match="layer"):
        decode(case.store, 2, plan, case.q[0][39:40])
    after = (case.store.k_pages[0], case.store.v_pages[0], case.store.tails["k"][0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _need_kernel(variant: str) -> None:
    if cpu_kernel.load(variant) is None:
        pytest.skip(f"the CPU kernel could not be built here: {cpu_kernel._errors.get(variant)}")


KERNEL_CONFIGS = [CONFIGS[0], CONFIGS[2], CONFIGS[4], CONFIGS[5], CONFIGS[8], CONFIGS[10], CONFIGS[12], CONFIGS[14]]


@pytest.mark.parametrize("backend", ["cpu", "portable"])
@pytest.mark.parametrize("kw", KERNEL_CONFIGS, ids=lambda kw: make_cfg(partition_size=32, **kw).label())
def test_cpu_kernel_decode(kw, backend):
    """The compiled kernel (AVX-512 build and plain-C build) against the reference, for a
    mixed-length batch whose decode steps cross page boundaries."""
    _need_kernel("native" if backend == "cpu" else "portable")
    cfg = make_cfg(partition_size=32, **kw)
    lens, _, ext = LENS[cfg.requant_elimination]
    case = Case(cfg, lens=lens, seed=11)
    kernel_extend = backend == "cpu" and cfg.requant_elimination
    case.check(case.extend(ext, backend="cpu" if kernel_extend else "torch"), "extend")
    for step in range(4):
        case.check(case.decode(backend=backend), f"decode {step}")
    case.finish()


@pytest.mark.parametrize("backend", ["cpu", "portable"])
@pytest.mark.parametrize("p,rep,head_dim,bits", [(32, 1, 128, 2), (64, 3, 64, 2), (64, 4, 256, 4), (128, 4, 128, 2),
                                                 (128, 8, 64, 4)])
def test_cpu_kernel_shapes(p, rep, head_dim, bits, backend):
    _need_kernel("native" if backend == "cpu" else "portable")
    cfg = make_cfg(partition_size=p, kv_bits=bits)
    # long enough for several 16-page work items per head at the smallest page size
    n = 17 * p + 5 if p == 32 else 3 * p + 7
    case = Case(cfg, lens=[n, p + 2], heads=2, rep=rep, head_dim=head_dim, seed=12)
    case.check(case.extend([n - 2, p], backend="cpu" if backend == "cpu" else "torch"), "extend")
    case.check(case.decode(backend=backend), "decode 1")
    case.check(case.decode(backend=backend), "decode 2")
    case.finish()


def test_auto_backend_choice():
    cfg = make_cfg(partition_size=32)
    store = HackKVStore(cfg, 1, 2, 64, num_pages=4, num_rows=2)
    if cpu_kernel.load("native") is not None:
        assert cpu_kernel.why_not(store, "hack") is None
    tk = HackKVStore(cfg.replace(orientation="token_k"), 1, 2, 64, num_pages=4, num_rows=2)
    assert "token_k" in cpu_kernel.why_not(tk, "hack")
    assert "mode" in cpu_kernel.why_not(store, "dequant")
    odd = HackKVStore(cfg, 1, 2, 96, num_pages=4, num_rows=2)
    assert "head_dim" in cpu_kernel.why_not(odd, "hack")
    plan = tk.plan(torch.arange(64, dtype=torch.int32).reshape(2, 32) + 32, [0], [1])
    with pytest.raises(RuntimeError, match="not usable"):
        decode(tk, 0, plan, torch.zeros(1, 6, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), backend="cpu")


@pytest.mark.skipif("range_search" not in HackConfig.__dataclass_fields__, reason="this HackConfig has no range_search")
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_range_search(backend):
    """The default config (clipped-range search when pages are quantized) end to end."""
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=32, range_search=True)
    case = Case(cfg, lens=[70, 40], seed=13)
    case.check(case.extend([66, 31], backend=backend), "extend")
    case.check(case.decode(backend=backend), "decode 1")
    case.check(case.decode(backend=backend), "decode 2")
    case.finish()


def test_strawman_prefill_reads_the_prefix_dequantized_and_the_chunk_in_full_precision():
    """The dequantizing baseline's prefill over a cached prefix (a chunked prompt) is dense
    attention over the prefix as the cache holds it (closed pages dequantized, the open page
    from the FP16 tail, sinks FP16) and the chunk's own tokens: the same math as the dense
    reference built by _exact_reference, to float32 roundoff."""
    from hack_ops.paged import extend_strawman

    cfg = make_cfg(partition_size=32)
    for prefix, total, seed in ((45, 120, 7), (64, 100, 8), (0, 70, 9)):
        case = Case(cfg, lens=[total], seed=seed)
        if prefix:
            case.extend([prefix])
        plan = case.store.plan(case.table, [case.rows[0]], [total], [total - prefix])
        sl = slice(prefix, total)
        out = extend_strawman(case.store, 0, plan, case.q[0][sl], case.k[0][sl], case.v[0][sl],
                              dtype=torch.float32)
        if prefix:
            ref = _exact_reference(case, 0, prefix)
        else:
            t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
            ref = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact")[0].transpose(0, 1)
        assert float((out - ref).abs().max()) <= ROUNDOFF_TOL, (prefix, float((out - ref).abs().max()))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_prefix_then_causal_is_masked_attention(dtype, tol):
    """A chunk over a prefix every query sees: two flash attentions merged by log-sum-exp
    (float32, BF16) or one masked SDPA (other dtypes) equal masked attention in float64, to the
    dtype's round-off (measured: 3.2e-7 float32, 1.4e-3 BF16, 2.2e-4 float16)."""
    from hack_ops.paged.attention import prefix_then_causal

    g = torch.Generator().manual_seed(21)
    m, n, h, rep, d = 150, 70, 2, 3, 64
    q = torch.randn(1, h * rep, n, d, generator=g)
    kp, vp, kc, vc = (torch.randn(1, h, ln, d, generator=g) for ln in (m, m, n, n))
    out = prefix_then_causal(*(x.to(dtype) for x in (q, kp, vp, kc, vc)), 0.125)
    assert out.dtype == torch.float32 and out.shape == q.shape
    k, v = (torch.cat([a, b], 2).double().repeat_interleave(rep, 1) for a, b in ((kp, kc), (vp, vc)))
    qd = q.to(dtype).double()
    k, v = k.to(dtype).double(), v.to(dtype).double()
    s = (qd @ k.transpose(-1, -2)) * 0.125
    s = s.masked_fill(torch.arange(m + n)[None, :] > torch.arange(m, m + n)[:, None], float("-inf"))
    want = torch.softmax(s, -1) @ v
    assert float((out.double() - want).abs().max()) <= tol


def test_dense_prefill_reads_the_prefix_dequantized():
    """PrefillMode.DENSE is the strawman's prefill on HACK's pages: the chunk in full precision
    and the cached prefix dequantized, by SDPA. It equals extend_strawman, is the dense reference
    built by _exact_reference to float32 roundoff, so it is closer to exact attention than the
    homomorphic prefill of the same chunk; the pages it leaves are the same bytes."""
    from hack_ops.paged import extend_strawman

    cfg = make_cfg(partition_size=32)
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    outs, stores = {}, {}
    for prefill in ("dense", "homomorphic", "strawman"):
        case = Case(cfg, lens=[120], seed=7)
        case.extend([45])
        if prefill == "strawman":
            plan = case.store.plan(case.table, [case.rows[0]], [120], [75])
            sl = slice(45, 120)
            outs[prefill] = extend_strawman(case.store, 0, plan, case.q[0][sl], case.k[0][sl], case.v[0][sl],
                                            dtype=torch.float32)
        else:
            outs[prefill] = case.extend([120], prefill=prefill)[0]
        stores[prefill] = case.store
    assert torch.equal(outs["dense"], outs["strawman"])
    for name in ("k_pages", "v_pages"):
        assert torch.equal(getattr(stores["dense"], name)[0], getattr(stores["homomorphic"], name)[0])
    ref = _exact_reference(case, 0, 45)
    assert float((outs["dense"] - ref).abs().max()) <= ROUNDOFF_TOL
    full = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact")[0].transpose(0, 1)[45:]
    err = {p: float((outs[p] - full).abs().mean()) for p in ("dense", "homomorphic")}
    assert err["dense"] < err["homomorphic"], err
