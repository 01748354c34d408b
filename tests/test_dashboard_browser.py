"""A real browser (Debian's chromium driven by Selenium and Debian's chromedriver) loads
`hack dashboard` over recorded runs. Screenshots are kept under artifacts/."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hack_metrics import rundir
from engine.metrics.sink import MetricsSink
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    bf16 = write_synthetic_run(SyntheticSpec(requests=150, seed=4, kv_mode="bf16"), root=root,
                               label="bf16")
    hack = write_synthetic_run(SyntheticSpec(requests=150, seed=4), root=root, label="hack")
    damaged = rundir.create_run("damaged", "hack", root=root)
    src = write_synthetic_run(SyntheticSpec(requests=30, seed=9), root=root / "src")
    for f in src.glob("*.arrows"):
        shutil.copy(f, damaged / f.name)
    data = (damaged / "decode-0.arrows").read_bytes()
    (damaged / "decode-0.arrows").write_bytes(data[: len(data) * 2 // 3])   # truncated
    pre = bytearray((damaged / "prefill-0.arrows").read_bytes())
    # Garbage over a message header in the middle (random bytes inside a batch body can
    # be valid numbers; a damaged header never is).
    mid = pre.find(b"\xff\xff\xff\xff", len(pre) // 2)
    pre[mid:mid + 16] = b"\x5a" * 16                                        # corrupted
    (damaged / "prefill-0.arrows").write_bytes(bytes(pre))
    for f in damaged.glob("*.arrows"):
        os.utime(f, (1, 1))                     # written long ago: not a live run
    return {"root": root, "bf16": bf16, "hack": hack, "damaged": damaged}


@pytest.fixture(scope="module")
def dashboard(runs):
    port = _free_port()
    env = dict(os.environ, HACK_RUNS_DIR=str(runs["root"]))
    log = open(runs["root"] / "dashboard.log", "w")
    # Through the real CLI; its own process group so that teardown stops the app too.
    proc = subprocess.Popen([sys.executable, "-m", "hack_cli.main", "dashboard", "--port",
                             str(port), "--refresh", "1"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
        assert proc.poll() is None, (runs["root"] / "dashboard.log").read_text()
    else:
        pytest.fail("the dashboard did not come up in 90 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:   # Streamlit's graceful stop takes ~10 s: skip it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def browser():
    from dashboard import headless

    if headless.missing():
        pytest.fail(f"{', '.join(headless.missing())} missing: `make install` installs Debian's chromium and "
                    "chromium-driver")
    with headless.browser() as driver:
        yield driver


def _wait(driver, what, cond, timeout=90.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard-timeout.png"))
    pytest.fail(f"timed out waiting for {what}; page text: {_text(driver)[:1500]}")


def _text(driver) -> str:
    from selenium.webdriver.common.by import By
    return driver.find_element(By.TAG_NAME, "body").text


# The helpers below read the page in one script each, inside the browser: a page that re-renders
# every second replaces its chart elements, and a check made of several WebDriver round trips
# (find the charts, then read each title) meets replaced elements whenever a render takes about
# as long as the refresh period (a slow or loaded host).
_CHARTS_JS = """
const charts = Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"]'));
const title = c => { const t = c.querySelector('.gtitle'); return t ? t.textContent : ''; };
"""


def _titles(driver) -> list[str]:
    return driver.execute_script(_CHARTS_JS + "return charts.map(title);")


def _in_chart(driver, title_start: str, selector: str) -> list[str] | None:
    """The text of each `selector` element of the first chart whose title starts with
    `title_start`; None while no such chart is on the page."""
    return driver.execute_script(_CHARTS_JS + """
const c = charts.find(c => title(c).startsWith(arguments[0]));
return c ? Array.from(c.querySelectorAll(arguments[1])).map(e => e.textContent) : null;""",
                                 title_start, selector)


def _count_in_chart(driver, title_start: str, selector: str) -> int:
    return len(_in_chart(driver, title_start, selector) or ())


def _metric(driver, label: str) -> str | None:
    return driver.execute_script("""
for (const m of document.querySelectorAll('[data-testid="stMetric"]')) {
  const lab = m.querySelector('[data-testid="stMetricLabel"]');
  const val = m.querySelector('[data-testid="stMetricValue"]');
  if (lab && val && lab.textContent.trim() === arguments[0]) return val.textContent;
}
return null;""", label)


def _no_crash(driver) -> None:
    from selenium.webdriver.common.by import By
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    assert "failed on this data" not in _text(driver)


def _shot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def test_run_page_shows_timeline_breakdown_and_memory(dashboard, runs, browser):
    browser.get(f"{dashboard}/?run={runs['hack'].name}")
    needed = ("Request timeline", "Phase breakdown per request", "Average JCT breakdown",
              "KV cache memory over time")
    _wait(browser, "the four main charts",
          lambda: all(any(t.startswith(n) for t in _titles(browser)) for n in needed))
    # queue, prefill, transfer, decode, ... per request
    assert _count_in_chart(browser, "Request timeline", ".barlayer .point") >= 3 * 147
    assert _count_in_chart(browser, "KV cache memory over time", ".scatterlayer .trace") == 8
    assert _metric(browser, "finished") == "147"
    assert "Synthetic run" in _text(browser)
    _no_crash(browser)
    assert _shot(browser, "dashboard-run.png").stat().st_size > 10_000


def test_damaged_run_warns_in_the_page(dashboard, runs, browser):
    from selenium.webdriver.common.by import By
    browser.get(f"{dashboard}/?run={runs['damaged'].name}")

    def alerts():
        text = " ".join(a.text for a in browser.find_elements(
            By.CSS_SELECTOR, '[data-testid="stAlert"]'))
        return text if "decode-0.arrows" in text and "prefill-0.arrows" in text else None

    text = _wait(browser, "warnings about both damaged streams", alerts)
    assert "truncated or corrupted" in text and "corrupted" in text
    _wait(browser, "the timeline of what could be read",
          lambda: _in_chart(browser, "Request timeline", ".gtitle"))
    _no_crash(browser)
    _shot(browser, "dashboard-damaged.png")


def test_compare_view_puts_two_runs_side_by_side(dashboard, runs, browser):
    browser.get(f"{dashboard}/?run={runs['hack'].name}&compare={runs['bf16'].name}")
    ticks = _wait(browser, "the comparison breakdown",
                  lambda: _in_chart(browser, "Average JCT breakdown", ".xtick text"))
    assert ticks == ["hack", "bf16"]
    _no_crash(browser)
    _shot(browser, "dashboard-compare.png")


def test_live_run_refreshes_without_reload(dashboard, runs, browser):
    run = rundir.create_run("live", "hack", root=runs["root"])
    sink = MetricsSink(run, "colocated", "0", flush_ms=50)
    t = time.time_ns()

    def finish(i: int) -> None:
        sink.record("arrival", f"r{i}", t_ns=t + i * 10**7)
        sink.record("span", f"r{i}", phase="prefill", t_ns=t + i * 10**7 + 10**6,
                    dur_ns=10**6)
        sink.record("finish", f"r{i}", t_ns=t + i * 10**7 + 2 * 10**6, tokens=4)

    try:
        for i in range(3):
            finish(i)
        sink.flush()
        browser.get(f"{dashboard}/?run={run.name}")
        _wait(browser, "3 finished requests", lambda: _metric(browser, "finished") == "3")
        for i in range(3, 7):
            finish(i)
        sink.flush()
        _wait(browser, "7 finished requests without a reload",
              lambda: _metric(browser, "finished") == "7", timeout=30)
        assert "live" in _text(browser)
        _no_crash(browser)
    finally:
        sink.close()
