"""JCT against link rate, per KV method, from a `hack bench disagg` result (a PNG for the docs).

`hack bench disagg --rates 50,100,... --plot FILE` draws it after the run; `hack bench plot
--json RESULT --out FILE` redraws it from a saved result. The rate where BF16 catches up with a
compressed method is where their mean JCT curves cross (interpolated on a log rate axis between
the two measured rates that bracket the crossing)."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def jct_by_rate(result: dict, method: str) -> list[tuple[float, float]]:
    """(link Mbit/s, mean JCT s) of one method's measured points, by rate."""
    pts = [(float(p["link_mbps"]), p["jct_s"]["mean"]) for p in result["points"]
           if p["method"] == method and p.get("jct_s", {}).get("mean") is not None]
    return sorted(pts)


def catch_up_rate(result: dict, method: str, base: str = "bf16") -> float | None:
    """Lowest link rate from which `base`'s mean JCT is no longer above `method`'s.

    None when `base` is slower at every measured rate (or there are no common rates); the
    lowest measured rate when `base` is already as fast there."""
    a, b = dict(jct_by_rate(result, method)), dict(jct_by_rate(result, base))
    rates = sorted(set(a) & set(b))
    if not rates:
        return None
    gap = [b[r] - a[r] for r in rates]  # > 0: base is slower
    if gap[0] <= 0:
        return rates[0]
    for (r0, g0), (r1, g1) in zip(zip(rates, gap), zip(rates[1:], gap[1:])):
        if g1 <= 0:
            x0, x1 = math.log(r0), math.log(r1)
            return math.exp(x0 + (x1 - x0) * g0 / (g0 - g1))
    return None


def plot(result: dict, path: Path) -> Path:
    """Draw mean JCT (with p50..p99 as a band) against the link rate, one line per method."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    methods = [m for m in result["methods"] if jct_by_rate(result, m)]
    for m in methods:
        pts = [p for p in result["points"] if p["method"] == m and p["jct_s"].get("mean") is not None]
        pts.sort(key=lambda p: p["link_mbps"])
        x = [p["link_mbps"] for p in pts]
        ax.plot(x, [p["jct_s"]["mean"] for p in pts], marker="o", label=m)
        lo = [p["jct_s"].get("p50") for p in pts]
        hi = [p["jct_s"].get("p99") for p in pts]
        if None not in lo and None not in hi:
            ax.fill_between(x, lo, hi, alpha=0.12)
    for m in methods:
        if m == "bf16":
            continue
        r = catch_up_rate(result, m)
        if r is not None and r > min(result["rates_mbps"]):
            ax.axvline(r, linestyle=":", color="grey")
            ax.annotate(f"bf16 catches {m} at ~{r:,.0f} Mbit/s", (r, ax.get_ylim()[1]),
                        textcoords="offset points", xytext=(4, -14), fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s, log scale)")
    ax.set_ylabel("mean JCT (s); band: p50 to p99")
    ax.set_title(f"JCT against link rate: workload {result['workload']}, {result['requests']} "
                 f"requests per point ({result.get('date', '')})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_lines(result: dict) -> list[str]:
    out = []
    for m in result["methods"]:
        if m == "bf16" or not jct_by_rate(result, m):
            continue
        r = catch_up_rate(result, m)
        lo, hi = min(result["rates_mbps"]), max(result["rates_mbps"])
        if r is None:
            out.append(f"bf16 stays slower than `{m}` at every measured rate ({lo:g}-{hi:g} Mbit/s)")
        elif r <= lo:
            out.append(f"bf16 is already as fast as `{m}` at {lo:g} Mbit/s")
        else:
            out.append(f"bf16 catches up with `{m}` at ~{r:,.0f} Mbit/s")
    return out


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("plot", help="draw JCT against link rate (PNG) from a `hack bench disagg` JSON")
    p.add_argument("--json", required=True, help="a result written by `hack bench disagg --out`")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    src = Path(args.json)
    if not src.is_file():
        raise ValueError(f"--json {src}: no such file (write one with `hack bench disagg --out`)")
    result = json.loads(src.read_text())
    if "points" not in result or "methods" not in result:
        raise ValueError(f"--json {src}: not a `hack bench disagg` result (no points/methods)")
    print(plot(result, Path(args.out)))
    for line in summary_lines(result):
        print(line)
    return 0


def run_default(args: argparse.Namespace) -> int:
    return 0  # `hack bench all` has nothing to draw without a sweep result
