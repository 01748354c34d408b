"""The CUDA decode kernel's accuracy, stated on the CPU: hack_ops.cuda.emulate replays its fp16
roundings (Q' and P' in fp16 on exact codes, no INT8) over pages written by the reference
quantizer, and is held here to hack_ops.attention:
  - within EMULATION_* of mode 'dequant' (the same pages in float): the kernel's own error;
  - no farther from exact attention than mode 'hack' (INT8 Q' and P', the CPU and Triton paths);
  - the gap between 'hack' and 'dequant' is far larger than the emulation's, so the GPU tests'
    tolerance (hack_ops.cuda.decode.TOL_*) tells the two computations apart.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.cuda.decode import TOL_MAX_ABS, TOL_MEAN_ABS
from hack_ops.cuda.emulate import emulate_request
from hack_ops.layout import page_layout
from hack_ops.triton.testing import dense_reference, random_batch

EMULATION_MAX_ABS = 1e-3  # measured 3.4e-4 at most over these cases
EMULATION_MEAN_ABS = 1.5e-4  # measured 7e-5 at most

CASES = [  # head_dim, query heads per KV head, KV heads, lengths, layer features, format
    (128, 4, 2, [5, 64, 200, 4 * 64 + 17, 1000], {}, HackConfig()),
    (64, 8, 1, [70, 300], {}, HackConfig(sink_tokens=4)),
    (256, 4, 1, [150, 700], {"window": 200, "logit_cap": 30.0}, HackConfig()),
    (128, 7, 1, [129, 640], {"scale": 0.05}, HackConfig(sink_tokens=0)),
]


def _errors(d, rep, heads, lens, feats, cfg):
    lay = page_layout(cfg, heads, d)
    b = random_batch(lay, lens, [0] * len(lens), heads * rep, seed=d + rep)
    q = torch.randn(len(lens), heads * rep, d, generator=torch.Generator().manual_seed(3)).half().float()
    rows = []
    for i, n in enumerate(lens):
        emu = emulate_request(lay, b["bufs"], b["pages"][i], n, q[i], int(b["tail_rows"][i]), int(b["sink_slots"][i]),
                              **feats)
        ref = {m: dense_reference(q[i:i + 1], b["k"][i], b["v"][i], lay, mode=m, **feats)[0]
               for m in ("dequant", "hack", "exact")}
        rows.append((n, emu, ref))
    return rows


@pytest.mark.parametrize("d,rep,heads,lens,feats,cfg", CASES)
def test_fp16_on_codes_follows_the_dequant_reference(d, rep, heads, lens, feats, cfg, one_torch_thread):
    for n, emu, ref in _errors(d, rep, heads, lens, feats, cfg):
        err = (emu - ref["dequant"]).abs()
        assert err.max() <= EMULATION_MAX_ABS and err.mean() <= EMULATION_MEAN_ABS, (n, float(err.max()), float(err.mean()))
        # no less accurate than the INT8 form, measured against exact attention (fp16 noise aside)
        assert (emu - ref["exact"]).abs().mean() <= (ref["hack"] - ref["exact"]).abs().mean() + 2e-4, n
        if n >= 2 * 64:  # closed pages: the INT8 form differs from 'dequant' well beyond the tolerance
            assert (ref["hack"] - ref["dequant"]).abs().max() > 5 * float(err.max()), n


def test_gpu_tolerance_leaves_room_for_the_output_rounding():
    """The GPU tests' bound = the emulation's + one fp16 rounding of outputs below 1 (4.9e-4)."""
    assert EMULATION_MAX_ABS + 4.9e-4 <= TOL_MAX_ABS and EMULATION_MEAN_ABS < TOL_MEAN_ABS
