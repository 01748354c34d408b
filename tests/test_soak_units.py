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
    s = Soak.__new__(Soak)  # the classification needs only the fault log (and the client's timeout)
    s.events = events
    s.spec = SoakSpec()
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


def test_link_faults_parse_with_their_argument_and_refuse_what_is_not_built() -> None:
    assert fault_schedule("partition:5@0.3,loss:1.5@0.2") == [
        FaultEvent(FaultKind.PARTITION, 0.3, 5.0), FaultEvent(FaultKind.LOSS, 0.2, 1.5)]
    assert FaultEvent.parse("partition:60@0.4").label() == "partition:60@0.4"
    for text, match in (("partition@0.3", "partition takes seconds"), ("loss:0@0.3", "loss takes a percentage"),
                        ("loss:100@0.3", "percentage"), ("partition:x@0.3", "takes seconds"),
                        ("kill-prefill:3@0.3", "takes no argument"),
                        ("delay:50@0.3", "needs tc netem"), ("reorder:25@0.3", "not built")):
        with pytest.raises(ValueError, match=match):
            FaultEvent.parse(text)
    spec = SoakSpec(faults=fault_schedule("partition:5@0.3"))
    spec.validate(1, 1, shaped_link=True)
    with pytest.raises(ValueError, match="--link-mbps"):
        spec.validate(1, 1, shaped_link=False)
    with pytest.raises(ValueError, match="one loss fault"):
        SoakSpec(faults=fault_schedule("loss:1@0.2,loss:5@0.5")).validate(1, 1)


def test_failures_around_a_partition_are_classified_by_when_they_ended() -> None:
    from disagg.soak import PARTITION_DEADLINE_S

    part = {"fault": "partition", "arg": 5.0, "t": 100.0, "t_end": 105.0}
    s = _soak([part, {"fault": "loss", "arg": 5.0, "t": 300.0, "t_end": 400.0}])
    gen = {"kind": "chat", "ok": False, "error": "Prefill server error: connection refused"}
    assert s.classify({**gen, "t_send": 99.0, "t_end": 112.0}) is FailureClass.DURING_PARTITION
    assert s.classify({**gen, "t_send": 102.0, "t_end": 103.0}) is FailureClass.DURING_PARTITION
    late = 105.0 + PARTITION_DEADLINE_S + 1
    assert s.classify({**gen, "t_send": 99.0, "t_end": late}) is FailureClass.DEFECT      # past the deadline
    assert s.classify({**gen, "t_send": 106.0, "t_end": 107.0}) is FailureClass.DEFECT    # sent after it
    assert s.classify({**gen, "t_send": 310.0, "t_end": 320.0}) is FailureClass.DEFECT    # TCP absorbs loss
    hung = {**gen, "t_send": 99.0, "t_end": 99.0 + SoakSpec().timeout_s}
    assert s.classify(hung) is FailureClass.DEFECT                                          # hung, whatever the fault
    recs = [{"kind": "chat", "ok": True, "t_send": 98.0, "t_end": 110.0, "failure": None},
            {**gen, "t_send": 101.0, "t_end": 111.0, "failure": "during-partition"},
            {"kind": "chat", "ok": True, "t_send": 106.0, "t_end": 108.5, "failure": None}]
    Soak._link_report(part, recs)
    assert (part["in_flight"], part["in_flight_served"], part["in_flight_failed"]) == (2, 1, 1)
    assert part["last_in_flight_ended_after_s"] == 6.0 and part["first_served_after_s"] == 3.5
    assert part["sent_after"] == 1 and part["failed_after"] == 0
    assert part["in_flight_errors"] == ["Prefill server error: connection refused"]
    broken = passed(_report(faults=[{**part, "server": "prefill links", "last_in_flight_ended_after_s": 61.0}]))
    assert broken == ["a request in flight during the 5 s partition ended 61.0 s after the link came back "
                      "(deadline 60 s)"]


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


def test_a_loss_begun_during_a_partition_takes_over_when_the_partition_ends(monkeypatch) -> None:
    import threading

    from disagg import link_faults

    calls = []
    monkeypatch.setattr(link_faults, "apply", lambda link, kind, pct=None: calls.append(("apply", kind.value, pct)))
    monkeypatch.setattr(link_faults, "clear", lambda link: calls.append(("clear",)))
    monkeypatch.setattr(link_faults, "dropped_packets", lambda link: 7)
    monkeypatch.setattr(threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None,
                                                                          "daemon": True})())
    s = _soak([])
    s.links, s._lock, s.log = [{"tag": "x"}], threading.Lock(), lambda m: None
    part, loss = FaultEvent.parse("partition:5@0.3"), FaultEvent.parse("loss:5@0.4")
    s._link_fault(part, 3, 100.0)
    s._link_fault(loss, 4, 101.0)            # during the partition: not cutting it short
    assert calls == [("apply", "partition", None)]
    s._end_link_fault(s.events[0])           # the partition ends: the loss takes over
    assert calls[1:] == [("clear",), ("apply", "loss", 5.0)]
    assert s.events[0]["dropped_packets"] == 7 and s.events[1]["t_end"] is None
    s._end_link_faults()                     # the end of the load ends the loss
    assert calls[-1] == ("clear",) and s.events[1]["t_end"] is not None
