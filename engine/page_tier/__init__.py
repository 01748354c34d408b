"""The page tier: KV pages that leave the pool come back from disk instead of being recomputed.

`--hack-page-tier DIR` (any --kv-cache-dtype: HACK pages, or BF16 pages for the baseline) turns on
SGLang's own external-store path for its unified radix cache (`--enable-unified-cache-external-linker`,
backend `dynamic`) with engine.page_tier.linker.PageTierLinker over SGLang's `file` storage backend
(HiCacheFile) in DIR, capped by `--hack-page-tier-size`. What is stored, verified and restored:
engine.page_tier.page_bytes; the linker: engine.page_tier.linker.
"""
from __future__ import annotations

from typing import Any

LINKER_MODULE = "engine.page_tier.linker"
LINKER_CLASS = "PageTierLinker"


class TierRefusal(ValueError):
    """A server option the page tier cannot run with (said at startup)."""


def linker_config(path: str, max_size: str | None) -> dict[str, Any]:
    """SGLang's --unified-cache-external-linker-config for the page tier at `path`."""
    extra: dict[str, Any] = {"path": path}
    if max_size:
        extra["max_size"] = max_size
    return {"linker": LINKER_CLASS, "linker_module_path": LINKER_MODULE, "linker_extra_config": extra}


def apply(ns: Any) -> None:
    """Turn `--hack-page-tier` into SGLang's linker options on the parsed namespace, or refuse."""
    path = getattr(ns, "hack_page_tier", None)
    size = getattr(ns, "hack_page_tier_size", None)
    if path is None:
        if size is not None:
            raise TierRefusal("--hack-page-tier-size caps the page tier; turn the tier on with --hack-page-tier DIR")
        return
    if getattr(ns, "disable_radix_cache", False):
        raise TierRefusal("--hack-page-tier restores prefixes through the radix cache; drop --disable-radix-cache")
    if getattr(ns, "disaggregation_mode", "null") == "decode":
        raise TierRefusal("--hack-page-tier restores prefixes before a prefill; a PD decode server has no radix "
                          "cache to restore into: give it to the prefill server")
    if getattr(ns, "enable_hierarchical_cache", False):
        raise TierRefusal("--hack-page-tier and --enable-hierarchical-cache are two KV tiers; use one")
    if getattr(ns, "enable_unified_cache_external_linker", False):
        raise TierRefusal("--hack-page-tier sets SGLang's external cache linker; drop "
                          "--enable-unified-cache-external-linker")
    for flag, dest in (("--tp-size", "tp_size"), ("--pp-size", "pp_size")):
        if int(getattr(ns, dest, 1) or 1) > 1:
            # every rank would write its own heads (or layers) under the same keys
            raise TierRefusal(f"--hack-page-tier stores one rank's pages; {flag} {getattr(ns, dest)} is not supported yet")
    if getattr(ns, "speculative_algorithm", None):
        raise TierRefusal("--hack-page-tier does not support speculative decoding")
    if size is not None:
        _parse_size(size)  # as SGLang's file evictor reads it
    path = _directory(path)
    ns.enable_unified_cache_external_linker = True
    ns.unified_cache_external_linker_backend = "dynamic"
    ns.unified_cache_external_linker_config = linker_config(path, size)


def _directory(path: str) -> str:
    """The tier's directory, absolute, created if missing; refused when it cannot hold files."""
    import os

    if not str(path).strip():
        raise TierRefusal("--hack-page-tier needs a directory")
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise TierRefusal(f"--hack-page-tier {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierRefusal(f"--hack-page-tier {path}: not writable")
    return path


def _parse_size(text: str) -> int:
    import argparse

    from sglang.srt.utils.common import human_readable_int

    try:
        value = int(human_readable_int(text))
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise TierRefusal(f"--hack-page-tier-size {text!r}: expected a size such as 4G or 512M") from None
    if value <= 0:
        raise TierRefusal(f"--hack-page-tier-size {text!r}: expected a positive size")
    return value
