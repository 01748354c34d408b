"""Batch-1 decode speed of real servers on this CPU: HACK vs SGLang's own CPU path (torch_native
attention over a BF16 cache), same model, same prompt ids, cold cache.

Both servers run with --sleep-on-idle (an idle one takes no CPU; the sleep only delays the
first token, not the decode rate measured from the first streamed token to the last), and the
measurements alternate between them, best of REPEATS per cell.

This is a regression guard, not the target: the decode target at 8K is measured by
`hack bench serve` (docs/engine.md). What the guard asserts is what a broken kernel or a
fallback to a dense path would lose: at 8K HACK decodes at least LONG_MIN_RATIO times as fast
as BF16 (BF16 gathers its whole cache into a contiguous copy every step, HACK reads ~6x fewer
bytes in place; a dequantizing fallback measures about x1), and at a short context it is not
slower, allowing SHORT_NOISE for run-to-run noise.

Why 1.5 and not more: the ratio is bounded by the part of a decode step both servers share
(the model's linear layers, norms, sampling). On the host this project runs on now (x86_64
with AVX-512 and AMX) the test measured x1.81 and x1.82 (2026-11-25): HACK 13.05 tok/s at 8K
against 15.56 at 128, so its attention is ~12 of ~77 ms a token, and BF16 7.18 against 15.21;
x2 would need HACK's whole 8K attention under ~5 ms a token. An earlier host without AMX
measured x2.92 and x3.25 on one commit. 1.5 sits 17% under the current measurement and 50%
over a dense fallback.
"""
from __future__ import annotations

import pytest

from engine.launcher import SGLangServer
from hack_eval.workloads import essay_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG, SHORT = 8000, 128
DECODE_TOKENS = 24
REPEATS = 2
LONG_MIN_RATIO = 1.5
SHORT_NOISE = 0.9


@pytest.fixture(scope="module")
def speeds(tmp_path_factory) -> dict:
    from hack_eval.models import prepare

    model = str(prepare("smollm2", log=lambda *a, **k: None))
    logs = tmp_path_factory.mktemp("speed")
    ids = {c: essay_ids(model, c, index=2) for c in (SHORT, LONG)}
    servers = {name: SGLangServer(model, [*args, "--hack-kv-budget-mb", "512", "--sleep-on-idle"],
                                  log_path=logs / f"{name}.log")
               for name, args in (("bf16", ["--attention-backend", "torch_native"]),
                                  ("hack", ["--kv-cache-dtype", "hack"]))}
    out: dict[str, dict] = {name: {} for name in servers}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
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
    finally:
        for s in servers.values():
            s.stop()
    for c in (SHORT, LONG):
        b, h = out["bf16"][c], out["hack"][c]
        print(f"\ncontext {c}: decode BF16 {b['decode_tok_s']:.2f} tok/s, HACK {h['decode_tok_s']:.2f} tok/s "
              f"(x{h['decode_tok_s'] / b['decode_tok_s']:.2f})")
    return out


def test_long_context_decode_well_above_bf16(speeds):
    ratio = speeds["hack"][LONG]["decode_tok_s"] / speeds["bf16"][LONG]["decode_tok_s"]
    assert ratio >= LONG_MIN_RATIO, ratio


def test_short_context_decode_not_slower_than_bf16(speeds):
    ratio = speeds["hack"][SHORT]["decode_tok_s"] / speeds["bf16"][SHORT]["decode_tok_s"]
    assert ratio >= SHORT_NOISE, ratio
