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
