"""Host-clock time of the phases the paper's breakdown names, inside the CPU path.

On the CPU every operation finishes before the call returns, so wall time around a call is
the time of that work. The attention functions wrap three pieces of work:
  quantization     storing new K/V: page quantization (range search, codes, side tables),
                   FP16 tails and sinks (HackKVStore.write)
  approximation    decode attention on the codes ('hack' mode): INT8 Q/P, the integer
                   matmuls and the Eq. 4 approximation, fused in one call; an upper bound of
                   the approximation alone, which has no boundary the host can see
  dequantization   'dequant' mode: building the dense BF16 copy of the visible pages (the
                   SDPA that follows is not included)
Nothing is measured unless a caller installed an accumulator (`measure`); a disabled clock
costs one global lookup per wrapped call (and no generator: a served layer starts from cold
caches, where entering a generator-based context cost ~20 us). Not meaningful for asynchronous
(GPU) kernels.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

_acc: dict[str, float] | None = None


def measure(acc: dict[str, float] | None) -> None:
    """Add the wrapped calls' seconds to `acc` (keyed by phase) from now on; None stops."""
    global _acc
    _acc = acc


_OFF = nullcontext()  # what phase() returns while nothing is measured (reusable)


def phase(name: str) -> AbstractContextManager[None]:
    """A context that adds its seconds to the accumulator's `name` (nothing while none is installed)."""
    acc = _acc
    return _OFF if acc is None else _timed(acc, name)


@contextmanager
def _timed(acc: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        acc[name] = acc.get(name, 0.0) + (time.perf_counter() - t0)
