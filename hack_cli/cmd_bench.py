"""`hack bench ...`: benchmarks (not tests). Each prints ratios against a baseline measured in
the same run and writes its results to a file that the docs quote."""
from __future__ import annotations

import argparse
import importlib

# Each module defines register(bench_subparsers) and a `run_default(args) -> int` used by
# `hack bench all` (which runs every benchmark with its defaults).
BENCH_MODULES: list[str] = [
    "hack_cli.bench_disagg",
    "hack_cli.bench_attention",
    "hack_cli.bench_sparse",
    "hack_cli.bench_serve",
    "hack_cli.bench_codec",
    "hack_cli.bench_rotation",
    "hack_cli.bench_hack_wire",
    "hack_cli.bench_plot",
    "hack_cli.bench_soak",
    "hack_cli.bench_fuzz",
    "hack_cli.bench_restore",
    "hack_cli.bench_tier",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (attention, sparse, serve, disagg, codec, rotation, hack-wire, plot, soak, fuzz, restore-sources, restore, all)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    mods = [importlib.import_module(m) for m in BENCH_MODULES]
    for mod in mods:
        mod.register(bsub)
    p_all = bsub.add_parser("all", help="run every benchmark with its defaults")
    p_all.set_defaults(func=lambda args: _run_all(mods, args))


def _run_all(mods: list, args: argparse.Namespace) -> int:
    if not mods:
        print("no benchmarks are registered yet")
        return 0
    rc = 0
    for mod in mods:
        rc |= int(mod.run_default(args) or 0)
    return rc
