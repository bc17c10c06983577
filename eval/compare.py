"""`draftsmith compare`: N drafters x M holdouts in one process, on the same prompts, with the
target-only baseline measured once per holdout -> compare.json, compare.md, compare.png.

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
from draftsmith.eval.drafters import parse_drafter, resolve
from draftsmith.eval.report import LOSSLESS_NOTE, lossless_cell, speedup_cell
from draftsmith.eval.run import evaluate, target_baseline


def compare(
    drafters: list[str], holdouts: list[str], target, tok, out: Path | None, cfg: EvalConfig, **options
) -> list[dict]:
    """Every drafter spec on every holdout, in the eval stage's settings `cfg` (its tree for every
    drafter that builds trees; a spec's own `@TREE` wins). options: evaluate's (target_name, batch_sizes)."""
    if not drafters or not holdouts:
        raise DraftsmithError("compare: give at least one --drafter and one --data")
    loaded = [(parse_drafter(spec)[0], resolve(spec, target)) for spec in drafters]
    reports = []
    for holdout in holdouts:
        shared = target_baseline(target, tok, holdout, cfg)  # target-only, once per holdout
        for path, drafter in loaded:
            trees = drafter.proposer is not None and drafter.proposer.drafts_trees
            run = replace(cfg, tree=cfg.tree if trees else None)
            # A drafter verified by its own trained backbone (Medusa-2) needs that backbone's baseline.
            baseline = shared if drafter.verifier is target else None
            r = evaluate(drafter, tok, holdout, None, run, baseline=baseline, **options)
            reports.append({**r, "drafter_path": path})
    if out is not None:
        write_compare(reports, Path(out))
    return reports


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
        f"{r0['temperature']}, batch size 1, one process; measured on {r0.get('device_name')} ({r0.get('dtype')}).\n\n"
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
