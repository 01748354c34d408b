"""`hack bench hack-wire` on real SmolLM2 KV (a short prompt): it runs end to end, its decode-side
rebuild restores the stored K pages bit for bit (measure() raises otherwise), and the bytes it
reports order as the transform promises."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_hack_wire_bench_measures_a_real_request() -> None:
    from hack_cli.bench_hack_wire import measure

    r = measure("smollm2", 150, 1)  # 2 full pages and a 22-token open partition
    assert r["pages"] == 3 and r["pages_sent"] == 2  # the open page stays home
    assert r["bytes_hack_pages"] < r["bytes_full_pages"] < r["bytes_bf16"]
    assert r["send_blocks_s"] >= 0 and r["rebuild_s"] >= 0
