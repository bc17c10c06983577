"""`draftsmith compare`: N drafters x M holdouts in one process, on the same prompts, interleaved as
the eval stage's rows are: every timing run decodes each prompt target-only and then with each drafter,
the drafters' order rotated between runs -> compare.json, compare.md, compare.png.

A drafter is anything `eval/drafters.py resolve` resolves: a trained drafter folder, a layer-skip folder
(`draftsmith layerskip`), `none`, `ngram`, `lookahead`, `hybrid:PATH` or `cascade:LOW,MID`; a trained
one optionally with its own draft tree: `PATH@static:recipes/trees/medusa-4heads.json` or
`PATH@dynamic:depth=3,top_k=3,tokens=8`; any of them with its own chain length, `SPEC@k=4` (P-EAGLE's
4 drafts per pass beside block drafters of 7 and --k 7).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved, parse_drafter, resolve
from draftsmith.eval.report import LOSSLESS_NOTE, lossless_cell, speedup_cell
from draftsmith.eval.run import Decoded, decode_rows, eval_report


def compare(
    drafters: list[str],
    holdouts: list[str],
    target,
    tok,
    out: Path | None,
    cfg: EvalConfig,
    *,
    target_name: str = "",
    **options,
) -> list[dict]:
    """Every drafter spec on every holdout, in the eval stage's settings `cfg` (its tree for every
    drafter that builds trees; a spec's own `@TREE` wins), decoded by `decode_rows` with every row's
    own adaptive run and batch-size curve and the rows' order rotated between timing runs: in each run
    every row divides by the target-only decode timed just before it on the same prompt, and no drafter
    always runs first (a baseline timed once before all drafters drifts with the host, and a fixed order
    favours one position). options: decode_rows' (batch_sizes, kernels, split, adaptive_costs)."""
    if not drafters or not holdouts:
        raise DraftsmithError("compare: give at least one --drafter and one --data")
    loaded = [(parse_drafter(spec)[0], with_tree(resolve(spec, target), cfg.tree)) for spec in drafters]
    run = replace(cfg, tree=None)  # each drafter carries its tree (with_tree)
    reports = []
    for holdout in holdouts:
        decoded: dict[int, Decoded] = {}
        for group in verifier_groups([d for _, d in loaded]):
            rows = decode_rows([loaded[i][1] for i in group], tok, holdout, run, every_row=True, **options)
            decoded.update(zip(group, rows))
        for i, (path, _) in enumerate(loaded):
            reports.append({**eval_report(decoded[i], holdout, run, target_name=target_name), "drafter_path": path})
    if out is not None:
        write_compare(reports, Path(out))
    return reports


def with_tree(drafter: Resolved, tree: str | None) -> Resolved:
    """The drafter with the run's `--tree` where it builds trees and has no `@TREE` of its own; a chain
    drafter keeps none, so one tree for the run does not refuse the n-gram row beside it."""
    trees = drafter.proposer is not None and drafter.proposer.drafts_trees
    return drafter._replace(tree=drafter.tree or tree) if trees else drafter


def verifier_groups(drafters: list[Resolved]) -> list[list[int]]:
    """The drafters' indices grouped by the model that verifies them, in order of first appearance: a
    drafter verified by its own trained backbone (Medusa-2) is timed against that backbone's
    target-only decode, so it is interleaved with the drafters of that backbone only."""
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(drafters):
        groups.setdefault(id(d.verifier), []).append(i)
    return list(groups.values())


def compare_table(reports: list[dict]) -> str:
    lines = [
        "| drafter | holdout | draft | τ | acceptance | per-position | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        shape = f"tree {r['tree']}" if r["tree"] else (f"chain K={r['k']}" if r["k"] else "-")
        pp = " ".join(f"{p:.2f}" for p in r["per_position"]) or "-"
        lines.append(
            f"| {r['drafter']} | {r['holdout']} | {shape} | {r['tau']:.2f} | {r['acceptance_rate']:.2f} | {pp} | "
            f"{speedup_cell(r)} | {lossless_cell(r)} |"
        )
    return "\n".join(lines)


def curve_tables(reports: list[dict]) -> str:
    """`--batch-sizes`: speedup per batch size, one row per drafter and holdout."""
    with_curve = [r for r in reports if r.get("batch_curve")]
    if not with_curve:
        return ""
    sizes = [c["batch_size"] for c in with_curve[0]["batch_curve"]]
    lines = [
        "",
        "## Speedup by batch size (greedy, chain drafts; batched target-only at the same B = 1.00x)",
        "",
        f"| drafter | holdout | {' | '.join(f'B={b}' for b in sizes)} |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for r in with_curve:
        lines.append(
            f"| {r['drafter']} | {r['holdout']} | "
            + " | ".join(
                f"{c['speedup']:.2f}x (τ {c['tau']:.2f}){'' if c['lossless'] else ' (not identical)'}"
                for c in r["batch_curve"]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def timing_words(runs: int) -> str:
    """How compare.md's speedups were timed, so that a reader knows they are paired and how often."""
    paired = "every prompt decoded target-only, then with each drafter verified by the same model"
    if runs == 1:
        return f"One timing run: {paired}, so each speedup divides by a target-only run timed beside it."
    return (
        f"{runs} timing runs, each with {paired} (the drafters' order rotated between runs); each speedup is "
        "the median run's, min-max beside it."
    )


def write_compare(reports: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "compare.json").write_text(json.dumps(reports, indent=2))
    r0 = reports[0]
    (tmp / "compare.md").write_text(
        f"# draftsmith compare\n\nTarget `{r0['target']}`, up to {r0['num_prompts']} prompts per holdout, temperature "
        f"{r0['temperature']}, batch size 1, one process; measured on {r0.get('device_name')} ({r0.get('dtype')}). "
        f"{timing_words(len(r0['speedup_runs']))}\n\n"
        + compare_table(reports)
        + "\n\n"
        + LOSSLESS_NOTE
        + "\n"
        + curve_tables(reports)
    )
    drafters = list(dict.fromkeys(r["drafter"] for r in reports))
    holdouts = list(dict.fromkeys(r["holdout"] for r in reports))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / max(len(drafters), 1)
    for ax, key, title in zip(axes, ("tau", "speedup"), ("τ (tokens per target pass)", "measured speedup")):
        for i, d in enumerate(drafters):
            ys = [next((r[key] for r in reports if r["drafter"] == d and r["holdout"] == h), 0) for h in holdouts]
            ax.bar([j + i * width for j in range(len(holdouts))], ys, width, label=d)
        ax.set_xticks([j + width * (len(drafters) - 1) / 2 for j in range(len(holdouts))], holdouts, fontsize=7)
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(tmp / "compare.png", dpi=100)
    plt.close(fig)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
