"""`hack model prepare [NAME]`: convert a shipped GGUF once into a cached HF folder."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from hack_eval.models import DEFAULT_MODEL, MODELS

    p = sub.add_parser("model", help="prepare the real models that ship in packages")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    msub.required = True
    prep = msub.add_parser(
        "prepare",
        help="convert the model once into a cached HF folder, verify it by hash, print its path",
    )
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    prep.add_argument("--force", action="store_true", help="convert again even if the cache verifies")
    prep.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from hack_eval.models import prepare

    # Progress goes to stderr so that "$(hack model prepare)" captures only the path.
    path = prepare(args.name, force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(path)
    return 0
