"""Stand-in for `sgl_kernel` on machines where no real build can be imported (no GPU).

SGLang's CPU engine imports a few names from `sgl_kernel` at module import time even though a
plain serve never calls them. This module satisfies those imports; calling anything from it
raises an error that names the missing kernel. It is put on the import path only by
engine.cpu_runtime, and only after an import of the real package failed.
"""
from __future__ import annotations

IS_HACK_STANDIN = True


class MissingKernelError(RuntimeError):
    """A kernel of the real sgl_kernel package was called but only the stand-in is installed."""


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise MissingKernelError(
            f"sgl_kernel.{name} was called, but no real sgl_kernel is installed on this machine "
            "(sglang-hack provided a stand-in so that SGLang's CPU engine can import). "
            "This code path needs the real kernel: install sglang-kernel on a supported GPU host "
            "or choose options that avoid it."
        )

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    # Dunder and private lookups (__path__, __spec__, _foo) must fail normally so that the
    # import machinery and hasattr() probes behave as for any module.
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _missing(name)
    globals()[name] = fn
    return fn
