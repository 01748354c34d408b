"""Metrics schema and stream files: round trip, versions, sink behavior, damaged files."""
from __future__ import annotations

import time

import pyarrow as pa
import pytest

from hack_metrics import schema as S
from hack_metrics.reader import StreamTail, read_stream
from engine.metrics.sink import MetricsSink


def _rows(sink: MetricsSink) -> list[dict]:
    t = 1_700_000_000_000_000_000
    sink.record("arrival", "r1", room=42, t_ns=t, tokens=100)
    sink.record("start", "r1", phase="prefill", room=42, t_ns=t + 5)
    sink.record("end", "r1", phase="prefill", room=42, t_ns=t + 900)
    sink.record("span", "r1", phase="quantization", room=42, t_ns=t + 900, dur_ns=30,
                method="attributed", note="store kernel share")
    sink.record("end", "r1", phase="transfer", room=42, t_ns=t + 1000, bytes=12_345,
                bytes_bf16=75_000)
    sink.record("error", "r2", t_ns=t + 1100, note="peer died: ü")
    sink.record("sample", None, t_ns=t + 1200, pages_used=3, pages_total=10,
                bytes_codes=1, bytes_side=2, bytes_tail=3, bytes_bf16=36, running=1,
                queued=0, rss_bytes=2**40)
    return sink


def test_round_trip_keeps_every_value_and_the_version(tmp_path):
    sink = _rows(MetricsSink(tmp_path, "prefill", "0", strict=True))
    sink.close()
    table, status = read_stream(tmp_path / "prefill-0.arrows")
    assert status.closed and status.problem is None and status.version == S.SCHEMA_VERSION
    assert table.schema.metadata[S.VERSION_KEY] == str(S.SCHEMA_VERSION).encode()
    rows = table.to_pylist()
    assert [r["seq"] for r in rows] == list(range(1, 8))
    assert {r["schema_version"] for r in rows} == {S.SCHEMA_VERSION}
    assert {r["server"] for r in rows} == {"prefill-0"} and {r["role"] for r in rows} == {"prefill"}
    assert rows[0]["tokens"] == 100 and rows[0]["room"] == 42 and rows[0]["bytes"] is None
    assert rows[3]["dur_ns"] == 30 and rows[3]["method"] == "attributed"
    assert rows[4]["bytes"] == 12_345 and rows[4]["bytes_bf16"] == 75_000
    assert rows[5]["rid"] == "r2" and rows[5]["note"] == "peer died: ü"
    assert rows[6]["rss_bytes"] == 2**40 and rows[6]["rid"] is None
    assert table.column_names == list(S.COLUMNS)


def test_a_version_1_stream_reads_with_the_later_columns_null(tmp_path):
    """Streams written before version 2 (no sparse decode columns) still read, in today's
    schema: the columns their version lacks are null."""
    v1 = pa.schema([f for f in S.arrow_schema() if f.name in S.columns_of(1)], metadata={S.VERSION_KEY: b"1"})
    assert "pages_selected" not in v1.names and "pages_used" in v1.names
    row = {name: None for name in v1.names}
    row.update(schema_version=1, seq=1, t_ns=5, kind="sample", role="decode", server="decode-0", pages_used=7)
    path = tmp_path / "decode-0.arrows"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, v1) as w:
        w.write_table(pa.Table.from_pylist([row], schema=v1))
    table, status = read_stream(path)
    assert status.problem is None and status.version == 1
    assert table.column_names == list(S.COLUMNS)
    got = table.to_pylist()[0]
    assert got["pages_used"] == 7 and got["pages_selected"] is None and got["pages_visible"] is None


def test_unknown_version_is_refused_with_a_clear_message(tmp_path):
    schema = S.arrow_schema().with_metadata({S.VERSION_KEY: b"99"})
    path = tmp_path / "decode-0.arrows"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        w.write_table(schema.empty_table())
    table, status = read_stream(path)
    assert table.num_rows == 0
    assert "version 99 is not supported" in status.problem and "reads version 1, 2" in status.problem
    with pytest.raises(S.SchemaVersionError, match="not a HACK metrics stream"):
        S.check_schema(pa.schema([("x", pa.int8())]))


@pytest.mark.parametrize("row, match", [
    ({"kind": "bogus", "role": "prefill", "rid": "a"}, "unknown metrics kind"),
    ({"kind": "start", "role": "prefill", "rid": "a"}, "needs a phase"),
    ({"kind": "start", "role": "prefill", "rid": "a", "phase": "warp"}, "needs a phase"),
    ({"kind": "span", "role": "prefill", "rid": "a", "phase": "decode"}, "needs dur_ns"),
    ({"kind": "arrival", "role": "nobody", "rid": "a"}, "unknown role"),
    ({"kind": "arrival", "role": "decode"}, "needs a rid or a room"),
    ({"kind": "arrival", "role": "decode", "rid": "a", "method": "guess"}, "unknown method"),
])
def test_bad_records_are_rejected(row, match):
    with pytest.raises(ValueError, match=match):
        S.validate_record(row)


