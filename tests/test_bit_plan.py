"""Bit plans (hack_ops.bit_plan) and `--hack-bits` (engine.bit_plans), without a server: a plan
raises K and V of each layer apart (HackConfig.four_bit_k_layers / four_bit_v_layers) in every
layout the store builds and in the PD fingerprint; a server finds the plan of its model by the
model's hash (beside the folder first, then the shipped ones), says so when there is none, and
refuses a plan of other weights with a sentence. The calibration's choice under the budget is
tested here on numbers; the measurement itself on the real model in tests/test_calibrate.py."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from transformers import LlamaConfig  # noqa: E402

from engine import settings as settings_mod  # noqa: E402
from engine.args import HackArgumentError  # noqa: E402
from engine.bit_plans import BitsSource, PlanRefusal, bits_spec, resolve_plan  # noqa: E402
from engine.server_options import apply_cli_namespace  # noqa: E402
from hack_ops import HackConfig  # noqa: E402
from hack_ops.bit_plan import BitPlan, find_plan, load_plan, model_hash, plan_file_name  # noqa: E402
from hack_ops.layout import describe_layouts, model_bytes_per_token, page_layout  # noqa: E402
from hack_ops.paged.store import HackKVStore  # noqa: E402

LAYERS, HEADS, DIM = 4, 2, 64


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(settings_mod.ENV_VAR, raising=False)


def _model(folder, weights: bytes = b"weights") -> str:
    folder.mkdir()
    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HEADS * DIM * 2, num_attention_heads=HEADS * 2,
                      num_key_value_heads=HEADS, intermediate_size=64, vocab_size=128)
    cfg.architectures = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def _plan(folder: str, k=(1,), v=(1, 3), **kw) -> BitPlan:
    return BitPlan(model_hash=model_hash(folder), model="tiny", num_layers=LAYERS, num_kv_heads=HEADS,
                   head_dim=DIM, k_layers=k, v_layers=v, budget_fraction=0.2, budget_context=4096,
                   bytes_ratio=0.19, plain_bytes_ratio=0.17, **kw)


def test_k_and_v_raised_in_different_layers_reach_every_layout():
    cfg = HackConfig(four_bit_k_layers=(1, 2), four_bit_v_layers=(2,))
    bits = [(cfg.for_layer(i, LAYERS).bits("k"), cfg.for_layer(i, LAYERS).bits("v")) for i in range(LAYERS)]
    assert bits == [(2, 2), (4, 2), (4, 4), (2, 2)]
    assert cfg.per_layer and cfg.split_bits and cfg.label().endswith("-K4L1,2-V4L2")
    store = HackKVStore(cfg, LAYERS, HEADS, DIM, num_pages=2, num_rows=1)
    for i, (kb, vb) in enumerate(bits):  # each layer holds exactly what a uniform store of its bits would
        uniform = page_layout(HackConfig(kv_bits=vb, k_bits=kb), HEADS, DIM)
        assert (store.layout_for(i).k.page_bytes, store.layout_for(i).v.page_bytes) == \
               (uniform.k.page_bytes, uniform.v.page_bytes)
    desc = describe_layouts(store)
    assert desc["layer_k_bits"] == [2, 4, 4, 2] and desc["layer_bits"] == [2, 2, 4, 2]
    # the same layers for K and V is the same format as four_bit_layers
    assert HackConfig(four_bit_k_layers=(1,), four_bit_v_layers=(1,)).for_layer(1, 4) == \
           HackConfig(four_bit_layers=(1,)).for_layer(1, 4)
    assert not HackConfig(kv_bits=4, four_bit_k_layers=(1,), four_bit_v_layers=(1,)).per_layer
    with pytest.raises(ValueError, match="four_bit_k_layers .* beyond"):
        HackConfig(four_bit_k_layers=(9,)).for_layer(0, LAYERS)
    # settings travel to the scheduler processes as JSON: the lists come back as the same config
    s = settings_mod.EngineSettings(config=cfg)
    assert settings_mod.EngineSettings.from_json(s.to_json()).config == cfg


def test_a_raised_tensor_costs_its_share_of_the_bytes():
    """One more 4-bit tensor of 30 SmolLM2-shaped layers: ~0.2 points of BF16's bytes at 4K."""
    base = model_bytes_per_token(HackConfig(), 30, 3, 64, 4096)["ratio"]
    k = model_bytes_per_token(HackConfig(four_bit_k_layers=(3,)), 30, 3, 64, 4096)["ratio"] - base
    v = model_bytes_per_token(HackConfig(four_bit_v_layers=(3,)), 30, 3, 64, 4096)["ratio"] - base
    assert 0.0015 < v < k < 0.0030, (k, v)  # K's code sums widen with its codes


