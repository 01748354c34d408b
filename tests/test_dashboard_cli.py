"""`hack dashboard` argument handling: which run it shows, and clear errors."""
from __future__ import annotations

import argparse

import pytest

from hack_metrics import rundir
from hack_cli import cmd_dashboard
from hack_cli.main import build_parser, main


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["dashboard", *argv])


def test_no_run_explains_how_to_start_one(tmp_path):
    env, what = cmd_dashboard.dashboard_env(_args("--runs-root", str(tmp_path / "none")))
    assert "No run directory yet" in what and "hack dashboard --synthetic" in what
    assert env["HACK_RUNS_DIR"] == str((tmp_path / "none").resolve())
    assert "HACK_DASHBOARD_RUN_DIR" not in env


def test_newest_run_is_the_default_and_env_root_is_honored(tmp_path, monkeypatch):
    import datetime as dt
    old = rundir.create_run("old", "bf16", root=tmp_path,
                            now=dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc))
    new = rundir.create_run("new", "hack", root=tmp_path,
                            now=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc))
    monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path))
    _, what = cmd_dashboard.dashboard_env(_args())
    assert what == f"showing the newest run, {new}"
    env, _ = cmd_dashboard.dashboard_env(_args("--run-dir", str(old)))
    assert env["HACK_DASHBOARD_RUN_DIR"] == str(old.resolve())


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    assert main(["dashboard", "--run-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["dashboard", "--url", "localhost:8000"]) == 2
    assert "must start with http://" in capsys.readouterr().err
    assert main(["dashboard", "--port", "70000", "--runs-root", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["dashboard", "--run-dir", "a", "--url", "http://b"])


def test_synthetic_writes_two_labelled_runs(tmp_path):
    env, what = cmd_dashboard.dashboard_env(_args("--synthetic", "--runs-root", str(tmp_path)))
    runs = rundir.list_runs(tmp_path)
    modes = sorted(rundir.read_run(r)["kv_mode"] for r in runs)
    assert modes == ["bf16", "hack"]
    assert all(rundir.read_run(r)["synthetic"] for r in runs)
    assert rundir.read_run(env["HACK_DASHBOARD_RUN_DIR"])["kv_mode"] == "hack"
    assert "synthetic" in what


def test_streamlit_command_points_at_the_app():
    cmd = cmd_dashboard.streamlit_command("127.0.0.1", 8600)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("dashboard/app.py")
    assert "--browser.gatherUsageStats" in cmd and "8600" in cmd
