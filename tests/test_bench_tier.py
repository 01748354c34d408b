"""`hack bench restore` (hack_cli.bench_tier) without servers: the ratios and the table from a
result, and the arguments it refuses. The servers themselves: tests/test_page_tier_server.py."""
from __future__ import annotations

import argparse

import pytest

from hack_cli import bench_tier


def _result(ttft_first: float, ttft_back: float, tier: dict | None = None, bpt: float | None = None) -> dict:
    return {"ttft_first_s": ttft_first, "ttft_returning_s": ttft_back, "tokens_from_tier": 640,
            "tokens_computed": 100, "page_tier": tier, "tier_bytes_per_token": bpt}


def test_ratios_and_table_state_the_targets():
    tier = {"bytes_on_disk": 4_400_000, "refused_records": 0}
    doc = {"command": "hack bench restore", "date": "2026-11-27", "cpu": "x", "amx": True, "docs": "2048",
           "conversations": 2, "turns": 2, "pool_tokens": 4096,
           "results": {"recompute": _result(4.0, 5.0), "tier": _result(4.0, 0.5, tier, 4400.0),
                       "bf16-tier": _result(4.0, 0.8, tier, 23040.0)}}
    doc["ratios"] = bench_tier.ratios(doc["results"])
    assert doc["ratios"]["ttft_returning_tier_vs_recompute"] == pytest.approx(0.1)
    assert doc["ratios"]["tier_tokens_per_byte_hack_vs_bf16"] == pytest.approx(23040 / 4400)
    text = bench_tier.table(doc)
    assert "x0.10 recompute's (target <= x0.2: met)" in text
    assert "x5.24 (target >= x5.0: met)" in text
    assert "| recompute | 4.00 | 5.00 | 640 | 100 | 0.0 | - | - |" in text


@pytest.mark.parametrize("change", [dict(methods="tier,nope"), dict(docs="12"), dict(turns=1), dict(docs="a,b")])
def test_bad_arguments_are_refused(change, capsys):
    args = argparse.Namespace(model="smollm2", docs="2048", conversations=2, turns=2, question_tokens=8,
                              answer_tokens=4, pool_tokens=4096, methods="tier", out="", doc=False)
    for k, v in change.items():
        setattr(args, k, v)
    assert bench_tier.run_cli(args) == 2
    assert "hack bench restore:" in capsys.readouterr().err
