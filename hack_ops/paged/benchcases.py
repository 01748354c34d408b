"""Benchmark cases for `hack bench attention`: a filled store plus the same context as a dense
BF16 cache, and one callable per method (decode or prefill)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..config import HackConfig
from ..modes import AttentionMode, PrefillMode
from .attention import decode, extend
from .fill import scattered_table
from .store import HackKVStore


def _kv(n: int, h: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K with uneven channel ranges (as real keys have) and V, in fp16."""
    chan = 1.0 + (torch.arange(d) % 7).float()
    k = (torch.randn(n, h, d, generator=g) * chan).half()
    v = torch.randn(n, h, d, generator=g).half()
    return k, v


class DecodeCase:
    def __init__(self, hq: int, h: int, d: int, batch: int, context: int, config: HackConfig | None = None,
                 seed: int = 0, chunk: int = 4096):
        cfg = config or HackConfig()
        p = cfg.partition_size
        g = torch.Generator().manual_seed(seed)
        pages = batch * -(-context // p) + 1
        self.store = HackKVStore(cfg, 1, h, d, num_pages=pages, num_rows=batch)
        rows = list(range(batch))
        table = scattered_table([context] * batch, p, batch, rows, pages, generator=g)
        self.k16 = torch.empty(batch, h, context, d, dtype=torch.bfloat16)
        self.v16 = torch.empty(batch, h, context, d, dtype=torch.bfloat16)
        last_k, last_v = [], []
        for b in rows:  # one request at a time, in chunks, to bound memory
            k, v = _kv(context, h, d, g)
            self.k16[b] = k.transpose(0, 1).to(torch.bfloat16)
            self.v16[b] = v.transpose(0, 1).to(torch.bfloat16)
            for lo in range(0, context - 1, chunk):
                hi = min(lo + chunk, context - 1)
                self.store.write(0, self.store.plan(table, [b], [hi], [hi - lo]), k[lo:hi], v[lo:hi])
            last_k.append(k[-1])
            last_v.append(v[-1])
        self.plan = self.store.plan(table, rows, [context] * batch)
        self.store.write(0, self.plan, torch.stack(last_k), torch.stack(last_v))
        self.q = torch.randn(batch, hq, d, generator=g).to(torch.bfloat16)
        self.hq, self.h, self.d = hq, h, d

    def methods(self) -> dict[str, Callable[[], torch.Tensor]]:
        b = self.q.shape[0]
        q4 = self.q.reshape(b, self.hq, 1, self.d)
        return {
            "hack": lambda: decode(self.store, 0, self.plan, self.q),
            "bf16": lambda: F.scaled_dot_product_attention(q4, self.k16, self.v16, enable_gqa=self.hq != self.h),
            "dequant": lambda: decode(self.store, 0, self.plan, self.q, mode=AttentionMode.DEQUANT),
        }

    def release(self) -> None:
        del self.store, self.k16, self.v16


class PrefillCase:
    def __init__(self, hq: int, h: int, d: int, n: int, config: HackConfig | None = None, seed: int = 0):
        cfg = config or HackConfig()
        p = cfg.partition_size
        g = torch.Generator().manual_seed(seed)
        pages = -(-n // p) + 1
        self.store = HackKVStore(cfg, 1, h, d, num_pages=pages, num_rows=1)
        table = scattered_table([n], p, 1, [0], pages, generator=g)
        self.plan = self.store.plan(table, [0], [n], [n])
        self.k, self.v = _kv(n, h, d, g)
        self.q = torch.randn(n, hq, d, generator=g).to(torch.bfloat16)
        self.q4 = self.q.transpose(0, 1)[None]
        self.k4 = self.k.transpose(0, 1)[None].to(torch.bfloat16)
        self.v4 = self.v.transpose(0, 1)[None].to(torch.bfloat16)
        self.gqa = hq != h
        self._windows = None

    def _sdpa(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q4, self.k4, self.v4, is_causal=True, enable_gqa=self.gqa)

    def _sdpa32(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q4.float(), self.k4.float(), self.v4.float(), is_causal=True,
                                              enable_gqa=self.gqa)

    def _attention_only(self) -> torch.Tensor:
        """HACK extend attention on pages already stored (the store step not timed)."""
        from .attention import _fp16_windows
        from .cpu_extend import attend

        if self._windows is None:
            self.store.write(0, self.plan, self.k, self.v)
            self._windows = _fp16_windows(self.store, self.plan, self.k, self.v, {})
        kw, vw, woff = self._windows
        return attend(self.store, 0, self.plan, self.q, self.q.shape[-1] ** -0.5, kw, vw, woff, False)

    def _dequant(self) -> torch.Tensor:
        self.store.write(0, self.plan, self.k, self.v)  # the strawman quantizes for storage only
        return self._sdpa()

    def methods(self) -> dict[str, Callable[[], torch.Tensor]]:
        return {
            "hack": lambda: extend(self.store, 0, self.plan, self.q, self.k, self.v, mode=AttentionMode.HACK),
            "hack-exact": lambda: extend(self.store, 0, self.plan, self.q, self.k, self.v, mode=AttentionMode.HACK,
                                         prefill=PrefillMode.EXACT),
            "hack-int8": lambda: extend(self.store, 0, self.plan, self.q, self.k, self.v, mode=AttentionMode.HACK,
                                        prefill=PrefillMode.INT8),
            "hack-store": lambda: self.store.write(0, self.plan, self.k, self.v),  # quantization alone
            "hack-attn": self._attention_only,  # the homomorphic attention alone
            "bf16": self._sdpa,
            "fp32": self._sdpa32,
            "dequant": self._dequant,
        }

    def release(self) -> None:
        del self.store, self.k4, self.v4


def decode_case(hq: int, h: int, d: int, batch: int, context: int) -> DecodeCase:
    return DecodeCase(hq, h, d, batch, context)


def prefill_case(hq: int, h: int, d: int, n: int) -> PrefillCase:
    return PrefillCase(hq, h, d, n)
