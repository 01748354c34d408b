"""engine.server_state: the hand-overs between hooks of one server process."""
from __future__ import annotations

import pytest

from engine import capacity, server_state
from engine.pool import pool_build_context
from engine.server_state import Reservation


@pytest.fixture(autouse=True)
def _fresh_state():
    server_state.reset()
    yield
    server_state.reset()


class _Configurator:
    __slots__ = ()  # like SGLang's KVCacheConfigurator: nothing can be attached to it


def test_reservation_belongs_to_its_configurator_only():
    a, b = _Configurator(), _Configurator()
    server_state.state().reserve(a, Reservation(rows=7, budget=1 << 20))
    assert capacity.reserved_budget(a) == 1 << 20
    assert capacity.cap_max_num_reqs(a, 100) == 7 and capacity.cap_max_num_reqs(a, 3) == 3
    assert capacity.reserved_budget(b) is None and capacity.cap_max_num_reqs(b, 100) == 100


def test_an_id_reused_by_another_object_finds_nothing():
    st = server_state.state()
    a = _Configurator()
    st.reserve(a, Reservation(rows=2, budget=10))
    other = _Configurator()
    st.reservations[id(other)] = st.reservations.pop(id(a))  # as if `other` got a's address
    assert st.reservation(other) is None


def test_pool_build_is_set_only_inside_the_context():
    with pool_build_context(rows=5, budget=None):
        assert server_state.state().pool_build == server_state.PoolBuild(rows=5, budget=None)
    assert server_state.state().pool_build is None
    with pytest.raises(ValueError):
        with pool_build_context(rows=3, budget=1):
            raise ValueError("a failed build")
    assert server_state.state().pool_build is None


class _Kvc:
    """What kv_budget_bytes reads of SGLang's configurator (one attention DP rank)."""

    __slots__ = ("layer_info", "attn_dp_size")

    def __init__(self) -> None:
        self.layer_info = type("L", (), {"num_effective_layers": 30})()
        self.attn_dp_size = 1


@pytest.mark.parametrize("mode,extra_slots,rows_reserved", [("null", 24, 13), ("decode", 24, 37),
                                                             ("decode", 0, 13), ("prefill", 24, 13)])
def test_a_decode_servers_pre_allocation_rows_get_tails_from_the_budget(monkeypatch, mode, extra_slots,
                                                                         rows_reserved):
    """A PD decode server's request table holds --disaggregation-decode-extra-slots rows beyond the
    running requests (2x them at --max-running-requests 12), and the pool gives every row FP16
    tails: the budget reserves them all, not only the running rows (else a 64 MB budget held
    103 MB)."""
    import sglang.srt.runtime_context as rc

    from engine.pool_geometry import unit_bytes

    units = unit_bytes(__import__("hack_ops").HackConfig(), 3, 64, 30)
    monkeypatch.setattr(capacity, "_units", lambda kvc: units)
    monkeypatch.setattr(capacity.settings_mod, "budget_bytes", lambda: 64 << 20)
    monkeypatch.setattr(rc, "get_schedule", lambda: type("S", (), {"max_running_requests": 12})())
    monkeypatch.setattr(rc, "get_disagg", lambda: type("D", (), {"disaggregation_mode": mode,
                                                                 "disaggregation_decode_extra_slots": extra_slots})())
    kvc = _Kvc()
    left = capacity.kv_budget_bytes(kvc, lambda: 0)
    per_row = capacity.row_bytes(units, 30)
    assert left == (64 << 20) - rows_reserved * per_row
    assert capacity.cap_max_num_reqs(kvc, 100) == 12  # running requests stay 12 either way
    if rows_reserved == 37:  # 38 rows would not fit in 48 MB: refused with a sentence naming both flags
        server_state.reset()
        monkeypatch.setattr(capacity.settings_mod, "budget_bytes", lambda: 48 << 20)
        with pytest.raises(ValueError, match="36 request rows .*12 running, 24 pre-allocated.*extra-slots"):
            capacity.kv_budget_bytes(_Kvc(), lambda: 0)
