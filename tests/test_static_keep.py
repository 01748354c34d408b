"""Look-once static eviction (hack_ops.static_keep): the votes, the pages kept, the study's
attention under it against a direct computation, and the wire bytes it leaves."""
from __future__ import annotations

import pytest
import torch

from hack_eval.attention_paths import dequant_views, study_attention
from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.page_wire import (derived_bytes, kept_request_bytes, model_kept_request_bytes, model_request_bytes,
                                request_bytes)
from hack_ops.static_keep import KeepUnit, StaticKeep, keep_mask, keep_pages, page_votes

P = 64


def test_config_is_checked():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="keep"):
            StaticKeep(keep=bad)
    with pytest.raises(ValueError, match="observe"):
        StaticKeep(keep=0.5, observe=0.0)
    with pytest.raises(ValueError):
        StaticKeep(keep=0.5, unit="token")
    st = StaticKeep(keep=0.5, observe=0.15)
    assert st.enabled and not StaticKeep().enabled and st.unit is KeepUnit.PAGE
    assert st.observe_rows(1000) == 150 and st.observe_rows(3) == 1 and st.kept_count(7) == 4
    assert st.label() == "static keep 0.5 (page)"
    assert StaticKeep(keep=0.5).observe_rows(4096) == 41  # the default window: the question at 4K


