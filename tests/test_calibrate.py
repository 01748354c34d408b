"""`hack calibrate` on the real SmolLM2 and `--hack-bits auto` on a real server: a plan measured for
a model folder lands beside it under the model's hash, within its byte budget; a server started on
that folder with the default flags loads it, says so in its log, and lays out every layer's K and
V pages with the plan's bits (checked in /server_info against the store's own layouts); the
shipped plans are keyed by the prepared models' hashes. The calibration runs at 256 tokens and one
item (a held-out play's) here (the shipped plans: docs/accuracy.md, "Calibrated bits")."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

BUDGET = 0.20


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory) -> Path:
    """A folder of links to the prepared SmolLM2's files: what calibrate writes beside it stays here."""
    from hack_eval.models import prepare

    src = prepare("smollm2", log=lambda *a, **k: None)
    dst = tmp_path_factory.mktemp("calibrated") / "smollm2-hf"
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("hack-bits-"):
            (dst / p.name).symlink_to(p)
    return dst


@pytest.fixture(scope="module")
def calibrated(model_copy) -> tuple[Path, dict]:
    from hack_cli.main import main

    assert main(["calibrate", str(model_copy), "--context", "256", "--items", "1", "--budget", str(BUDGET),
                 "--threads", "2"]) == 0
    plans = list(model_copy.glob("hack-bits-*.json"))
    assert len(plans) == 1
    return plans[0], json.loads(plans[0].read_text())


def test_calibrate_writes_a_plan_within_the_budget(model_copy, calibrated):
    from hack_ops.bit_plan import load_plan, model_hash, plan_file_name

    path, raw = calibrated
    plan = load_plan(path)
    assert path.name == plan_file_name(model_hash(model_copy)) and plan.model_hash == model_hash(model_copy)
    assert (plan.num_layers, plan.num_kv_heads, plan.head_dim) == (30, 3, 64)
    assert plan.plain_bytes_ratio < plan.bytes_ratio <= BUDGET
    # filled up to less than two raised tensors short of it, unless the last round found nothing that buys
    assert BUDGET - plan.bytes_ratio < 0.0035 or not plan.measurements["rounds"][-1]["taken"]
    assert plan.k_layers or plan.v_layers
    rows = plan.measurements["per_layer"]
    assert [r["layer"] for r in rows] == list(range(30))
    assert all(math.isfinite(r["k_kl_gain"]) and math.isfinite(r["v_score"]) and len(r["k_head_err"]) == 3
               for r in rows)
    # the plan is what the rounds raised, each tensor once
    rounds = plan.measurements["rounds"]
    taken = [x for r in rounds for x in r["taken"]]
    chosen = {(l, "k") for l in plan.k_layers} | {(l, "v") for l in plan.v_layers}
    assert len(taken) == len(set(taken)) == len(chosen) and {(int(x[:-1]), x[-1]) for x in taken} == chosen
    assert rounds[0]["measured"] == 60 and all(r["measured"] <= 32 for r in rounds[1:])
    # round 1 took, per byte, the best of what it measured (costs are equal per tensor kind)
    first = {(int(x[:-1]), x[-1]) for x in rounds[0]["taken"]}
    assert first
    for t in "kv":
        raised = [r[f"{t}_score"] for r in rows if (r["layer"], t) in first]
        left = [r[f"{t}_score"] for r in rows if (r["layer"], t) not in first]
        if raised and left:
            assert min(raised) >= max(left)
    # and what it bought on the items: less KL than the plain format
    check = plan.measurements["check"]
    assert check["plan"]["kl"] < check["plain"]["kl"] and check["sources"] == ["plays"]
    heads = plan.measurements["heads"]
    assert 0 < heads["layer_plan_score_share"] <= 1 and heads["head_over_layer"] >= 1 - 1e-9
    assert raw["calibration"]["command"].startswith("hack calibrate ")
    # the rotation step scored the plan with and without the Walsh-Hadamard rotation and kept by its rule
    from hack_eval.calibrate import choose_rotation

    step = plan.measurements["rotation"]
    assert set(step["tried"]) == {"none", "hadamard_kv"} and all(math.isfinite(r["kl"]) for r in step["tried"].values())
    tried = dict(step["tried"])
    assert plan.rotation == step["chosen"] == choose_rotation(tried.pop("none"), tried)
    assert check["plan"] == step["tried"][plan.rotation]


def test_layers_from_keeps_a_plan_and_measures_its_rotation(model_copy, calibrated, tmp_path):
    """`--layers-from` runs the rotation step alone: the earlier plan's layers and rounds stay, its
    calibration record gains the step's; `--rotation none` measures no rotation and keeps none."""
    from hack_cli.main import main
    from hack_ops.bit_plan import load_plan

    path, _ = calibrated
    before = load_plan(path)
    out = tmp_path / "again"
    assert main(["calibrate", str(model_copy), "--context", "256", "--items", "1", "--threads", "2",
                 "--layers-from", str(path), "--rotation", "none", "--out", str(out)]) == 0
    after = load_plan(out / path.name)
    assert (after.k_layers, after.v_layers, after.rotation) == (before.k_layers, before.v_layers, "none")
    assert after.measurements["rounds"] == before.measurements["rounds"]
    assert set(after.measurements["rotation"]["tried"]) == {"none"}
    assert after.calibration["command"] == before.calibration["command"]
    assert "--layers-from" in after.calibration["rotation_step"]["command"]


@pytest.mark.integration
def test_a_default_server_loads_the_plan_into_its_store(model_copy, calibrated):
    from engine.launcher import SGLangServer
    from hack_ops import HackConfig
    from hack_ops.bit_plan import load_plan
    from hack_ops.layout import page_layout

    path, _ = calibrated
    plan = load_plan(path)
    server = SGLangServer(str(model_copy), ["--kv-cache-dtype", "hack", "--hack-kv-budget-mb", "64"]).start()
    try:
        server.wait_ready(timeout=600)
        log = Path(server.log_path).read_text(errors="replace")
        assert f"--hack-bits auto = plan {path}" in log, log[-3000:]
        layout = server.kv_usage()["hack"]["layout"]
        assert layout["rotation"] == plan.rotation  # --hack-rotation auto: the plan's
        cfg = plan.apply(HackConfig())
        k_bits = [4 if i in plan.k_layers else 2 for i in range(30)]
        v_bits = [4 if i in plan.v_layers else 2 for i in range(30)]
        assert layout["layer_bits"] == v_bits
        assert layout.get("layer_k_bits", v_bits) == k_bits
        lays = [page_layout(cfg.for_layer(i, 30), 3, 64) for i in range(30)]
        assert layout["k_page_bytes"] == [lay.k.page_bytes for lay in lays]
        assert layout["v_page_bytes"] == [lay.v.page_bytes for lay in lays]
        out = server.generate("The capital of France is", 8)
        assert len(out["output_ids"]) == 8
    finally:
        server.stop()


def test_the_shipped_plans_are_keyed_by_the_prepared_models():
    from hack_eval.models import prepare
    from hack_ops.bit_plan import SHIPPED_DIR, find_plan

    for name in ("smollm2", "gemma3"):
        folder = prepare(name, log=lambda *a, **k: None)
        found = find_plan(folder)
        assert found is not None, f"no shipped plan for {name} ({folder})"
        plan, where = found
        assert where.parent == SHIPPED_DIR and plan.model == name
        assert plan.bytes_ratio <= plan.budget_fraction
