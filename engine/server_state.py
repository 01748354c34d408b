"""The state one server process keeps between hooks, in one typed object looked up in one place.

SGLang calls the plugin's hooks at separate points of a process's life (option parsing, KV pool
sizing, pool construction, every forward pass, every batch result); a decision made at one point
is needed at a later one, and SGLang's objects cannot carry it (the KV cache configurator has
__slots__, the pool is built by SGLang's own constructor call). Those hand-overs live here
instead of in module globals scattered over the package. One SGLang server process serves one
model, so "per process" is "per server"; `reset()` gives tests a clean one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PoolBuild:
    """What the HACK pool under construction needs besides SGLang's constructor arguments."""

    rows: int  # request rows (one FP16 tail each)
    budget: int | None  # the KV byte budget it was sized from (None: unknown)


@dataclass(frozen=True)
class Reservation:
    """Request rows whose FP16 tails were reserved out of the KV budget while profiling."""

    rows: int
    budget: int


@dataclass
class ServerState:
    # The argparse parser SGLang built: option errors found later are reported through it.
    cli_parser: Any = None
    # Set around SGLang's pool construction (engine.pool.pool_build_context).
    pool_build: PoolBuild | None = None
    # Per KV cache configurator (the target model's and a draft model's): keyed by id(), the
    # configurator itself kept beside the value so that an id can never be reused for another.
    reservations: dict[int, tuple[Any, Reservation]] = field(default_factory=dict)
    # Per-forward phase records not yet attributed to their batch (engine.fused_phases).
    forward_records: deque = field(default_factory=lambda: deque(maxlen=8))
    # Metrics failures so far (the first few are logged; serving never stops for them).
    metric_failures: int = 0

    def reserve(self, configurator: Any, reservation: Reservation) -> None:
        self.reservations[id(configurator)] = (configurator, reservation)

    def reservation(self, configurator: Any) -> Reservation | None:
        entry = self.reservations.get(id(configurator))
        return entry[1] if entry is not None and entry[0] is configurator else None


_STATE = ServerState()


def state() -> ServerState:
    """This server process's state."""
    return _STATE


def reset() -> ServerState:
    """A fresh state (tests build several pools in one process)."""
    global _STATE
    _STATE = ServerState()
    return _STATE
