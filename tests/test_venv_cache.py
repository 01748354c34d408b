"""scripts/venv_cache.sh: a fresh clone reuses the pinned dependencies another checkout installed,
without touching that checkout's venv. Run on a stand-in checkout and venv (no pip involved)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checkout(path: Path, requirements: str = "torch==1\n") -> Path:
    (path / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "venv_cache.sh", path / "scripts" / "venv_cache.sh")
    (path / "scripts" / "install.sh").write_text("# the recipe\n")
    (path / "requirements").mkdir()
    (path / "requirements" / "base.txt").write_text(requirements)
    return path


def _installed_venv(checkout: Path) -> Path:
    venv = checkout / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "pinned.py").write_text("PIN = 1\n")
    (venv / "bin" / "tool").write_text(f"#!{checkout.resolve()}/.venv/bin/python\nimport pinned\n")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / ".hack-install-stamp").write_text("done\n")
    return venv


def _run(checkout: Path, what: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "venv_cache.sh"), what], capture_output=True, text=True,
                          env={**os.environ, "HACK_VENV_CACHE": str(cache)}, timeout=60, check=True)


def test_a_fresh_clone_gets_a_relocated_copy_and_the_source_stays_as_it_was(tmp_path):
    cache = tmp_path / "cache"
    first = _checkout(tmp_path / "first")
    venv = _installed_venv(first)
    _run(first, "save", cache)
    (key,) = [p for p in cache.iterdir()]
    assert (key / "origin").read_text().strip() == str(venv.resolve())

    second = _checkout(tmp_path / "second")
    out = _run(second, "restore", cache)
    assert "the pinned dependencies from" in out.stdout
    copy = second / ".venv"
    assert (copy / "lib" / "pinned.py").read_text() == "PIN = 1\n"
    assert (copy / "bin" / "tool").read_text().startswith(f"#!{second.resolve()}/.venv/bin/python\n")
    assert not (copy / ".hack-install-stamp").exists()     # install.sh still installs this checkout
    # The checkout it came from and the cache keep their own files.
    assert (venv / "bin" / "tool").read_text().startswith(f"#!{first.resolve()}/.venv/bin/python\n")
    assert (venv / ".hack-install-stamp").exists()
    assert (key / "venv" / "bin" / "tool").read_text().startswith(f"#!{first.resolve()}/")


def test_nothing_is_restored_over_a_venv_or_for_other_pins_and_two_keys_are_kept(tmp_path):
    cache = tmp_path / "cache"
    first = _checkout(tmp_path / "first")
    _installed_venv(first)
    _run(first, "save", cache)
    other = _checkout(tmp_path / "other", requirements="torch==2\n")
    assert "pinned" not in _run(other, "restore", cache).stdout
    assert not (other / ".venv").exists()
    has_venv = _checkout(tmp_path / "has-venv")
    (has_venv / ".venv").mkdir()
    _run(has_venv, "restore", cache)
    assert list((has_venv / ".venv").iterdir()) == []
    # No stamp (an install that did not finish): nothing saved.
    unfinished = _checkout(tmp_path / "unfinished", requirements="torch==3\n")
    (_installed_venv(unfinished) / ".hack-install-stamp").unlink()
    _run(unfinished, "save", cache)
    assert len(list(cache.iterdir())) == 1
    for n in (4, 5):
        c = _checkout(tmp_path / f"pins{n}", requirements=f"torch=={n}\n")
        _installed_venv(c)
        _run(c, "save", cache)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def test_an_empty_cache_setting_turns_it_off(tmp_path):
    first = _checkout(tmp_path / "first")
    _installed_venv(first)
    subprocess.run(["bash", str(first / "scripts" / "venv_cache.sh"), "save"], check=True, timeout=60,
                   env={**os.environ, "HACK_VENV_CACHE": "", "HOME": str(tmp_path / "home")})
    assert not (tmp_path / "home").exists()
