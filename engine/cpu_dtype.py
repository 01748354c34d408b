"""The model's dtype on a CPU without BF16 arithmetic: float32 weights, a BF16 KV cache.

SGLang runs a model in its checkpoint's dtype (`--dtype auto`), BF16 for the models served here.
On a CPU with AVX512-BF16 or AMX-BF16, torch's BF16 matmul runs on that hardware. On one with
neither (AVX2 only: AMD EPYC before Zen 4, Intel before Cooper Lake), torch converts element by
element: a 2048x576 @ 576x1536 BF16 matmul ran at 1.2 GFLOP/s against float32's 63 on an AMD
EPYC (Zen 3, AVX2), and SmolLM2's 2K-token prefill took 35 s against 7.4 s in float32
(docs/engine.md, "A CPU without BF16 arithmetic"). So there a server that leaves `--dtype auto`
runs the weights in float32, and one that also leaves `--kv-cache-dtype auto` keeps its KV cache
in BF16, the bytes it would have had, so that a BF16 baseline's memory is what it always was.
A server that names `--dtype` keeps it. CPUs with AVX-512 but no BF16 are left as they are:
not measured.

Applied through SGLang's platform plugin interface (engine.platform, `apply_server_args_defaults`),
so every server on such a host gets it, HACK or not. A model not in BF16 also needs
`embeds_in_model_dtype`: upstream hands a request's `input_embeds` to the model as BF16 whatever
the model's dtype, and a float32 model died in its first linear layer.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

FLOAT32 = "float32"
KV_BF16 = "bfloat16"


def cpu_capabilities() -> dict:
    """torch's view of this CPU (what its kernels dispatch on); {} when it cannot say."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return {}
    try:
        return dict(get())
    except RuntimeError:  # cpuinfo could not initialize
        return {}


def bf16_arithmetic(capabilities: dict | None = None) -> bool:
    """Whether BF16 matmuls are worth running on this CPU: it has BF16 instructions, or it has
    AVX-512 (unmeasured there, so SGLang's choice stands). Unknown CPUs count as yes."""
    caps = cpu_capabilities() if capabilities is None else capabilities
    if not caps:
        return True
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("avx512_f"))


def apply_defaults(server_args: Any, capabilities: dict | None = None) -> str | None:
    """Set float32 weights (and a BF16 KV cache) on a server left at `--dtype auto` on a CPU
    without BF16 arithmetic. Returns what it did, for the log; None when nothing changed."""
    if getattr(server_args, "device", "cpu") not in ("cpu", None) or bf16_arithmetic(capabilities):
        return None
    if getattr(server_args, "dtype", "auto") != "auto":
        return None
    server_args.dtype = FLOAT32
    done = "--dtype float32"
    if getattr(server_args, "kv_cache_dtype", "auto") == "auto":
        server_args.kv_cache_dtype = KV_BF16
        done += " --kv-cache-dtype bfloat16"
    why = (f"this CPU has no BF16 arithmetic (AVX2 only): the model runs with {done} "
           "(torch's BF16 matmul is ~50x slower than float32 here; pass --dtype to choose)")
    logger.warning(why)
    return why


def weights_dtype(capabilities: dict | None = None):
    """The torch dtype a server on this CPU runs a BF16 checkpoint's weights in, for in-process
    benchmarks that stand for a server (their KV is cast to BF16 where a server's would be)."""
    import torch

    return torch.bfloat16 if bf16_arithmetic(capabilities) else torch.float32


def embeds_in_model_dtype(kwargs: dict, forward_batch: Any, dtype: Any) -> dict:
    """The model's forward kwargs with `input_embeds` in the model's dtype. Upstream
    (ModelRunner._extend_forward_kwargs) casts a request's input_embeds to BF16 unconditionally,
    so a float32 (or float16) model raised "expected m1 and m2 to have the same dtype" in its
    first linear and the scheduler died. They are rebuilt from the request's float32 values (not
    from the BF16 copy: no precision lost), with the token replacements upstream scattered in."""
    emb = kwargs.get("input_embeds")
    if emb is None or dtype is None or emb.dtype == dtype:
        return kwargs
    src = getattr(forward_batch, "input_embeds", None)
    if src is None:  # the model's own embeddings with replacements: already the model's dtype
        kwargs["input_embeds"] = emb.to(dtype)
        return kwargs
    fixed = src.to(dtype, copy=True)
    positions, values = getattr(forward_batch, "replace_positions", None), getattr(forward_batch, "replace_embeds", None)
    if positions is not None and values is not None:
        fixed[positions] = values.to(dtype)
    kwargs["input_embeds"] = fixed
    return kwargs
