"""The SGLang command lines of a disaggregated pair, per KV method.

Methods (same launcher, same model, same transfer path; only the KV cache differs):
  hack     --kv-cache-dtype hack: 2-bit pages, homomorphic attention (this project); pages
           travel without their derived bytes (--hack-kv-codec hack-pages, disagg.hack_wire);
           the prefill is the server's default, --hack-prefill auto (dense on a CPU with
           AMX-BF16 or without AVX-512 VNNI, int8 elsewhere: engine.prefill_choice)
  hack-homomorphic-prefill
           the same with --hack-prefill homomorphic on every host
  hack-full-pages
           the same with every page sent as stored (--hack-kv-codec none): the transform off
  hack-int8-prefill
           the same with --hack-prefill int8: the homomorphic kernel reading a prompt's own
           tokens from 6-bit codes (hack_ops.paged.chunk_codes)
  hack-exact-prefill
           the same with --hack-prefill exact: a prompt's own tokens attend to each other in
           full precision (on CPU, where INT8 buys prefill nothing, the faster prefill)
  hack-dense-prefill
           the same with --hack-prefill dense: also a cached prefix dequantized once per chunk
           (the same as exact for a prompt in one chunk, which these servers prefill)
  dequant  --kv-cache-dtype hack --hack-attention dequant: the same 2-bit pages, dequantized
           before attention (the paper's CacheGen/KVQuant-style strawman)
  bf16     the model's BF16 KV cache (the paper's baseline)
  bf16-lossless
           the same BF16 KV cache, its pages sent coded with the lossless SplitZip codec
           (--hack-kv-codec splitzip; disagg.transfer_codec)
  fp8      SGLang's own FP8 KV cache (--kv-cache-dtype fp8_e4m3): half of BF16's bytes, lossy
Every method uses page size 64 so the transfer engine moves the same number of items. No method
names the model's dtype: every server runs the checkpoint's (BF16), or float32 weights on a CPU
without BF16 arithmetic (engine.cpu_dtype), the KV cache's dtype staying as above.
"""
from __future__ import annotations

import sys

METHODS = ("hack", "dequant", "bf16", "hack-homomorphic-prefill", "hack-int8-prefill", "hack-exact-prefill",
           "hack-dense-prefill",
           "bf16-lossless", "fp8", "hack-full-pages")
# HACK's pages on the wire: lossless, fewer bytes with identical tokens (docs/disagg.md), so on
# for the HACK methods; the strawman (dequant) sends its pages as stored.
HACK_WIRE_FLAGS = ["--hack-kv-codec", "hack-pages"]
PAGE_SIZE = 64

# CPU-specific flags, each for a reason observed with SGLang 0.5.23 (see docs/disagg.md).
COMMON_FLAGS = [
    "--device", "cpu",
    "--disable-overlap-schedule",  # the overlap scheduler records CUDA events on early sends
    "--sleep-on-idle",  # two idle schedulers on 2 cores would otherwise spin
    "--disaggregation-transfer-backend", "mooncake_tcp",
    "--disaggregation-enable-kv-checksum",  # damaged transfers fail the request
    # A fixed KV budget (any KV dtype): profiling free host memory fails when it is shared.
    "--hack-kv-budget-mb", "768",
    # A long document (up to 8K tokens, the model's window) is prefilled as one chunk by every
    # method (SGLang picks 4096 on CPU), so no method pays for a chunk over a cached prefix.
    "--chunked-prefill-size", "8192",
]


# hack-static-FRACTION: the hack method with look-once static eviction on both servers, keeping
# that fraction of each prompt's closed pages (--hack-static-keep; `hack up --static-keep`)
STATIC_PREFIX = "hack-static-"


def static_keep_of(method: str) -> float | None:
    """The fraction a hack-static-FRACTION method keeps (None: not such a method)."""
    if not method.startswith(STATIC_PREFIX):
        return None
    try:
        keep = float(method[len(STATIC_PREFIX):])
    except ValueError:
        return None
    return keep if 0.0 < keep < 1.0 else None


def is_method(method: str) -> bool:
    return method in METHODS or static_keep_of(method) is not None


def method_flags(method: str) -> list[str]:
    keep = static_keep_of(method)
    if keep is not None:
        return [*method_flags("hack"), "--hack-static-keep", f"{keep:g}"]
    if method == "hack":
        return ["--kv-cache-dtype", "hack", *HACK_WIRE_FLAGS]
    if method == "hack-full-pages":
        return ["--kv-cache-dtype", "hack", "--hack-kv-codec", "none"]
    if method in ("hack-homomorphic-prefill", "hack-int8-prefill", "hack-exact-prefill", "hack-dense-prefill"):
        return ["--kv-cache-dtype", "hack", "--hack-prefill", method.split("-")[1], *HACK_WIRE_FLAGS]
    if method == "dequant":
        return ["--kv-cache-dtype", "hack", "--hack-attention", "dequant"]
    if method == "bf16":
        return ["--kv-cache-dtype", "bfloat16", "--attention-backend",
                "torch_native", "--page-size", str(PAGE_SIZE)]
    if method == "bf16-lossless":
        return [*method_flags("bf16"), "--hack-kv-codec", "splitzip"]
    if method == "fp8":
        return ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend",
                "torch_native", "--page-size", str(PAGE_SIZE)]
    raise ValueError(f"unknown KV method {method!r}; choose one of {', '.join(METHODS)}, {STATIC_PREFIX}FRACTION")


def server_command(role: str, method: str, model_path: str, host: str, port: int,
                   bootstrap_port: int | None, max_total_tokens: int, extra: list[str] | None = None) -> list[str]:
    if role not in ("prefill", "decode", "colocated"):
        raise ValueError(f"role must be prefill, decode or colocated, got {role!r}")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port), "--max-total-tokens", str(max_total_tokens),
           *COMMON_FLAGS, *method_flags(method)]
    if role != "colocated":
        cmd += ["--disagg-mode", role]
    if role == "prefill" and bootstrap_port is not None:
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if role == "decode":
        # The default backup calls torch.cuda; a CPU tensor copy works on this host.
        cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if role == "colocated":
        cmd = [c for c in cmd if c != "--disaggregation-enable-kv-checksum"]
        if "--hack-kv-codec" in cmd:  # nothing is transferred: the codec has nothing to code
            i = cmd.index("--hack-kv-codec")
            del cmd[i:i + 2]
    return cmd + list(extra or [])

