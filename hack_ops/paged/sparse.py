"""Sparse decode on the paged store: the pages each (request, KV head) reads in one decode step.

The selection (hack_ops.sparse) scores each request's closed pages from their K minimum and
scale (no other metadata: read where the pages keep them, or by the compiled one-level selection
from copies of them in page order, hack_ops.paged.side_copies), and turns the choice into what
the decode kernels already take: a page table, per (request, KV head) here, the selected closed
pages in position order then the open page, with the request's length shortened to match
(hack_ops.sparse: a sparse step is the ordinary decode of that shorter sequence). The compiled
kernel reads the per-head table in place (cpu_kernel.decode); the PyTorch path gathers each
head's own pages (pages.request_pages).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..packing import unpack
from ..sparse import LINEAR_ALPHA, PageScore, SparseConfig, page_best, select
from .group_boxes import GroupBoxCache
from .plan import ForwardPlan
from .side_copies import SideTableCopies

_I64, _P = ctypes.c_int64, ctypes.c_void_p
# (page, KV head) scores per thread: below this a parallel region costs more than it saves
# (waking a second thread measured ~10 ms on a loaded 2-core host; one 32K-token request's
# 1,536 scores take 0.7 ms on one core)
PAIRS_PER_THREAD = 16384


class _SelArgs(ctypes.Structure):  # hack_select_args of csrc/hack_select.c, field for field
    _fields_ = [(n, _I64) for n in (
        "batch", "heads", "rep", "head_dim", "max_pages", "width", "k_page_bytes", "k_min_off", "k_scale_off",
        "meta_fp32", "score", "nthreads")] + [("levels", ctypes.c_double), ("alpha", ctypes.c_double)] + [
        (n, _P) for n in ("n_closed", "page_table", "k_pages", "q", "out")] + [
        ("copy_bytes", _I64), ("copies", _P), ("q_dtype", _I64), ("copied", _P)]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """t on `device`; from the host to a GPU through pinned memory, so the copy does not wait
    for the work queued before it (a pageable, blocking copy synchronizes the stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class PageSelection:
    """What one decode step reads. W = the widest request's selected closed pages + 1."""

    page_size: int
    positions: Tensor  # [B, H, W] long: page positions read, ascending, then the open page; padding after
    table: Tensor  # [B, H, W] long: the page ids at those positions (padding: a page the kernel never reads)
    n_closed: Tensor  # [B] long: closed pages each head of the request reads
    seq_lens: Tensor  # [B] long: the shortened length: n_closed * Π + the open partition's tokens
    resident: Tensor  # [B] long: the request's closed pages (what a dense step reads)

    @property
    def batch_size(self) -> int:
        return int(self.n_closed.shape[0])

    def head_csr(self) -> tuple[Tensor, Tensor]:
        """The selection as one page list per (request, KV head), CSR over requests (what
        hack_ops.cuda.CudaDecodeAttention.plan(head_tables=True) reads): indptr int32 [B+1] counts
        each request's pages per head (its selected closed pages, then the open page when it holds
        tokens); indices int32 [indptr[-1] * H], request b's heads' lists one after another."""
        b, h, w = self.table.shape
        has_open = self.seq_lens > self.n_closed * self.page_size
        n = self.n_closed + has_open.to(self.n_closed.dtype)
        indptr = torch.zeros(b + 1, dtype=torch.int32, device=n.device)
        indptr[1:] = torch.cumsum(n, 0)
        mask = torch.arange(w, device=n.device)[None, None, :] < n[:, None, None]
        return indptr, self.table[mask.expand(b, h, w)].to(torch.int32)

    def closed_read(self) -> int:
        """Closed pages each KV head reads, summed over the requests (the totals' pages read)."""
        return int(self.n_closed.sum())

    def kernel_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """What the CPU decode kernel reads (int64, contiguous): the shortened lengths, the
        closed pages below them (lengths // page size) and the per-head table [B * H, W]."""
        seq = self.seq_lens.to(torch.int64).contiguous()
        return seq, (seq // self.page_size).contiguous(), self.table.reshape(-1, self.table.shape[-1]).to(
            torch.int64).contiguous()

    def head_csr_from_host(self, n_pages: list[int]) -> tuple[Tensor, Tensor]:
        """head_csr() without reading the selection back from its device (a boolean gather
        waits for it): n_pages[b], the pages each KV head of request b reads (its selected closed
        pages, + 1 when its open page holds tokens), are host integers the caller has from the
        plan's lengths. The offsets and the flat index of every listed table entry are built on
        the host and copied in one transfer, then gathered from `table`. The same tensors as
        head_csr() when n_pages agrees with the selection (which is not read to check it)."""
        b, h, w = self.table.shape
        if len(n_pages) != b or any(not 0 <= x <= w for x in n_pages):
            raise ValueError(f"n_pages must be {b} counts in 0..{w}, got {list(n_pages)}")
        n = torch.tensor(list(n_pages), dtype=torch.long)
        indptr = torch.zeros(b + 1, dtype=torch.long)
        indptr[1:] = torch.cumsum(n, 0)
        listed = (torch.arange(w)[None, None, :] < n[:, None, None]).expand(b, h, w)
        entries = torch.arange(b * h * w).view(b, h, w)[listed]
        both = to_device(torch.cat([indptr, entries]), self.table.device)  # request, head, column order: head_csr's
        return both[:b + 1].to(torch.int32), torch.take(self.table, both[b + 1:]).to(torch.int32)

    def heads_pages(self, b: int) -> Tensor:
        """Request b's page ids per KV head [H, n]: the n pages its heads read (closed, then
        the open page when it holds tokens)."""
        has_open = int(self.seq_lens[b]) > int(self.n_closed[b]) * self.page_size
        return self.table[b, :, :int(self.n_closed[b]) + int(has_open)]


def _closed_ids(store, plan: ForwardPlan) -> tuple[Tensor, Tensor]:
    """The page ids of every request's closed pages [B, N] (N: the most closed pages of any
    request; a shorter request's row padded with its first page) and the counts n_closed [B]."""
    n_closed = (plan.seq_lens // store.page_size).to(torch.long)
    n = max(1, int(n_closed.max()))
    ids = plan.page_table[:, :n] if plan.page_table.shape[1] >= n else torch.nn.functional.pad(
        plan.page_table, (0, n - plan.page_table.shape[1]))
    return torch.where(torch.arange(n)[None, :] < n_closed[:, None], ids, ids[:, :1]).to(store.device), n_closed


def closed_page_meta(store, layer: int, plan: ForwardPlan) -> tuple[Tensor, Tensor, Tensor]:
    """K's per-channel minimum and scale of every request's closed pages, float [B, H, N, D]
    (N: the most closed pages of any request; a shorter request's rows are padded with its
    first page, which the selection ignores past its count), and the counts n_closed [B]."""
    lay = store.layout_for(layer)
    if not lay.k.per_channel:
        raise ValueError("sparse decode scores pages from K's per-channel side tables: orientation 'channel_k' only")
    ids, n_closed = _closed_ids(store, plan)
    buf = store.k_pages[layer]
    mn = lay.k.view(buf, "minimum")[ids].float().transpose(1, 2)  # [B, H, N, D]
    sc = lay.k.view(buf, "scale")[ids].float().transpose(1, 2)
    return mn, sc, n_closed


def closed_page_best(store, layer: int, plan: ForwardPlan, q: Tensor) -> Tensor:
    """hack_ops.sparse.page_best of every request's closed pages from the pages' K codes, float
    [B, H, N] (the PyTorch path of a refined selection; the compiled one scores only the
    candidates, with the decode kernel's own scores)."""
    p, h = store.page_size, store.num_heads
    lay = store.layout_for(layer)
    ids, _ = _closed_ids(store, plan)
    n = ids.shape[1]
    buf = store.k_pages[layer]
    codes = unpack(lay.k.view(buf, "codes")[ids], lay.k.bits, store.head_dim).float()  # [B, N, H, P, D]
    mn = lay.k.view(buf, "minimum")[ids].float()[:, :, :, None, :]  # [B, N, H, 1, D]
    sc = lay.k.view(buf, "scale")[ids].float()[:, :, :, None, :]
    keys = (codes * sc + mn).permute(0, 2, 1, 3, 4).reshape(ids.shape[0], h, n * p, -1)  # [B, H, N * P, D]
    b, hq, d = q.shape
    return page_best(q.float().reshape(b, h, hq // h, d).to(keys.device), keys, p).cpu()


class _ChooseArgs(ctypes.Structure):  # hack_choose_args of csrc/hack_select.c
    _fields_ = [("s", _SelArgs), ("budget", _I64), ("out_width", _I64)] + [
        (n, _P) for n in ("recent_from", "num_pages", "positions", "table", "count")] + [
        (n, _I64) for n in ("refine", "page_size", "k_bits", "group", "k_codes_off", "k_sums_off", "k_sums_bytes",
                            "sel_group", "keep_groups")] + [(n, _P) for n in ("boxes", "box_cap", "open_tokens",
                                                                               "seq_lens", "read_total")]


class _LayerArgs(ctypes.Structure):  # hack_select_layer of csrc/hack_select.c
    _fields_ = [(n, _I64) for n in ("k_page_bytes", "k_min_off", "k_scale_off", "meta_fp32", "k_bits", "group",
                                    "k_codes_off", "k_sums_off", "k_sums_bytes")] + [
        ("levels", ctypes.c_double), ("k_pages", _P)]


_typed: set[int] = set()  # libraries whose selection entry points have their ctypes signatures


def _library():
    """The compiled library when it has the selection kernels (None: use the PyTorch path)."""
    from . import cpu_kernel  # late import: the compiled kernels are optional

    lib = cpu_kernel.load("native")
    if lib is None or not hasattr(lib, "hack_select_pages_at"):
        return None
    if id(lib) not in _typed:  # once per library: this runs every sparse layer of every step
        lib.hack_page_scores.argtypes = [ctypes.POINTER(_SelArgs)]
        lib.hack_page_scores.restype = ctypes.c_int
        lib.hack_select_pages.argtypes = [ctypes.POINTER(_ChooseArgs)]
        lib.hack_select_pages.restype = ctypes.c_int
        lib.hack_select_pages_at.argtypes = [ctypes.POINTER(_ChooseArgs), ctypes.POINTER(_LayerArgs), _P,
                                             ctypes.POINTER(_I64), ctypes.POINTER(_I64), _I64]
        lib.hack_select_pages_at.restype = ctypes.c_int
        _typed.add(id(lib))
    return lib


@dataclass(frozen=True)
class _PlanInputs:
    """What the compiled selection takes from the plan alone: the same for every layer of a
    forward, so built once per plan (ForwardPlan.memo) rather than once per layer."""

    n_closed: Tensor  # [B] int64
    closed: list[int]  # n_closed as ints
    open_tokens: Tensor  # [B] int64: tokens of the still-open page
    table: Tensor  # [B, max_pages] int64, contiguous
    num_pages: Tensor  # [B] int64
    most_closed: int  # the most closed pages of any request (0: none has one)
    closed_total: int  # closed pages over the batch (what a dense step reads per KV head)

    @property
    def width(self) -> int:
        """The page scores' last dimension: the most closed pages, at least 1."""
        return max(1, self.most_closed)


def _plan_inputs(plan: ForwardPlan, p: int) -> _PlanInputs:
    key = ("sparse_inputs", p)
    got = plan.memo.get(key)
    if got is None:
        closed = [s // p for s in plan.seq_list]
        most = max(closed, default=0)
        got = _PlanInputs(n_closed=torch.tensor(closed, dtype=torch.int64), closed=closed,
                          open_tokens=torch.tensor([s % p for s in plan.seq_list], dtype=torch.int64),
                          table=plan.page_table.to(torch.int64).contiguous(),
                          num_pages=plan.num_pages.to(torch.int64).contiguous(), most_closed=most,
                          closed_total=sum(closed))
        plan.memo[key] = got
    return got


@dataclass(frozen=True)
class _LayerConsts:
    """What the compiled selection reads of a layer's K pages: fixed for the store's life, so
    looked up once per layer (every sparse layer of every step passes them)."""

    buf: Tensor  # the layer's K pages
    page_bytes: int
    min_off: int
    scale_off: int
    meta_fp32: int
    bits: int
    codes_off: int
    sums_off: int
    sums_bytes: int
    group: int  # K's quantization group in channels (the decode kernel's, for the refinement)
    per_channel: bool  # K's side tables per channel (what the selection scores from)
    args: _LayerArgs  # the same, as hack_select_pages_at takes them


def _layer_consts(store, layer: int) -> _LayerConsts:
    cache = store.__dict__.setdefault("_select_consts", {})
    got = cache.get(layer)
    if got is None or got.buf is not store.k_pages[layer]:  # (a store that replaced its buffers looks again)
        lay = store.layout_for(layer)
        buf = store.k_pages[layer]
        if not buf.is_contiguous():
            raise RuntimeError("the K pages must be contiguous")
        fields = dict(page_bytes=lay.k.page_bytes, min_off=lay.k.minimum.offset, scale_off=lay.k.scale.offset,
                      meta_fp32=int(lay.k.minimum.dtype == torch.float32), bits=lay.k.bits,
                      codes_off=lay.k.codes.offset, sums_off=lay.k.sums.offset, sums_bytes=lay.k.sums.dtype.itemsize,
                      group=store.config_for(layer).head_group(store.head_dim))
        args = _LayerArgs(k_page_bytes=fields["page_bytes"], k_min_off=fields["min_off"],
                          k_scale_off=fields["scale_off"], meta_fp32=fields["meta_fp32"], k_bits=fields["bits"],
                          group=fields["group"], k_codes_off=fields["codes_off"], k_sums_off=fields["sums_off"],
                          k_sums_bytes=fields["sums_bytes"], levels=float((1 << fields["bits"]) - 1),
                          k_pages=buf.data_ptr())
        got = cache[layer] = _LayerConsts(buf=buf, per_channel=lay.k.per_channel, args=args, **fields)
    return got


def _point_at_layer(a: _SelArgs, lc: _LayerConsts) -> None:
    """Sets the fields of `a` that name a layer's K pages."""
    a.k_page_bytes, a.k_min_off, a.k_scale_off, a.meta_fp32 = lc.page_bytes, lc.min_off, lc.scale_off, lc.meta_fp32
    a.levels, a.k_pages = float((1 << lc.bits) - 1), lc.buf.data_ptr()


# the query dtypes hack_select.c reads as they are (its q_dtype codes); others are converted first
_Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _q_in(q: Tensor) -> tuple[Tensor, int]:
    """q as the compiled selection takes it, and its q_dtype code."""
    code = _Q_DTYPES.get(q.dtype)
    if code is None or not q.is_contiguous():
        return q.float().contiguous(), 0
    return q, code


def _score_args(store, layer: int, plan: ForwardPlan, q: Tensor, score: PageScore | str, keep: list,
                scores: bool = True) -> _SelArgs:
    """The scoring kernel's arguments; `keep` holds the tensors their pointers point into.
    scores=False: no score per closed page is written (the two levels score only some)."""
    lc = _layer_consts(store, layer)
    b, hq, d = q.shape
    h = store.num_heads
    pin = _plan_inputs(plan, store.page_size)
    qf, q_code = _q_in(q)
    out = torch.empty(b, h, pin.width if scores else 1, dtype=torch.float32)
    keep += [pin.n_closed, pin.table, qf, out, lc.buf]
    threads = max(1, min(torch.get_num_threads(), b * h * pin.width // PAIRS_PER_THREAD))
    a = _SelArgs(batch=b, heads=h, rep=hq // h, head_dim=d, max_pages=pin.table.shape[1], width=pin.width,
                 score=int(PageScore(score) != PageScore.BOUND), nthreads=threads, alpha=LINEAR_ALPHA,
                 n_closed=pin.n_closed.data_ptr(), page_table=pin.table.data_ptr(), q=qf.data_ptr(), q_dtype=q_code,
                 out=out.data_ptr())
    _point_at_layer(a, lc)
    return a


def _check_rc(rc: int, kernel: str, allocation: str, store, q: Tensor) -> None:
    """A selection kernel's return code as the error it stands for (0: none)."""
    if rc == -2:
        raise MemoryError(f"the {kernel} kernel could not allocate {allocation}")
    if rc != 0:
        raise RuntimeError(f"the {kernel} kernel rejected the geometry (head_dim {q.shape[2]}, "
                           f"{q.shape[1] // store.num_heads} query heads per KV head)")


SEL_MAX_QD = 16384  # csrc/hack_select.c: query heads x head_dim of one request


def _usable(store, layer: int, q: Tensor) -> bool:
    """Whether the compiled selection takes this call (else the PyTorch path runs it); looked
    up once per (layer, query heads): every sparse layer of every step asks."""
    memo = store.__dict__.setdefault("_select_usable", {})
    key = (layer, q.shape[1])
    got = memo.get(key)
    if got is None:
        d = store.head_dim
        got = memo[key] = (store.device.type == "cpu" and store.layout_for(layer).k.per_channel and d % 16 == 0
                           and d <= 256 and q.shape[1] // store.num_heads <= 16 and q.shape[1] * d <= SEL_MAX_QD
                           and _library() is not None)
    return got


def kernel_scores(store, layer: int, plan: ForwardPlan, q: Tensor, score: PageScore | str = PageScore.BOUND
                  ) -> Tensor | None:
    """hack_ops.sparse.page_scores of every request's closed pages, by the compiled kernel
    reading K's minimum and scale inside the pages: float [B, H, N] (-inf past a request's
    closed pages), or None where the kernel is not available."""
    if not _usable(store, layer, q):
        return None
    keep: list = []
    a = _score_args(store, layer, plan, q, score, keep)
    rc = _library().hack_page_scores(ctypes.byref(a))
    _check_rc(rc, "page-score", "its float queries", store, q)
    return keep[3]


@dataclass
class _SelectCall:
    """One forward's compiled-selection arguments for a SparseConfig: what the plan fixes (batch,
    page tables, counts, the recent pages, the scores' scratch) set once in `args`; each layer
    then sets only its own fields (its pages, its queries, its outputs) before the call."""

    args: _ChooseArgs
    keep: list  # the tensors args points into
    width: int  # the output tables' last dimension
    need: list[int]  # two levels: each request's middle groups, whose boxes the call reads


def _select_call(store, plan: ForwardPlan, q: Tensor, cfg: SparseConfig) -> _SelectCall:
    key = ("sparse_call", id(store), cfg, tuple(q.shape))
    got = plan.memo.get(key)
    if got is not None:
        return got
    p, g = store.page_size, cfg.group_pages
    keep: list = []
    s = _score_args(store, 0, plan, q, cfg.score, keep, scores=not g)  # layer fields are set per call
    pin = _plan_inputs(plan, p)
    budget = cfg.budget_pages(p)
    recent_from = (pin.n_closed - min(cfg.recent_pages(p), budget - 1)).contiguous()
    keep.append(recent_from)
    width = min(pin.width, budget) + 1
    keep.append(pin.open_tokens)
    args = _ChooseArgs(s=s, budget=budget, out_width=width, recent_from=recent_from.data_ptr(),
                       num_pages=pin.num_pages.data_ptr(), refine=cfg.refine, page_size=p, sel_group=g,
                       keep_groups=cfg.keep_groups(p) if g else 0, open_tokens=pin.open_tokens.data_ptr())
    need = (recent_from.clamp(min=0) // g).tolist() if g else []
    got = plan.memo[key] = _SelectCall(args=args, keep=keep, width=width, need=need)
    return got


def kernel_select(store, layer: int, plan: ForwardPlan, q: Tensor, cfg: SparseConfig,
                  boxes: GroupBoxCache | None = None, copies: SideTableCopies | None = None
                  ) -> PageSelection | None:
    """The selection of select_for_decode in one compiled call (scores, top-k, the per-head page
    table), or None where the kernel is not available. Two levels (cfg.group_pages) need
    `boxes`, the cached group boxes: only the best groups' pages are scored. One level scores
    from `copies` where given (the requests' side tables in page order; the same pages chosen)."""
    if not _usable(store, layer, q) or (cfg.refine > 1 and store.head_dim % 64):
        return None  # the refinement scores pages with the decode kernel, whose heads are 64-channel multiples
    if cfg.group_pages and (boxes is None or boxes.group_pages != cfg.group_pages):
        return None
    p = store.page_size
    call = _select_call(store, plan, q, cfg)
    a, width = call.args, call.width
    b, h = a.s.batch, a.s.heads
    qf, q_code = _q_in(q)
    # the four outputs as four allocations: from cold caches (a served layer's), each torch call
    # costs microseconds, and slicing one buffer took more calls (views, splits) than it saved
    positions = torch.empty(b, h, width, dtype=torch.int64)
    table = torch.empty(b, h, width, dtype=torch.int64)
    count = torch.empty(b, dtype=torch.int64)
    seq_lens = torch.empty(b, dtype=torch.int64)
    lc = _layer_consts(store, layer)
    _point_at_layer(a.s, lc)  # this layer's pages and queries
    a.s.q, a.s.q_dtype = qf.data_ptr(), q_code
    a.k_bits, a.group, a.k_codes_off, a.k_sums_off, a.k_sums_bytes = (lc.bits, lc.group, lc.codes_off, lc.sums_off,
                                                                       lc.sums_bytes)
    a.positions, a.table, a.count, a.seq_lens = (positions.data_ptr(), table.data_ptr(), count.data_ptr(),
                                                 seq_lens.data_ptr())
    alive: list = []
    if cfg.group_pages:  # each request's middle groups (before its recent pages' first group) need boxes
        box_ptrs, box_cap, alive = boxes.pointers(store, layer, plan, call.need)
        alive += [box_ptrs, box_cap]
        a.boxes, a.box_cap = box_ptrs.data_ptr(), box_cap.data_ptr()
        a.s.copies = a.s.copied = None
    elif copies is not None:  # one level: scored from the copies (alive holds their address arrays)
        ptrs, held, a.s.copy_bytes = copies.pointers(store, layer, plan, _plan_inputs(plan, p).closed)
        alive += [ptrs, held]
        a.s.copies, a.s.copied = ctypes.addressof(ptrs), ctypes.addressof(held)
    else:
        a.s.copies = a.s.copied = None
    rc = _library().hack_select_pages(ctypes.byref(a))
    _check_rc(rc, "page-selection", "its heap or its float queries", store, q)
    return PageSelection(page_size=p, positions=positions, table=table, n_closed=count,
                         seq_lens=seq_lens, resident=_plan_inputs(plan, p).n_closed)


@dataclass(eq=False)
class _StepSelection(PageSelection):
    """A prepared step's selection: the same outputs rewritten by each layer that selects, and
    the closed pages read, summed by the kernel (no torch call to count them)."""

    read: ctypes.c_int64 | None = None
    inputs: tuple[Tensor, Tensor, Tensor] | None = None  # kernel_inputs(), views of the outputs

    def closed_read(self) -> int:
        return self.read.value

    def kernel_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.inputs  # (n_closed is lengths // page size: the open page holds < page size tokens)


@dataclass
class _Step:
    """One forward's compiled one-level selection, prepared at its first sparse layer: the
    arguments every layer shares and the outputs each layer writes in turn. A served layer
    starts from cold caches, where each Python statement and torch call around the kernel costs
    microseconds; prepared, a layer passes only its pages, queries and copies (one call)."""

    args: _ChooseArgs
    keep: list  # the tensors args points into
    q_dtype: torch.dtype
    q_shape: torch.Size
    closed: list[int]  # each request's closed pages
    dense: bool  # no request has more closed pages than the budget: every layer reads all
    selection: _StepSelection
    call: Callable[..., int]


_NOT_PREPARED = object()  # a plan's memo entry: this forward's selection is not prepared (generic path)


def _prepare_step(store, plan: ForwardPlan, q: Tensor, cfg: SparseConfig) -> _Step | None:
    """The step's prepared selection, or None where only the generic path takes it."""
    lib = _library()
    if (lib is None or not plan.is_decode or store.device.type != "cpu" or cfg.group_pages
            or q.dtype not in _Q_DTYPES or not q.is_contiguous() or (cfg.refine > 1 and store.head_dim % 64)):
        return None
    p = store.page_size
    pin = _plan_inputs(plan, p)
    call = _select_call(store, plan, q, cfg)
    a = _ChooseArgs.from_buffer_copy(call.args)  # the step's own: kernel_select rewrites the memo's outputs
    b, h, width = a.s.batch, a.s.heads, call.width
    positions = torch.zeros(b, h, width, dtype=torch.int64)
    table = torch.zeros(b, h, width, dtype=torch.int64)
    count = torch.zeros(b, dtype=torch.int64)
    seq_lens = torch.zeros(b, dtype=torch.int64)
    read = ctypes.c_int64(0)
    a.positions, a.table, a.count, a.seq_lens = (positions.data_ptr(), table.data_ptr(), count.data_ptr(),
                                                 seq_lens.data_ptr())
    a.read_total = ctypes.addressof(read)
    a.s.q_dtype = _Q_DTYPES[q.dtype]
    sel = _StepSelection(page_size=p, positions=positions, table=table, n_closed=count, seq_lens=seq_lens,
                         resident=pin.n_closed, read=read, inputs=(seq_lens, count, table.view(b * h, width)))
    return _Step(args=a, keep=call.keep + [positions, table, count, seq_lens, read], q_dtype=q.dtype,
                 q_shape=q.shape, closed=pin.closed, dense=pin.most_closed <= cfg.budget_pages(p), selection=sel,
                 call=lib.hack_select_pages_at)


def forget_prepared(plan: ForwardPlan) -> None:
    """Drops what the plan's sparse selections prepared (inputs, arguments, outputs): the next
    layer prepares them again, as a new forward's first sparse layer does (a benchmark times it)."""
    for key in [k for k in plan.memo if isinstance(k, tuple) and k[0] in ("sparse_inputs", "sparse_call",
                                                                          "sparse_step")]:
        del plan.memo[key]


def _select_in_step(store, layer: int, plan: ForwardPlan, q: Tensor, cfg: SparseConfig,
                    copies: SideTableCopies | None) -> PageSelection | None | object:
    """select_for_decode through the forward's prepared step: its one selection object,
    rewritten (each layer's decode reads it before the next layer selects), None (every page),
    or _NOT_PREPARED where the generic path must answer."""
    key = ("sparse_step", id(store), cfg)
    st = plan.memo.get(key)
    if st is None:
        st = plan.memo[key] = _prepare_step(store, plan, q, cfg) or _NOT_PREPARED
    if st is _NOT_PREPARED or q.dtype is not st.q_dtype or q.shape != st.q_shape or not q.is_contiguous():
        return _NOT_PREPARED
    lc = _layer_consts(store, layer)
    if not lc.per_channel:
        return _NOT_PREPARED  # (the generic path says why)
    if st.dense:
        return None
    if not _usable(store, layer, q):
        return _NOT_PREPARED
    ptrs, held, cb = copies.pointers(store, layer, plan, st.closed) if copies is not None else (None, None, 0)
    rc = st.call(st.args, lc.args, q.data_ptr(), ptrs, held, cb)
    _check_rc(rc, "page-selection", "its heap or its float queries", store, q)
    return st.selection


def select_for_decode(store, layer: int, plan: ForwardPlan, q: Tensor, cfg: SparseConfig,
                      boxes: GroupBoxCache | None = None, copies: SideTableCopies | None = None,
                      reuse: bool = False) -> PageSelection | None:
    """The pages a decode step of `plan` reads at `layer` under `cfg`, for queries q [B, Hq, D]
    (scaled or not: the ranking is the same). None when no request has more closed pages than
    the budget (every page is read: dense decode). The compiled selection where available (two
    levels, cfg.group_pages, from the cached group `boxes`; one level from the side tables'
    `copies` where given, else from the pages); else the portable path, which gathers the side
    tables (and computes the group boxes anew).
    reuse: the one-level compiled selection of the same plan and cfg returns one selection
    object for every layer, rewritten by each call (a server's decode step, whose layer reads
    its selection before the next layer selects), prepared once per plan; else a new one each
    call."""
    if reuse:
        got = _select_in_step(store, layer, plan, q, cfg, copies)
        if got is not _NOT_PREPARED:
            return got
    if not plan.is_decode:
        raise ValueError("sparse selection is for decode steps (one new token per request)")
    p = store.page_size
    h = store.num_heads
    if not store.layout_for(layer).k.per_channel:
        raise ValueError("sparse decode scores pages from K's per-channel side tables: orientation 'channel_k' only")
    budget = cfg.budget_pages(p)
    if _plan_inputs(plan, p).most_closed <= budget:
        return None
    sel = kernel_select(store, layer, plan, q, cfg, boxes, copies)
    if sel is not None:
        return sel
    mn, sc, n_closed = closed_page_meta(store, layer, plan)
    b, hq, d = q.shape
    qg = q.float().reshape(b, h, hq // h, d).to(mn.device)
    best = closed_page_best(store, layer, plan, q) if cfg.refine > 1 else None
    index, count = select(qg, mn, sc, store.layout_for(layer).k.bits, n_closed, cfg, p, best)
    return _as_table(plan, index, count, n_closed, p)


def _as_table(plan: ForwardPlan, index: Tensor, count: Tensor, n_closed: Tensor, p: int) -> PageSelection:
    """The selection as the kernels' per-head page table: each row's count[b] closed pages,
    then the open page's position (read from the tail; listed so positions stay complete)."""
    b, h, w = index.shape
    positions = torch.zeros(b, h, w + 1, dtype=torch.long)
    positions[:, :, :w] = index
    cols = torch.arange(w + 1)
    at_open = cols[None, None, :] == count[:, None, None]
    positions = torch.where(at_open, n_closed[:, None, None], positions)
    past = cols[None, None, :] > count[:, None, None]
    positions = positions.masked_fill(past, 0)
    last = (plan.num_pages.to(torch.long) - 1).clamp(min=0)
    lookup = torch.minimum(positions, last[:, None, None])
    table = torch.gather(plan.page_table.to(torch.long)[:, None, :].expand(b, h, -1), 2, lookup)
    seq = count * p + (plan.seq_lens.to(torch.long) - n_closed * p)
    return PageSelection(page_size=p, positions=positions, table=table, n_closed=count.to(torch.long), seq_lens=seq,
                         resident=n_closed)


@dataclass
class SparseTotals:
    """What sparse decode read over a server's life (summed over sparse layers and requests, per
    KV head): closed pages read against the closed pages resident, and the selections computed
    (the rest were shared between layers). A server's /server_info reports them."""

    pages_read: int = 0
    pages_resident: int = 0
    selections: int = 0
    steps: int = 0  # decode forwards with at least one sparse layer
    layer_steps: int = 0  # (decode forward, sparse layer) pairs
    group_boxes: int = 0  # two levels: group boxes computed (each once per request and layer)
    box_requests: int = 0  # two levels: requests whose boxes are kept now
    copy_bytes: int = 0  # one level on the CPU: bytes the side tables' copies hold now (outside the pool)
    copy_refused: int = 0  # (request, layer) selections read in the pages: the copies were at their cap

    def as_dict(self) -> dict:
        frac = self.pages_read / self.pages_resident if self.pages_resident else None
        return {"pages_read": self.pages_read, "pages_resident": self.pages_resident, "selections": self.selections,
                "steps": self.steps, "layer_steps": self.layer_steps,
                "read_fraction": None if frac is None else round(frac, 4),
                "group_boxes": self.group_boxes, "box_requests": self.box_requests, "copy_bytes": self.copy_bytes,
                "copy_refused": self.copy_refused}

    def per_layer_step_since(self, before: "SparseTotals") -> tuple[int | None, int | None]:
        """(pages selected, pages visible) per (decode step, sparse layer) since `before`, summed
        over the batch; (None, None) when no sparse layer ran in between."""
        n = self.layer_steps - before.layer_steps
        if n <= 0:
            return None, None
        return (round((self.pages_read - before.pages_read) / n),
                round((self.pages_resident - before.pages_resident) / n))


class SparseDecode:
    """The selection of one forward pass across its layers: each sparse layer selects from its
    own queries, or reuses the selection of the layer before it (SparseConfig.share_layers,
    MPCache's layer-wise index sharing: page ids name the same tokens in every layer). Counts
    what was read (pages selected and resident, summed over layers and heads), into `totals`
    as well when given."""

    def __init__(self, cfg: SparseConfig, totals: SparseTotals | None = None, boxes: GroupBoxCache | None = None,
                 keys: list | None = None, selector: Callable[..., PageSelection | None] | None = None,
                 copies: SideTableCopies | None = None) -> None:
        """boxes: the cached group boxes a two-level selection reads (kept across forwards by
        the caller; None: computed anew each step); copies: the requests' K side tables in page
        order that a one-level compiled selection reads (kept likewise; None: read in the
        pages); keys: the forward's request ids for both.
        selector: another selection of select_for_decode's (store, layer, plan, q, cfg) -> the
        pages (the GPU path's hack_ops.triton.sparse.select_on_device); None: select_for_decode."""
        self.cfg = cfg
        self.selector = selector
        self.totals = totals
        self.boxes = boxes
        self.copies = copies
        self.keys = keys
        self._plan: ForwardPlan | None = None
        self._last: PageSelection | None = None
        self._reuse_left = 0
        self.selections = 0  # selections computed (the rest were shared)
        self.pages_read = 0  # closed pages read over sparse layers and requests, per KV head
        self.pages_resident = 0  # closed pages a dense step would have read there

    @property
    def last(self) -> PageSelection | None:
        """The selection the latest sparse layer read (None: every page)."""
        return self._last

    def select(self, store, layer: int, plan: ForwardPlan, q: Tensor) -> PageSelection | None:
        """The pages this layer's decode reads (None: all), after the layer's store step."""
        t = self.totals
        if t is not None and self._plan is None:
            t.steps += 1  # one SparseDecode per forward pass: its first sparse layer
        if plan is self._plan and self._reuse_left > 0:
            self._reuse_left -= 1
            sel = self._last
        else:
            if self.boxes is not None:
                self.boxes.begin(plan, self.keys)
            if self.copies is not None:
                self.copies.begin(plan, self.keys)
            if self.selector is not None:
                sel = self.selector(store, layer, plan, q, self.cfg)
            else:
                sel = select_for_decode(store, layer, plan, q, self.cfg, self.boxes, self.copies, reuse=True)
            self._plan, self._last, self._reuse_left = plan, sel, self.cfg.share_layers - 1
            self.selections += 1
            if t is not None:
                t.selections += 1
                if self.boxes is not None:
                    t.group_boxes, t.box_requests = self.boxes.computed, len(self.boxes)
                if self.copies is not None:
                    t.copy_bytes, t.copy_refused = self.copies.nbytes, self.copies.refused
        resident = _plan_inputs(plan, store.page_size).closed_total
        read = resident if sel is None else sel.closed_read()
        self.pages_resident += resident
        self.pages_read += read
        if t is not None:
            t.pages_resident += resident
            t.pages_read += read
            t.layer_steps += 1
        return sel
