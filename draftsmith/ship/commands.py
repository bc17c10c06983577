"""The shipping commands: `draftsmith export`, `publish`, `serve-check` and `bakeoff` (their flags: ship/args.py).
Each checks its inputs before a model loads."""

from __future__ import annotations

import copy
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.data.load import load_prompts
from draftsmith.engine.batched import parse_batch_sizes
from draftsmith.models.folder import read_drafter_meta
from draftsmith.ship.args import BakeoffArgs, ExportArgs, PublishArgs, ServeCheckArgs
from draftsmith.ship.bakeoff import bakeoff, table
from draftsmith.ship.export import export
from draftsmith.ship.publish import checked_inputs, publish, speculators_line, verify_export
from draftsmith.ship.serve_check import markdown, serve_check, summary

# The modules, not their functions: load_target is looked up when called, so a test that replaces it
# proves that no model loads before the inputs are checked (tests/test_bad_input.py).
from draftsmith.target import load as target_load
from draftsmith.target import vllm_server


def run_export(args: ExportArgs) -> None:
    meta = read_drafter_meta(Path(args.drafter))
    if args.verify:
        load_prompts(args.data, 1)  # a bad holdout fails before any model loads
    target, tok = target_load.load_target(args.target or meta["target"], args.dtype)
    source = copy.deepcopy(target) if args.verify else target  # a Medusa-2 load adapts the target it is given
    out = export(args.drafter, source, args.format, args.out, tok)
    print(f"wrote {out} ({args.format} format)")
    if args.verify:
        _verify(args, out, target, tok)


def _verify(args: ExportArgs, out: Path, target, tok) -> None:
    """`export --verify`: the export read back drafts like the drafter; then vLLM serves it, where installed."""
    parity = verify_export(Path(args.drafter), out, target, tok, args.data)
    print(
        f"serving parity on {args.data}: draft-token agreement {parity['draft_token_agreement']:.1%} over "
        f"{parity['rounds']} rounds, max |Δ logits| {parity['max_abs_logit_diff']:.2e} over "
        f"{parity['logit_rows']} rows (argmax agreement {parity['logit_argmax_agreement']:.1%}), "
        f"τ {parity['tau_export']:.2f} (export) vs {parity['tau_drafter']:.2f} (drafter).{speculators_line(parity)}"
    )
    if not parity["passed"]:
        raise DraftsmithError(f"{out}: the export does not draft like the drafter it came from")
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


def run_publish(args: PublishArgs) -> None:
    meta = read_drafter_meta(Path(args.drafter))
    checked_inputs(Path(args.drafter), args.repo_id, args.format, args.force, args.dry_run)  # before any model loads
    target, tok = target_load.load_target(args.target or meta["target"])
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


def run_serve_check(args: ServeCheckArgs) -> None:
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
        parse_batch_sizes(args.deploy_k, "--deploy-k") if args.deploy_k else None,
        args.deploy_runs,
    )
    print(markdown(r))
    print(f"wrote {args.out}/serve_check.json, serve_check.md")
    if not r["passed"]:
        raise DraftsmithError(
            f"serve-check {args.dir}: {'vLLM did not load the export: ' if not r['loaded'] else ''}{r['why']}"
        )


def run_bakeoff(args: BakeoffArgs) -> None:
    r = bakeoff(
        args.drafter,
        args.data,
        args.out,
        steps=args.steps,
        concurrency=parse_batch_sizes(args.concurrency, "--concurrency"),
        k=args.k,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        deploy_k=parse_batch_sizes(args.deploy_k, "--deploy-k") if args.deploy_k else None,
        train_data=args.train_data,
        train_args=args.train_arg,
        vllm_python=args.vllm_python,
        extra=tuple(args.vllm_arg),
    )
    print(table(r))
    deployed = r["deploy"]["path"] or f"no deploy config ({r['deploy']['why']})"
    print(f"wrote {args.out}/bakeoff.json, bakeoff.md, bakeoff.png; {deployed}")
