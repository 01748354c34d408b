"""Build a plain-C shared library once per machine and cache it, and load it once per process:
the one build and load step behind the compiled CPU kernels (hack_ops.paged.cpu_kernel) and the
CPU codec (hack_ops.codec.cpu).

The cache key covers the sources, the flags, the compiler's version and what `-march=native`
expands to on this machine, so a changed source or another CPU never loads a stale library.
Environment: CC picks the compiler; HACK_KERNEL_CACHE sets the cache directory.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence


def cache_dir() -> Path:
    base = os.environ.get("HACK_KERNEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "sglang-hack" / "cpu-kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build_library(stem: str, sources: Sequence[Path], headers: Sequence[Path], flags: Sequence[str],
                  what: str, libs: Sequence[str] = ()) -> Path:
    """Compile `sources` (if not cached) into `<cache>/<stem>_<key>.so` and return its path.
    RuntimeError naming `what` when a source is missing, there is no compiler or gcc fails."""
    missing = [p.name for p in [*sources, *headers] if not p.exists()]
    if missing:
        raise RuntimeError(f"the sources of {what} {missing} are not installed")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # -march=native resolves per machine: key the cache on what it expands to.
    probe = subprocess.run([cc, *flags, "-Q", "--help=target"], capture_output=True, text=True).stdout
    text = "".join(p.read_text() for p in [*sources, *headers])
    key = hashlib.sha256((text + " ".join(flags) + version + probe).encode()).hexdigest()[:16]
    out = cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        res = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(tmp_so), *map(str, sources), *libs],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {what} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see a half-written file
    return out


class LibraryCache:
    """The loaded library of each build variant, built and loaded on first use. When that is
    impossible, load() gives None and errors[variant] keeps the reason (asked again, it does
    not retry: one failed build per process). build(variant) returns the library's path;
    declare(lib) types its entry points; disabled() names an environment switch that turns it
    off (None: on)."""

    def __init__(self, build: Callable[[str], Path], declare: Callable[[ctypes.CDLL], None],
                 disabled: Callable[[], str | None] = lambda: None) -> None:
        self._build, self._declare, self._disabled = build, declare, disabled
        self.libs: dict[str, ctypes.CDLL | None] = {}
        self.errors: dict[str, str] = {}

    def load(self, variant: str) -> ctypes.CDLL | None:
        if variant in self.libs:
            return self.libs[variant]
        lib = None
        off = self._disabled()
        if off is not None:
            self.errors[variant] = off
        else:
            try:
                lib = ctypes.CDLL(str(self._build(variant)))
                self._declare(lib)
            except (RuntimeError, OSError) as exc:
                self.errors[variant] = str(exc)
                lib = None
        self.libs[variant] = lib
        return lib
