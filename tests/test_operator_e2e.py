"""The operator's path on a real cluster: `hack up` (1 prefill + 1 decode behind a shaped
200 Mbit/s link, Prometheus on), a handful of short requests, then `hack status`, run.json,
the live /hack/* routes on both servers (prefill behind its namespace), the hack: metrics on
the servers' /metrics, the prefill's wire log, `hack dashboard` with no arguments and with `--url
ROUTER` rendered in Debian's chromium (timeline, phase breakdown, memory chart, header) and stopped
by SIGTERM, and `hack down` leaving nothing (a second one says so). One cluster for the module
(started once); tests/test_disagg_cli.py has no cluster of its own for the same path.
Screenshots: artifacts/operator-*.png."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requests

from disagg import cluster, netns, procs
from disagg.replay import generate
from hack_metrics import rundir
from hack_metrics.http_client import HttpRunLoader
from hack_metrics.run_view import build_view
from test_dashboard_browser import (ARTIFACTS, _count_in_chart, _free_port, _metric, _no_crash, _text,
                                    _titles, _wait)
from test_metrics_grafana import exposition_names, grafana_queries, metric_names

pytestmark = [pytest.mark.memory_heavy, pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="the shaped link needs root")]

N_REQUESTS = 4
ONE_TOKEN_PROMPT = 50  # the max_new_tokens=1 request's prompt length (no other has it)
STOP_LIMIT_S = 15.0


def _hack(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hack_cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from hack_eval.models import model_dir

    if not model_dir().exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    base = tmp_path_factory.mktemp("operator")
    env = dict(os.environ, HACK_RUNS_DIR=str(base / "runs"),
               HACK_CLUSTER_STATE_DIR=str(base / "state"))
    up = _hack("up", "--kv", "hack", "--link-mbps", "200", "--enable-metrics", "--json", env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    state = json.loads(up.stdout)
    try:
        # Short prompts, a few output tokens: the page has this run's requests to show.
        results = [generate(state["router_url"], list(range(100 + 7 * i, 164 + 7 * i)), 6,
                            stream=False) for i in range(N_REQUESTS)]
        # One request whose only token is prefill's: it finishes in decode's prebuilt batch.
        results.append(generate(state["router_url"], list(range(300, 300 + ONE_TOKEN_PROMPT)), 1,
                                stream=False))
        assert all(r.ok for r in results), [r.error for r in results]
        yield {"env": env, "state": state, "base": base}
    finally:
        _hack("down", env=env, timeout=300)
        cluster.down(state)   # idempotent; stops it even if its state file went missing


@pytest.fixture()
def browser():
    """A fresh chromium per page: one crashed tab (seen on a loaded machine) does not take
    the next page's checks with it."""
    from dashboard import headless

    if headless.missing():
        pytest.fail(f"{', '.join(headless.missing())} missing: `make install` installs Debian's chromium and "
                    "chromium-driver")
    with headless.browser() as driver:
        yield driver


def _server(state: dict, role: str) -> dict:
    return next(s for s in state["servers"] if s["role"] == role)


def test_hack_status_lists_the_cluster(live):
    st = live["state"]
    out = _hack("status", "--json", env=live["env"], timeout=120)
    assert out.returncode == 0, out.stderr
    (c,) = json.loads(out.stdout)["clusters"]
    assert c["name"] == st["name"] and c["state"] == "running" and not c["problems"]
    assert c["kv"] == "hack" and c["link_mbps"] == 200 and c["run_dir"] == st["run_dir"]
    assert c["namespace"] == st["link"]["namespace"]
    assert [(s["role"], s["health"]) for s in c["servers"]] == \
        [("prefill", "ok"), ("decode", "ok"), ("router", "ok")]
    assert all(procs.alive(s["pid"]) for s in c["servers"])
    text = _hack("status", env=live["env"], timeout=120).stdout
    assert f"cluster {st['name']}: RUNNING" in text and st["run_dir"] in text


def test_run_json_names_method_model_link_servers_and_command(live):
    st = live["state"]
    meta = rundir.read_run(st["run_dir"])
    assert Path(st["run_dir"]).parent == live["base"] / "runs"
    assert meta["kv_mode"] == "hack" and meta["link_rate"] == "200mbit"
    assert meta["model"] == "smollm2" and meta["cluster"] == st["name"]
    assert meta["command"].startswith("hack up --kv hack --link-mbps 200")
    assert meta["router"] == st["router_url"] and meta["finished"] is None
    assert {(s["id"], s["url"]) for s in meta["servers"]} == \
        {(f"{s['role']}-0", s["url"]) for s in st["servers"] if s["role"] != "router"}


