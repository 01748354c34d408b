"""`hack serve` and `hack bench serve` record their runs under the runs root, like `hack up`,
so that `hack dashboard` with no arguments shows them."""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from hack_metrics import rundir
from hack_cli import bench_serve, cmd_dashboard, cmd_serve
from hack_cli.main import build_parser


def test_hack_serve_records_its_run_and_points_the_server_at_it(tmp_path, monkeypatch):
    monkeypatch.setenv(rundir.RUNS_ROOT_VAR, str(tmp_path))
    args = build_parser().parse_args(["serve", "--port", "30007", "--", "--enable-metrics",
                                      "--host", "0.0.0.0"])
    cmd = cmd_serve.command(args, "/models/SmolLM2")
    run_dir, env = cmd_serve.record_run(args, "/models/SmolLM2", cmd, pid=4242)
    assert run_dir.parent == tmp_path and run_dir.name.endswith("-serve-hack")
    meta = rundir.read_run(run_dir)
    assert meta["kv_mode"] == "hack" and meta["model"] == "smollm2" and meta["model_path"] == "/models/SmolLM2"
    # The URL follows the options passed to SGLang (the last --host wins there too).
    assert meta["servers"] == [{"id": "colocated-0", "role": "colocated", "url": "http://0.0.0.0:30007",
                                "pid": 4242}]
    assert env == {"HACK_METRICS_RUN_DIR": str(run_dir), "HACK_METRICS_ROLE": "colocated",
                   "HACK_METRICS_INSTANCE": "0", "HACK_METRICS_PROMETHEUS": "1"}
    _, what = cmd_dashboard.dashboard_env(build_parser().parse_args(["dashboard"]))
    assert what == f"showing the newest run, {run_dir}"

    bf16 = build_parser().parse_args(["serve", "--bf16", "--run-dir", str(tmp_path / "mine")])
    run_dir, env = cmd_serve.record_run(bf16, "/m", cmd_serve.command(bf16, "/m"), pid=1)
    assert run_dir == tmp_path / "mine" and rundir.read_run(run_dir)["kv_mode"] == "bf16"
    assert env["HACK_METRICS_PROMETHEUS"] == "0"
    assert rundir.read_run(run_dir)["servers"][0]["url"] == "http://127.0.0.1:30000"


class _FakeServer:
    """The SGLangServer calls `hack bench serve` makes, without a server."""

    started: list["_FakeServer"] = []

    def __init__(self, model_path: str, args: list[str], env: dict | None = None) -> None:
        self.args, self.env, self.url, self.log_path = args, env or {}, None, "log"
        self.proc = None

    def start(self):
        self.proc = SimpleNamespace(pid=1000 + len(self.started))
        self.url = f"http://127.0.0.1:{31000 + len(self.started)}"
        self.started.append(self)
        return self

    def wait_ready(self):
        return self

    def kv_usage(self):
        return {"max_total_num_tokens": 4096}

    def timed_stream(self, ids, n):
        return {"decode_tok_s": 10.0, "prefill_tok_s": 100.0}

    def flush_cache(self):
        pass

    def stop(self):
        self.stopped = True


def test_hack_bench_serve_records_one_run_per_method(tmp_path, monkeypatch):
    import engine.launcher
    import hack_eval.workloads

    monkeypatch.setenv(rundir.RUNS_ROOT_VAR, str(tmp_path))
    monkeypatch.setattr(engine.launcher, "SGLangServer", _FakeServer)
    monkeypatch.setattr(_FakeServer, "started", [])
    monkeypatch.setattr(hack_eval.workloads, "essay_ids", lambda path, n, index=0: [1] * n)
    monkeypatch.setattr(hack_eval.workloads, "essay_ids_up_to", lambda path, n, index: [1] * n)
    monkeypatch.setattr(bench_serve, "_throughput", lambda *a: {"output_tok_s": 5.0})
    cfg = {"contexts": [16], "decode_tokens": 2, "concurrency": 1, "requests": 1, "tp_prompt": 8,
           "tp_tokens": 2, "budget_mb": 64.0}
    bench_serve._measure_all(["bf16", "hack"], "/models/SmolLM2", cfg, lambda *a: None,
                             {"model": "smollm2", "command": "hack bench serve --quick"})
    runs = {rundir.read_run(p)["kv_mode"]: p for p in rundir.list_runs(tmp_path)}
    assert sorted(runs) == ["bf16", "hack"]
    for server, (kv, run_dir) in zip(_FakeServer.started, sorted(runs.items())):
        meta = rundir.read_run(run_dir)
        assert meta["finished"] and meta["bench"] == "serve" and meta["command"] == "hack bench serve --quick"
        assert meta["servers"] == [{"id": "colocated-0", "role": "colocated", "url": server.url,
                                    "pid": server.proc.pid}]
        assert server.env["HACK_METRICS_RUN_DIR"] == str(run_dir) and server.stopped
