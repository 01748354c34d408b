"""Bring the CPU compose stack (docker/compose.cpu.yaml) up, serve requests through its router,
find them on its dashboard's page, take it down, and check that nothing is left behind.

    python docker/stack_check.py [--engine podman|docker] [--requests 4] [--link-mbps 100]
                                 [--record artifacts/images/stack.json]

The image must exist (`make images`). Each run uses its own compose project name and free host
ports, so it never touches a stack a user started. The page's screenshot and, on a failure,
the containers' logs go to artifacts/images/; the stack is taken down either way. Exit status 0 only when every
request was served, the page counted them, the link was shaped as asked and `down` left no
container, network or volume.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_images import Engine, detect_engine, engine_env  # noqa: E402

from engine.launcher import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker" / "compose.cpu.yaml"
RUN_NAME = "compose"  # the run directory the stack's servers share (compose.cpu.yaml)
PROMPTS = ["The capital of France is", "The ocean is", "List three prime numbers:", "def fibonacci(n):"]


def compose_base(engine: Engine, project: str) -> list[str]:
    if engine is Engine.DOCKER:
        return ["docker", "compose", "-p", project, "-f", str(COMPOSE_FILE)]
    tool = shutil.which("podman-compose", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if tool is None:
        raise RuntimeError("podman-compose is missing (`make images` installs it: scripts/install_containers.sh)")
    return [tool, "-p", project, "-f", str(COMPOSE_FILE)]


def leftovers(engine: Engine, project: str) -> dict[str, list[str]]:
    """Containers, networks and volumes of the project that still exist."""
    env = engine_env(engine)

    def names(*args: str) -> list[str]:
        out = subprocess.run([engine.value, *args], capture_output=True, text=True, env=env, timeout=60)
        return [n for n in out.stdout.split() if n.startswith(project)]

    return {"containers": names("ps", "-a", "--format", "{{.Names}}"),
            "networks": names("network", "ls", "--format", "{{.Name}}"),
            "volumes": names("volume", "ls", "--format", "{{.Name}}")}


def container_of(engine: Engine, project: str, service: str) -> str:
    label = "io.podman.compose" if engine is Engine.PODMAN else "com.docker.compose"
    out = subprocess.run([engine.value, "ps", "--filter", f"label={label}.project={project}",
                          "--filter", f"label={label}.service={service}", "--format", "{{.Names}}"],
                         capture_output=True, text=True, env=engine_env(engine), timeout=60)
    names = out.stdout.split()
    if not names:
        raise RuntimeError(f"no running container for the service {service}")
    return names[0]


def generate(url: str, text: str, max_new_tokens: int, timeout: float) -> dict[str, Any]:
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                         "temperature": 0}}).encode()
    req = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.loads(resp.read())
    return {"status": resp.status, "s": round(time.monotonic() - t0, 3), "text": out.get("text", ""),
            "completion_tokens": out.get("meta_info", {}).get("completion_tokens")}


def wait_serving(url: str, deadline_s: float) -> None:
    """Until the router serves a generation (that one probe counts among the served)."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < deadline_s:
        try:
            generate(url, "Hello", 1, timeout=120)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = str(exc)
        time.sleep(3)
    raise RuntimeError(f"the router at {url} did not serve within {deadline_s:.0f} s (last: {last})")


def recorded_finished(engine: Engine, container: str, env: dict[str, str]) -> int:
    """Finished requests in the stack's run directory, by the dashboard's own loader."""
    code = f"from dashboard.sources import load_view; print(len(load_view('/data/runs/{RUN_NAME}').finished))"
    out = subprocess.run([engine.value, "exec", container, "python", "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading the run directory failed: {out.stderr.strip()[-500:]}")
    return int(out.stdout.strip().splitlines()[-1])


def page_counts(dashboard_url: str, run: str, expect: int, timeout_s: float, shot: Path) -> dict[str, Any]:
    """Open the dashboard's page of the run in a headless browser and read its 'finished' count."""
    from selenium.webdriver.common.by import By

    from dashboard import headless

    with headless.browser() as driver:
        driver.get(f"{dashboard_url}/?run={run}")
        t0, finished = time.monotonic(), None
        while time.monotonic() - t0 < timeout_s:
            for m in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stMetric"]'):
                lab = m.find_elements(By.CSS_SELECTOR, '[data-testid="stMetricLabel"]')
                if lab and lab[0].text.strip() == "finished":
                    finished = m.find_element(By.CSS_SELECTOR, '[data-testid="stMetricValue"]').text
            if finished is not None and finished.isdigit() and int(finished) >= expect:
                break
            time.sleep(1)
        shot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shot))
        body = driver.find_element(By.TAG_NAME, "body").text
        return {"finished": int(finished) if finished and finished.isdigit() else None,
                "run_named": run in body,
                "screenshot": str(shot.relative_to(ROOT)) if shot.is_relative_to(ROOT) else str(shot)}