def test_plan_files_are_keyed_by_the_model_hash(tmp_path):
    import hashlib

    a, b = _model(tmp_path / "a"), _model(tmp_path / "b", weights=b"other weights")
    digest = model_hash(a)
    assert digest != model_hash(b)
    # a prepared folder's manifest gives the same hash without re-reading the weights
    files = {n: hashlib.sha256((tmp_path / "a" / n).read_bytes()).hexdigest() for n in ("config.json", "model.safetensors")}
    (tmp_path / "a" / "hack-manifest.json").write_text(json.dumps({"files": files}))
    assert model_hash(a) == digest
    plan = _plan(a)
    assert BitPlan.from_json(plan.to_json()) == plan
    assert plan.apply(HackConfig()) == HackConfig(four_bit_k_layers=(1,), four_bit_v_layers=(1, 3))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    assert find_plan(a, shipped) is None
    shipped_plan = _plan(a, k=(0,), v=())
    shipped_plan.write(shipped)
    assert find_plan(a, shipped) == (shipped_plan, shipped / plan_file_name(plan.model_hash))
    path = plan.write(a)  # the user's own calibration, beside the model, comes first
    assert find_plan(a, shipped) == (plan, path) and path.name.startswith("hack-bits-")
    assert find_plan(b, shipped) is None
    (shipped / "x.json").write_text("[1]")
    with pytest.raises(ValueError, match="is not a bit plan"):
        load_plan(shipped / "x.json")
    with pytest.raises(ValueError, match="outside the plan's 4 layers"):
        _plan(a, k=(4,))


def test_the_server_finds_the_plan_or_says_there_is_none(tmp_path, caplog):
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b", weights=b"other weights")
    with caplog.at_level("INFO", logger="engine.bit_plans"):
        assert resolve_plan(None, a, manual=False, uniform_bits=None) is None
    assert "--hack-bits auto: no bit plan for model" in caplog.text and f"hack calibrate {a}" in caplog.text
    plan = _plan(a)
    plan.write(a)
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.bit_plans"):
        assert resolve_plan(None, a, manual=False, uniform_bits=None) == plan
    assert "K at 4 bits in layers 1; V at 4 bits in layers 1,3" in caplog.text
    assert resolve_plan(BitsSource.PLAIN, a, manual=False, uniform_bits=None) is None
    assert resolve_plan(None, a, manual=True, uniform_bits=None) is None  # --hack-4bit-layers overrides
    assert resolve_plan(None, a, manual=False, uniform_bits=4) is None
    path = tmp_path / "a" / plan_file_name(plan.model_hash)
    assert bits_spec("auto") is BitsSource.AUTO and bits_spec(str(path)) == path
    assert resolve_plan(path, a, manual=False, uniform_bits=None) == plan
    for spec, folder, manual, uniform, words in (
            (path, b, False, None, "was measured on model .* run `hack calibrate"),
            (path, a, True, None, "both choose the 4-bit layers; give one"),
            (path, a, False, 4, "raises 2-bit codes"),
            (path, "not/a/folder", False, None, "not a local model folder")):
        with pytest.raises(PlanRefusal, match=words):
            resolve_plan(spec, folder, manual=manual, uniform_bits=uniform)
    bad = BitPlan(**{**json.loads(plan.to_json()), "num_kv_heads": 1})
    bad.write(a)
    with pytest.raises(PlanRefusal, match="measured on 4 layers of 1 KV heads"):
        resolve_plan(None, a, manual=False, uniform_bits=None)


def test_the_published_settings_hold_the_plan(sglang_parser, tmp_path):
    a = _model(tmp_path / "a")
    _plan(a).write(a)

    def published(*argv: str) -> HackConfig:
        apply_cli_namespace(sglang_parser.parse_args(["--model-path", a, *argv]))
        return settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]).config

    assert published("--kv-cache-dtype", "hack") == HackConfig(four_bit_k_layers=(1,), four_bit_v_layers=(1, 3))
    assert published("--kv-cache-dtype", "hack", "--hack-bits", "plain") == HackConfig()
    assert published("--kv-cache-dtype", "hack", "--hack-4bit-layers", "2") == HackConfig(four_bit_layers=(2,))
    assert published("--kv-cache-dtype", "hack", "--hack-4bit-layers", "none") == HackConfig()
    assert published("--kv-cache-dtype", "hack", "--hack-kv-bits", "4") == HackConfig(kv_bits=4)
    with pytest.raises(HackArgumentError, match="both choose the 4-bit layers"):
        published("--kv-cache-dtype", "hack", "--hack-bits", "auto", "--hack-4bit-layers", "2")
    with pytest.raises(HackArgumentError, match="only apply with --kv-cache-dtype hack"):
        published("--hack-bits", "plain")


