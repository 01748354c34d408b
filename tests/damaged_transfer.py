"""What a damaged KV transfer must lead to behind the PD router, shared by the PD e2e tests.

The decode server's digest check catches the damage (its log names the request) and the
damaged KV is never decoded. What the client sees then depends on the router: SGLang's Rust
router (`hack up`'s default) retries the failed request on a fresh transfer and the client
gets the undamaged answer; the mini-lb passes the decode server's error on, which names the
checksum. Either way the servers keep serving.
"""
from __future__ import annotations

from pathlib import Path

MISMATCH = "KV checksum mismatch"


def decode_mismatches(state: dict, index: int = 0) -> int:
    log = next(s["log"] for s in state["servers"] if s["role"] == "decode" and s["index"] == index)
    return Path(log).read_text(errors="replace").count(MISMATCH)


def check_damaged_request(state: dict, bad, good, mismatches_before: int) -> None:
    assert decode_mismatches(state) == mismatches_before + 1, "the digest check did not catch the damage"
    assert good.ok, good.error
    if bad.ok:  # retried by the router on a new transfer: the same tokens as an undamaged run
        assert state.get("router") != "mini-lb", "the mini-lb does not retry"
        assert bad.output_ids == good.output_ids, (bad.output_ids, good.output_ids)
    else:
        assert "checksum" in (bad.error or "").lower(), bad.error
