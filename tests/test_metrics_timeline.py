"""The scheduler-side timeline (engine.timeline) driven the way SGLang's scheduler calls it,
and the BF16-equivalent bytes of a PD transfer (engine.usage + disagg.wire_meter)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from engine import metrics as hm
from engine import timeline, usage
from hack_metrics import analysis
from hack_metrics.run_view import build_view
from hack_metrics.runload import RunLoader

LAYERS, HEADS, HEAD_DIM = 3, 2, 64  # BF16: 2 * 3 * 2 * 64 * 2 = 1536 bytes per token


class FakeReq:
    """The parts of SGLang's Req the timeline reads."""

    def __init__(self, rid: str, room: int | None = None) -> None:
        self.rid, self.bootstrap_room = rid, room
        self.output_ids: list[int] = []
        self.finished_reason = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, kind: str = "stop") -> None:
        self.finished_reason = SimpleNamespace(to_json=lambda: {"type": kind})


def _scheduler(mode: str = "null", used: int = 0) -> SimpleNamespace:
    pool = SimpleNamespace(page_size=1, layer_num=LAYERS, head_num=HEADS, head_dim=HEAD_DIM)
    alloc = SimpleNamespace(available_size=lambda: 1000 - used, get_kvcache=lambda: pool)
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode), max_total_num_tokens=1000,
                           token_to_kv_pool_allocator=alloc, running_batch=SimpleNamespace(reqs=[]),
                           waiting_queue=[], req_to_token_pool=SimpleNamespace(size=8, available_size=lambda: 8))


def _arrive(sched: SimpleNamespace, req: FakeReq, prompt: int) -> None:
    timeline.on_arrival(sched, SimpleNamespace(rid=req.rid, bootstrap_room=req.bootstrap_room,
                                               input_ids=list(range(prompt))))


def _batch(mode: ForwardMode, *reqs: FakeReq) -> SimpleNamespace:
    # SGLang stamps the batch's launch on the monotonic clock before it runs.
    return SimpleNamespace(forward_mode=mode, reqs=list(reqs), launch_ts=time.monotonic())


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "_state", type(timeline._state)())
    monkeypatch.setattr(timeline, "_sampler", [object()])  # no sampler thread in these tests
    monkeypatch.setattr(usage, "transfers", usage.TransferLedger())
    hm.configure(tmp_path, "colocated", strict=True)
    yield tmp_path
    hm.close()


def _requests(run_dir):
    hm.flush()
    data = RunLoader(run_dir).load()
    data.live = False
    return build_view(data).requests.set_index("key")


def test_colocated_request_ending_on_its_first_token_is_finished(run_dir):
    sched = _scheduler()
    eos, longer = FakeReq("eos"), FakeReq("two")
    _arrive(sched, eos, 5)
    _arrive(sched, longer, 5)
    # The prefill batch makes each request's first token; one of them is EOS.
    eos.output_ids.append(2)
    eos.finish("stop")
    longer.output_ids.append(7)
    timeline.on_batch_result(sched, _batch(ForwardMode.EXTEND, eos, longer))
    longer.output_ids.append(8)
    longer.finish("length")
    timeline.on_batch_result(sched, _batch(ForwardMode.DECODE, longer))
    req = _requests(run_dir)
    assert req.loc["rid:eos", "status"] == "finished" and req.loc["rid:eos", "output_tokens"] == 1
    assert req.loc["rid:two", "status"] == "finished" and req.loc["rid:two", "output_tokens"] == 2
    assert timeline._state == {}


def test_pd_decode_request_finished_in_its_prebuilt_batch_is_finished(run_dir):
    """PD decode: SGLang runs process_batch_result_prebuilt outside process_batch_result; a
    request with max_new_tokens=1 (or EOS first) finishes there and never reaches a decode
    batch. Without on_prebuilt it stayed in flight."""
    sched = _scheduler("decode")
    one, more = FakeReq("one", room=7001), FakeReq("more", room=7002)
    _arrive(sched, one, 9)
    _arrive(sched, more, 9)
    for r in (one, more):
        r.output_ids.append(5)  # the token prefill made
    one.finish("length")
    timeline.on_prebuilt(_batch(ForwardMode.PREBUILT, one, more))  # SGLang then filters `one` out
    more.output_ids.append(6)
    more.finish("stop")
    timeline.on_batch_result(sched, _batch(ForwardMode.DECODE, more))
    req = _requests(run_dir)
    for key in ("room:7001", "room:7002"):
        assert req.loc[key, "status"] == "finished", key
        assert req.loc[key, "ttft_s"] >= 0 and req.loc[key, "jct_s"] >= req.loc[key, "ttft_s"]
    assert req.loc["room:7001", "output_tokens"] == 1
    assert "rid:one" not in timeline._state and timeline._state == {}


def test_transfer_span_carries_the_bf16_bytes_of_the_tokens_sent(run_dir, monkeypatch, tmp_path):
    from disagg import wire_meter

    monkeypatch.setenv(wire_meter.WIRE_LOG_ENV, str(tmp_path / "wire.jsonl"))
    prefill = _scheduler("prefill")
    _arrive(prefill, FakeReq("p1", room=8001), 100)
    _arrive(prefill, FakeReq("p2", room=8002), 100)
    _arrive(_scheduler("null"), FakeReq("c", room=8003), 100)  # not a PD prefill: nothing noted
    per_token = 2 * LAYERS * HEADS * HEAD_DIM * 2
    wire_meter.around_transfer(lambda *a: 0, None, "t", 0, 0, 40_000)
    wire_meter.around_send_aux(lambda m, r: 0, None, SimpleNamespace(room=8001, decode_prefix_len=None))
    wire_meter.around_transfer(lambda *a: 0, None, "t", 0, 0, 30_000)
    # The decode server held 36 tokens of the prompt already: 64 were sent.
    wire_meter.around_send_aux(lambda m, r: 0, None, SimpleNamespace(room=8002, decode_prefix_len=36))
    wire_meter.around_send_aux(lambda m, r: 0, None, SimpleNamespace(room=8003))
    recs = {r["room"]: r for r in wire_meter.read_log(tmp_path / "wire.jsonl")}
    assert (recs[8001]["tokens"], recs[8001]["bytes_bf16"]) == (100, 100 * per_token)
    assert (recs[8002]["tokens"], recs[8002]["bytes_bf16"]) == (64, 64 * per_token)
    assert recs[8003]["tokens"] is None and recs[8003]["bytes_bf16"] is None
    # The span (the dashboard's source) carries the same numbers as the JSON line.
    req = _requests(run_dir)
    assert req.loc["room:8001", "bytes"] == 40_000 and req.loc["room:8001", "bytes_bf16"] == 100 * per_token
    assert req.loc["room:8002", "bytes_bf16"] == 64 * per_token
    ratio = analysis.wire_ratio(req)
    assert ratio == pytest.approx(164 * per_token / 70_000)


def test_memory_sample_and_capacity_share_one_bf16_formula():
    from engine.capacity import capacity_report
    from engine.pool_geometry import UnitBytes, bf16_bytes_per_token

    sample = usage.memory_sample(_scheduler(used=10))
    assert sample["bytes_bf16"] == 10 * bf16_bytes_per_token(LAYERS, HEADS, HEAD_DIM) == 10 * 1536
    info = capacity_report(UnitBytes(page=100, row=10, sink_slot=0, page_size=64), LAYERS, HEADS, HEAD_DIM,
                           1000, None)
    assert info["bf16_bytes_per_token"] == 1536