def test_a_plan_carries_its_rotation_unless_the_server_names_one(sglang_parser, tmp_path):
    """A plan's rotation reaches the published config with --hack-rotation auto (the default);
    a rotation given on the command line keeps its own; a plan written before plans had one
    loads as 'none'; an unknown one is refused with the values."""
    from hack_ops.rotation import Rotation

    a = _model(tmp_path / "a")
    plan = _plan(a, rotation="hadamard_kv")
    assert BitPlan.from_json(plan.to_json()) == plan and "hadamard_kv rotation" in plan.summary()
    old = json.loads(plan.to_json())
    del old["rotation"]
    assert BitPlan(**old).rotation == "none"
    with pytest.raises(ValueError, match="rotation must be one of"):
        _plan(a, rotation="spin")
    plan.write(a)

    def published(*argv: str) -> HackConfig:
        apply_cli_namespace(sglang_parser.parse_args(["--model-path", a, "--kv-cache-dtype", "hack", *argv]))
        return settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]).config

    raised = dict(four_bit_k_layers=(1,), four_bit_v_layers=(1, 3))
    assert published() == HackConfig(rotation=Rotation.HADAMARD_KV, **raised)
    assert published("--hack-rotation", "auto") == HackConfig(rotation=Rotation.HADAMARD_KV, **raised)
    assert published("--hack-rotation", "none") == HackConfig(**raised)
    assert published("--hack-rotation", "hadamard_v") == HackConfig(rotation=Rotation.HADAMARD_V, **raised)
    assert published("--hack-bits", "plain") == HackConfig()  # no plan: no rotation either
    assert plan.apply(HackConfig(), rotation=False) == HackConfig(**raised)


def test_different_plans_are_different_pd_layouts():
    """The plan is part of the layout both PD sides compare at bootstrap; the refusal says what to align."""
    from types import SimpleNamespace

    from disagg import pd_state
    from disagg.connector import incompatible_reason

    def fp(cfg: HackConfig) -> str:
        pool = SimpleNamespace(store=HackKVStore(cfg, 30, 3, 64, num_pages=1, num_rows=1), layer_num=30)
        return pd_state.layout_fingerprint(pool, model="m")

    plain, plan = fp(HackConfig()), fp(HackConfig(four_bit_k_layers=(7, 21), four_bit_v_layers=(21,)))
    other = fp(HackConfig(four_bit_k_layers=(7,), four_bit_v_layers=(7, 21)))
    rotated = fp(HackConfig(four_bit_k_layers=(7, 21), four_bit_v_layers=(21,), rotation="hadamard_kv"))
    assert len({plain, plan, other, rotated}) == 4  # a plan's rotation is part of its layout too
    assert fp(HackConfig(four_bit_k_layers=(7, 21), four_bit_v_layers=(21,))) == plan
    msg = (f"KV cache dtype mismatch: prefill server has kv_cache_dtype={plan}, but decode server has "
           f"kv_cache_dtype={plain}. Both servers must ...")
    text = incompatible_reason(msg, "127.0.0.1:9000")
    assert plan.split(":")[3] in text and plain.split(":")[3] in text and "--hack-bits" in text


def test_the_calibration_spends_the_budget_by_score_per_byte():
    from hack_eval.calibrate import choose, head_analysis

    import torch

    geo = (30, 3, 64)
    scores = {(layer, t): 0.0 for layer in range(30) for t in "kv"}
    scores.update({(21, "k"): 0.30, (18, "k"): 0.20, (18, "v"): 0.15, (0, "v"): 0.10, (5, "k"): 0.05})
    base = model_bytes_per_token(HackConfig(), 30, 3, 64, 4096)["ratio"]
    picks = choose(scores, geo, base + 0.0050, 4096)  # room for two tensors, not three
    assert picks == [(18, "k"), (21, "k")]
    assert choose(scores, geo, 1.0, 4096) == sorted(k for k, s in scores.items() if s > 0)  # zero scores buy nothing
    assert choose(scores, geo, base, 4096) == []
    # one head of three holding a layer's error: a per-head plan buys more at the same bytes
    err = {t: torch.full((30, 3), 1.0) for t in "kv"}
    err["k"][21] = torch.tensor([1.0, 0.0, 0.0])
    heads = head_analysis(scores, err, torch.rand(30, 3), [(21, "k")])
    assert heads["layer_plan_score_share"] == pytest.approx(0.30 / 0.80)
    assert heads["head_plan_score_share"] == pytest.approx((0.30 + 0.20 / 3 * 2) / 0.80)
    flat = head_analysis(scores, {t: torch.ones(30, 3) for t in "kv"}, torch.rand(30, 3), [(21, "k")])
    assert flat["head_plan_score_share"] == pytest.approx(flat["layer_plan_score_share"]) and not flat["heads_matter_more"]


