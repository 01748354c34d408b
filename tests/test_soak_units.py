"""The soak's bookkeeping (disagg/soak.py) without servers: fault schedules, failure classes,
the properties a report must hold, the retraction count and the RSS of a process group."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg.soak import (FailureClass, FaultEvent, FaultKind, Soak, SoakSpec, fault_schedule, is_idle,
                         decode_pressure, group_rss_bytes, passed, retractions)


def test_fault_schedule_parses_and_refuses_with_a_sentence() -> None:
    assert fault_schedule("kill-prefill@0.3, corrupt-transfer@0.5") == [
        FaultEvent(FaultKind.KILL_PREFILL, 0.3), FaultEvent(FaultKind.CORRUPT_TRANSFER, 0.5)]
    assert fault_schedule(None) == [] and fault_schedule("") == []
    for text, match in (("kill-router@0.3", "kind must be one of"), ("kill-prefill", "KIND@FRACTION"),
                        ("kill-decode@1.5", r"fraction in \(0, 1\)"), ("kill-decode@x", "not a number")):
        with pytest.raises(ValueError, match=match):
            FaultEvent.parse(text)


def test_a_kill_needs_a_survivor() -> None:
    spec = SoakSpec(faults=fault_schedule("kill-prefill@0.3,kill-decode@0.6"))
    spec.validate(2, 2)
    with pytest.raises(ValueError, match="prefill kill.*at least one must survive"):
        spec.validate(1, 2)
    with pytest.raises(ValueError, match="decode kill.*at least one must survive"):
        spec.validate(2, 1)
    with pytest.raises(ValueError, match="long-fraction"):
        SoakSpec(long_fraction=1.5).validate(1, 1)


def _soak(events: list[dict]) -> Soak:
    s = Soak.__new__(Soak)  # the classification needs only the fault log
    s.events = events
    return s


def test_failures_are_classified_by_the_fault_log() -> None:
    kill = {"fault": "kill-prefill", "t": 100.0}
    corrupt = {"fault": "corrupt-transfer", "t": 200.0}
    s = _soak([kill, corrupt])
    gen = {"kind": "chat", "ok": False, "error": "connection reset"}
    assert s.classify({**gen, "ok": True, "t_send": 1, "t_end": 2}) is None
    assert s.classify({**gen, "t_send": 90.0, "t_end": 110.0}) is FailureClass.IN_FLIGHT_AT_KILL
    assert s.classify({**gen, "t_send": 101.0, "t_end": 110.0}) is FailureClass.DEFECT  # sent after
    digest = {**gen, "error": "KV checksum mismatch", "t_send": 190.0, "t_end": 210.0}
    assert s.classify(digest) is FailureClass.CORRUPTED_TRANSFER
    assert s.classify({**digest, "t_end": 150.0}) is FailureClass.DEFECT  # ended before the trigger
    assert s.classify({"kind": "bad", "ok": False, "status": 500, "t_send": 1, "t_end": 2}) is FailureClass.DEFECT


def _report(**over) -> dict:
    rep = {"failures": {c.value: 0 for c in FailureClass},
           "malformed": {"sent": 3, "answered_4xx": 3, "statuses": [400, 422]},
           "faults": [{"fault": "kill-prefill", "server": "prefill-1", "failed_after": 0}],
           "pools": {"idle_after": {"prefill-0": True, "decode-0": True}},
           "rss": {"decode-0": {"dead": False, "growth_from_100": 0.01},
                   "prefill-1": {"dead": True, "growth_from_100": None}}}
    rep.update(over)
    return rep


def test_passed_names_each_broken_property() -> None:
    assert passed(_report()) == []
    broken = passed(_report(
        failures={"defect": 2, "in-flight-at-kill": 1, "corrupted-transfer": 1},
        malformed={"sent": 3, "answered_4xx": 2, "statuses": [400, 500]},
        faults=[{"fault": "kill-decode", "server": "decode-1", "failed_after": 4}],
        pools={"idle_after": {"decode-0": False}},
        rss={"decode-0": {"dead": False, "growth_from_100": 0.08}}))
    assert len(broken) == 5
    assert any("2 failure(s) not explained" in b for b in broken)
    assert any("not answered 4xx" in b for b in broken)
    assert any("sent after kill-decode of decode-1 failed" in b for b in broken)
    assert any("not idle" in b and "decode-0" in b for b in broken)
    assert any("grew 8.0%" in b for b in broken)


def test_retractions_sum_sglang_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    log.write_text("x\n[2026] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 5\n"
                   "KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 1\n"
                   "Testing retraction. #retracted_reqs: 9\n")
    assert retractions(log) == 5
    assert retractions(tmp_path / "missing.log") == 0


def test_decode_pressure_reads_sglangs_decode_batch_lines(tmp_path: Path) -> None:
    line = ("[2026-11-24 15:45:28] Decode batch, #running-req: {r}, #token: 896, token usage: {u}, pre-allocated "
            "usage: 0.03, #prealloc-req: {p}, #transfer-req: 3, #retracted-req: 0, cpu graph: False, gen "
            "throughput (token/s): 3.20, #queue-req: 0\n")
    log = tmp_path / "decode-0.log"
    log.write_text("noise\n" + line.format(r=1, u=0.06, p=2) + line.format(r=3, u=0.73, p=10))
    assert decode_pressure(log) == {"batches_logged": 2, "running_mean": 2.0, "running_max": 3,
                                    "prealloc_queue_mean": 6.0, "prealloc_queue_max": 10, "kv_usage_max": 0.73}
    (tmp_path / "quiet.log").write_text("no batches\n")
    assert decode_pressure(tmp_path / "quiet.log") is None
    assert decode_pressure(tmp_path / "missing.log") is None


def test_group_rss_counts_this_process_group() -> None:
    rss = group_rss_bytes(os.getpgrp())
    assert rss > 10 * 2**20  # at least this Python interpreter
    assert group_rss_bytes(2**22 + 12345) == 0  # no such group


def test_idle_means_no_row_and_nothing_beyond_the_radix_cache() -> None:
    assert is_idle({"request_rows_in_use": 0, "used_tokens": 128, "radix_cached_tokens": 128})
    assert not is_idle({"request_rows_in_use": 1, "used_tokens": 128, "radix_cached_tokens": 128})
    assert not is_idle({"request_rows_in_use": 0, "used_tokens": 192, "radix_cached_tokens": 128})
    assert not is_idle(None)
    assert is_idle({"request_rows_in_use": 0, "used_tokens": 0, "radix_cached_tokens": None})
    assert not is_idle({"request_rows_in_use": 0, "used_tokens": 64, "radix_cached_tokens": None})
