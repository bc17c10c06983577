"""The eval room's commands: `draftsmith eval`, `compare` and `layerskip` (their flags: eval/args.py).
Each checks every input before a model loads, so a typo costs seconds, not a target load."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.engine import selfspec
from draftsmith.engine.batched import parse_batch_sizes
from draftsmith.engine.drafts import parse_tree
from draftsmith.eval.args import CompareArgs, EvalArgs, LayerskipArgs
from draftsmith.eval.compare import compare, compare_table
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import parse_drafter, resolve, trained_folders
from draftsmith.eval.outputs import checked_out, standalone_folder, unused_folder
from draftsmith.eval.report import format_table, require_rule_exact
from draftsmith.eval.run import evaluate, evaluate_drafter
from draftsmith.models.folder import read_drafter_meta
from draftsmith.models.registry import load_drafter

# The family, not its functions: load_target is looked up when called, so a test that replaces it
# proves that no model loads before the inputs are checked (tests/test_bad_input.py).
from draftsmith.target import load as target_load


def eval_config(args: EvalArgs | CompareArgs) -> EvalConfig:
    """The eval stage's settings the flags give (the flags mirror EvalConfig's fields, by name)."""
    return EvalConfig(**{f.name: getattr(args, f.name) for f in fields(EvalConfig) if hasattr(args, f.name)})


def _eval_inputs(args: EvalArgs) -> tuple[list[int] | None, str, list[dict], bool, Path]:
    """(batch sizes, the drafter's path, the metadata of its trained folders, whether it is one trained
    drafter on its own, the report folder), every input checked before any model loads."""
    if args.tree:
        parse_tree(args.tree)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.k < 1 or args.timing_runs < 1:
        raise DraftsmithError("eval: expected --temperature >= 0, 0 < --top-p <= 1, --k >= 1 and --timing-runs >= 1")
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    if args.cascade:
        args.drafter = f"cascade:{args.cascade}"
    if not args.drafter:
        raise DraftsmithError(
            "eval: give --drafter (a folder, none, ngram, lookahead, hybrid:PATH) or --cascade LOW,MID"
        )
    path = parse_drafter(args.drafter)[0]
    metas = [read_drafter_meta(Path(d)) for d in trained_folders(args.drafter)]
    trained = bool(metas) and trained_folders(args.drafter) == [path]  # a trained drafter on its own
    if args.lookup and not trained:
        raise DraftsmithError(
            f"eval: --lookup grafts prompt lookup onto a trained drafter; '{args.drafter}' is not one"
        )
    if args.out:
        out = checked_out(Path(args.out), args.force)
    elif trained:  # beside the run's own report
        out = standalone_folder(path, args.data, args.k, args.tree, args.num_prompts, args.temperature, args.lookup)
    else:  # a new folder here
        out = unused_folder(Path(f"eval-{path.split(':')[0]}"))
    load_prompts(args.data, args.num_prompts)
    return batch_sizes, path, metas, trained, out


def run_eval(args: EvalArgs) -> None:
    batch_sizes, path, metas, trained, out = _eval_inputs(args)
    target_name = args.target or (metas[0]["target"] if metas else None) or "smollm2-135m"
    target, tok = target_load.load_target(target_name, args.dtype)
    cfg = eval_config(args)
    options: dict[str, Any] = dict(target_name=target_name, batch_sizes=batch_sizes)
    if not trained:  # training-free drafters and combinations (eval/drafters.py `resolve`)
        assert args.drafter  # _eval_inputs refused an empty one
        report = evaluate(resolve(args.drafter, target, args.allow_stale), tok, args.data, out, cfg, **options)
    else:
        family, dcfg, drafter = load_drafter(path, target, allow_stale=args.allow_stale)
        now = target_load.fingerprint(target)
        if metas[0]["target_fingerprint"] != now:  # allowed: the report says so, with both fingerprints
            options["stale"] = {"trained_for": metas[0]["target_fingerprint"], "evaluated_on": now}
        report = evaluate_drafter(family, drafter, dcfg, target, tok, args.data, out, cfg, **options)
    print(format_table([report]))
    print(f"wrote {out}/report.json, report.md, acceptance.png")
    require_rule_exact(report, str(out))


def run_compare(args: CompareArgs) -> None:
    if args.timing_runs < 1:
        raise DraftsmithError(f"compare: expected --timing-runs >= 1, got {args.timing_runs}")
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    metas = [read_drafter_meta(Path(p)) for d in args.drafter for p in trained_folders(d)]
    for data in args.data:
        load_prompts(data, args.num_prompts)
    target_name = args.target or (metas[0]["target"] if metas else "smollm2-135m")
    target, tok = target_load.load_target(target_name, args.dtype)
    reports = compare(
        args.drafter,
        args.data,
        target,
        tok,
        Path(args.out),
        eval_config(args),
        target_name=target_name,
        batch_sizes=batch_sizes,
    )
    print(compare_table(reports))
    print(f"wrote {args.out}/compare.json, compare.md, compare.png")
    for r in reports:
        require_rule_exact(r, args.out)


def run_layerskip(args: LayerskipArgs) -> None:
    prompts = load_prompts(args.data, args.num_prompts)  # bad prompts fail before the target loads
    target, tok = target_load.load_target(args.target, args.dtype)
    ids = [encode_prompt(tok, p) for p in prompts]
    choice = selfspec.calibrate(target, tok, ids, args.data, args.k, args.max_new_tokens, args.budget)
    out = selfspec.save(choice, target, args.target, Path(args.out))
    print(
        f"skip layers {choice['skip']} on {args.data}: τ {choice['tau']:.2f}, draft cost {choice['cost_fraction']:.2f} of "
        f"the target, estimated speedup {choice['estimated_speedup']:.2f} ({choice['evaluations']} evaluations); wrote {out}"
    )
