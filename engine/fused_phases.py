"""Fused phases of each forward pass (quantization, approximation, dequantization), attributed
to the requests of its batch.

The CPU path times these pieces of work with the host clock (hack_ops.paged.clock: exact on
CPU, where every call is synchronous). The attention backend opens one record per forward
pass (`begin_forward`); the scheduler hook (engine.timeline) takes the record of the batch it
just processed (`take`, matched by request ids) and splits each phase among the batch's
requests: quantization by new tokens (the store quantizes each new token once),
approximation and dequantization by context length (both scale with the tokens read).
With SGLang's overlap scheduler the next forward may start before a batch's result is
processed; records are therefore kept in a short queue and matched by request ids.
On GPU nothing is recorded (the kernels are asynchronous; host clocks would measure launches).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hack_ops.paged import clock

from . import metrics as hm
from .server_state import state


@dataclass
class ForwardRecord:
    rids: tuple[str, ...]
    new_tokens: tuple[int, ...]
    context: tuple[int, ...]
    seconds: dict[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, dict[str, float]]:
        """Seconds of each phase per request id."""
        out: dict[str, dict[str, float]] = {rid: {} for rid in self.rids}
        weights = {"quantization": self.new_tokens}
        for phase, total in self.seconds.items():
            w = weights.get(phase, self.context)
            norm = float(sum(w)) or 1.0
            for rid, wi in zip(self.rids, w):
                out[rid][phase] = out[rid].get(phase, 0.0) + total * wi / norm
        return out


def begin_forward(rids: list[str] | None, new_tokens: list[int], context: list[int]) -> None:
    """Start timing a forward pass (call before its first layer). A no-op without metrics."""
    if not rids or not hm.enabled():
        clock.measure(None)
        return
    rec = ForwardRecord(tuple(rids), tuple(int(x) for x in new_tokens), tuple(int(x) for x in context))
    state().forward_records.append(rec)
    clock.measure(rec.seconds)


def take(rids: list[str]) -> ForwardRecord | None:
    """The record of the forward pass that ran exactly these requests (oldest first); it and
    every older record leave the queue."""
    key = tuple(rids)
    records = state().forward_records
    for i, rec in enumerate(records):
        if rec.rids == key:
            for _ in range(i + 1):
                records.popleft()
            return rec
    return None
