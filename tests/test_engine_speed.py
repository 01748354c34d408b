"""Batch-1 decode speed of real servers on this CPU: HACK vs SGLang's own CPU path (torch_native
attention over a BF16 cache), same model, same prompt ids, cold cache.

The servers run one after the other (never sharing the two cores) and without
--sleep-on-idle (its 1 s idle poll would distort per-token timing). Required (the issue's
targets): at an 8K context HACK decodes >= 3x as many tokens/s as BF16 (BF16 gathers its whole
cache into a contiguous copy every step, HACK reads ~6x fewer bytes in place); at a short
context HACK is not slower, allowing SHORT_NOISE for run-to-run noise on a shared machine
(the two servers are measured minutes apart).
"""
from __future__ import annotations

import pytest

from engine.launcher import SGLangServer
from engine.workload import essay_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG, SHORT = 8000, 128
DECODE_TOKENS = 24
LONG_MIN_RATIO = 3.0
SHORT_NOISE = 0.9


@pytest.fixture(scope="module")
def speeds(tmp_path_factory) -> dict:
    from hack_eval.models import prepare

    model = str(prepare("smollm2", log=lambda *a, **k: None))
    logs = tmp_path_factory.mktemp("speed")
    ids = {c: essay_ids(model, c, index=2) for c in (SHORT, LONG)}
    out: dict[str, dict] = {}
    for name, args in (("bf16", ["--attention-backend", "torch_native"]),
                       ("hack", ["--kv-cache-dtype", "hack"])):
        server = SGLangServer(model, [*args, "--hack-kv-budget-mb", "512"], log_path=logs / f"{name}.log")
        server.start()
        try:
            server.wait_ready()
            server.timed_stream(ids[SHORT], 4)  # warm-up (first-use costs)
            out[name] = {}
            for c in (SHORT, LONG):
                server.flush_cache()
                out[name][c] = server.timed_stream(ids[c], DECODE_TOKENS)
        finally:
            server.stop()
    for c in (SHORT, LONG):
        b, h = out["bf16"][c], out["hack"][c]
        print(f"\ncontext {c}: decode BF16 {b['decode_tok_s']:.2f} tok/s, HACK {h['decode_tok_s']:.2f} tok/s "
              f"(x{h['decode_tok_s'] / b['decode_tok_s']:.2f}); prefill BF16 {b['prefill_tok_s']:.0f}, "
              f"HACK {h['prefill_tok_s']:.0f} tok/s")
    return out


def test_long_context_decode_at_least_3x_bf16(speeds):
    ratio = speeds["hack"][LONG]["decode_tok_s"] / speeds["bf16"][LONG]["decode_tok_s"]
    assert ratio >= LONG_MIN_RATIO, ratio


def test_short_context_decode_not_slower_than_bf16(speeds):
    ratio = speeds["hack"][SHORT]["decode_tok_s"] / speeds["bf16"][SHORT]["decode_tok_s"]
    assert ratio >= SHORT_NOISE, ratio
