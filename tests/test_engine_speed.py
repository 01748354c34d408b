"""Batch-1 decode speed of real servers on this CPU: HACK vs SGLang's own CPU path (torch_native
attention over a BF16 cache), same model, same prompt ids, cold cache.

The two servers are the shared ones of tests/shared_servers.py, which tests/test_engine_server.py
uses too (a server start costs more than this whole measurement): both run with --sleep-on-idle
(an idle one takes no CPU; the sleep only delays the first token, not the decode rate measured
from the first streamed token to the last), and the measurements alternate between them, best
of REPEATS per cell, each context's first repeat on a flushed cache. Their flags do not move
what is measured here: the HACK server names the homomorphic prefill (decode reads the codes in
every prefill mode, and only decode is timed), both hold 256 MB of KV (the 8K prompt and its
new tokens fit either pool; the pool's size is not read per step), and both record metrics, as
every `hack up` server does.

This is a regression guard, not the target: the decode target at 8K is measured by
`hack bench serve` (docs/engine.md). What the guard asserts is what a broken kernel or a
fallback to a dense path would lose: at 8K HACK decodes at least LONG_MIN_RATIO times as fast
as BF16 (BF16 gathers its whole cache into a contiguous copy every step, HACK reads ~6x fewer
bytes in place; a dequantizing fallback measures about x1), and at a short context it is not
much slower (SHORT_MIN_RATIO, below).

Why these bars: the ratio is bounded by the part of a decode step both servers share (the
model's linear layers, norms, sampling), and that part, like BF16's gather, moves with the host.
On one AMX Xeon host the test measured x1.81 and x1.82 at 8K (2026-11-25: HACK 13.05 tok/s at 8K
against 15.56 at 128, BF16 7.18 against 15.21); on the AMX Xeon host of 2026-11-26, x1.19-x1.32
(HACK 11.2 tok/s at 8K against 17.2 at 128, BF16 9.5 against 16.7: the linear layers take half of
a HACK step there, py-spy of the scheduler, and BF16's gather is cheaper), with the decode kernel
as fast per layer as on 2026-11-25 (0.5 ms a SmolLM2 layer at 8K on two threads); an earlier host
without AMX measured x2.92 and x3.25. LONG_MIN_RATIO sits under the slowest host's measurement
and over what a dequantizing fallback measures (x1 at best: it pays BF16's reads plus the
dequantization). 64 tokens per stream and the best of 3 keep one descheduled slice of a shared
2-core host from deciding a cell (with 24 tokens and 2 repeats the short cell read x0.78 once
and x1.03 on the next run).

At 128 tokens HACK is slower than BF16 on the 2026-11-26 host: x0.84 with 64 tokens and 3 repeats
(HACK 16.1 tok/s, BF16 19.3). A py-spy profile of the HACK scheduler there puts the backend's
decode at 23% of a step, ~0.5 ms a layer, of which the compiled kernel takes ~0.19 ms; the rest is
per-layer Python (the kernel's argument block, the store's input checks, the tail append). That
gap is known and not closed (docs/engine.md); SHORT_MIN_RATIO guards it from growing.
"""
from __future__ import annotations

import pytest

from hack_eval.workloads import essay_ids

# solo: under `make test`'s two workers the other worker waits while this module measures.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.solo,
              pytest.mark.shared_servers("smollm2_bf16", "smollm2_hack")]

LONG, SHORT = 8000, 128
DECODE_TOKENS = 64
REPEATS = 3
LONG_MIN_RATIO = 1.1
SHORT_MIN_RATIO = 0.75


@pytest.fixture(scope="module")
def speeds(shared_servers) -> dict:
    from hack_eval.models import prepare

    model = str(prepare("smollm2", log=lambda *a, **k: None))
    ids = {c: essay_ids(model, c, index=2) for c in (SHORT, LONG)}
    servers = {"bf16": shared_servers.get("smollm2_bf16", starting_with=("smollm2_hack",)),
               "hack": shared_servers.get("smollm2_hack")}
    out: dict[str, dict] = {name: {} for name in servers}
    for s in servers.values():
        s.timed_stream(ids[SHORT], 4)  # warm-up (first-use costs)
    # Interleaved and repeated, best of REPEATS per cell: the machine's load drifts, and the
    # idle server (sleeping) takes no CPU from the measured one.
    for c in (SHORT, LONG):
        for rep in range(REPEATS):
            for name, s in servers.items():
                if rep == 0:  # cold prefill once; later repeats reuse the cached prompt
                    s.flush_cache()
                m = s.timed_stream(ids[c], DECODE_TOKENS)
                if m["decode_tok_s"] > out[name].get(c, {}).get("decode_tok_s", 0.0):
                    out[name][c] = m
    for c in (SHORT, LONG):
        b, h = out["bf16"][c], out["hack"][c]
        print(f"\ncontext {c}: decode BF16 {b['decode_tok_s']:.2f} tok/s, HACK {h['decode_tok_s']:.2f} tok/s "
              f"(x{h['decode_tok_s'] / b['decode_tok_s']:.2f})")
    return out


def test_long_context_decode_well_above_bf16(speeds):
    ratio = speeds["hack"][LONG]["decode_tok_s"] / speeds["bf16"][LONG]["decode_tok_s"]
    assert ratio >= LONG_MIN_RATIO, ratio


def test_short_context_decode_not_much_slower_than_bf16(speeds):
    ratio = speeds["hack"][SHORT]["decode_tok_s"] / speeds["bf16"][SHORT]["decode_tok_s"]
    assert ratio >= SHORT_MIN_RATIO, ratio
