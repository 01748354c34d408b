"""`hack eval layers` (hack_eval/layers.py) and the pieces it adds to the study: a row that
quantizes some layers only (Variant.layers), K or V alone (QuantizedTensors), and the default
format with chosen layers at 4 bits (`--4bit-layers`, HackConfig.four_bit_layers).

K or V alone is checked against the dense reference on inputs the other tensor's 2-bit format
holds exactly (4 evenly spaced levels that each group spans), so quantizing it costs nothing
and the reference's full 'dequant' is the expected result: DENSE_TOL as in
tests/test_eval_attention_paths.py (the same float expression in another order)."""
from __future__ import annotations

import types

import pytest
import torch

from hack_eval import runner
from hack_eval.attention_paths import QuantizedTensors, study_attention
from hack_eval.layers import render_layers, sweep_variants
from hack_eval.runner import EXACT, Variant
from hack_eval.variants import layer_bits_variants
from hack_ops import HackConfig, attention

DENSE_TOL = 1e-4
N, HQ, H, D = 200, 4, 2, 64


def _levels(shape, g, per_channel_page: int | None) -> torch.Tensor:
    """Values on 4 levels (-0.75 + 0.5 * code), each group spanning all four: lossless at 2 bits
    (per token over head_dim groups, or per channel over pages of `per_channel_page` tokens)."""
    codes = torch.randint(0, 4, shape, generator=g)
    if per_channel_page is None:  # every token's group holds codes 0 and 3
        codes[..., 0], codes[..., 1] = 0, 3
    else:  # every channel of every page holds codes 0 and 3
        for start in range(0, shape[-2], per_channel_page):
            codes[..., start, :], codes[..., start + 1, :] = 0, 3
    return -0.75 + 0.5 * codes.float()


@pytest.mark.parametrize("alone", [QuantizedTensors.K, QuantizedTensors.V])
def test_k_or_v_alone_matches_the_reference_when_the_other_is_lossless(alone):
    g = torch.Generator().manual_seed(11)
    cfg = HackConfig()
    q = torch.randn(1, HQ, N, D, generator=g).half().float()
    if alone == QuantizedTensors.K:  # V per token: lossless levels; K random
        k = (torch.randn(1, H, N, D, generator=g) * 2).half().float()
        v = _levels((1, H, N, D), g, None)
    else:  # K per channel over each page: lossless levels; V random
        k = _levels((1, H, N, D), g, cfg.partition_size)
        v = torch.randn(1, H, N, D, generator=g).half().float()
    want = attention(q, k, v, cfg, mode="dequant", causal=True)
    got = study_attention(q, k, v, cfg, "dequant", tensors=alone)
    torch.testing.assert_close(got, want, atol=DENSE_TOL, rtol=0)
    # and the lossless tensor really is lossless: quantizing both gives the same
    both = study_attention(q, k, v, cfg, "dequant")
    torch.testing.assert_close(both, got, atol=DENSE_TOL, rtol=0)
    # while the random tensor's 2-bit error shows
    exact = attention(q, k, v, None, mode="exact", causal=True)
    assert float((got - exact).abs().max()) > 100 * DENSE_TOL


def test_k_or_v_alone_is_refused_where_it_is_not_computed():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 80, 64, generator=g) for h in (2, 1, 1))
    for kw in ({"mode": "hack"}, {"mode": "dequant", "path": "reference"}):
        with pytest.raises(ValueError, match="fast 'dequant' path"):
            study_attention(q, k, v, HackConfig(), tensors="k", **kw)
    with pytest.raises(ValueError, match="fast 'dequant' path"):  # a generation step
        study_attention(q[:, :, -1:], k, v, HackConfig(), "dequant", tensors="v")
    with pytest.raises(ValueError, match="'dequant' mode only"):
        Variant("k", "hack", HackConfig(), tensors="k")
    with pytest.raises(ValueError):
        Variant("k", "dequant", HackConfig(), tensors="q")


def test_a_row_quantizes_only_its_layers():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 150, 64, generator=g).half().float() for h in (4, 2, 2))
    variant = Variant("layer 1", "dequant", HackConfig(), layers=(1,))
    assert variant.layers == (1,)
    outs = {}
    for layer in (0, 1):
        module = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=3))
        with runner.use_variant(variant):
            outs[layer], _ = runner._attention_fn(module, q, k, v, None)
    exact = study_attention(q, k, v, None, "exact").transpose(1, 2)
    deq = study_attention(q, k, v, HackConfig(), "dequant").transpose(1, 2)
    torch.testing.assert_close(outs[0], exact, atol=0, rtol=0)
    torch.testing.assert_close(outs[1], deq, atol=0, rtol=0)
    assert not torch.equal(outs[0], outs[1])


