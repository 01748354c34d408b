"""Fast tests of the disaggregation pieces that need no server: digests, format fingerprint,
request guard, link shaping (real namespaces, root only), stale-state cleanup, workloads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disagg import checksum, cluster, netns, pd_state, procs
from disagg.replay import Result, summarize

ROOT = Path(__file__).resolve().parent.parent


def _computer(tensors, state=()):
    return SimpleNamespace(_kv_data_ptrs=[t.data_ptr() for t in tensors],
                           _kv_item_lens=[t[0].nbytes for t in tensors],
                           _state_data_ptrs=[t.data_ptr() for t in state],
                           _state_item_lens=[t[0].nbytes for t in state])


def test_digest_detects_a_flipped_byte_and_a_missing_page():
    g = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, (8, 96), dtype=torch.uint8, generator=g) for _ in range(2)]
    comp = _computer(pages)
    idx = torch.tensor([1, 3, 4])
    ref = checksum.compute(comp, idx)
    assert ref > 0 and ref & 1
    assert checksum.compute(comp, idx) == ref  # deterministic
    pages[1][3, 17] ^= 1
    assert checksum.compute(comp, idx) != ref
    pages[1][3, 17] ^= 1
    assert checksum.compute(comp, idx) == ref
    pages[0][4].zero_()  # a page whose bytes never arrived
    assert checksum.compute(comp, idx) != ref
    assert checksum.compute(comp, torch.tensor([1, 3])) != checksum.compute(comp, idx)


def test_digest_of_hack_state_covers_only_live_tail_slots():
    page_size, rows = 4, 3
    tail = torch.zeros(rows, page_size, 2, 8, dtype=torch.float16)
    sink = torch.zeros(rows, 1, 2, 8, dtype=torch.float16)
    pages = torch.zeros(5, 32, dtype=torch.uint8)
    comp = _computer([pages], [tail, sink])
    hs = pd_state.HackStateIndices(row=1, live=2, num_tail=1, page_size=page_size)
    ref = checksum.compute(comp, torch.tensor([0]), hs)
    tail[1, 3] = 7.0  # beyond the live slots: not sent, not digested
    tail[2, 0] = 7.0  # another row
    assert checksum.compute(comp, torch.tensor([0]), hs) == ref
    tail[1, 1, 0, 0] = 1.0  # a live slot
    assert checksum.compute(comp, torch.tensor([0]), hs) != ref
    tail[1, 1, 0, 0] = 0.0
    sink[1, 0, 1, 3] = 2.0  # the sink row
    assert checksum.compute(comp, torch.tensor([0]), hs) != ref


def test_fingerprint_names_version_partition_and_model():
    from hack_ops import HackConfig
    from hack_ops.layout import describe_layouts
    from hack_ops.paged import HackKVStore

    def fp(cfg, model="m", layers=30):
        store = HackKVStore(cfg, layers, 3, 64, num_pages=1, num_rows=1)
        return pd_state.layout_fingerprint(SimpleNamespace(store=store, layer_num=layers), model=model)

    base = fp(HackConfig())
    assert base.startswith("hack:v") and ":P64:" in base and base.endswith(":m:L30")
    assert fp(HackConfig()) == base
    assert fp(HackConfig().replace(partition_size=32)) != base
    assert fp(HackConfig(), model="other") != base
    assert fp(HackConfig(), layers=24) != base
    # a rotated format computes on other codes: a pair differing only in --hack-rotation is refused
    assert fp(HackConfig(rotation="hadamard_v")) != base
    assert fp(HackConfig(rotation="hadamard_v")) != fp(HackConfig(rotation="signed_hadamard_v"))
    # which layers hold 4-bit pages is part of the format; a uniform store describes as its layout
    assert len({base, fp(HackConfig(four_bit_layers=(1,))), fp(HackConfig(four_bit_layers=(2,))),
                fp(HackConfig(edge_layer_bits=4)), fp(HackConfig(four_bit_layers=(1,), raised_tensors="k")),
                fp(HackConfig(k_bits=4))}) == 6
    uniform = HackKVStore(HackConfig(), 3, 3, 64, num_pages=1, num_rows=1)
    assert describe_layouts(uniform) == uniform.layout.describe()
    mixed = describe_layouts(HackKVStore(HackConfig(four_bit_layers=(1,)), 3, 3, 64, num_pages=1, num_rows=1))
    assert mixed["layer_bits"] == [2, 4, 2] and mixed["kv_bits"] == 2
    text = pd_state.describe_fingerprint(fp(HackConfig().replace(partition_size=32)))
    assert "partition size 32" in text and "model m" in text


def test_incompatible_reason_is_readable():
    from disagg.connector import incompatible_reason

    msg = ("KV cache dtype mismatch: prefill server has kv_cache_dtype=hack:v2:P32:aa:m:L30, but "
           "decode server has kv_cache_dtype=hack:v2:P64:bb:m:L30. Both servers must ...")
    text = incompatible_reason(msg, "10.211.3.2:9000")
    assert "partition size 32" in text and "partition size 64" in text and "10.211.3.2:9000" in text


def test_request_guard_refuses_missing_bootstrap_fields_only_on_pd_servers():
    from disagg.request_guard import check_bootstrap_fields

    mode = lambda m: SimpleNamespace(disaggregation_mode=SimpleNamespace(value=m))  # noqa: E731
    bare = SimpleNamespace(bootstrap_host=None, bootstrap_room=None)
    with pytest.raises(ValueError, match="bootstrap_host and bootstrap_room"):
        check_bootstrap_fields(mode("decode"), bare)
    with pytest.raises(ValueError, match="bootstrap_room"):
        check_bootstrap_fields(mode("prefill"), SimpleNamespace(bootstrap_host="10.0.0.1", bootstrap_room=None))
    check_bootstrap_fields(mode("null"), bare)
    check_bootstrap_fields(mode("decode"), SimpleNamespace(bootstrap_host="10.0.0.1", bootstrap_room=7))
    check_bootstrap_fields(mode("decode"), SimpleNamespace(bootstrap_host="2.2.2.2", bootstrap_room=None))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_servers_refuse_parallel_sampling(role):
    """n > 1 through PD hung (SGLang sends a warm-up and the n samples under one bootstrap room, so
    the transfers never pair): both servers answer 400 naming n; n = 1 and colocated servers serve."""
    from disagg.request_guard import check_parallel_sampling

    mode = lambda m: SimpleNamespace(disaggregation_mode=SimpleNamespace(value=m))  # noqa: E731
    for obj in (SimpleNamespace(sampling_params={"n": 2}), SimpleNamespace(sampling_params=[{"n": 1}, {"n": 4}]),
                SimpleNamespace(sampling_params={}, parallel_sample_num=3)):
        with pytest.raises(ValueError, match=r"n > 1 \(parallel sampling\) is not supported"):
            check_parallel_sampling(mode(role), obj)
        check_parallel_sampling(mode("null"), obj)
    for obj in (SimpleNamespace(sampling_params={"n": 1}), SimpleNamespace(sampling_params=None),
                SimpleNamespace(sampling_params={"n": True}), SimpleNamespace(sampling_params={}, parallel_sample_num=1)):
        check_parallel_sampling(mode(role), obj)


def test_a_decode_server_refuses_input_embeds_its_prefill_would_refuse(monkeypatch):
    """SGLang refuses input_embeds where the radix cache is on, and turns it off on every decode
    server: without this check the decode leg waited for KV the refused prefill leg never sent."""
    from disagg.connector import PdConnector
    from disagg.request_guard import check_input_embeds

    mode = lambda m: SimpleNamespace(disaggregation_mode=SimpleNamespace(value=m))  # noqa: E731
    embeds = SimpleNamespace(input_embeds=[[0.0] * 8], bootstrap_host="10.0.0.1", bootstrap_room=7)
    with pytest.raises(ValueError, match="needs --disable-radix-cache on the prefill and decode servers"):
        check_input_embeds(mode("decode"), embeds, radix_asked_off=False)
    check_input_embeds(mode("decode"), embeds, radix_asked_off=True)  # both launched without it: served
    check_input_embeds(mode("prefill"), embeds, radix_asked_off=False)  # SGLang's own check answers there
    check_input_embeds(mode("null"), embeds, radix_asked_off=False)
    check_input_embeds(mode("decode"), SimpleNamespace(input_embeds=None), radix_asked_off=False)
    # the flag as the command line gave it, noted before SGLang forces it on for decode
    from disagg import transfer_codec

    monkeypatch.setenv(transfer_codec.ENV_VAR, "none")  # check_options publishes the codec: restored after
    try:
        PdConnector.check_options(None, SimpleNamespace(disable_radix_cache=True, hack_kv_codec="none"))
        check_input_embeds(mode("decode"), embeds)
        PdConnector.check_options(None, SimpleNamespace(disable_radix_cache=False, hack_kv_codec="none"))
        with pytest.raises(ValueError, match="input_embeds"):
            check_input_embeds(mode("decode"), embeds)
    finally:
        from disagg.request_guard import note_radix_cache_flag

        note_radix_cache_flag(False)


def test_tbf_burst_covers_a_timer_tick():
    args = netns.tbf_args(10000)
    assert args[:3] == ["tbf", "rate", "10000mbit"]
    assert int(args[4]) >= 10000e6 / 8 / 250
    assert int(netns.tbf_args(10)[4]) == 32 * 1024  # the floor


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_shaped_link_is_created_and_removed():
    link = netns.create("ut" + os.urandom(2).hex(), 50)
    try:
        assert link.namespace in netns.list_namespaces()
        assert link.veth_root in netns.list_veths()
        out = subprocess.run(["tc", "qdisc", "show", "dev", link.veth_root], capture_output=True, text=True).stdout
        assert "tbf" in out and "50Mbit" in out
        import socket

        with socket.socket() as srv:  # a TCP connection from inside the namespace crosses the veth
            srv.bind((link.root_ip, 0))
            srv.listen(1)
            code = f"import socket; socket.create_connection(('{link.root_ip}', {srv.getsockname()[1]}), 5).sendall(b'x')"
            out = subprocess.run(["ip", "netns", "exec", link.namespace, sys.executable, "-c", code],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            conn, _ = srv.accept()
            assert conn.recv(1) == b"x"
            conn.close()
        assert netns.veth_bytes(link)["rx"] > 0
        # A reverse lookup of the namespace's own address (what torch's process-group store does
        # at every server start) fails at once instead of timing out on an unreachable DNS server.
        t0 = time.monotonic()
        out = subprocess.run(["ip", "netns", "exec", link.namespace, "getent", "hosts", link.ns_ip],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and time.monotonic() - t0 < 3.0, (out, time.monotonic() - t0)
    finally:
        netns.remove(link.namespace, link.veth_root)
    assert link.namespace not in netns.list_namespaces()
    assert link.veth_root not in netns.list_veths()
    assert not (netns.NETNS_ETC / link.namespace).exists()


def test_stale_cluster_state_is_cleaned(tmp_path, monkeypatch):
    monkeypatch.setenv("HACK_CLUSTER_STATE_DIR", str(tmp_path))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=os.setsid)
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    state = {"name": "stale1", "owner_pid": dead_owner.pid, "pids": [sleeper.pid],
             "servers": [{"role": "decode", "index": 0, "pid": sleeper.pid}], "link": None}
    (tmp_path / "stale1.json").write_text(json.dumps(state))
    msgs = cluster.clean_stale()
    assert any("stale1" in m for m in msgs)
    sleeper.wait(timeout=20)
    assert not procs.alive(sleeper.pid)
    assert not (tmp_path / "stale1.json").exists()


def test_a_young_empty_namespace_is_not_an_orphan(tmp_path, monkeypatch):
    # Another state directory's cluster between creating its link and starting its prefill in
    # it (or another test's link) is empty and unowned here: clean_stale leaves it to its owner.
    if not netns.can_shape()[0]:
        pytest.skip("shaping the link needs root, ip and tc")
    monkeypatch.setenv("HACK_CLUSTER_STATE_DIR", str(tmp_path))
    link = netns.create("yo" + os.urandom(2).hex(), 1000)
    try:
        assert netns.age_s(link.namespace) < cluster.ORPHAN_MIN_AGE_S
        cluster.clean_stale()
        assert link.namespace in netns.list_namespaces()
        monkeypatch.setattr(cluster, "ORPHAN_MIN_AGE_S", 0.0)  # as if it had been left long ago
        assert any(link.namespace in m for m in cluster.clean_stale())
        assert link.namespace not in netns.list_namespaces()
    finally:
        netns.remove(link.namespace, link.veth_root)


def test_summarize_percentiles():
    rs = [Result(i, 10, 4, ok=True, ttft_s=float(i), jct_s=float(10 * i)) for i in range(1, 101)]
    rs.append(Result(101, 10, 4, ok=False, error="x"))
    s = summarize(rs)
    assert s["ok"] == 100 and s["requests"] == 101
    assert s["jct_s"]["mean"] == pytest.approx(505.0)
    assert s["jct_s"]["p50"] == pytest.approx(505.0)
    assert s["jct_s"]["p99"] == pytest.approx(990.0)


def test_workloads_build_from_every_source():
    from hack_eval.workloads import build, tokenizer
    from hack_eval.models import model_dir

    path = model_dir()
    if not path.exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    tok = tokenizer(str(path))
    long = build("longdoc-2k", tok, 2, rps=1.0, seed=3)
    assert [len(w.input_ids) for w in long] == [2048, 2048] and long[0].input_ids != long[1].input_ids
    assert long[0].arrival_s == 0.0 and long[1].arrival_s > 0
    assert build("longdoc-2k", tok, 2, rps=1.0, seed=3) == long  # seeded
    for name in ("gsm8k", "humaneval", "sharegpt"):
        items = build(name, tok, 3, rps=None, seed=0)
        assert len(items) == 3 and all(w.input_ids and w.max_new_tokens >= 1 for w in items)
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", tok, 1, None)


def test_wire_meter_attributes_bytes_and_time_to_the_room(tmp_path, monkeypatch):
    import time as _time

    from disagg import wire_meter

    log = tmp_path / "wire.jsonl"
    monkeypatch.setenv(wire_meter.WIRE_LOG_ENV, str(log))

    def slow_ok(engine, target, bufs, peers, lengths):
        _time.sleep(0.2)
        return 0

    fail = lambda *a: -1  # noqa: E731 - a failed call moves nothing
    wire_meter.around_batch_transfer(slow_ok, None, "t", [0, 0], [0, 0], [1000, 24])
    wire_meter.around_batch_transfer(fail, None, "t", [0], [0], [999])
    wire_meter.around_transfer(lambda *a: 0, None, "t", 0, 0, 76)
    wire_meter.around_send_aux(lambda mgr, req: 0, None, SimpleNamespace(room=42))
    wire_meter.around_send_aux(lambda mgr, req: 0, None, SimpleNamespace(room=43))
    recs = wire_meter.read_log(log)
    assert [r["room"] for r in recs] == [42, 43]
    assert recs[0]["bytes"] == 1100 and recs[0]["calls"] == 2
    assert recs[0]["t_end"] - recs[0]["t_start"] >= 0.19  # the first call's duration counts
    # On-the-wire time: the slow successful call and the fast one, not the failed one.
    assert 0.19 <= recs[0]["busy_s"] < 0.35
    assert recs[0]["t_start"] <= recs[0]["t_last"] <= recs[0]["t_end"]
    assert recs[1]["bytes"] == 0 and recs[1]["busy_s"] == 0.0


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_link_faults_drop_what_crosses_the_prefill_link_and_nothing_once_cleared():
    # The soak's partition and loss (disagg.link_faults): nft rules in the prefill's namespace on
    # its end of the veth. Datagrams from the namespace to the root end show what gets through.
    import socket

    from disagg import link_faults

    link = netns.create("ut" + os.urandom(2).hex(), 1000)
    state_link = {**link.to_dict(), "namespace": link.namespace, "veth_root": link.veth_root}

    def through(n: int) -> int:
        import threading

        got = [0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
            rx.bind((link.root_ip, 0))
            rx.settimeout(3.0)  # the sender's interpreter starts within that, even on a busy host

            def drain() -> None:  # read while they arrive: a full receive buffer would drop too
                try:
                    while True:
                        rx.recv(16)
                        got[0] += 1
                except socket.timeout:
                    pass

            reader = threading.Thread(target=drain)
            reader.start()
            code = (f"import socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    f"for i in range({n}): s.sendto(b'x', ('{link.root_ip}', {rx.getsockname()[1]})); time.sleep(0.0005)")
            subprocess.run(["ip", "netns", "exec", link.namespace, sys.executable, "-c", code], check=True, timeout=60)
            reader.join(30)
        return got[0]

    try:
        assert through(200) == 200
        link_faults.apply(state_link, link_faults.LinkFault.PARTITION)
        assert through(50) == 0
        assert link_faults.dropped_packets(state_link) >= 50
        link_faults.apply(state_link, link_faults.LinkFault.LOSS, 30.0)   # replaces the partition
        got = through(1000)
        assert 550 <= got <= 850, got                                     # ~70% through
        link_faults.clear(state_link)
        assert through(200) == 200 and link_faults.dropped_packets(state_link) == 0
        link_faults.clear(state_link)                                     # idempotent
        with pytest.raises(netns.LinkError, match="percentage"):
            link_faults.apply(state_link, link_faults.LinkFault.LOSS, 0.0)
    finally:
        netns.remove(link.namespace, link.veth_root)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_container_shapes_its_own_egress_through_its_default_route():
    # What the CPU image's entry point runs in the compose stack's prefill container: the same
    # tbf as a `hack up` link, on the interface of the namespace's default route.
    link = netns.create("ut" + os.urandom(2).hex(), 50)
    nsx = ["ip", "netns", "exec", link.namespace]
    try:
        out = subprocess.run([*nsx, sys.executable, "-m", "disagg.netns", "shape-egress", "20"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0 and out.stdout.strip() == f"{link.veth_ns}: egress limited to 20 Mbit/s", out
        qdisc = subprocess.run([*nsx, "tc", "qdisc", "show", "dev", link.veth_ns],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "20Mbit" in qdisc, qdisc
        bad = subprocess.run([*nsx, sys.executable, "-m", "disagg.netns", "shape-egress", "0"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert bad.returncode == 1 and "link rate must be positive" in bad.stderr
    finally:
        netns.remove(link.namespace, link.veth_root)
    bare = "hkvut" + os.urandom(2).hex()  # no default route: the interface must be named
    subprocess.run(["ip", "netns", "add", bare], check=True)
    try:
        out = subprocess.run(["ip", "netns", "exec", bare, sys.executable, "-m", "disagg.netns",
                              "shape-egress", "20"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 1 and "no default route" in out.stderr, out
    finally:
        subprocess.run(["ip", "netns", "del", bare], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_clean_stale_keeps_the_link_of_a_cluster_still_starting(tmp_path, monkeypatch):
    monkeypatch.setenv("HACK_CLUSTER_STATE_DIR", str(tmp_path))
    name = "ut" + os.urandom(2).hex()
    # The state is written (owner alive, no link recorded yet) before the link exists.
    (tmp_path / f"{name}.json").write_text(json.dumps({"name": name, "owner_pid": os.getpid(),
                                                       "pids": [], "servers": [], "link": None}))
    link = netns.create(name, 100)
    try:
        cluster.clean_stale()
        assert link.namespace in netns.list_namespaces()
        assert link.veth_root in netns.list_veths()
    finally:
        netns.remove(link.namespace, link.veth_root)


def test_servers_sharing_the_host_wait_passively_unless_told_otherwise(tmp_path, monkeypatch):
    # Spinning OpenMP workers of co-located servers slowed decode ~20x on 2 cores.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = cluster.server_env("127.0.0.1", tmp_path, "decode", 0)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cluster.server_env("127.0.0.1", tmp_path, "prefill", 0)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_bench_breakdown_is_the_exclusive_breakdown_of_the_run(tmp_path):
    from hack_metrics.run_view import build_view
    from hack_metrics.runload import RunLoader
    from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run
    from disagg.bench import _exclusive_means
    from hack_cli.bench_disagg import render

    run = Path(write_synthetic_run(SyntheticSpec(requests=20, error_every=0), tmp_path))
    means = _exclusive_means(run, 0)
    assert means["quantization"] > 0 and means["approximation"] > 0 and means["transfer"] > 0
    jct = build_view(RunLoader(run).load()).breakdown["jct_s"].mean()
    assert sum(means.values()) == pytest.approx(jct, rel=1e-6)  # phases add up to the JCT
    assert _exclusive_means(run, 2**62) == {}  # nothing arrived after that
    pct = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
    point = {"method": "hack", "link_mbps": 100, "ok": 20, "requests": 20, "jct_s": pct, "ttft_s": pct,
             "breakdown_s": means, "wire_s_mean": 0.5, "wire_bytes_mean": 7.6e6}
    text = render({"date": "d", "workload": "w", "requests": 20, "rps": 1, "seed": 0, "rates_mbps": [100],
                   "points": [point]}, "hack bench disagg")
    row = [line for line in text.splitlines() if line.startswith("| hack |")][0]
    assert row.count("|") == 18 and "7.6 MB" in row and "n/a" not in row
