"""Shared pytest setup."""
from __future__ import annotations

import os
import sys

import pytest


def pytest_configure(config) -> None:
    # There is no GPU here: Triton kernels (hack_ops.triton) run in Triton's CPU interpreter.
    # Triton fixes the mode when it decorates functions, its own library included, so it is
    # switched on before triton is first imported; only for this process (the environment
    # variable is removed again, so servers started by tests do not inherit it).
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET"):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:
        return
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.__dict__["interpret"] = True  # in-process override, no setenv


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: on a shared 2-core machine, intra-op threads only add synchronization."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
