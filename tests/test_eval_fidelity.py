"""`hack eval fidelity` (hack_cli/fidelity_served.py): each server's greedy continuation scored
against BF16's and, where the float32 server ran, against its too. The real servers run in the
docs' quoted runs; here the scoring, the report and the servers' options."""
from __future__ import annotations


def test_fidelity_rows_against_bf16_alone():
    from hack_cli.fidelity_served import fidelity_rows, render_fidelity

    outputs = {"bf16": [[1, 2, 3, 4], [5, 6, 7, 8]], "hack": [[1, 2, 0, 4], [5, 6, 7, 8]]}
    args = {"bf16": ["--attention-backend", "torch_native"], "hack": ["--kv-cache-dtype", "hack"]}
    rows = fidelity_rows(outputs, args, 4)
    assert rows[0]["prefixes"] == [4, 4] and rows[0]["agreement"] == 1.0
    assert rows[1]["prefixes"] == [2, 4] and rows[1]["agreement"] == 0.75
    assert all("agreement_fp32" not in r for r in rows)
    text = render_fidelity({"model": "m", "prompts": 2, "prompt_tokens": [300, 400], "new_tokens": 4,
                            "budget_mb": 256.0, "rows": rows}, "hack eval fidelity")
    assert "| hack | --kv-cache-dtype hack | 2, 4 | 0.75 |\n" in text and "against fp32" not in text


def test_fidelity_rows_against_fp32_as_well():
    """With the fp32 server, every row also says how far it stays from unrounded arithmetic,
    BF16's row included (its first share is BF16 against itself, 1.0)."""
    from hack_cli.fidelity_served import fidelity_rows, render_fidelity
    from hack_cli.server_methods import method_args

    outputs = {"bf16": [[1, 2, 3, 4], [5, 6, 7, 8]], "fp32": [[1, 2, 3, 9], [5, 0, 7, 8]],
               "hack": [[1, 2, 3, 9], [5, 6, 7, 8]]}
    args = {m: method_args(m, None) for m in outputs}
    rows = {r["method"]: r for r in fidelity_rows(outputs, args, 4)}
    assert rows["bf16"]["agreement"] == 1.0 and rows["bf16"]["prefixes_fp32"] == [3, 1]
    assert rows["bf16"]["agreement_fp32"] == 0.5
    assert rows["fp32"]["agreement_fp32"] == 1.0 and rows["fp32"]["agreement"] == 0.5
    assert rows["hack"]["prefixes"] == [3, 4] and rows["hack"]["prefixes_fp32"] == [4, 1]
    text = render_fidelity({"model": "m", "prompts": 2, "prompt_tokens": [300, 400], "new_tokens": 4,
                            "budget_mb": 256.0, "rows": list(rows.values())}, "hack eval fidelity")
    assert "| of the length | of the length, against fp32 |" in text
    assert "| bf16 | --attention-backend torch_native | 4, 4 | 1.00 | 0.50 |" in text


def test_the_fp32_method_is_the_bf16_server_in_float32():
    """fp32 names its dtype (a server that names --dtype keeps it, engine.cpu_dtype) on BF16's
    attention backend, and no HACK option."""
    from hack_cli.server_methods import is_method, method_args

    assert is_method("fp32")
    opts = method_args("fp32", None)
    assert opts[opts.index("--dtype") + 1] == "float32"
    assert opts[opts.index("--attention-backend") + 1] == "torch_native"
    assert "--kv-cache-dtype" not in opts