def test_votes_are_attention_mass_and_find_a_planted_key():
    g = torch.Generator().manual_seed(0)
    h, r, d, n = 2, 3, 32, 10 * P + 17
    k = torch.randn(h, n, d, generator=g) * 0.3
    q = torch.randn(h, r, 8, d, generator=g) * 0.3
    rows = torch.arange(n - 8, n)
    # Query head 1 of KV head 0 looks for a key planted on page 4; the other heads do not.
    base = torch.randn(d, generator=g)
    q[0, 1] = base + 0.1 * torch.randn(8, d, generator=g)
    k[0, 4 * P + 9] = 3 * base
    votes = page_votes(q, k, rows, P, scale=d ** -0.5)
    assert votes.shape == (h, n // P)
    # each head's share of a softmax, so a page's max over the group is <= 1 and the sum <= R
    assert (votes >= 0).all() and (votes <= 1 + 1e-6).all() and (votes.sum(-1) <= r + 1e-5).all()
    one = page_votes(q[:, :1], k, rows, P, scale=d ** -0.5)
    assert (one.sum(-1) <= 1 + 1e-5).all()
    assert int(votes[0].argmax()) == 4 and votes[0, 4] > 0.5
    assert int(votes[1].argmax()) != 4 or votes[1, 4] < 0.3
    # causal: a row sees no key after it, so a key planted past every row gets no vote
    k2 = k.clone()
    k2[1, n - 1] = 40 * q[1, 0, 0]
    early = page_votes(q[:, :, :1], k2, rows[:1], P, scale=d ** -0.5)
    assert torch.allclose(early, page_votes(q[:, :, :1], k, rows[:1], P, scale=d ** -0.5))


def test_kept_pages_hold_the_forced_ones_and_the_best_voted():
    votes = torch.tensor([[0.0, 0.3, 0.01, 0.2, 0.02, 0.0, 0.1, 0.0],
                          [0.0, 0.0, 0.5, 0.0, 0.0, 0.4, 0.0, 0.0]])
    first_observed = 7 * P + 5  # the window starts inside page 7
    head = keep_pages(votes, first_observed, P, StaticKeep(keep=0.5, unit="head"))
    # 4 of 8 kept per head: page 0 and page 7 forced, then each head's two best
    assert head[0].nonzero().flatten().tolist() == [0, 1, 3, 7]
    assert head[1].nonzero().flatten().tolist() == [0, 2, 5, 7]
    page = keep_pages(votes, first_observed, P, StaticKeep(keep=0.5, unit="page"))
    assert torch.equal(page[0], page[1])  # one decision for the layer's page
    assert page[0].nonzero().flatten().tolist() == [0, 2, 5, 7]  # by the max over heads: 0.5 and 0.4
    # forced pages beyond the budget are all kept
    many = keep_pages(votes, 2 * P, P, StaticKeep(keep=0.25, unit="page"))
    assert many[0].nonzero().flatten().tolist() == [0, 2, 3, 4, 5, 6, 7]
    assert keep_pages(votes[:, :0], 0, P, StaticKeep(keep=0.5)).shape == (2, 0)


def test_keep_mask_reads_only_the_prompt():
    g = torch.Generator().manual_seed(1)
    h, r, d, plen = 2, 2, 16, 6 * P
    q = torch.randn(h, r, plen + 40, d, generator=g)
    k = torch.randn(h, plen + 40, d, generator=g)
    st = StaticKeep(keep=0.5, observe=0.2, unit="head")
    kept = keep_mask(q, k, plen, P, st, scale=0.25)
    # 77 observed rows start on page 4: pages 0, 4, 5 forced, which is already half of 6
    assert kept.shape == (h, 6) and kept[:, [0, 4, 5]].all() and (kept.sum(-1) == 3).all()
    q2, k2 = q.clone(), k.clone()
    q2[:, :, plen:] = 0
    k2[:, plen:] = 99  # what follows the prompt changes nothing
    assert torch.equal(kept, keep_mask(q2, k2, plen, P, st, scale=0.25))


def _direct(q, k, v, cfg, kept, plen, scale):
    """Row by row: decode-time visibility (hack_ops.attention's rule, through dequant_views),
    and rows at or past plen skip the dropped pages' keys."""
    kc, ko, vc, vo = dequant_views(k, v, cfg)
    hq, n = q.shape[1], q.shape[2]
    rep = hq // k.shape[1]
    out = torch.empty(1, hq, n, v.shape[-1])
    for t in range(n):
        j = torch.arange(t + 1)
        closed = j < ((t + 1) // cfg.partition_size) * cfg.partition_size
        for hh in range(hq):
            kv = hh // rep
            keys = torch.where(closed[:, None], kc[0, kv, :t + 1], ko[0, kv, :t + 1])
            vals = torch.where(closed[:, None], vc[0, kv, :t + 1], vo[0, kv, :t + 1])
            s = (q[0, hh, t].float() @ keys.T) * scale
            if t >= plen:
                pg = j // cfg.partition_size
                inside = pg < kept.shape[-1]
                drop = inside & ~kept[kv, pg.clamp(max=kept.shape[-1] - 1)]
                s = s.masked_fill(drop, float("-inf"))
            out[0, hh, t] = torch.softmax(s, -1) @ vals
    return out


def test_study_attention_drops_the_evicted_pages_for_decode_rows_only():
    g = torch.Generator().manual_seed(2)
    cfg = HackConfig()
    h, hq, d, plen, n = 2, 4, 32, 3 * P + 10, 3 * P + 10 + 90
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, h, n, d, generator=g)
    v = torch.randn(1, h, n, d, generator=g)
    kept = torch.tensor([[True, False, True], [True, True, False]])
    scale = d ** -0.5
    got = study_attention(q, k, v, cfg, "dequant", scale=scale, static=(kept, plen))
    want = _direct(q, k, v, cfg, kept, plen, scale)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    dense = study_attention(q, k, v, cfg, "dequant", scale=scale)
    assert torch.allclose(got[:, :, :plen], dense[:, :, :plen], atol=1e-6)  # the prompt reads every page
    assert not torch.allclose(got[:, :, plen:], dense[:, :, plen:], atol=1e-3)
    every = study_attention(q, k, v, cfg, "dequant", scale=scale, static=(torch.ones(h, 3, dtype=torch.bool), plen))
    assert torch.allclose(every, dense, atol=1e-6)
    for bad in ({"mode": "hack"}, {"window": 100}, {"path": "reference"}):
        with pytest.raises(ValueError, match="static eviction"):
            study_attention(q, k, v, cfg, bad.pop("mode", "dequant"), scale=scale, static=(kept, plen), **bad)


@pytest.mark.parametrize("cfg", [HackConfig(), HackConfig(kv_bits=4),
                                 HackConfig(orientation="token_k", tail_tensors="per_channel")])
def test_kept_request_bytes(cfg):
    lay = page_layout(cfg, 3, 64)
    for tokens in (40, 5 * P, 5 * P + 7):
        n = tokens // P
        assert kept_request_bytes(lay, tokens, [True] * n) == request_bytes(lay, 1, tokens)
    tokens = 5 * P + 7
    full = request_bytes(lay, 1, tokens)
    cut = derived_bytes(lay.k) + derived_bytes(lay.v)
    # page 2 stays home: one page fewer, and the run before it ends with its page in wire form
    assert kept_request_bytes(lay, tokens, [1, 1, 0, 1, 1]) == full - lay.page_bytes - cut
    # only the last closed page kept
    one = kept_request_bytes(lay, tokens, [0, 0, 0, 0, 1])
    assert one == full - 4 * lay.page_bytes
    with pytest.raises(ValueError, match="closed pages"):
        kept_request_bytes(lay, tokens, [True] * 4)


def test_model_kept_request_bytes_counts_a_page_any_head_keeps():
    cfg = HackConfig()
    tokens, layers, heads, d = 4 * P + 3, 3, 2, 64
    full = model_request_bytes(cfg, layers, heads, d, tokens)
    assert model_kept_request_bytes(cfg, layers, heads, d, tokens, {}) == full
    kept = {1: torch.tensor([[True, False, False, True], [True, False, True, True]])}
    lay = page_layout(cfg, heads, d)
    want = full - request_bytes(lay, 1, tokens) + kept_request_bytes(lay, tokens, [1, 0, 1, 1])
    assert model_kept_request_bytes(cfg, layers, heads, d, tokens, kept) == want < full


def test_static_rows_are_the_dequant_rows_of_the_base():
    from hack_eval.runner import EXACT, Variant
    from hack_eval.variants import static_variants

    cfg = HackConfig()
    base = [EXACT, Variant("default", "hack", cfg), Variant("default", "dequant", cfg)]
    st = (StaticKeep(keep=0.5), StaticKeep(keep=0.4, unit="head"))
    rows = static_variants(base, st)
    assert [(r.name, r.mode.value, r.static) for r in rows] == [
        ("default, static keep 0.5 (page)", "dequant", st[0]), ("default, static keep 0.4 (head)", "dequant", st[1])]
    with pytest.raises(ValueError, match="'dequant' rows"):
        static_variants(base[:2], st)
    with pytest.raises(ValueError, match="static eviction is studied in 'dequant' mode"):
        Variant("x", "hack", cfg, static=StaticKeep(keep=0.5))


def test_needle_kept_counts_heads_that_kept_every_page_of_the_needle():
    from hack_eval.retrieval import Item, needle_kept

    it = Item(300, 0.5, "12345", tuple(range(300)), 290, needle_start=120, needle_len=20)  # pages 1 and 2
    kept = {0: torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]]).bool(), 3: torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]]).bool()}
    assert needle_kept(it, kept, P) == pytest.approx(3 / 4)
    assert needle_kept(it, {}, P) == 1.0
    late = Item(300, 0.9, "12345", tuple(range(300)), 290, needle_start=260, needle_len=20)  # the open partition
    assert needle_kept(late, kept, P) == 1.0