def test_live_routes_on_both_servers_join_prefill_and_decode(live):
    st = live["state"]
    servers = [_server(st, "prefill")["url"], _server(st, "decode")["url"]]
    for url, name in zip(servers, ("prefill-0", "decode-0")):
        r = requests.get(f"{url}/hack/streams", timeout=10)
        assert r.status_code == 200, (url, r.text[:300])
        assert [s["name"] for s in r.json()["streams"]] == [name]
        ev = requests.get(f"{url}/hack/events", params={"since": 0, "limit": 5}, timeout=10)
        assert ev.status_code == 200 and len(ev.json()["events"]) == 5
    view = build_view(HttpRunLoader(st["router_url"], servers=servers).load())
    joined = view.finished[view.finished["roles"] == "decode,prefill"]
    assert len(joined) >= N_REQUESTS + 1     # (+ SGLang's own warm-up request)
    assert view.data.meta["kv_mode"] == "hack" and not view.data.warnings
    one = view.requests[(view.requests["prompt_tokens"] == ONE_TOKEN_PROMPT)
                        & (view.requests["roles"] == "decode,prefill")]
    assert list(one["status"]) == ["finished"] and list(one["output_tokens"]) == [1]
    # Every transfer carries its prompt's BF16 size, from the model's geometry (SmolLM2:
    # 30 layers x 3 KV heads x head_dim 64), so the wire compression line is drawn.
    from transformers import AutoConfig

    from dashboard.figures import compression_figure
    from hack_eval.models import model_dir
    from hack_metrics import analysis

    cfg = AutoConfig.from_pretrained(model_dir())
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    sent = joined[joined["bytes"] > 0]
    assert len(sent) >= N_REQUESTS + 1
    assert (sent["bytes_bf16"] == sent["prompt_tokens"] * per_token).all(), \
        sent[["prompt_tokens", "bytes", "bytes_bf16"]]
    assert analysis.wire_ratio(view.requests) > 1.0
    assert any("on the wire" in (a.text or "") for a in compression_figure(view).layout.annotations)


def test_servers_metrics_carry_hack_beside_sglang_and_cover_grafana(live):
    st = live["state"]
    names = set()
    for role in ("prefill", "decode"):
        text = requests.get(f"{_server(st, role)['url']}/metrics", timeout=10).text
        page = exposition_names(text)
        assert any(n.startswith("sglang:") for n in page), role
        assert {"hack:events_total", "hack:phase_seconds_bucket", "hack:bytes_codes"} <= page
        names |= page
    for title, exprs in grafana_queries().items():
        for e in exprs:
            assert metric_names(e) <= names, f"Grafana panel {title!r}: {metric_names(e) - names}"


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _dashboard(env: dict, *args: str) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    log = Path(env["HACK_RUNS_DIR"]).parent / f"dashboard-{port}.log"
    with open(log, "w") as out:     # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "hack_cli.main", "dashboard", "--port",
                                 str(port), "--refresh", "1", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                return proc, url, log
        except OSError:
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
    proc.kill()
    pytest.fail("the dashboard did not come up in 90 s")


def _sigterm_stops(proc: subprocess.Popen) -> float:
    """SIGTERM `hack dashboard`; it and its Streamlit child are gone within the limit."""
    kids = _children(proc.pid)
    assert kids, "hack dashboard runs Streamlit as a child"
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"hack dashboard still running {STOP_LIMIT_S:g} s after SIGTERM")
    took = time.time() - t0
    assert not [k for k in kids if procs.alive(k)], "Streamlit outlived hack dashboard"
    return took


