"""The HACK page layout: one definition shared by the kernels, the SGLang KV pool and the
transfer engine, so a page moves between them as opaque bytes.

A page holds Π = partition_size tokens of one layer. Each layer has one uint8 buffer for K and
one for V, shaped [num_pages, page_bytes]. Inside a page, sections follow each other, each
starting at a 16-byte aligned offset, and each is head-major:

  codes  [H, Π, D*bits/8]  uint8  codes packed along head_dim (see hack_ops.packing); K and V
                                  may have different bits (HackConfig.k_bits)
  minimum[H, M]            meta   (fp16 by default)
  scale  [H, M]            meta
  sums   [H, Π*ng]         int    K only: code sums per token and head_dim group

The per-channel tensor (K for 'channel_k', V for 'token_k') has M = D: one min/scale per
channel over the page's tokens. The per-token tensor has M = Π*ng (ng = D / Gd groups of
Gd = min(Π, D) channels per token).
Sums: K needs per-token sums over each head_dim group (Π*ng values), because Q's INT8
minimum multiplies Σ_d Kq[j, d] (in both orientations); this is the paper's summation
elimination. V has no sums section: P >= 0 is quantized with a zero minimum, so the term
that would need Σ_j Vq[j, d] vanishes (format version 2; version 1 stored V sums).

Dense-and-sparse K (HackConfig.k_outlier_channels = n > 0) adds two K sections:
  outlier_index  [H, n]     uint8  the page's n widest channels per head
  outlier_values [H, Π, n]  fp16   their values (their codes stay 0, min 0, scale 0)
No serving path reads them yet (the server refuses the option); they are here so that the
bytes the study reports are the bytes a page would hold.

Sink tokens (the first `sink_tokens` of a sequence) take no part in their page's ranges; their
slots hold code 0 and (per-token side) min 0, scale 0, so they add nothing to any sum.

FP16 tails hold the open partition of each tensor that has one (`tail_tensors`: K and V by
default, see HackConfig.tail_tensors): [Π, H, D] fp16 per request row and layer, each; a page
is quantized once, whole, when its last token arrives. The sinks are [S, H, D] fp16 for K and
for V per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import HackConfig
from .quant import sums_dtype
from .rotation import check_head_dim

LAYOUT_VERSION = 2
_ALIGN = 16

_META = {"float16": torch.float16, "float32": torch.float32}


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Section:
    offset: int  # bytes from the page start
    nbytes: int  # bytes of the whole section (all heads)
    dtype: torch.dtype
    shape: tuple[int, ...]  # per page: (H, ...)


@dataclass(frozen=True)
class TensorLayout:
    """Where codes, minimum, scale and sums of one tensor (K or V) sit inside a page."""

    per_channel: bool
    codes: Section
    minimum: Section
    scale: Section
    sums: Section | None  # None for V (no sums section)
    page_bytes: int
    bits: int  # bits per code of this tensor (K and V may differ: HackConfig.bits)
    outlier_index: Section | None = None  # K with k_outlier_channels only
    outlier_values: Section | None = None

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of one section for all pages: buf is [num_pages, page_bytes] uint8."""
        sec: Section | None = getattr(self, name)
        if sec is None:
            raise ValueError(f"this tensor has no {name!r} section")
        raw = buf[:, sec.offset : sec.offset + sec.nbytes]
        return raw.view(sec.dtype).view(buf.shape[0], *sec.shape)