def test_a_round_spends_up_to_its_share_and_joins_the_plan_so_far():
    from hack_eval.calibrate import choose

    geo = (30, 3, 64)
    scores = {(layer, t): 0.0 for layer in range(30) for t in "kv"}
    scores.update({(21, "k"): 0.30, (18, "k"): 0.20, (18, "v"): 0.15, (0, "v"): 0.10, (5, "k"): -0.05})
    one = model_bytes_per_token(HackConfig(four_bit_k_layers=(21,)), 30, 3, 64, 4096)["ratio"] \
        - model_bytes_per_token(HackConfig(), 30, 3, 64, 4096)["ratio"]
    assert choose(scores, geo, 1.0, 4096, spend=one * 2.5) == [(18, "k"), (21, "k")]
    assert choose(scores, geo, 1.0, 4096, spend=0.0) == [(21, "k")]  # the first always
    # what the plan holds is not taken again, and the budget counts it
    assert choose(scores, geo, 1.0, 4096, picks=[(21, "k")], spend=one * 1.5) == [(18, "k")]
    base = model_bytes_per_token(HackConfig(four_bit_k_layers=(21,)), 30, 3, 64, 4096)["ratio"]
    assert choose(scores, geo, base + one * 0.5, 4096, picks=[(21, "k")]) == []
    assert (5, "k") not in choose(scores, geo, 1.0, 4096)  # a tensor that costs loss is never raised


def test_a_rotation_is_kept_where_it_takes_a_tenth_of_the_kl_away_and_finds_as_many_codes():
    from hack_eval.calibrate import ROTATION_GAIN, choose_rotation

    plan = {"kl": 0.10, "answer_nll": 1.0, "answered": 2}
    row = lambda kl, answered=2: {"kl": kl, "answer_nll": 1.0, "answered": answered}  # noqa: E731
    assert choose_rotation(plan, {}) == "none"
    assert choose_rotation(plan, {"hadamard_kv": row(0.07)}) == "hadamard_kv"
    assert choose_rotation(plan, {"hadamard_kv": row(0.10 * (1 - ROTATION_GAIN) + 1e-4)}) == "none"  # too little
    assert choose_rotation(plan, {"hadamard_kv": row(0.05, answered=1)}) == "none"  # loses a code
    assert choose_rotation(plan, {"hadamard_kv": row(0.12)}) == "none"  # worse (Gemma-3's case)
    assert choose_rotation(plan, {"hadamard_kv": row(0.08), "hadamard_v": row(0.06)}) == "hadamard_v"


def test_a_candidate_scores_the_share_of_each_loss_it_takes_back():
    from hack_eval.calibrate import Loss, scores_from_gains

    plain = Loss(kl=0.2, answer_nll=5.0)
    base = Loss(kl=0.1, answer_nll=3.0)  # half of plain's 4-nat rise over exact still lost
    cands = {(3, "k"): Loss(kl=0.05, answer_nll=3.0), (4, "v"): Loss(kl=0.1, answer_nll=2.0),
             (5, "k"): Loss(kl=0.12, answer_nll=3.5)}
    s = scores_from_gains(plain, 1.0, base, cands)
    assert s[(3, "k")]["score"] == pytest.approx(0.05 / 0.2)
    assert s[(4, "v")]["score"] == pytest.approx(1.0 / 4.0)
    assert s[(5, "k")]["score"] == pytest.approx(-0.02 / 0.2 - 0.5 / 4.0)
    assert s[(5, "k")]["kl_gain"] == pytest.approx(-0.02) and s[(4, "v")]["answer_nll_gain"] == pytest.approx(1.0)
    # where the plain format lost nothing of the answer, the answer adds nothing
    flat = scores_from_gains(Loss(0.2, 1.0), 1.0, base, cands)
    assert flat[(4, "v")]["score"] == pytest.approx(0.0)
    # nor once the plan keeps it (a rise of 1 of plain's 4 nats, or under a nat), nor where plain's
    # own rise is under a nat: the KL alone decides
    for plain_, base_ in ((plain, Loss(0.1, 2.0)), (Loss(0.2, 1.5), Loss(0.1, 1.5)), (plain, Loss(0.1, 1.9))):
        kept = scores_from_gains(plain_, 1.0, base_, cands)
        assert kept[(4, "v")]["score"] == pytest.approx((base_.kl - 0.1) / 0.2, abs=1e-9)
