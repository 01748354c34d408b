"""`hack calibrate MODEL`: measure a model's per-layer, per-head sensitivity to 2-bit K and V
and write its bit plan beside the model folder (hack_eval.calibrate), where `--hack-bits auto`
finds it."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from hack_eval.calibration_text import CalibrationText
    from hack_eval.models import MODELS
    from hack_ops.rotation import ROTATION_AUTO, Rotation

    p = sub.add_parser("calibrate", help="measure where a model's 2-bit error and retrieval sit and write its "
                                         "bit plan (which layers' K and V are 4-bit) for --hack-bits auto")
    p.add_argument("model", help=f"a model name ({', '.join(MODELS)}; prepared once) or an HF model folder")
    p.add_argument("--budget", type=float, default=0.20,
                   help="the plan's bytes per token as a fraction of BF16's (default 0.20)")
    p.add_argument("--budget-context", type=int, default=4096,
                   help="the context the budget is counted at, tails and sinks included (default 4096)")
    p.add_argument("--context", type=int, default=2048, help="tokens per calibration item (default 2048)")
    p.add_argument("--items", type=int, default=3, help="calibration items (default 3: one of each kind of --text mix)")
    p.add_argument("--text", choices=[t.value for t in CalibrationText], default=CalibrationText.MIX.value,
                   help="the items' haystack: 'mix' (default: held-out Shakespeare plays, ShareGPT conversations "
                        "and GSM8K problems, item by item in turn), or one of them alone; no evaluation reads "
                        "any of it")
    p.add_argument("--rotation", choices=[ROTATION_AUTO, *(r.value for r in Rotation)], default=ROTATION_AUTO,
                   help="the rotation the plan's codes are taken under: 'auto' (default) scores the plan with "
                        "and without the Walsh-Hadamard rotation of K and V on the same items and keeps it where "
                        "it takes >= 10%% of the KL away and finds as many codes (a server's --hack-rotation auto "
                        "then applies it); or the rotation named, taken as given and measured")
    p.add_argument("--layers-from", metavar="PLAN.json", default=None,
                   help="keep this earlier plan's layers (same weights) and run only the rotation step and the "
                        "check on them: minutes instead of the rounds' half hour on this CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None,
                   help="folder to write the plan into (default: the model folder, where servers look first)")
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from hack_eval.calibrate import CalibrationSettings, calibrate, render
    from hack_eval.models import MODELS, prepare
    from hack_ops.bit_plan import load_plan

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if args.model in MODELS:
        folder, name = prepare(args.model, log=log), args.model
    else:
        folder = Path(args.model)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is neither a known model ({', '.join(MODELS)}) nor an HF model folder")
        name = folder.name
    settings = CalibrationSettings(context=args.context, items=args.items, budget_fraction=args.budget,
                                   budget_context=args.budget_context, seed=args.seed, threads=args.threads,
                                   text=args.text, rotation=args.rotation)
    command = "hack " + " ".join(shlex.quote(a) for a in getattr(args, "argv", ["calibrate", args.model]))
    layers_from = load_plan(args.layers_from) if args.layers_from else None
    plan = calibrate(folder, name, settings, command=command, log=log, layers_from=layers_from)
    out = Path(args.out) if args.out else folder
    out.mkdir(parents=True, exist_ok=True)
    path = plan.write(out)
    print(render(plan))
    print(path)
    return 0