@dataclass(frozen=True)
class PageLayout:
    config: HackConfig
    num_heads: int  # KV heads of this layer (per tensor-parallel rank)
    head_dim: int
    k: TensorLayout
    v: TensorLayout
    version: int = LAYOUT_VERSION

    @property
    def page_size(self) -> int:
        return self.config.partition_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer, K and V together."""
        return self.k.page_bytes + self.v.page_bytes

    @property
    def meta_dtype(self) -> torch.dtype:
        """dtype of the min/scale side tables."""
        return _META[self.config.meta_dtype]

    @property
    def tail_tensors(self) -> tuple[str, ...]:
        """The tensors whose open partition is held in FP16: ('k', 'v'), ('k',) or ('v',)."""
        return tuple(n for n, on in (("k", self.config.k_tail), ("v", self.config.v_tail)) if on)

    def tail_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.num_heads, self.head_dim)

    def sink_shape(self) -> tuple[int, int, int]:
        return (self.config.sink_tokens, self.num_heads, self.head_dim)

    def bf16_page_bytes(self) -> int:
        return 2 * 2 * self.page_size * self.num_heads * self.head_dim

    def describe(self) -> dict:
        """A JSON-able summary (used by the PD bootstrap check and the docs). Options that are
        off add no key, so the fingerprints of layouts without them do not change."""
        desc = {
            "version": self.version,
            "partition_size": self.page_size,
            "kv_bits": self.config.kv_bits,
            "orientation": self.config.orientation,
            "sink_tokens": self.config.sink_tokens,
            "meta_dtype": self.config.meta_dtype,
            "tail_tensors": list(self.tail_tensors),
            "rotation": self.config.rotation.value,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "k_page_bytes": self.k.page_bytes,
            "v_page_bytes": self.v.page_bytes,
        }
        if self.config.k_outlier_channels:
            desc["k_outlier_channels"] = self.config.k_outlier_channels
        if self.config.k_bits:
            desc["k_bits"] = self.config.k_bits
        return desc


def _tensor_layout(cfg: HackConfig, heads: int, head_dim: int, per_channel: bool, is_k: bool) -> TensorLayout:
    p, b = cfg.partition_size, cfg.bits("k" if is_k else "v")
    gd = cfg.head_group(head_dim)
    ng = head_dim // gd
    meta = _META[cfg.meta_dtype]
    msize = torch.tensor([], dtype=meta).element_size()
    row = head_dim * b // 8
    m = head_dim if per_channel else p * ng
    parts = [
        (heads * p * row, torch.uint8, (heads, p, row)),
        (heads * m * msize, meta, (heads, m)),
        (heads * m * msize, meta, (heads, m)),
    ]
    n_out = cfg.k_outlier_channels if is_k else 0
    if is_k:
        sdt = sums_dtype(b, gd)
        ssize = torch.tensor([], dtype=sdt).element_size()
        parts.append((heads * p * ng * ssize, sdt, (heads, p * ng)))
    if n_out:
        parts.append((heads * n_out, torch.uint8, (heads, n_out)))
        parts.append((heads * p * n_out * 2, torch.float16, (heads, p, n_out)))
    off = 0
    secs: list[Section | None] = []
    for nbytes, dt, shape in parts:
        secs.append(Section(off, nbytes, dt, shape))
        off = _align(off + nbytes)
    if not is_k:
        secs.append(None)
    return TensorLayout(per_channel, *secs[:4], page_bytes=off, bits=b, outlier_index=secs[4] if n_out else None,
                        outlier_values=secs[5] if n_out else None)


def page_layout(config: HackConfig, num_heads: int, head_dim: int) -> PageLayout:
    """The layout for one layer with `num_heads` KV heads of size `head_dim`."""
    if num_heads <= 0 or head_dim <= 0:
        raise ValueError(f"num_heads and head_dim must be positive, got {num_heads}, {head_dim}")
    check_head_dim(config.rotation, head_dim)
    if config.per_layer:
        raise ValueError(f"{config.label()} differs per layer: lay out config.for_layer(layer, num_layers)")
    if config.k_outlier_channels >= head_dim:
        raise ValueError(f"k_outlier_channels ({config.k_outlier_channels}) must be below head_dim {head_dim}")
    gd = config.head_group(head_dim)
    if head_dim % gd or (head_dim * min(config.bits("k"), config.bits("v"))) % 8:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {gd} and pack into whole bytes")
    k_chan = not config.k_per_token
    return PageLayout(
        config=config,
        num_heads=num_heads,
        head_dim=head_dim,
        k=_tensor_layout(config, num_heads, head_dim, per_channel=k_chan, is_k=True),
        v=_tensor_layout(config, num_heads, head_dim, per_channel=not k_chan, is_k=False),
    )


def bytes_per_token(layout: PageLayout, context: int, tail_fill: float | None = None) -> dict:
    """Bytes per token of one layer at `context` tokens, everything a request holds included:
    allocated pages (the open one too), the FP16 tail tokens and the sinks.
    tail_fill=None averages over the open partition's fill (0..Π-1 tokens, uniform)."""
    p = layout.page_size
    h, d = layout.num_heads, layout.head_dim
    fp16_tok = h * d * 2
    fills = range(p) if tail_fill is None else [int(tail_fill)]
    n_tails = len(layout.tail_tensors)
    tot = 0.0
    for r in fills:
        n = context + r
        pages = -(-n // p)
        tails = r * n_tails * fp16_tok
        tot += (pages * layout.page_bytes + tails + 2 * layout.config.sink_tokens * fp16_tok) / n
    per_tok = tot / len(fills)
    bf16 = 2 * fp16_tok
    return {"bytes_per_token": per_tok, "bf16_bytes_per_token": bf16, "ratio": per_tok / bf16}


def model_bytes_per_token(config: HackConfig, num_layers: int, num_heads: int, head_dim: int, context: int) -> dict:
    """bytes_per_token averaged over a model's layers (each laid out with config.for_layer, so
    edge_layer_bits is counted where it applies): per layer, like bytes_per_token."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    rows = [bytes_per_token(page_layout(config.for_layer(i, num_layers), num_heads, head_dim), context)
            for i in range(num_layers)]
    per_tok = sum(r["bytes_per_token"] for r in rows) / num_layers
    bf16 = rows[0]["bf16_bytes_per_token"]
    return {"bytes_per_token": per_tok, "bf16_bytes_per_token": bf16, "ratio": per_tok / bf16}


def describe_layouts(store) -> dict:
    """describe() of a store's layouts (anything with `config` and `layouts`, one per layer):
    layer 0's description; where layers differ in bits, `layer_bits` and the K and V page bytes
    as one entry per layer, `kv_bits` the config's. A uniform store describes exactly as its
    one layout, so its PD fingerprint does not change."""
    layouts = store.layouts
    desc = layouts[0].describe()
    first = (layouts[0].k.bits, layouts[0].v.bits)
    if any((lay.k.bits, lay.v.bits) != first for lay in layouts):
        desc["kv_bits"] = store.config.kv_bits
        desc.pop("k_bits", None)
        desc["layer_bits"] = [lay.config.kv_bits for lay in layouts]
        if store.config.split_bits:
            desc["layer_k_bits"] = [lay.k.bits for lay in layouts]
        desc["k_page_bytes"] = [lay.k.page_bytes for lay in layouts]
        desc["v_page_bytes"] = [lay.v.page_bytes for lay in layouts]
    return desc