def test_sink_never_raises_and_counts_what_it_drops(tmp_path, caplog):
    sink = MetricsSink(tmp_path, "decode", "1")
    sink.record("no-such-kind", "x")
    sink.record("arrival", "x", colour="red")      # unknown column
    sink.record("arrival", "y", tokens=3)
    sink.close()
    assert sink.dropped == 2 and sink.written == 1
    assert "dropped a metrics record" in caplog.text
    table, _ = read_stream(tmp_path / "decode-1.arrows")
    assert table.column("rid").to_pylist() == ["y"]
    sink.record("arrival", "z")                    # after close: ignored, no error
    with pytest.raises(ValueError, match="role must be one of"):
        MetricsSink(tmp_path, "cook")


def test_flush_by_count_and_by_time(tmp_path):
    sink = MetricsSink(tmp_path, "prefill", "0", flush_every=5, flush_ms=60_000)
    for i in range(5):
        sink.record("arrival", f"r{i}")
    deadline = time.time() + 5
    while sink.written < 5 and time.time() < deadline:
        time.sleep(0.01)
    assert sink.written == 5          # the count woke the flusher, not the timer
    timed = MetricsSink(tmp_path, "decode", "0", flush_every=10_000, flush_ms=50)
    timed.record("arrival", "t")
    deadline = time.time() + 5
    while timed.written < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert timed.written == 1
    # Readable while still open: no end-of-stream marker yet.
    table, status = read_stream(timed.path)
    assert table.num_rows == 1 and not status.closed and status.problem is None
    sink.close(), timed.close()


def test_second_writer_of_a_server_gets_its_own_file(tmp_path):
    a = MetricsSink(tmp_path, "prefill", "0")
    b = MetricsSink(tmp_path, "prefill", "0")
    a.record("arrival", "a"), b.record("arrival", "b")
    a.close(), b.close()
    assert a.path.name == "prefill-0.arrows" and b.path.name == "prefill-0.1.arrows"


def test_tail_returns_only_new_batches(tmp_path):
    sink = MetricsSink(tmp_path, "decode", "0")
    sink.record("arrival", "a")
    sink.flush()
    tail = StreamTail(sink.path)
    assert sum(b.num_rows for b in tail.poll()) == 1
    assert tail.poll() == []
    sink.record("arrival", "b"), sink.record("finish", "b")
    sink.flush()
    new = tail.poll()
    assert [r["rid"] for b in new for r in b.to_pylist()] == ["b", "b"]
    assert tail.status.last_seq == 3 and not tail.status.closed
    sink.close()
    assert tail.poll() == [] and tail.status.closed


def _three_batches(tmp_path) -> bytes:
    sink = MetricsSink(tmp_path, "prefill", "0")
    for i in range(3):
        sink.record("arrival", f"r{i}")
        sink.flush()
    sink.close()
    return sink.path.read_bytes()


def test_truncated_file_keeps_complete_batches_and_says_so(tmp_path):
    data = _three_batches(tmp_path)
    cut = tmp_path / "cut" / "prefill-0.arrows"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 60])    # EOS and part of the last batch gone
    table, status = read_stream(cut)
    assert table.column("rid").to_pylist() == ["r0", "r1"]
    assert not status.closed and status.partial_tail > 0
    msg = status.describe(stale_after_s=0.0, now=time.time() + 1)
    assert "truncated" in msg and "2 records" in msg


def test_corrupted_bytes_keep_what_came_before(tmp_path):
    data = bytearray(_three_batches(tmp_path))
    table, _ = read_stream(tmp_path / "prefill-0.arrows")
    assert table.num_rows == 3
    # Overwrite the start of the third batch's message with garbage.
    third = data.rfind(b"\xff\xff\xff\xff", 0, len(data) - 8)
    data[third:third + 16] = b"\x13" * 16
    bad = tmp_path / "bad" / "prefill-0.arrows"
    bad.parent.mkdir()
    bad.write_bytes(bytes(data))
    table, status = read_stream(bad)
    assert table.column("rid").to_pylist() == ["r0", "r1"]
    assert "corrupted" in status.problem and "2 records" in status.problem
    # Not Arrow at all.
    junk = tmp_path / "junk.arrows"
    junk.write_bytes(b"hello, this is not an arrow stream at all")
    table, status = read_stream(junk)
    assert table.num_rows == 0 and "corrupted at byte 0" in status.problem


def test_a_forked_child_writes_its_own_stream(tmp_path):
    import os

    sink = MetricsSink(tmp_path, "decode", "0", flush_ms=20)
    sink.record("arrival", "parent-1")
    sink.flush()
    pid = os.fork()
    if pid == 0:                                  # child: must not touch the parent's file
        code = 1
        try:
            sink.record("arrival", "child")
            sink.close()
            code = 0 if sink.path.name == "decode-0.1.arrows" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    sink.record("arrival", "parent-2")
    sink.close()
    parent, _ = read_stream(tmp_path / "decode-0.arrows")
    child, st = read_stream(tmp_path / "decode-0.1.arrows")
    assert parent.column("rid").to_pylist() == ["parent-1", "parent-2"]
    assert child.column("rid").to_pylist() == ["child"] and st.closed
    assert child.column("seq").to_pylist() == [1]
