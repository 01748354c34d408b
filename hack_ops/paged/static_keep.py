"""Look-once static eviction on the paged store (`--hack-static-keep`): the kept pages of each
request, decided once from its prompt's last queries and read by every later decode step.

hack_ops.static_keep states the rule (votes, forced pages, the kept count). Here a server
applies it: after a prompt chunk has been stored, each attending layer (sliding-window layers
are bounded by their window already) takes the chunk's last `observe` rows of queries, the
prompt's keys as the pages hold them (dequantized once, K only) and keeps the best-voted closed
pages. A decode step then reads, per request and KV head, the kept prompt pages, every page
closed after the prompt and the FP16 open partition: a PageSelection, the shorter sequence the
sparse decode kernels already read (hack_ops.paged.sparse). Nothing is freed: a page dropped
for one layer is still held by the others (a slot holds every layer's page) and by the radix
cache for the requests that share it, each of which decides its own kept set.

Each extend forward recomputes the kept set of the rows it touches (a chunked prompt's last
chunk decides, an earlier chunk's set is replaced); with a radix-cache hit the window is the
rows the chunk has (at least one). A row without a set (a prompt under one page) reads every
page.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..static_keep import StaticKeep, keep_from_window
from .dequant import dense_kv
from .plan import ForwardPlan
from .sparse import PageSelection, SparseTotals, _as_table


@dataclass
class KeptPages:
    """One request's kept set: prompt_pages, the closed pages its prompt had when the set was
    decided; positions[layer], [H, k] long, the kept ones among them per KV head, ascending
    (every head keeps as many: the forced pages and the kept count are the same for all)."""

    prompt_pages: int
    positions: dict[int, Tensor] = field(default_factory=dict)

    def page_mask(self, num_layers: int) -> Tensor:
        """bool [num_layers, prompt_pages]: which prompt pages some KV head of each layer reads
        (what PD must send); every page of a layer without a set."""
        mask = torch.ones(num_layers, self.prompt_pages, dtype=torch.bool)
        for layer, pos in self.positions.items():
            mask[layer] = False
            mask[layer, pos.reshape(-1)] = True
        return mask


class StaticKeepPages:
    """The kept sets of a server's request rows and the decode steps that read them. `totals`
    (SparseTotals) counts the closed pages read against resident, as sparse decode does."""

    def __init__(self, cfg: StaticKeep, totals: SparseTotals | None = None) -> None:
        if not cfg.enabled:
            raise ValueError("static eviction is off (keep = 1): nothing to keep track of")
        self.cfg = cfg
        self.totals = totals
        self._rows: dict[int, KeptPages] = {}
        self._counted: ForwardPlan | None = None  # the decode plan whose step was counted

    def kept(self, row: int) -> KeptPages | None:
        return self._rows.get(int(row))

    def install(self, row: int, kept: KeptPages | None) -> None:
        """Set row's kept set as another server decided it (PD: the prefill server's, received
        with the request's state); None: the row reads every page."""
        if kept is None:
            self._rows.pop(int(row), None)
        else:
            self._rows[int(row)] = kept

    def begin_extend(self, plan: ForwardPlan) -> None:
        """An extend forward is about to store new tokens for plan's rows: their old kept sets
        (a finished request's, or an earlier chunk's) no longer apply."""
        for r in plan.rows.tolist():
            self._rows.pop(int(r), None)

    def observe(self, store, layer: int, plan: ForwardPlan, q: Tensor, scale: float, logit_cap: float = 0.0) -> None:
        """Decide layer's kept pages for every request of the extend plan, after the layer's
        store step: q [N, Hq, D], the forward's queries as attention got them."""
        p, h = store.page_size, store.num_heads
        ends = plan.qo_indptr.tolist()
        for b, (n, ext) in enumerate(zip(plan.seq_list, plan.ext_list)):
            nc = n // p
            m = min(self.cfg.observe_rows(n), ext)
            if nc == 0 or m <= 0:
                continue
            row = int(plan.rows[b])
            qb = q[ends[b + 1] - m:ends[b + 1]].float()  # the chunk's last m rows: [m, Hq, D]
            q_obs = qb.reshape(m, h, qb.shape[1] // h, qb.shape[2]).permute(1, 2, 0, 3)
            tails = {name: t[layer][row] for name, t in store.tails.items()}
            k = dense_kv(store, layer, plan, b, n, tails, torch.float32, names=("k",))["k"]
            kept = keep_from_window(q_obs, k.to(q_obs.device), p, self.cfg, scale, logit_cap)  # [H, nc]
            entry = self._rows.setdefault(row, KeptPages(prompt_pages=nc))
            entry.positions[layer] = kept.nonzero()[:, 1].reshape(h, -1)

    def select(self, store, layer: int, plan: ForwardPlan, q: Tensor | None = None) -> PageSelection | None:
        """The pages a decode step of plan reads at layer (q is not needed: the set was decided
        at prefill), or None where no request of the batch drops a page there."""
        if not plan.is_decode:
            raise ValueError("the kept pages are read by decode steps (one new token per request)")
        p, h = store.page_size, store.num_heads
        entries = [self._rows.get(int(r)) for r in plan.rows.tolist()]
        n_closed = [n // p for n in plan.seq_list]
        per_req = []
        for e, nc in zip(entries, n_closed):
            pos = e.positions.get(layer) if e is not None else None
            if pos is None:
                per_req.append(torch.arange(nc).expand(h, nc))
            else:  # the kept prompt pages, then every page closed since
                per_req.append(torch.cat([pos, torch.arange(min(e.prompt_pages, nc), nc).expand(h, -1)], 1))
        count = torch.tensor([x.shape[1] for x in per_req], dtype=torch.long)
        resident = torch.tensor(n_closed, dtype=torch.long)
        self._count(plan, int(count.sum()), int(resident.sum()))
        if bool((count == resident).all()):
            return None
        index = torch.zeros(len(per_req), h, int(count.max()), dtype=torch.long)
        for i, x in enumerate(per_req):
            index[i, :, :x.shape[1]] = x
        return _as_table(plan, index, count, resident, p)

    def _count(self, plan: ForwardPlan, read: int, resident: int) -> None:
        t = self.totals
        if t is None:
            return
        if plan is not self._counted:
            self._counted = plan
            t.steps += 1
            t.selections += 1  # decided at prefill; one lookup per step
        t.pages_read += read
        t.pages_resident += resident
        t.layer_steps += 1
