"""`hack eval size`, `accuracy`, `retrieval`, `selection`, `recall`, `fidelity` and `layers`."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from engine.args import LAYER_SPEC_METAVAR, layer_list
from hack_eval.models import MODELS
from hack_ops.rotation import Rotation
from hack_ops.sparse import PageScore

from .server_methods import METHOD_NAMES as SERVED_METHODS

# hack_eval.attention_paths.AttentionPath's values (that module imports torch, which `hack --help`
# should not wait for; tests/test_eval_attention_paths.py checks they agree).
ATTENTION_PATHS = ("fast", "reference")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="bytes and accuracy of the KV formats on the real model")
    esub = p.add_subparsers(dest="eval_command", metavar="WHAT")
    esub.required = True

    size = esub.add_parser("size", help="bytes per token per layer for a model vs BF16")
    size.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    size.add_argument("--context", type=int, default=2048, help="tokens per request (default 2048)")
    size.add_argument("--json", action="store_true", help="print one JSON object")
    size.set_defaults(func=_size)

    acc = esub.add_parser("accuracy", help="the accuracy study (perplexity, KL, top-1, generation)")
    acc.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    acc.add_argument("--context", type=int, default=2048)
    acc.add_argument("--essays", type=int, default=3, help="essay windows (default 3)")
    acc.add_argument("--plays", type=int, default=3, help="Shakespeare windows (default 3)")
    acc.add_argument("--gen-prompts", type=int, default=5, help="HumanEval prompts for generation")
    acc.add_argument("--gen-tokens", type=int, default=48, help="greedy tokens per prompt")
    acc.add_argument("--quick", action="store_true", help="three variants only (a smoke run)")
    acc.add_argument("--core", action="store_true", help="the rows that carry the decisions only")
    acc.add_argument("--variants", default=None, metavar="PATTERNS",
                     help="comma-separated patterns: instead of --quick/--core, the rows of the full "
                          "study whose name or config label contains one (plus the exact baseline); "
                          "'=NAME' matches a whole name (a comma followed by a space is part of a name); e.g. "
                          "--variants 'rotation,=default, 4-bit K/V'")
    acc.add_argument("--modes", default=None, metavar="MODES",
                     help="with --variants: keep only the rows in these attention modes (hack, dequant; "
                          "comma-separated), e.g. --variants =default --modes hack")
    _add_layer_bits_flag(acc)
    acc.add_argument("--bits-plan", action="store_true",
                     help="score exactly three rows instead of a selection: exact, the plain 2-bit default and the "
                          "default with the model's calibrated bit plan (what a server's --hack-bits auto loads; "
                          "`hack calibrate`), in the --modes given (default hack); with --sparse-budgets, the plan's "
                          "format under sparse decode as well")
    acc.add_argument("--plan-file", action="append", default=[], metavar="PLAN.json",
                     help="with --bits-plan: also score the default with the bit plan in this file (measured for "
                          "the same model; e.g. an earlier calibration), in the same modes; repeatable")
    acc.add_argument("--sparse-budgets", default=None, metavar="TOKENS[,TOKENS]",
                     help="also score the default format under sparse decode at these token budgets (the server's "
                          "--hack-sparse-budget): every position reads the closed pages its own selection keeps, "
                          "as a decode step would; 'dequant' rows on the fast path, 'hack' rows on the reference "
                          "(slow past 2K: e.g. --variants =default --modes dequant)")
    acc.add_argument("--sparse-refine", type=int, default=1, metavar="R",
                     help="with --sparse-budgets: each budget also with the selection refined (the server's "
                          "--hack-sparse-refine R; default 1: no refined rows)")
    acc.add_argument("--sparse-refined-only", action="store_true",
                     help="with --sparse-refine R > 1: score only the refined rows, not the budgets' unrefined ones")
    acc.add_argument("--sparse-score", choices=[s.value for s in PageScore], default=PageScore.BOUND.value,
                     help="how the --sparse-budgets rows rank pages (the server's --hack-sparse-score): 'bound' "
                          "(default) or MPCache's 'linear' stand-in")
    acc.add_argument("--no-plain", action="store_true",
                     help="with --bits-plan: leave out the plain 2-bit row (exact and the plan's rows only)")
    _add_report_flags(acc, "accuracy")
    acc.set_defaults(func=_accuracy)

    ret = esub.add_parser("retrieval", help="passkey retrieval from long essay documents: exact match "
                                            "of exact, hack and dequant on the same items")
    ret.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    ret.add_argument("--contexts", default="4096,8192",
                     help="comma-separated prompt lengths in tokens (default 4096,8192)")
    ret.add_argument("--items", type=int, default=50, help="items per context (default 50)")
    ret.add_argument("--seed", type=int, default=0, help="seed of keys and haystacks (default 0)")
    ret.add_argument("--variants", default="=default", metavar="PATTERNS",
                     help="rows of the accuracy study to score besides exact, as for `hack eval accuracy "
                          "--variants` (default '=default': the default format, hack and dequant)")
    ret.add_argument("--modes", default=None, metavar="MODES",
                     help="keep only the rows in these attention modes (hack, dequant; comma-separated)")
    ret.add_argument("--needle-attention", action="store_true",
                     help="also report, per layer, how much attention the exact model's answer positions put "
                          "on the needle sentence (where its retrieval heads are)")
    _add_layer_bits_flag(ret)
    ret.add_argument("--bits-plan", action="store_true",
                     help="score exact and the default with the model's calibrated bit plan (what a server's "
                          "--hack-bits auto loads) instead of --variants, in the --modes given (default hack)")
    ret.add_argument("--static-keep", default=None, metavar="FRACTION[,FRACTION]",
                     help="also score each 'dequant' row under look-once static eviction at these fractions of the "
                          "prompt's closed pages kept (the prompt's last queries choose them; every decode step "
                          "reads only those, and PD would send only those), with the wire bytes it leaves")
    ret.add_argument("--static-unit", default="page", metavar="page|head[,...]",
                     help="with --static-keep: what is kept or dropped together: page (a layer's page for all its "
                          "KV heads, what the wire can leave out; default) or head (each KV head its own pages)")
    ret.add_argument("--static-observe", type=float, default=0.01, metavar="FRACTION",
                     help="with --static-keep: the prompt's last fraction of queries that vote (default 0.01: "
                          "the question at the end of a 4K prompt; MPCache's 0.15 loses pass keys)")
    ret.add_argument("--served", default=None, metavar="METHODS",
                     help="instead of the study's rows, ask real servers, one per KV method (comma-separated, of "
                          f"{', '.join(SERVED_METHODS)}; hack-4bit-layers takes --4bit-layers), each answer "
                          "decoded greedily by the server")
    ret.add_argument("--budget-mb", type=float, default=256.0, help="with --served: the KV budget of every server")
    ret.add_argument("--items-digest", action="store_true",
                     help="only print, per context, the hash of the items --model/--contexts/--items/--seed build "
                          "(the items_digest a run's JSON records; equal digests: the same questions), and exit; "
                          "loads the tokenizer alone")
    _add_report_flags(ret, "retrieval")
    ret.set_defaults(func=_retrieval)

    sel = esub.add_parser("selection", help="where sparse decode's page selection puts a pass key: per score and "
                                            "budget, how often the needle's page is read and how much exact "
                                            "attention the dropped pages held (the exact model's own q and K)")
    sel.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    sel.add_argument("--context", type=int, default=4096, help="prompt length in tokens (default 4096)")
    sel.add_argument("--items", type=int, default=20, help="pass-key items (default 20)")
    sel.add_argument("--seed", type=int, default=0, help="seed of keys and haystacks (default 0)")
    sel.add_argument("--budgets", default="1024,2048", metavar="TOKENS[,TOKENS]",
                     help="sparse budgets in tokens (the server's --hack-sparse-budget; default 1024,2048)")
    sel.add_argument("--scores", default=None, metavar="SCORE[,SCORE]",
                     help="the selections to measure (default: all), of page, box32, box16, linear, refine2, "
                          "refine4, groups8, groups8-refine4, oracle-max, oracle-mass")
    _add_report_flags(sel, "selection", attention_path=False)
    sel.set_defaults(func=_selection)

    rec = esub.add_parser("recall", help="recall of a passage read ~700 tokens earlier, through real servers: "
                                         "each method's greedy continuation against BF16's")
    rec.add_argument("--model", default="gemma3", help=f"model name ({', '.join(MODELS)}; prepared once)")
    rec.add_argument("--served", default="bf16,hack", metavar="METHODS",
                     help="KV methods, one server each (comma-separated, of "
                          f"{', '.join(SERVED_METHODS)}; bf16, the reference, is always run)")
    rec.add_argument("--prompts", type=int, default=6, help="recall prompts (default 6)")
    rec.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    rec.add_argument("--budget-mb", type=float, default=128.0, help="the KV budget of every server (default 128)")
    rec.add_argument("--4bit-layers", dest="four_bit_layers", type=layer_list, default=None, metavar=LAYER_SPEC_METAVAR,
                     help="the layers the hack-4bit-layers method holds at 4 bits (the server's --hack-4bit-layers: "
                          "indices, or 'full', 'auto', 'none' resolved from the model's config)")
    rec.add_argument("--4bit-tensors", dest="four_bit_tensors", default="kv", metavar="kv|k|v",
                     help="which tensors of those layers: kv (default), k or v (the server's --hack-4bit-tensors)")
    rec.add_argument("--out", default=None, help="markdown report ('' = none; default docs/study/recall-MODEL.md)")
    rec.add_argument("--json-out", default=None, help="raw results ('' = none; default docs/study/recall-MODEL.json)")
    rec.set_defaults(func=_recall)

    fid = esub.add_parser("fidelity", help="prefill fidelity through real servers: each method's greedy "
                                           "continuation of ShareGPT turns against BF16's")
    fid.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    fid.add_argument("--served", default="bf16,hack-homomorphic-prefill,hack-exact-prefill,hack-dense-prefill",
                     metavar="METHODS", help="KV methods, one server each (comma-separated, of "
                                             f"{', '.join(SERVED_METHODS)}; bf16, the reference, always runs)")
    fid.add_argument("--prompts", type=int, default=6, help="ShareGPT first turns of 256-2048 tokens (default 6)")
    fid.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    fid.add_argument("--budget-mb", type=float, default=256.0, help="the KV budget of every server (default 256)")
    fid.add_argument("--out", default=None, help="markdown report ('' = none; default docs/study/fidelity-MODEL.md)")
    fid.add_argument("--json-out", default=None, help="raw results ('' = none; default docs/study/fidelity-MODEL.json)")
    fid.set_defaults(func=_fidelity)

    lay = esub.add_parser("layers", help="where the 2-bit error sits: each layer alone, K against V "
                                         "(dequant mode, teacher-forced over the study's windows)")
    lay.add_argument("--model", default="smollm2", help=f"model name ({', '.join(MODELS)}; prepared once)")
    lay.add_argument("--context", type=int, default=2048)
    lay.add_argument("--essays", type=int, default=1, help="essay windows (default 1)")
    lay.add_argument("--plays", type=int, default=1, help="Shakespeare windows (default 1)")
    _add_report_flags(lay, "layers", attention_path=False)
    lay.set_defaults(func=_layers)


def _add_layer_bits_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--4bit-layers", dest="four_bit_layers", type=layer_list, default=None, metavar=LAYER_SPEC_METAVAR,
                        help="also score the default format with these 0-based layers at 4 bits (the ones "
                             "`hack eval layers` ranks first, or 'full': the model's layers without a sliding "
                             "window, 'auto': the server's default set, 'none': no row; the server's "
                             "--hack-4bit-layers), in hack and dequant mode or those --modes names")
    parser.add_argument("--4bit-tensors", dest="four_bit_tensors", default="kv", metavar="kv|k|v[,..]",
                        help="which tensors of the --4bit-layers rows take 4 bits: 'kv' (K and V, default), 'k' "
                             "(K alone, V stays at 2 bits: fewer bytes), 'v' (V alone), or several, e.g. 'kv,k', "
                             "for a row of each (the server's --hack-4bit-tensors)")
    parser.add_argument("--4bit-rotation", dest="four_bit_rotation", default="none",
                        choices=[r.value for r in Rotation],
                        help="the --4bit-layers rows with this K/V rotation as well (default none; e.g. "
                             "hadamard_kv, the study's best 2-bit option; the server's --hack-rotation)")


def _add_report_flags(parser: argparse.ArgumentParser, stem: str, attention_path: bool = True) -> None:
    """--threads, --attention-path and where a study writes its report and raw results
    (--out, --json-out; default report_stem)."""
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    if attention_path:
        parser.add_argument("--attention-path", choices=ATTENTION_PATHS, default="fast",
                            help="where each layer's attention runs: 'fast' (default: exact and dequant in query "
                                 "blocks, hack on the serving store and extend kernel, all held to the reference "
                                 "by the tests) or 'reference' (hack_ops.attention on every query at once: minutes "
                                 "per 2K window, out of memory at 8K); rows the fast paths cannot compute run on "
                                 "the reference either way")
    parser.add_argument("--out", default=None,
                        help=f"markdown report to write ('' = none; default docs/study/{stem}-MODEL-CONTEXTS.md, "
                             "e.g. docs/study/" + stem + "-smollm2-4k.md; the curated docs/accuracy.md is never "
                             "written)")
    parser.add_argument("--json-out", default=None,
                        help=f"raw results ('' = none; default docs/study/{stem}-MODEL-CONTEXTS.json)")


def context_label(tokens: int) -> str:
    """'2k' for 2048, '8k' for 8192, '4000' for 4000: the context part of a report's name."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def report_stem(stem: str, model: str, contexts: list[int]) -> str:
    """Where a study run writes by default (without suffix): docs/study/STEM-MODEL-CONTEXTS, so
    runs of other models or contexts never overwrite one another or a curated doc (no contexts:
    docs/study/STEM-MODEL)."""
    return f"docs/study/{stem}-{model}" + "".join("-" + context_label(c) for c in contexts)


