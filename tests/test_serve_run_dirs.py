"""`hack serve` and `hack bench serve` record their runs under the runs root, like `hack up`,
so that `hack dashboard` with no arguments shows them."""
from __future__ import annotations

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


def test_hack_serve_roles_start_what_hack_up_starts_and_share_one_run(tmp_path, monkeypatch):
    # The compose stack's containers each run one `hack serve --role ...`: the same command line
    # and environment as `hack up` gives that server, recorded into one run directory.
    from disagg import cluster
    from disagg.server_cmd import server_command

    monkeypatch.setenv(rundir.RUNS_ROOT_VAR, str(tmp_path))
    run = tmp_path / "compose"
    pre = build_parser().parse_args(["serve", "--role", "prefill", "--host", "0.0.0.0", "--port", "30000",
                                     "--advertise-host", "10.89.0.5", "--run-dir", str(run), "--join",
                                     "--", "--enable-metrics"])
    dec = build_parser().parse_args(["serve", "--role", "decode", "--kv", "hack", "--host", "0.0.0.0",
                                     "--port", "30001", "--advertise-host", "10.89.0.6", "--run-dir", str(run),
                                     "--join"])
    cmd = cmd_serve.command(pre, "/m")
    assert cmd == server_command("prefill", "hack", "/m", "0.0.0.0", 30000, 8998,
                                 cluster.ClusterSpec.max_total_tokens, ["--enable-metrics"])
    assert cmd_serve.command(dec, "/m") == server_command("decode", "hack", "/m", "0.0.0.0", 30001, None,
                                                          cluster.ClusterSpec.max_total_tokens)
    monkeypatch.setenv("HACK_LINK_MBPS", "100")   # set where the image's entry point shaped the link
    _, env = cmd_serve.record_run(pre, "/m", cmd, pid=11)
    assert rundir.read_run(run)["link_rate"] == "100mbit"
    assert env["SGLANG_HOST_IP"] == "10.89.0.5"   # what mooncake and the bootstrap server advertise
    assert env["HACK_METRICS_ROLE"] == "prefill" and env["HACK_METRICS_PROMETHEUS"] == "1"
    assert env["HACK_DISAGG_WIRE_LOG"] == str(run / "wire-prefill-0.jsonl")
    _, env = cmd_serve.record_run(dec, "/m", cmd_serve.command(dec, "/m"), pid=12)
    assert env["HACK_DISAGG_FAULT_FILE"] == str(run / "fault-trigger-decode-0")
    meta = rundir.read_run(run)
    assert meta["kv_mode"] == "hack" and meta["label"] == "pd-hack"
    assert sorted(meta["servers"], key=lambda s: s["id"]) == [
        {"id": "decode-0", "role": "decode", "url": "http://10.89.0.6:30001", "pid": 12},
        {"id": "prefill-0", "role": "prefill", "url": "http://10.89.0.5:30000", "pid": 11, "bootstrap_port": 8998}]

    # podman-compose turns an empty `${HACK_DECODE_ARGS:-}` into an empty word: not an argument.
    dec.sglang_args = ["--", ""]
    assert "" not in cmd_serve.command(dec, "/m")
    bf16 = build_parser().parse_args(["serve", "--role", "decode", "--kv", "bf16", "--port", "30001"])
    assert "torch_native" in cmd_serve.command(bf16, "/m")
    # --advertise-host auto (or a wildcard --host): the address this host's name resolves to.
    auto = build_parser().parse_args(["serve", "--role", "prefill", "--host", "0.0.0.0"])
    import socket
    assert cmd_serve.advertised_host(auto) == socket.gethostbyname(socket.gethostname())


def test_hack_serve_refuses_flags_that_do_not_fit_with_a_sentence(capsys, monkeypatch):
    monkeypatch.setattr(os, "execve", lambda *a: (_ for _ in ()).throw(AssertionError("started")))
    for argv, sentence in ((["--role", "prefill", "--join"], "--join needs --run-dir"),
                           (["--advertise-host", "auto"], "--advertise-host: only for --role prefill or decode"),
                           (["--bootstrap-port", "9000", "--max-total-tokens", "64"],
                            "--max-total-tokens, --bootstrap-port: only for --role")):
        args = build_parser().parse_args(["serve", "--model-path", "/m", *argv])
        assert args.func(args) == 2
        assert sentence in capsys.readouterr().err


def test_a_joined_run_keeps_the_first_servers_run(tmp_path):
    first = rundir.init_run(tmp_path / "r", "pd-hack", "hack", join=True)
    rundir.register_server(first, "prefill-0", "prefill", "http://a:1")
    again = rundir.init_run(tmp_path / "r", "pd-hack", "hack", join=True)
    assert again == first and [s["id"] for s in rundir.read_run(again)["servers"]] == ["prefill-0"]
    # Without join, init_run starts the directory over (a new cluster in an old directory).
    rundir.init_run(tmp_path / "r", "pd-hack", "hack")
    assert rundir.read_run(first)["servers"] == []
