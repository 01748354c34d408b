"""A small soak of real HACK clusters behind SGLang's Rust PD router (disagg/soak.py): mixed
chat and long-document load, malformed requests interleaved: a corrupted transfer, then a
partition and packet loss on the prefill's shaped link (disagg/link_faults.py), two soaks one after
the other on one 1P1D cluster; a prefill killed with SIGKILL mid-run on 2P1D (each prefill behind
its own shaped link).

Asserted (the issue's properties, at a size CI affords): no failure other than the corrupted
request and requests in flight at the kill; every request sent after the kill served by the
surviving prefill; every malformed request answered 4xx; the pools of the live servers back to
idle; and after `cluster.down` no process, namespace or veth of the cluster left.
"""
from __future__ import annotations

import os

import pytest

from disagg import cluster, netns, procs
from disagg.soak import FailureClass, Soak, SoakSpec, fault_schedule, passed

pytestmark = [pytest.mark.memory_heavy, pytest.mark.slow, pytest.mark.e2e]


def _model() -> str:
    from hack_eval.models import model_dir

    path = model_dir()
    if not path.exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    return str(path)


def _spec(prefill: int, link_mbps: float | None) -> cluster.ClusterSpec:
    return cluster.ClusterSpec(model_path=_model(), kv="hack", prefill=prefill, decode=1,
                               link_mbps=link_mbps, max_total_tokens=16384, label="soak-test")


def _soak(prefill: int, spec: SoakSpec, link_mbps: float | None) -> tuple[dict, dict]:
    state = cluster.up(_spec(prefill, link_mbps), log=lambda m: None)
    try:
        report = Soak(state, spec, _model(), log=print).run()
    finally:
        cluster.down(state)
    return state, report


@pytest.fixture(scope="module")
def one_p_one_d(request) -> dict:
    """One 1P1D cluster for the two 1P1D soaks, one after the other (a cluster start is most of a
    minute here): the prefill behind a 1 Gbit/s shaped link where the host allows it (root), which
    the link faults need and the damaged transfer does not mind. The last soak stops it."""
    link = 1000.0 if os.geteuid() == 0 else None
    state = cluster.up(_spec(1, link), log=lambda m: None)
    request.addfinalizer(lambda: cluster.down(state))
    return state


def _assert_gone(state: dict) -> None:
    assert not any(procs.alive(int(s["pid"])) for s in state["servers"])
    if netns.can_shape()[0]:
        present = set(netns.list_namespaces())
        veths = set(netns.list_veths())
        for link in cluster.state_links(state):
            assert link["namespace"] not in present and link["veth_root"] not in veths
    assert not (cluster.state_dir() / f"{state['name']}.json").exists()


def test_1p1d_corrupted_transfer_and_malformed_requests(one_p_one_d: dict) -> None:
    spec = SoakSpec(requests=24, concurrency=4, seed=1, long_fraction=0.1, bad_every=4,
                    faults=fault_schedule("corrupt-transfer@0.5"))
    report = Soak(one_p_one_d, spec, _model(), log=print).run()
    print(report["failures"], report["requests"], report["faults"])
    assert one_p_one_d["router"] == "rust"
    assert passed(report) == [], report["defects"]
    assert report["malformed"]["sent"] == 6
    assert report["failures"][FailureClass.CORRUPTED_TRANSFER.value] <= 1
    assert report["faults"][0]["consumed"], "the damaged transfer never happened"
    assert report["requests"]["ok"] >= report["requests"]["sent"] - 1


def test_1p1d_link_partition_then_packet_loss(one_p_one_d: dict) -> None:
    # Needs the shaped link (network namespaces: root, as CI runs). A 5 s partition at 30% of the
    # requests, then 5% of the link's packets lost from 60% to the end. Runs after the damaged
    # transfer's soak on the same cluster, and stops it.
    assert os.geteuid() == 0, "link faults act on the shaped link, which needs root"
    spec = SoakSpec(requests=30, concurrency=4, seed=3, long_fraction=0.1, bad_every=0,
                    faults=fault_schedule("partition:5@0.3,loss:5@0.6"))
    state = one_p_one_d
    try:
        report = Soak(state, spec, _model(), log=print).run()
    finally:
        cluster.down(state)
    print(report["failures"], report["requests"], report["faults"])
    assert passed(report) == [], report["defects"]
    part, loss = report["faults"]
    assert part["fault"] == "partition" and loss["fault"] == "loss"
    assert part["dropped_packets"] > 0 and loss["dropped_packets"] > 0
    assert 4.5 <= part["t_end"] - part["t"] <= 10.0
    # Nothing hung: whatever was in flight ended (served or with an error) soon after the link
    # came back, and every request sent after it was served.
    assert (part.get("last_in_flight_ended_after_s") or 0) < 60
    assert part["sent_after"] > 0 and part["failed_after"] == 0
    assert report["failures"]["defect"] == 0       # TCP absorbs the 5% loss: no request lost to it
    assert set(report["pools"]["idle_after"].values()) == {True}
    _assert_gone(state)


def test_2p1d_prefill_killed_mid_run() -> None:
    link = 1000.0 if os.geteuid() == 0 else None  # each prefill behind its own link (root)
    spec = SoakSpec(requests=40, concurrency=4, seed=2, long_fraction=0.1, bad_every=8,
                    faults=fault_schedule("kill-prefill@0.4"))
    state, report = _soak(2, spec, link)
    print(report["failures"], report["requests"], report["faults"])
    if link:
        assert len(cluster.state_links(state)) == 2
        assert len({s.get("namespace") for s in state["servers"] if s["role"] == "prefill"}) == 2
    assert passed(report) == [], report["defects"]
    kill = report["faults"][0]
    assert kill["server"] == "prefill-1" and kill["sent_after"] > 0 and kill["failed_after"] == 0
    assert report["rss"]["prefill-1"]["dead"]
    assert set(report["pools"]["idle_after"]) == {"prefill-0", "decode-0"}
    _assert_gone(state)