def _write_reports(args: argparse.Namespace, stem: str, contexts: list[int], results: dict, text: str) -> None:
    """Write the report and the raw results where --out/--json-out say (default: report_stem;
    '' writes none), then print the report."""
    from hack_eval.accuracy import save

    base = report_stem(stem, args.model, contexts)
    out = f"{base}.md" if args.out is None else args.out
    json_out = f"{base}.json" if args.json_out is None else args.json_out
    if json_out:
        save(results, Path(json_out))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)


def _size(args: argparse.Namespace) -> int:
    from hack_eval.size import size_table

    rows = size_table(args.model, args.context)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'format':<58} {'bytes/token/layer':>18} {'vs BF16':>8}")
    for r in rows:
        print(f"{r['format']:<58} {r['bytes_per_token_layer']:>18.1f} {r['ratio'] * 100:>7.2f}%")
    return 0


def _accuracy(args: argparse.Namespace) -> int:
    from hack_eval.accuracy import run_study
    from hack_eval.report import render

    if args.context < 2 or args.essays < 0 or args.plays < 0 or args.essays + args.plays == 0:
        raise ValueError("need a context of at least 2 tokens and at least one window")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.plan_file and not args.bits_plan:
        raise ValueError("--plan-file adds rows to --bits-plan's; give --bits-plan too")
    if args.no_plain and not args.bits_plan:
        raise ValueError("--no-plain leaves a row out of --bits-plan's; give --bits-plan too")
    if args.sparse_score != PageScore.BOUND.value and not args.sparse_budgets:
        raise ValueError("--sparse-score ranks the --sparse-budgets rows' pages; give --sparse-budgets too")
    if args.bits_plan:
        if args.variants or args.quick or args.core or args.four_bit_layers:
            raise ValueError("--bits-plan scores its own three rows (and --sparse-budgets' rows over the plan); "
                             "drop --variants/--quick/--core/--4bit-layers")
        rows = _plan_variants(args.model, _csv(args.modes), plain=not args.no_plain,
                              sparse_budgets=_sparse_budgets(args), sparse_refine=_sparse_refine(args),
                              plan_files=args.plan_file, sparse_score=args.sparse_score,
                              sparse_refined_only=args.sparse_refined_only)
        res = run_study(context=args.context, essays=args.essays, plays=args.plays, gen_prompts=args.gen_prompts,
                        gen_tokens=args.gen_tokens, threads=args.threads, log=log, model_name=args.model,
                        path=args.attention_path, variants=rows)
        _write_reports(args, "accuracy", [args.context], res, render(res, _rerun_command("accuracy")))
        return 0
    res = run_study(context=args.context, essays=args.essays, plays=args.plays,
                    gen_prompts=args.gen_prompts, gen_tokens=args.gen_tokens,
                    quick=args.quick, core=args.core, threads=args.threads, log=log, model_name=args.model,
                    variant_patterns=_patterns(args.variants), modes=_csv(args.modes),
                    path=args.attention_path, four_bit_layers=_layer_indices(args),
                    raised=_raised(args), four_bit_rotation=_four_bit_rotation(args),
                    sparse_budgets=_sparse_budgets(args), sparse_refine=_sparse_refine(args),
                    sparse_score=args.sparse_score, sparse_refined_only=args.sparse_refined_only)
    _write_reports(args, "accuracy", [args.context], res, render(res, _rerun_command("accuracy")))
    return 0


