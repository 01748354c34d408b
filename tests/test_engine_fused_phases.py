"""engine.fused_phases: per-forward timing of the fused phases and its split among requests."""
from __future__ import annotations

import pytest
import torch

from engine import fused_phases, server_state
from hack_ops import HackConfig
from hack_ops.paged import HackKVStore, clock
from hack_ops.paged import decode as paged_decode
from hack_ops.paged import extend as paged_extend


def test_shares_split_quantization_by_new_tokens_and_attention_by_context():
    rec = fused_phases.ForwardRecord(("a", "b"), new_tokens=(3, 1), context=(100, 300),
                                     seconds={"quantization": 0.4, "approximation": 2.0})
    sh = rec.shares()
    assert sh["a"]["quantization"] == pytest.approx(0.3) and sh["b"]["quantization"] == pytest.approx(0.1)
    assert sh["a"]["approximation"] == pytest.approx(0.5) and sh["b"]["approximation"] == pytest.approx(1.5)


def test_take_matches_by_request_ids_and_drops_older_records(monkeypatch):
    monkeypatch.setattr(fused_phases.hm, "enabled", lambda: True)
    records = server_state.reset().forward_records
    try:
        fused_phases.begin_forward(["x"], [5], [5])
        fused_phases.begin_forward(["x", "y"], [1, 1], [6, 9])
        fused_phases.begin_forward(["y"], [1], [10])
        rec = fused_phases.take(["x", "y"])
        assert rec is not None and rec.context == (6, 9)
        assert [r.rids for r in records] == [("y",)]  # the older one went too
        assert fused_phases.take(["z"]) is None
    finally:
        clock.measure(None)
        server_state.reset()


def test_without_metrics_nothing_is_timed(monkeypatch):
    monkeypatch.setattr(fused_phases.hm, "enabled", lambda: False)
    records = server_state.reset().forward_records
    fused_phases.begin_forward(["x"], [1], [1])
    assert not records and clock._acc is None


@pytest.mark.parametrize("mode,phase", [("hack", "approximation"), ("dequant", "dequantization")])
def test_cpu_path_reports_store_and_attention_time(mode, phase, one_torch_thread):
    torch.manual_seed(0)
    cfg = HackConfig(partition_size=16)
    store = HackKVStore(cfg, num_layers=1, num_heads=2, head_dim=64, num_pages=8, num_rows=2)
    req_to_token = torch.arange(2 * 64).reshape(2, 64)
    paged_extend(store, 0, store.plan(req_to_token, [0], [39], [39]), torch.randn(39, 4, 64),
                 torch.randn(39, 2, 64), torch.randn(39, 2, 64))  # a prompt, not timed
    plan = store.plan(req_to_token, [0], [40])
    acc: dict[str, float] = {}
    clock.measure(acc)
    try:
        paged_decode(store, 0, plan, torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64), mode=mode)
    finally:
        clock.measure(None)
    assert acc.get("quantization", 0) > 0 and acc.get(phase, 0) > 0, acc
    assert set(acc) == {"quantization", phase}
