"""Entry point of the `hack` console script: assembles the subcommands of each area."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

# Each module defines register(subparsers) and sets `func` on the parsers it adds.
COMMAND_MODULES = [
    "hack_cli.cmd_model",
    "hack_cli.cmd_eval",
    "hack_cli.cmd_calibrate",
    "hack_cli.cmd_bench",
    "hack_cli.cmd_dashboard",
    "hack_cli.cmd_cluster",
    "hack_cli.cmd_serve",
    "hack_cli.cmd_codec",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hack",
        description="sglang-hack: HACK 2-bit homomorphic KV cache for SGLang (PD disaggregation).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _sigterm_as_interrupt(signum: int, _frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so every command's cleanup (finally blocks that stop the
    # servers it started) runs; commands with their own handling install their own handler.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for the docs' command lines
    old = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"hack {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, old)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