def _plan_variants(model: str, modes: list[str] | None, plain: bool = True,
                   sparse_budgets: tuple[int, ...] = (), sparse_refine: int = 1,
                   plan_files: list[str] | tuple[str, ...] = (), sparse_score: str = "bound",
                   sparse_refined_only: bool = False) -> list:
    """exact, the plain default (unless not `plain`) and the default with the model's bit plan, in
    `modes` (default hack), and with each plan of `plan_files` (ValueError where one was measured
    on other weights); with sparse_budgets, the plan's format under sparse decode at each budget
    too (refined as well with sparse_refine > 1, or only refined with sparse_refined_only; pages
    ranked by sparse_score), in the same modes."""
    from hack_eval.models import prepare
    from hack_eval.runner import EXACT, Variant
    from hack_eval.variants import sparse_variants
    from hack_ops import HackConfig
    from hack_ops.bit_plan import find_plan, load_plan, model_hash

    folder = prepare(model, log=lambda *a, **k: None)
    found = find_plan(folder)
    if found is None:
        raise ValueError(f"no bit plan for {model} ({folder}); `hack calibrate {model}` writes one")
    plan, _ = found
    others = []
    for path in plan_files:
        other = load_plan(path)
        if other.model_hash != model_hash(folder):
            raise ValueError(f"--plan-file {path} was measured for model {other.short_hash}, not {model} "
                             f"({plan.short_hash})")
        others.append((Path(path).name, other))
    rows = [EXACT]
    for mode in modes or ["hack"]:
        rows += [Variant("default, plain 2-bit", mode.strip(), HackConfig())] if plain else []
        rows += [Variant("default, calibrated bit plan", mode.strip(), plan.apply(HackConfig()))]
        rows += [Variant(f"default, bit plan {name}", mode.strip(), other.apply(HackConfig())) for name, other in others]
    if sparse_budgets:
        rows += sparse_variants(sparse_budgets, modes or ["hack"], sparse_refine, base=plan.apply(HackConfig()),
                                name="default, calibrated bit plan", score=sparse_score,
                                refined_only=sparse_refined_only)
    return rows