def _check_page(driver, shot: str) -> None:
    """The page of this run: charts, header, requests. The page re-renders every second while
    the run is live, so each check is retried until it holds on one rendering (each check reads
    the page in one script: tests/test_dashboard_browser.py)."""
    needed = ("Request timeline", "Phase breakdown per request", "KV cache memory over time")
    _wait(driver, "timeline, breakdown and memory charts",
          lambda: all(any(t.startswith(n) for t in _titles(driver)) for n in needed))
    _wait(driver, f"{N_REQUESTS}+ finished requests",
          lambda: int(_metric(driver, "finished") or 0) >= N_REQUESTS)
    _wait(driver, "the header: method and link rate",
          lambda: "KV mode: hack" in _text(driver) and "link: 200mbit" in _text(driver))
    assert "Synthetic run" not in _text(driver)
    _wait(driver, "a bar per phase of each request in the timeline",
          lambda: _count_in_chart(driver, "Request timeline", ".barlayer .point") >= 3 * N_REQUESTS)
    _wait(driver, "memory series",
          lambda: _count_in_chart(driver, "KV cache memory over time", ".scatterlayer .trace"))
    _no_crash(driver)
    ARTIFACTS.mkdir(exist_ok=True)
    _screenshot(driver, ARTIFACTS / shot)


def _screenshot(driver, path: Path) -> None:
    """Keep a screenshot as an artifact. Capturing a page that re-renders every second can
    crash chromium's tab on a loaded machine; the checks above have passed by then, so a
    failed capture is reported as a warning, not as a failure of the page."""
    import warnings

    from selenium.common.exceptions import WebDriverException
    try:
        driver.save_screenshot(str(path))
    except WebDriverException as exc:
        warnings.warn(f"screenshot {path.name} not taken: {exc.msg}")


def test_dashboard_without_arguments_shows_this_run(live, browser):
    proc, url, log = _dashboard(live["env"])
    try:
        assert live["state"]["run_dir"] in log.read_text()      # "showing the newest run, ..."
        browser.get(url)
        _check_page(browser, "operator-dashboard-run.png")
        assert "live" in _text(browser)
    finally:
        took = _sigterm_stops(proc)
    assert took < STOP_LIMIT_S


def test_dashboard_url_follows_the_router(live, browser):
    st = live["state"]
    proc, url, log = _dashboard(live["env"], "--url", st["router_url"])
    try:
        assert f"following cluster {st['name']}" in log.read_text()
        browser.get(url)
        _check_page(browser, "operator-dashboard-url.png")
        assert f"Following {st['router_url']}" in _text(browser)
    finally:
        took = _sigterm_stops(proc)
    assert took < STOP_LIMIT_S


def test_every_request_crossed_the_shaped_link_once(live):
    from disagg.wire_meter import read_log

    st = live["state"]
    assert st["link"]["namespace"] in netns.list_namespaces()
    wire = read_log(Path(st["run_dir"]) / "wire-prefill-0.jsonl")
    assert len(wire) >= N_REQUESTS + 1 and all(w["bytes"] > 0 for w in wire), wire   # (+ the warm-up)


def test_hack_down_leaves_nothing(live):
    st, env = live["state"], live["env"]
    down = _hack("down", env=env, timeout=300)
    assert down.returncode == 0, down.stderr
    assert "stopped prefill-0" in down.stdout and "removed" in down.stdout
    assert not any(procs.alive(s["pid"]) for s in st["servers"])
    assert st["link"]["namespace"] not in netns.list_namespaces()
    assert st["link"]["veth_root"] not in netns.list_veths()
    assert not os.listdir(env["HACK_CLUSTER_STATE_DIR"])
    assert rundir.read_run(st["run_dir"])["finished"]
    assert "no clusters" in _hack("status", env=env, timeout=120).stdout
    assert "nothing to stop" in _hack("down", env=env, timeout=120).stdout


def test_sigterm_stops_hack_up_in_the_foreground_while_starting(tmp_path):
    from hack_eval.models import model_dir

    if not model_dir().exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    env = dict(os.environ, HACK_RUNS_DIR=str(tmp_path / "runs"),
               HACK_CLUSTER_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "hack_cli.main", "up", "--foreground",
                             "--link-mbps", "100"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    state_dir = tmp_path / "state"
    state = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        files = list(state_dir.glob("*.json")) if state_dir.exists() else []
        state = json.loads(files[0].read_text()) if files else None
        if state and len(state["servers"]) == 2:      # both servers spawned, not yet healthy
            break
        time.sleep(0.3)
    assert state and len(state["servers"]) == 2, proc.communicate(timeout=60)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        cluster.down(state)   # idempotent: whatever the outcome, nothing stays behind
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert took < STOP_LIMIT_S, f"hack up took {took:.1f} s to stop"
    assert "SIGTERM during startup" in err
    assert not any(procs.alive(s["pid"]) for s in state["servers"])
    assert state["link"]["namespace"] not in netns.list_namespaces()
    assert not list(state_dir.glob("*.json"))
