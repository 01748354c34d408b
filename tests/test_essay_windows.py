"""essay_ids: a window from one essay when enough essays are long enough, else from the essays
joined in order (a tokenizer with a large vocabulary, like Gemma-3's, packs essays shorter)."""
from __future__ import annotations

import pytest

import hack_eval.texts
import hack_eval.workloads as wl


class _WordTokenizer:
    """One token per whitespace-separated word: token id = the word's integer."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(w) for w in text.split()]}


@pytest.fixture
def essays(tmp_path, monkeypatch):
    files = []
    for i, n in enumerate((30, 12, 25)):  # essay i holds words i*100 .. i*100+n-1
        f = tmp_path / f"e{i}.txt"
        f.write_text(" ".join(str(i * 100 + j) for j in range(n)))
        files.append(f)
    monkeypatch.setattr(wl, "tokenizer", lambda path: _WordTokenizer())
    monkeypatch.setattr(hack_eval.texts, "essay_files", lambda: files)
    return files


def test_single_essay_windows_when_long_enough(essays):
    assert wl.essay_ids("m", 20, index=0) == list(range(20))
    assert wl.essay_ids("m", 20, index=1) == list(range(200, 220))  # essay 1 (12 words) is skipped


def test_joined_essays_when_too_few_are_long_enough(essays):
    stream = list(range(30)) + list(range(100, 112)) + list(range(200, 225))
    assert wl.essay_ids("m", 20, index=2) == stream[40:60]
    assert wl.essay_ids("m", 40, index=0) == stream[:40]
    with pytest.raises(ValueError, match="the essays hold 67 tokens, fewer than 2 windows of 40"):
        wl.essay_ids("m", 40, index=1)


def test_token_windows_counts(essays):
    """One window per file long enough, at most `count`; a count of 0 asks for none (the study's
    `--plays 0`), not for every file."""
    tok = _WordTokenizer()
    assert hack_eval.texts.token_windows(tok, essays, 20, 5) == [list(range(20)), list(range(200, 220))]
    assert hack_eval.texts.token_windows(tok, essays, 20, 1) == [list(range(20))]
    assert hack_eval.texts.token_windows(tok, essays, 20, 0) == []
