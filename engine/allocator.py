"""The memory allocator of the SGLang servers this project starts on a CPU host.

Under a long mixed load a prefill server's resident memory grew with glibc's malloc: +18.6%
from the 100th to the 500th request of the 2P2D fault soak (docs/reliability.md, "Soak"); the
scheduler's activations come in many sizes, and glibc raises its mmap threshold after each large
free, so later large buffers come from heaps that fragment and are rarely given back. With
tcmalloc, which SGLang's own CPU image preloads, the same run grew +12.5% and took 822 s instead
of 1,036 s; bounding oneDNN's per-shape caches as well (engine/cpu_runtime.PRIMITIVE_CACHE_ENV)
brought it to +3.0%, flat from the 40% mark of the load on. Servers started
by `hack up`, `hack demo`, `hack bench` and the tests preload tcmalloc when it is installed
(`make install` installs libtcmalloc-minimal4); HACK_SERVER_ALLOCATOR=system keeps glibc's.
"""
from __future__ import annotations

import enum
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = "HACK_SERVER_ALLOCATOR"
# Debian/Ubuntu's gperftools package; the full libtcmalloc works as well.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class ServerAllocator(str, enum.Enum):
    TCMALLOC = "tcmalloc"  # preloaded when found (default)
    SYSTEM = "system"  # glibc malloc, nothing preloaded


def chosen(env: dict[str, str]) -> ServerAllocator:
    raw = env.get(ALLOCATOR_ENV, ServerAllocator.TCMALLOC.value).strip().lower()
    try:
        return ServerAllocator(raw)
    except ValueError:
        known = ", ".join(a.value for a in ServerAllocator)
        raise ValueError(f"{ALLOCATOR_ENV}={raw!r} is not an allocator this project knows ({known})") from None


def find_tcmalloc(dirs: tuple[str, ...] = LIB_DIRS) -> Path | None:
    for d in dirs:
        for name in TCMALLOC_NAMES:
            p = Path(d) / name
            if p.is_file():
                return p
    return None


_warned: list[bool] = []


def _preloaded(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def _preloaded_allocator(preload: list[str]) -> str | None:
    return next((p for p in preload if "tcmalloc" in Path(p).name or "jemalloc" in Path(p).name), None)


def apply(env: dict[str, str], dirs: tuple[str, ...] = LIB_DIRS) -> dict[str, str]:
    """Add the chosen allocator to a server's environment (LD_PRELOAD, ahead of anything the
    caller preloads). Returns `env` (updated). A missing tcmalloc is a warning, not an error:
    the server runs, with glibc's malloc."""
    if chosen(env) is ServerAllocator.SYSTEM:
        return env
    preload = _preloaded(env)
    if _preloaded_allocator(preload):
        return env  # the caller chose an allocator already
    lib = find_tcmalloc(dirs)
    if lib is None:
        if not _warned:
            _warned.append(True)
            logger.warning("tcmalloc is not installed (apt-get install libtcmalloc-minimal4, or `make "
                           "install`): servers use glibc's malloc, whose resident memory creeps up under "
                           "long mixed loads")
        return env
    env["LD_PRELOAD"] = " ".join([str(lib), *preload])
    # tcmalloc reports every allocation over 1 GiB on stderr; a large KV pool is one, by design.
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return env


def describe(env: dict[str, str], dirs: tuple[str, ...] = LIB_DIRS) -> str:
    """What `apply` gives a server started with `env`, in words (benchmark reports quote it)."""
    chosen_lib = _preloaded_allocator(_preloaded(apply(dict(env), dirs)))
    if chosen_lib:
        return Path(chosen_lib).name
    if chosen(env) is ServerAllocator.SYSTEM:
        return f"glibc malloc ({ALLOCATOR_ENV}=system)"
    return "glibc malloc (tcmalloc not installed)"
