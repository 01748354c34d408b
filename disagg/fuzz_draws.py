"""Fuzz draws that depend on the seed and the strategy only.

Hypothesis (6.170) mixes constants found in the source of every project module loaded at the
time into what it draws (hypothesis.internal.conjecture.providers._get_local_constants). A fuzz
run then depends on which modules earlier tests happened to import and on every constant of
the tree: the same seed drew other requests in the whole suite than in the fuzz file alone, so
a failure found in CI could not be replayed by running its test. Inside `module_independent()`
that pool is empty; Hypothesis's own constants (its edge numbers and strings) still apply.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def module_independent() -> Iterator[None]:
    from hypothesis.internal.conjecture import providers  # private: pinned hypothesis==6.170.15

    original = providers._get_local_constants
    empty = providers.Constants()
    providers.CONSTANTS_CACHE.cache.clear()  # drawn-from pools cached with the modules' constants
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()