def test_sweep_rows_and_layer_bits_rows():
    rows = sweep_variants(3)
    assert rows[0] is EXACT
    assert [(r.name, r.layers, r.tensors.value) for r in rows[1:]] == [
        ("all layers", None, "kv"), ("all layers, K only", None, "k"), ("all layers, V only", None, "v"),
        ("layer 0", (0,), "kv"), ("layer 1", (1,), "kv"), ("layer 2", (2,), "kv")]
    both = layer_bits_variants([5, 1])
    assert [(v.name, v.mode.value, v.config.four_bit_layers) for v in both] == [
        ("default, layers 1,5 at 4 bits", "hack", (1, 5)), ("default, layers 1,5 at 4 bits", "dequant", (1, 5))]
    assert [v.mode.value for v in layer_bits_variants((2,), ["dequant"])] == ["dequant"]


def test_layer_bits_rows_with_a_rotation():
    """--4bit-rotation: the same raised layers, rotated; each layer's own config keeps the
    rotation (the raised ones at 4 bits, the rest at 2)."""
    from hack_ops.rotation import Rotation

    rows = layer_bits_variants([1, 5], ["dequant"], ("kv", "k"), "hadamard_kv")
    assert [v.name for v in rows] == ["default, layers 1,5 at 4 bits, rotation hadamard_kv",
                                      "default, layers 1,5 K at 4 bits, rotation hadamard_kv"]
    cfg = rows[0].config
    assert cfg.rotation is Rotation.HADAMARD_KV and "hadamard_kv" in cfg.label()
    raised, plain = cfg.for_layer(5, 18), cfg.for_layer(4, 18)
    assert (raised.bits("k"), raised.bits("v"), raised.rotation) == (4, 4, Rotation.HADAMARD_KV)
    assert (plain.bits("k"), plain.bits("v"), plain.rotation) == (2, 2, Rotation.HADAMARD_KV)
    assert rows[0].config != layer_bits_variants([1, 5], ["dequant"])[0].config
    with pytest.raises(ValueError):
        layer_bits_variants([1], rotation="spin")


@pytest.mark.parametrize("argv, message", [
    (["eval", "accuracy", "--4bit-rotation", "hadamard_kv"], "give --4bit-layers too"),
    (["eval", "retrieval", "--4bit-rotation", "hadamard_kv"], "give --4bit-layers too"),
    (["eval", "retrieval", "--served", "bf16", "--4bit-layers", "1", "--4bit-rotation", "hadamard_kv"],
     "--served measures servers"),
])
def test_cli_refuses_a_rotation_that_changes_no_row(argv, message, capsys):
    """Refused before the model loads (the refusal names what to add)."""
    from hack_cli.main import main

    assert main([*argv, "--out", "", "--json-out", ""]) != 0
    assert message in capsys.readouterr().err


def test_explicit_variants_start_with_exact():
    from hack_eval.accuracy import run_study

    with pytest.raises(ValueError, match="start with the exact baseline"):
        run_study(variants=sweep_variants(2)[1:], log=lambda m: None)
    with pytest.raises(ValueError, match="replace every other row selection"):
        run_study(variants=sweep_variants(2), quick=True, log=lambda m: None)


def test_cli_parses_layer_lists(capsys):
    from hack_cli.main import main

    for argv in (["eval", "accuracy", "--4bit-layers", "1,x"], ["eval", "retrieval", "--4bit-layers", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "layer indices" in capsys.readouterr().err


@pytest.mark.slow
def test_layer_sweep_on_the_real_model():
    """A short sweep on SmolLM2 (one 96-token window: one closed page, the rest FP16): every
    row is between exact and the all-layer error, and the report names every layer."""
    from hack_eval.layers import run_layer_sweep

    res = run_layer_sweep("smollm2", context=96, essays=1, plays=0, log=lambda m: None)
    rows = {r["variant"]: r for r in res["rows"]}
    assert res["num_layers"] == 30 and len(res["ranked"]) == 30
    everything = rows["all layers"]["kl"]
    assert everything > 0 and rows["exact"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < rows["all layers, K only"]["kl"] < everything * 1.5
    assert 0 < rows["all layers, V only"]["kl"] < everything * 1.5
    singles = [rows[f"layer {i}"]["kl"] for i in range(30)]
    assert all(0 <= s < everything for s in singles)
    text = render_layers(res, "hack eval layers --context 96")
    assert "| layer 29 |" in text and "Layers by KL, largest first: " in text
