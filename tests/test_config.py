"""HackConfig: defaults, immutability, validation messages, derived properties."""
from __future__ import annotations

import dataclasses

import pytest

from hack_ops import HackConfig


def test_defaults_match_the_design():
    c = HackConfig()
    assert c.partition_size == 64
    assert c.kv_bits == 2
    assert c.qp_bits == 8
    assert c.rounding == "nearest"
    assert c.summation_elimination is True
    assert c.requant_elimination is True
    assert c.orientation == "channel_k"
    assert c.tail_tensors == "kv"
    assert c.sink_tokens == 1
    assert c.meta_dtype == "float16"


def test_frozen_and_hashable():
    c = HackConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.partition_size = 32  # type: ignore[misc]
    assert c == HackConfig()
    assert hash(c) == hash(HackConfig())
    assert c != HackConfig(partition_size=32)
    assert len({c, HackConfig(), HackConfig(kv_bits=4)}) == 2


@pytest.mark.parametrize("p", list(range(16, 257, 16)))
def test_every_valid_partition_size(p):
    assert HackConfig(partition_size=p, sink_tokens=0).partition_size == p


@pytest.mark.parametrize("p", [0, -16, 8, 15, 17, 24, 100, 272, 512, 64.0, "64", True, None])
def test_invalid_partition_size_names_field_and_range(p):
    with pytest.raises(ValueError) as e:
        HackConfig(partition_size=p)
    msg = str(e.value)
    assert "partition_size" in msg and "16..256" in msg and "multiple of 16" in msg


@pytest.mark.parametrize("bits", [2, 4])
def test_kv_bits_accepts_2_and_4(bits):
    assert HackConfig(kv_bits=bits).kv_bits == bits


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("kv_bits", 1, "2 or 4"),
        ("kv_bits", 3, "2 or 4"),
        ("kv_bits", 8, "2 or 4"),
        ("qp_bits", 4, "8"),
        ("qp_bits", 16, "8"),
        ("rounding", "floor", "nearest"),
        ("rounding", "Nearest", "stochastic"),
        ("orientation", "per_token", "channel_k"),
        ("orientation", "", "token_k"),
        ("tail_tensors", "k", "per_channel"),
        ("tail_tensors", None, "kv"),
        ("meta_dtype", "bfloat16", "float16"),
        ("meta_dtype", "float64", "float32"),
        ("summation_elimination", 1, "bool"),
        ("summation_elimination", "yes", "bool"),
        ("requant_elimination", 0, "bool"),
        ("requant_elimination", None, "bool"),
    ],
)
def test_invalid_value_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as e:
        HackConfig(**{field: value})
    msg = str(e.value)
    assert field in msg and allowed in msg and repr(value) in msg


@pytest.mark.parametrize("s", [0, 1, 4, 31, 32])
def test_sink_tokens_valid_up_to_partition_size(s):
    assert HackConfig(partition_size=32, sink_tokens=s).sink_tokens == s


@pytest.mark.parametrize("s", [-1, 33, 1.0, True])
def test_sink_tokens_invalid(s):
    with pytest.raises(ValueError) as e:
        HackConfig(partition_size=32, sink_tokens=s)
    assert "sink_tokens" in str(e.value) and "0..partition_size (32)" in str(e.value)


def test_replace_returns_new_validated_config():
    c = HackConfig()
    d = c.replace(partition_size=32, kv_bits=4)
    assert (d.partition_size, d.kv_bits) == (32, 4)
    assert (c.partition_size, c.kv_bits) == (64, 2)  # the original is untouched
    with pytest.raises(ValueError, match="partition_size"):
        c.replace(partition_size=48 + 1)
    with pytest.raises(ValueError, match="sink_tokens"):
        HackConfig(partition_size=16, sink_tokens=16).replace(sink_tokens=17)


@pytest.mark.parametrize("p,d,expected", [(16, 64, 16), (32, 64, 32), (64, 64, 64), (128, 64, 64),
                                          (64, 128, 64), (256, 16, 16)])
def test_head_group_is_min_of_partition_and_head_dim(p, d, expected):
    assert HackConfig(partition_size=p).head_group(d) == expected


@pytest.mark.parametrize(
    "orientation,tail,k_per_token,v_per_token,k_tail,v_tail",
    [
        # channel_k: K per channel (needs a tail), V per token (tail only with 'kv').
        ("channel_k", "kv", False, True, True, True),
        ("channel_k", "per_channel", False, True, True, False),
        # token_k (the paper's): K per token (tail only with 'kv'), V per channel (always a tail).
        ("token_k", "kv", True, False, True, True),
        ("token_k", "per_channel", True, False, False, True),
    ],
)
def test_orientation_and_tail_properties(orientation, tail, k_per_token, v_per_token, k_tail, v_tail):
    c = HackConfig(orientation=orientation, tail_tensors=tail)
    assert c.k_per_token is k_per_token
    assert c.v_per_token is v_per_token
    assert c.k_tail is k_tail
    assert c.v_tail is v_tail


def test_label_names_the_non_default_choices():
    assert HackConfig().label() == "channel_k-P64-2bit-sink1"
    c = HackConfig(orientation="token_k", partition_size=32, kv_bits=4, tail_tensors="per_channel",
                   sink_tokens=0, rounding="stochastic", requant_elimination=False)
    assert c.label() == "token_k-P32-4bit-tail-per_channel-stochastic-noRQE"
    labels = {HackConfig(partition_size=p, kv_bits=b).label() for p in (16, 32, 64) for b in (2, 4)}
    assert len(labels) == 6
