"""ForwardPlan: the batch metadata of one forward pass, computed once and shared by all layers.

Inputs follow SGLang's index tables: `req_to_token[row, pos]` is the slot of token `pos` of the
request living in row `row`, with slot = page_id * Π + pos % Π (page size Π). A forward adds
`ext_lens[i]` new tokens to request i, whose total length then becomes `seq_lens[i]`
(decode: ext_lens = 1). The plan derives the page table, the new tokens' slots and positions,
and checks that the table is page-aligned, so every layer's store and attention step can rely
on it without re-checking.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class ForwardPlan:
    page_size: int
    rows: Tensor  # [B] long: request rows (SGLang req_pool_indices)
    seq_lens: Tensor  # [B] long: lengths after this forward
    ext_lens: Tensor  # [B] long: new tokens per request
    prefix_lens: Tensor  # [B] long: tokens already cached before this forward
    qo_indptr: Tensor  # [B+1] long: request i's new tokens are [qo_indptr[i], qo_indptr[i+1])
    page_table: Tensor  # [B, max_pages] long: pages holding tokens 0..seq_len-1 (padded with 0)
    num_pages: Tensor  # [B] long: ceil(seq_len / Π)
    tok_req: Tensor  # [N] long: request index of each new token
    tok_row: Tensor  # [N] long
    tok_pos: Tensor  # [N] long: position in its sequence
    tok_slot: Tensor  # [N] long
    tok_page: Tensor  # [N] long
    tok_off: Tensor  # [N] long: offset inside the page (= pos % Π)
    sink_slot: Tensor  # [B] long: sink-store slot of each sequence (-1: none / no sinks)
    seq_list: list[int]
    ext_list: list[int]
    prefix_list: list[int]
    # every new token only appends to its row's FP16 tails (HackKVStore.plan sets it; None: unknown)
    appends_only: bool | None = None
    # values derived from the plan alone that a per-layer step needs, computed by its first
    # layer and read by the rest (e.g. hack_ops.paged.sparse's selection inputs); never copied
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def has_prefix(self) -> bool:
        """Some request of this forward extends tokens already cached."""
        return max(self.prefix_list, default=0) > 0

    @property
    def num_new_tokens(self) -> int:
        return int(self.tok_pos.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.ext_list)

    def csr_pages(self, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """The page table in FlashInfer's CSR form, as the Triton kernels take it: (kv_indptr,
        kv_indices) int32 on `device`, request b's pages being
        kv_indices[kv_indptr[b]:kv_indptr[b+1]] (the padding of page_table dropped)."""
        npg = self.num_pages.to(torch.long).cpu()
        table = self.page_table.cpu()
        indptr = torch.zeros(npg.shape[0] + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(npg, 0).to(torch.int32)
        indices = table[torch.arange(table.shape[1])[None, :] < npg[:, None]].to(torch.int32)
        return indptr.to(device), indices.to(device)


def _as_long(x, name: str) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {tuple(t.shape)} {t.dtype}")
    return t.to(torch.long)


def build_plan(req_to_token: Tensor, rows, seq_lens, ext_lens, page_size: int) -> ForwardPlan:
    """Validate the batch metadata and derive what every layer needs (sink slots unset)."""
    if not isinstance(req_to_token, Tensor) or req_to_token.dim() != 2:
        raise ValueError("req_to_token must be a 2-D tensor [rows, max_tokens]")
    rows_t = _as_long(rows, "rows")
    seq_t = _as_long(seq_lens, "seq_lens")
    ext_t = _as_long(ext_lens, "ext_lens")
    b = rows_t.shape[0]
    if b == 0:
        raise ValueError("the batch is empty")
    if seq_t.shape[0] != b or ext_t.shape[0] != b:
        raise ValueError(f"rows ({b}), seq_lens ({seq_t.shape[0]}) and ext_lens ({ext_t.shape[0]}) differ in length")
    if int(rows_t.min()) < 0 or int(rows_t.max()) >= req_to_token.shape[0]:
        raise ValueError(f"rows must be in 0..{req_to_token.shape[0] - 1}")
    if torch.unique(rows_t).shape[0] != b:
        raise ValueError("rows must be distinct: each request of a batch has its own row")
    if int(ext_t.min()) < 1:
        raise ValueError("every request must add at least one token (ext_lens >= 1)")
    if bool((ext_t > seq_t).any()):
        raise ValueError("ext_lens must not exceed seq_lens")
    if int(seq_t.max()) > req_to_token.shape[1]:
        raise ValueError(f"seq_lens exceed req_to_token's width {req_to_token.shape[1]}")
    p = page_size
    prefix_t = seq_t - ext_t
    npg = (seq_t + p - 1) // p
    max_pages = int(npg.max())
    # each page's first slot, the columns taken before the rows (gathering whole rows first copied
    # the pool's full context width per request every step)
    table = req_to_token[:, : max_pages * p : p][rows_t].to(torch.long)
    if table.shape[1] < max_pages:  # req_to_token narrower than whole pages: pad the view
        table = torch.nn.functional.pad(table, (0, max_pages - table.shape[1]))
    used = torch.arange(max_pages)[None, :] < npg[:, None]
    if bool((table[used] % p != 0).any()):
        raise ValueError(f"req_to_token is not page-aligned: a page's first token sits at a slot not divisible by {p}")
    table = torch.where(used, table // p, torch.zeros_like(table))
    ext_list = ext_t.tolist()
    qo = torch.zeros(b + 1, dtype=torch.long)
    qo[1:] = torch.cumsum(ext_t, 0)
    tok_req = torch.repeat_interleave(torch.arange(b), ext_t)
    tok_pos = torch.arange(int(qo[-1])) - qo[:-1][tok_req] + prefix_t[tok_req]
    tok_row = rows_t[tok_req]
    tok_slot = req_to_token[tok_row, tok_pos].to(torch.long)
    tok_page = tok_slot // p
    tok_off = tok_slot % p
    if bool((tok_off != tok_pos % p).any()) or bool((tok_page != table[tok_req, tok_pos // p]).any()):
        raise ValueError("req_to_token is not page-aligned: a new token's slot does not match its page and offset")
    if torch.unique(tok_slot).shape[0] != tok_slot.shape[0]:
        raise ValueError("two new tokens of this batch map to the same slot in req_to_token")
    return ForwardPlan(
        page_size=p, rows=rows_t, seq_lens=seq_t, ext_lens=ext_t, prefix_lens=prefix_t, qo_indptr=qo,
        page_table=table, num_pages=npg, tok_req=tok_req, tok_row=tok_row, tok_pos=tok_pos,
        tok_slot=tok_slot, tok_page=tok_page, tok_off=tok_off,
        sink_slot=torch.full((b,), -1, dtype=torch.long),
        seq_list=seq_t.tolist(), ext_list=ext_list, prefix_list=prefix_t.tolist(),
    )
