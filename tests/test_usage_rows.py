"""engine.usage counts a request pool's rows with SGLang's own pool classes: a PD decode server's
DecodeReqToTokenPool holds pre_alloc_size rows beyond `size` for requests still arriving, and an
idle server must report 0 rows in use (it reported -pre_alloc_size before, so a soak at
--max-running-requests 12 called both idle decode pools leaky)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.usage import _request_rows, _rows_in_use


def _scheduler(pool):
    return SimpleNamespace(req_to_token_pool=pool)


@pytest.mark.parametrize("pre_alloc", [0, 24])
def test_decode_pool_rows(pre_alloc):
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

    pool = DecodeReqToTokenPool(size=12, max_context_len=16, device="cpu", enable_memory_saver=False,
                                pre_alloc_size=pre_alloc)
    assert _request_rows(pool) == 12 + pre_alloc
    assert _rows_in_use(_scheduler(pool)) == 0
    taken = [pool.free_slots.pop() for _ in range(5)]  # what alloc does for five requests
    assert _rows_in_use(_scheduler(pool)) == 5
    pool.free_slots += taken
    assert _rows_in_use(_scheduler(pool)) == 0


def test_plain_pool_rows():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=8, max_context_len=16, device="cpu", enable_memory_saver=False)
    assert _request_rows(pool) == 8 and _rows_in_use(_scheduler(pool)) == 0
    pool.free_slots.pop()
    assert _rows_in_use(_scheduler(pool)) == 1
