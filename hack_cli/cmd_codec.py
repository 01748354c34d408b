"""`hack codec calibrate`: the KV exponent codebook of a prepared model (SplitZip codec)."""
from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    from hack_eval.models import DEFAULT_MODEL, MODELS

    p = sub.add_parser("codec", help="the lossless KV transfer codec (SplitZip): calibrate its codebook")
    csub = p.add_subparsers(dest="codec_command", metavar="ACTION")
    csub.required = True
    cal = csub.add_parser(
        "calibrate",
        help="run the prepared model on a few prompts, pick the 16 most frequent KV exponents "
             "(BF16 and FP16) and store them as kv_codebook.json in the model folder")
    cal.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    cal.add_argument("--repeat", type=int, default=4, help="each prompt repeated N times (longer contexts)")
    cal.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from hack_eval.models import prepare
    from hack_ops.codec import codebook as cb
    from hack_ops.codec.format import FloatFormat

    from .codec_kv import DEFAULT_PROMPTS, collect

    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    folder = prepare(args.name, log=lambda m: print(m, file=sys.stderr))
    kv = collect(folder, repeat=args.repeat)
    tensors = [t for pair in kv for t in pair]
    books = {f: cb.calibrate(tensors, f) for f in FloatFormat}
    out = folder / cb.FILE_NAME
    cb.CodebookSet(books, f"calibrated ({out.name})").save(out, meta={
        "model": args.name, "prompts": len(DEFAULT_PROMPTS), "repeat": args.repeat,
        "tokens": int(kv[0][0].shape[0]), "date": time.strftime("%Y-%m-%d")})
    for f, b in books.items():
        print(f"{f.name}: exponents {list(b.exponents)} (id {b.ident:08x})", file=sys.stderr)
    print(out)
    return 0
