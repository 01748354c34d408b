"""`hack eval selection`: where sparse decode's page selection puts a pass key. The finer boxes
bound what they claim to; the command runs end to end on the real model, and on its item the
oracles do what they are for (the mass oracle drops the least attention, the best-q.k oracle
reads the needle page at least as often as the bound)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hack_eval.selection import Score, box_bounds, scores_of
from hack_ops.quant import dequantize, quantize

P = 64


def test_finer_boxes_bound_their_keys_and_sit_under_the_page_box():
    g = torch.Generator().manual_seed(2)
    d, n = 64, 6
    k = torch.randn(n * P, d, generator=g) * (1 + torch.arange(d) % 5)
    q = torch.randn(3, 4, d, generator=g)  # 3 query heads, 4 decode rows
    qt = quantize(k, 2, dim=0, group_size=P, meta_dtype=torch.float16)
    kq, mn, sc = dequantize(qt), qt.minimum.float(), qt.scale.float()
    true = (q @ kq.T).reshape(3, 4, n, P).amax(-1)  # [R, S, N]
    page = scores_of(Score.PAGE, q, kq, qt.codes, mn, sc, 2, P, torch.zeros(3, 4, n * P))
    last = None
    for box in (P, 32, 16):
        b = box_bounds(q, qt.codes, mn, sc, P, box)
        assert bool((b >= true - 1e-3).all())  # a bound of every key of its page
        if last is not None:
            assert bool((b <= last + 1e-3).all())  # finer boxes never loosen it
        last = b
    assert torch.allclose(box_bounds(q, qt.codes, mn, sc, P, P).amax(0), page, atol=1e-3)
    assert bool((last.amax(0) < page - 1e-3).any())  # and here they tighten it


def test_cli_reports_every_score(tmp_path):
    out, js = tmp_path / "s.md", tmp_path / "s.json"
    subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "selection", "--context", "1024", "--items", "1",
                    "--budgets", "512", "--threads", "2", "--out", str(out), "--json-out", str(js)],
                   capture_output=True, text=True, timeout=900, check=True)
    res = json.loads(js.read_text())
    rows = {r["score"]: r for r in res["rows"]}
    assert set(rows) == {s.value for s in Score}
    assert all(0 <= r["needle_kept"] <= 1 and 0 <= r["dropped_mass"] <= 1 and r["needle_cells"] > 0
               for r in rows.values())
    # no page choice per KV head keeps more of its group's attention than the mass oracle's
    assert rows["oracle-mass"]["dropped_mass"] <= min(r["dropped_mass"] for r in rows.values()) + 1e-6
    assert rows["oracle-max"]["needle_kept"] >= rows["page"]["needle_kept"]
    text = out.read_text()
    assert "hack eval selection --context 1024 --items 1 --budgets 512 --threads 2" in text
    assert "| refine2: `--hack-sparse-refine 2` |" in text
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "selection", "--budgets", "64"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "at least two pages" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "selection", "--scores", "page,groups9"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--scores takes page, box32" in bad.stderr


def test_cli_measures_the_scores_asked_for(tmp_path):
    """--scores: only those rows, each over the same needle cells; the two-level rows at 2,048
    tokens (32 pages in 4 groups of 8; a 256-token budget keeps 3 of them, the first and the
    recent ones among them)."""
    js = tmp_path / "s.json"
    subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "selection", "--context", "2048", "--items", "1",
                    "--budgets", "256", "--threads", "2", "--scores", "page,groups8,refine4,groups8-refine4",
                    "--out", "", "--json-out", str(js)], capture_output=True, text=True, timeout=900, check=True)
    rows = {r["score"]: r for r in json.loads(js.read_text())["rows"]}
    assert set(rows) == {"page", "groups8", "refine4", "groups8-refine4"}
    assert all(r["needle_cells"] == rows["page"]["needle_cells"] > 0 for r in rows.values())


def test_study_rows_of_sparse_decode_refined():
    from hack_eval.variants import sparse_variants

    rows = sparse_variants([1024, 2048], ["dequant"], refine=2)
    assert [r.name for r in rows] == ["default, sparse decode 1024 tokens", "default, sparse decode 1024 tokens, refine 2",
                                      "default, sparse decode 2048 tokens", "default, sparse decode 2048 tokens, refine 2"]
    assert [r.sparse.refine for r in rows] == [1, 2, 1, 2] and {r.mode.value for r in rows} == {"dequant"}
    assert len(sparse_variants([1024], None)) == 2  # hack and dequant, no refined row
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "accuracy", "--sparse-refine", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "give --sparse-budgets too" in bad.stderr


def test_study_rows_of_sparse_decode_by_score_refined_only():
    """--sparse-score linear names the score in each row and sets it; --sparse-refined-only keeps
    the refined rows alone; the flags that shape rows a run does not have are refused."""
    from hack_eval.variants import sparse_variants
    from hack_ops.sparse import PageScore

    rows = sparse_variants([1024, 2048], ["dequant"], refine=2, score="linear", refined_only=True)
    assert [r.name for r in rows] == ["default, sparse decode 1024 tokens, linear score, refine 2",
                                      "default, sparse decode 2048 tokens, linear score, refine 2"]
    assert {(r.sparse.score, r.sparse.refine) for r in rows} == {(PageScore.LINEAR, 2)}
    with pytest.raises(ValueError, match="refine > 1"):
        sparse_variants([1024], ["dequant"], refine=1, refined_only=True)
    for argv, message in ((["--no-plain"], "give --bits-plan too"),
                          (["--sparse-score", "linear"], "give --sparse-budgets too"),
                          (["--sparse-budgets", "1024", "--sparse-refined-only"], "give --sparse-refine R > 1")):
        bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "accuracy", *argv],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and message in bad.stderr, (argv, bad.stderr[-400:])