def check(engine: Engine, requests: int, link_mbps: float | None, out_dir: Path, log=print) -> dict[str, Any]:
    project = f"sglang-hack-check-{uuid.uuid4().hex[:6]}"
    base = compose_base(engine, project)
    router_port, dash_port = free_port(), free_port()
    env = {**engine_env(engine), "HACK_ROUTER_PORT": str(router_port), "HACK_DASHBOARD_PORT": str(dash_port),
           "HACK_LINK_MBPS": "" if link_mbps is None else f"{link_mbps:g}"}
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "engine": engine.value, "project": project,
                              "link_mbps": link_mbps, "requests": []}
    router = f"http://127.0.0.1:{router_port}"
    t0 = time.monotonic()
    try:
        log(f"[stack] {project}: up (router :{router_port}, dashboard :{dash_port}) ...")
        subprocess.run([*base, "up", "-d"], cwd=ROOT, env=env, check=True, timeout=600)
        wait_serving(router, 900)
        result["up_to_serving_s"] = round(time.monotonic() - t0, 1)
        log(f"[stack] serving after {result['up_to_serving_s']} s")
        for i in range(requests):
            r = generate(router, PROMPTS[i % len(PROMPTS)], 16, timeout=300)
            result["requests"].append(r)
            log(f"[stack] request {i}: {r['status']} in {r['s']} s, {r['completion_tokens']} tokens: {r['text']!r}")
        served = 1 + sum(1 for r in result["requests"] if r["status"] == 200)  # + the probe that answered
        prefill = container_of(engine, project, "prefill")
        qdisc = subprocess.run([engine.value, "exec", prefill, "tc", "qdisc", "show"], capture_output=True,
                               text=True, env=env, timeout=60).stdout
        result["prefill_qdisc"] = qdisc.strip()
        result["link_shaped"] = (f"rate {link_mbps:g}Mbit" in qdisc) if link_mbps else ("tbf" not in qdisc)
        urllib.request.urlopen(f"http://127.0.0.1:{dash_port}/_stcore/health", timeout=30).read()
        # What the run directory records, read with the dashboard's own loader in its container,
        # before and after the page is read: the page must show that (the router's health probes
        # are generations too, so the record may grow meanwhile, and may hold more than we sent).
        dash = container_of(engine, project, "dashboard")
        before = recorded_finished(engine, dash, env)
        result["dashboard"] = page_counts(f"http://127.0.0.1:{dash_port}", RUN_NAME, max(before, served), 120,
                                          out_dir / "stack-dashboard.png")
        result["recorded_finished"] = [before, recorded_finished(engine, dash, env)]
        result["served"] = served
        log(f"[stack] dashboard page: {result['dashboard']['finished']} finished; run directory: "
            f"{result['recorded_finished']}; served through the router: {served}")
    except Exception as exc:  # the stack still goes down; the record says what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        logs = subprocess.run([*base, "logs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "stack-logs.txt").write_text(logs.stdout + logs.stderr)
        log(f"[stack] failed: {result['error']} (logs in {out_dir / 'stack-logs.txt'})")
    finally:
        # The stack goes down even when the check is interrupted, and a second Ctrl-C (or a
        # SIGTERM from a wrapper that forwards signals) cannot stop the teardown halfway.
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            t1 = time.monotonic()
            down = subprocess.run([*base, "down", "-v"], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=600)
            result["down_s"] = round(time.monotonic() - t1, 1)
            result["down_rc"] = down.returncode
            result["leftovers"] = leftovers(engine, project)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    ok = ("error" not in result and result["down_rc"] == 0 and not any(result["leftovers"].values())
          and len(result["requests"]) == requests and all(r["status"] == 200 and r["text"] for r in result["requests"])
          and result.get("link_shaped") and result["recorded_finished"][0] >= result["served"]
          and result["recorded_finished"][0] <= (result["dashboard"]["finished"] or -1) <= result["recorded_finished"][1])
    result["ok"] = bool(ok)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=[e.value for e in Engine], default=None)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--link-mbps", type=float, default=100.0, help="the prefill's link; 0: unshaped")
    p.add_argument("--record", type=Path, default=ROOT / "artifacts" / "images" / "stack.json")
    args = p.parse_args(argv)
    if args.requests < 1:
        print("error: --requests must be at least 1", file=sys.stderr)
        return 2
    try:
        engine = Engine(args.engine) if args.engine else detect_engine()
        # Screenshot and, on a failure, the containers' logs: artifacts/images/ (not beside a
        # record kept in docs/).
        result = check(engine, args.requests, args.link_mbps or None, ROOT / "artifacts" / "images",
                       log=lambda m: print(m, flush=True))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("ok", "up_to_serving_s", "served", "down_s", "leftovers")}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
