"""Wall-clock timing shared by the one-core benchmarks (codec, hack-wire, rotation)."""
from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], runs: int, warmup: bool = False) -> float:
    """The fastest of `runs` calls of fn, in seconds (the least disturbed by other work)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