def test_static_wire_counts_bytes_pages_read_and_slots():
    from types import SimpleNamespace

    from hack_eval.retrieval import static_wire
    from hack_eval.runner import Variant

    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4,
                                                   head_dim=64, hidden_size=256))
    cfg = HackConfig()
    tokens = 4 * P + 3
    kept = {0: torch.tensor([[1, 0, 1, 1], [1, 0, 0, 1]]).bool(), 1: torch.tensor([[1, 0, 0, 1], [1, 0, 0, 1]]).bool()}
    w = static_wire(model, Variant("x", "dequant", cfg, static=StaticKeep(keep=0.5)), tokens, kept)
    full = model_request_bytes(cfg, 2, 2, 64, tokens)
    sent = model_kept_request_bytes(cfg, 2, 2, 64, tokens, kept)
    bf16 = 2 * 2 * 2 * 2 * 64 * tokens
    assert w["wire_vs_bf16"] == pytest.approx(sent / bf16) and w["wire_all_pages_vs_bf16"] == pytest.approx(full / bf16)
    assert w["wire_vs_all_pages"] == pytest.approx(sent / full) and sent < full
    assert w["pages_read"] == pytest.approx((5 / 8 + 4 / 8) / 2)
    assert w["slots_needed"] == pytest.approx(3 / 4)  # page 1 is dropped by every layer and head
    one_layer = static_wire(model, Variant("x", "dequant", cfg, static=StaticKeep(keep=0.5)), tokens, {1: kept[1]})
    assert one_layer["slots_needed"] == 1.0  # layer 0 keeps every page