def _sparse_budgets(args: argparse.Namespace) -> tuple[int, ...]:
    """--sparse-budgets as positive token counts (ValueError naming the flag otherwise)."""
    text = getattr(args, "sparse_budgets", None)
    if not text:
        return ()
    try:
        budgets = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--sparse-budgets takes comma-separated token counts, got {text!r}") from None
    if not budgets or min(budgets) <= 0:
        raise ValueError(f"--sparse-budgets takes positive token counts, got {text!r}")
    return budgets


def _sparse_refine(args: argparse.Namespace) -> int:
    """--sparse-refine, checked: positive, and only beside --sparse-budgets."""
    r = args.sparse_refine
    if getattr(args, "sparse_refined_only", False) and r <= 1:
        raise ValueError("--sparse-refined-only keeps the refined rows: give --sparse-refine R > 1")
    if r < 1:
        raise ValueError(f"--sparse-refine takes a positive count of candidates per page, got {r}")
    if r > 1 and not args.sparse_budgets:
        raise ValueError("--sparse-refine refines the --sparse-budgets rows; give --sparse-budgets too")
    return r


def _layer_indices(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--4bit-layers as indices: a set's name ('full') read from the model's config."""
    from engine.layer_sets import LayerSet, resolve_for_model_path
    from hack_eval.models import prepare

    if not isinstance(args.four_bit_layers, LayerSet):
        return args.four_bit_layers
    return resolve_for_model_path(args.four_bit_layers, str(prepare(args.model, log=lambda *a, **k: None)))


def _raised(args: argparse.Namespace) -> tuple:
    """--4bit-tensors as RaisedTensors (ValueError naming the choices for another word, or for a
    value other than 'kv' without --4bit-layers, where it would change no row)."""
    from hack_ops.config import RaisedTensors, raised_tensors

    raised = tuple(raised_tensors(t.strip()) for t in args.four_bit_tensors.split(",") if t.strip())
    if not raised:
        raise ValueError("--4bit-tensors needs kv, k or v (or several, comma-separated)")
    if not args.four_bit_layers and raised != (RaisedTensors.KV,):
        raise ValueError(f"--4bit-tensors {args.four_bit_tensors} says which tensors of the --4bit-layers rows take "
                         "4 bits; give --4bit-layers too")
    return raised


def _four_bit_rotation(args: argparse.Namespace) -> Rotation:
    """--4bit-rotation, refused without --4bit-layers (it would change no row)."""
    rotation = Rotation(args.four_bit_rotation)
    if rotation is not Rotation.NONE and not args.four_bit_layers:
        raise ValueError(f"--4bit-rotation {rotation.value} rotates the --4bit-layers rows; give --4bit-layers too")
    return rotation


def _patterns(value: str | None) -> list[str] | None:
    """--variants as its patterns (None when the flag was not given); names keep their ', '."""
    from hack_eval.variants import split_patterns

    return None if value is None else split_patterns(value)


def _csv(value: str | None) -> list[str] | None:
    """A comma-separated flag as its items (None when the flag was not given)."""
    return None if value is None else value.split(",")


def _rerun_command(what: str) -> str:
    """The command to rerun, without where this run wrote its files."""
    argv, shown, skip = sys.argv[3:], [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--json-out"):
            skip = True
        elif not a.startswith(("--out=", "--json-out=")):
            shown.append(a)
    return (f"hack eval {what} " + " ".join(shlex.quote(a) for a in shown)).strip()


def _recall(args: argparse.Namespace) -> int:
    from .recall_served import render_recall, run_served_recall

    raised = _raised(args)
    if len(raised) != 1:
        raise ValueError("--4bit-tensors: give one value (one hack-4bit-layers server)")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run_served_recall(args.model, _csv(args.served), prompts=args.prompts, n_new=args.tokens,
                            four_bit_layers=_layer_indices(args), raised=raised[0].value, budget_mb=args.budget_mb,
                            log=log)
    _write_reports(args, "recall", [], res, render_recall(res, _rerun_command("recall")))
    return 0


def _fidelity(args: argparse.Namespace) -> int:
    from .fidelity_served import render_fidelity, run_served_fidelity

    if args.prompts < 1 or args.tokens < 1:
        raise ValueError("need at least one prompt and one new token")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run_served_fidelity(args.model, _csv(args.served), prompts=args.prompts, n_new=args.tokens,
                              budget_mb=args.budget_mb, log=log)
    _write_reports(args, "fidelity", [], res, render_fidelity(res, _rerun_command("fidelity")))
    return 0


def _retrieval(args: argparse.Namespace) -> int:
    from hack_eval.retrieval import render_retrieval, run_study_retrieval

    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    if not contexts or min(contexts) < 64 or args.items < 1:
        raise ValueError("need contexts of at least 64 tokens and at least one item per context")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.items_digest:
        from hack_eval.models import prepare
        from hack_eval.retrieval import build_items, items_digest
        from hack_eval.workloads import tokenizer

        tok = tokenizer(prepare(args.model, log=log))
        print(json.dumps(items_digest(build_items(tok, contexts, args.items, args.seed))))
        return 0
    if args.served is not None:
        from .retrieval_served import run_served_retrieval

        if args.needle_attention:
            raise ValueError("--needle-attention reads the HF model's attention; it does not combine with --served")
        if Rotation(args.four_bit_rotation) is not Rotation.NONE:
            raise ValueError("--4bit-rotation rotates the study's --4bit-layers rows; --served measures servers "
                             "(start one with --hack-rotation instead)")
        if args.bits_plan or args.static_keep:
            raise ValueError("--bits-plan and --static-keep choose the study's rows; --served measures servers "
                             "(hack is the calibrated plan already)")
        raised = _raised(args)
        if len(raised) != 1:
            raise ValueError("--served starts one hack-4bit-layers server: give one --4bit-tensors value")
        res = run_served_retrieval(args.model, contexts, args.items, _csv(args.served), seed=args.seed,
                                   four_bit_layers=_layer_indices(args), budget_mb=args.budget_mb, log=log,
                                   raised=raised[0].value)
        _write_reports(args, "retrieval", contexts, res, render_retrieval(res, _rerun_command("retrieval")))
        return 0
    static = _static_keeps(args)
    variants = None
    if args.bits_plan:
        if args.variants != "=default" or args.four_bit_layers:
            raise ValueError("--bits-plan scores its own rows (exact and the calibrated plan); "
                             "drop --variants/--4bit-layers")
        variants = _plan_variants(args.model, _csv(args.modes), plain=False)
    res = run_study_retrieval(model_name=args.model, contexts=contexts, per_cell=args.items, seed=args.seed,
                              variant_patterns=_patterns(args.variants), threads=args.threads, log=log,
                              modes=_csv(args.modes), path=args.attention_path,
                              four_bit_layers=_layer_indices(args), needle=args.needle_attention,
                              raised=_raised(args), four_bit_rotation=_four_bit_rotation(args),
                              variants=variants, static=static)
    _write_reports(args, "retrieval", contexts, res, render_retrieval(res, _rerun_command("retrieval")))
    return 0


def _static_keeps(args: argparse.Namespace) -> tuple:
    """--static-keep x --static-unit as StaticKeep rows (ValueError naming the flag otherwise)."""
    from hack_ops.static_keep import KeepUnit, StaticKeep

    if not args.static_keep:
        if args.static_unit != "page" or args.static_observe != 0.01:
            raise ValueError("--static-unit and --static-observe shape the --static-keep rows; give --static-keep too")
        return ()
    try:
        keeps = [float(x) for x in args.static_keep.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--static-keep takes comma-separated fractions, got {args.static_keep!r}") from None
    units = [u.strip() for u in args.static_unit.split(",") if u.strip()]
    for u in units:
        if u not in {k.value for k in KeepUnit}:
            raise ValueError(f"--static-unit takes {', '.join(k.value for k in KeepUnit)}, got {u!r}")
    if not keeps or not units or not all(0.0 < f < 1.0 for f in keeps):
        raise ValueError(f"--static-keep takes fractions strictly between 0 and 1, got {args.static_keep!r}")
    if not 0.0 < args.static_observe <= 1.0:
        raise ValueError(f"--static-observe takes a fraction in (0, 1], got {args.static_observe!r}")
    return tuple(StaticKeep(keep=f, observe=args.static_observe, unit=u) for f in keeps for u in units)


def _selection(args: argparse.Namespace) -> int:
    from hack_eval.selection import render_selection, run_selection

    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    if args.context < 256 or args.items < 1 or not budgets or min(budgets) < 128:
        raise ValueError("need a context of at least 256 tokens, at least one item and budgets of at least two pages")
    from hack_eval.selection import Score

    names = [x.strip() for x in (args.scores or "").split(",") if x.strip()]
    unknown = [x for x in names if x not in {k.value for k in Score}]
    if unknown:
        raise ValueError(f"--scores takes {', '.join(k.value for k in Score)}, got {', '.join(unknown)}")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run_selection(args.model, args.context, args.items, budgets, seed=args.seed, threads=args.threads, log=log,
                        scores=[Score(x) for x in names] or None)
    _write_reports(args, "selection", [args.context], res, render_selection(res, _rerun_command("selection")))
    return 0


def _layers(args: argparse.Namespace) -> int:
    from hack_eval.layers import render_layers, run_layer_sweep

    if args.context < 2 or args.essays < 0 or args.plays < 0 or args.essays + args.plays == 0:
        raise ValueError("need a context of at least 2 tokens and at least one window")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run_layer_sweep(args.model, args.context, args.essays, args.plays, threads=args.threads, log=log)
    _write_reports(args, "layers", [args.context], res, render_layers(res, _rerun_command("layers")))
    return 0
