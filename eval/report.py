"""report.json (keys fixed by design.md), report.md and acceptance.png; for a drafter with confidences
also reliability.png and the calibration and adaptive-verification sections."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.util.calibration import LEVEL, verdict

REPORT_KEYS = (
    "drafter",
    "target",
    "holdout",
    "num_prompts",
    "new_tokens",
    "temperature",
    "k",
    "tree",
    "tau",
    "acceptance_rate",
    "per_position",
    "lossless",
    "target_tokens_per_s",
    "spec_tokens_per_s",
    "speedup",
)


LOSSLESS = {True: "yes", False: "NO", None: "sampled*"}
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def lossless_cell(r: dict) -> str:
    """The lossless column: the guarantee that holds, `rule_exact` (every greedy round emitted what the
    verification rule gives for the target's own logits of that pass), with beside it how many outputs
    are identical to the target-only reference and the dtype: `yes (identical 18/20, bf16)`. In fp32
    the two agree; in bf16 kernels of other shapes can break near-ties (docs/troubleshooting.md, "bf16 near-ties")."""
    if r.get("lossless") is None:
        return LOSSLESS[None]
    n = r["num_prompts"]
    same = f"identical {n - (r.get('lossless_mismatches') or 0)}/{n}"
    if r.get("rule_exact") is None:  # a report written before the rule was checked
        return f"{LOSSLESS[r['lossless']]} ({same})"
    dtype = r.get("dtype", "?")
    return f"{LOSSLESS[r['rule_exact']]} ({same}, {SHORT_DTYPE.get(dtype, dtype)})"


LOSSLESS_NOTE = (
    "Lossless: yes/NO is the verification rule held in every greedy round (`rule_exact`), the guarantee; "
    "beside it, how many outputs are identical to target-only decoding, and the dtype (in bf16, near-ties "
    "of the target's logits can differ between kernel shapes; each report.md explains both checks)."
)


def rows_of(report: dict) -> list[dict]:
    """The report, then its `with_lookup` row (eval.lookup) if it has one."""
    return [report, *([report["with_lookup"]] if report.get("with_lookup") else [])]


def require_rule_exact(report: dict, where: str) -> None:
    """A greedy run whose rounds broke the verification rule is not lossless: a one-line error (the
    report is written first, as the evidence). Its `with_lookup` row (eval.lookup) is held to the same."""
    for r in rows_of(report):
        if r.get("rule_exact") is False:
            raise DraftsmithError(
                f"{where}: greedy verification broke the rule (rule_exact false) on "
                f"{r['drafter']}: the speculation is not lossless (the report is in {where})"
            )


def format_table(reports: list[dict]) -> str:
    """One row per report; a report's `with_lookup` (eval.lookup) adds its row under it."""
    reports = [row for r in reports for row in rows_of(r)]
    head = "| drafter | draft | τ | acceptance | per-position | lossless | target tok/s | spec tok/s | speedup |"
    rows = [head, "|" + "---|" * 9]
    for r in reports:
        pp = " ".join(f"{p:.2f}" for p in r["per_position"]) or "-"
        rows.append(
            f"| {r['drafter']} | {_shape(r)} | {r['tau']:.2f} | {r['acceptance_rate']:.2f} | {pp} | "
            f"{lossless_cell(r)} | {r['target_tokens_per_s']:.1f} | "
            f"{r['spec_tokens_per_s']:.1f} | {speedup_cell(r)} |"
        )
    return "\n".join(rows)


def speedup_cell(r: dict) -> str:
    """`1.62x`, or with several timing runs (eval.timing_runs) the median's `1.62x (1.57-1.64x, 5 runs)`."""
    runs = r.get("speedup_runs") or []
    if len(runs) < 2:
        return f"{r['speedup']:.2f}x"
    return f"{r['speedup']:.2f}x ({min(runs):.2f}-{max(runs):.2f}x, {len(runs)} runs)"


def _shape(r: dict) -> str:
    """chain K=5, or the tree spec with the mean number of draft nodes verified per pass."""
    if r.get("tree"):
        return f"tree {r['tree']} ({r.get('draft_tokens_per_pass', '?')} nodes/pass)"
    return f"chain K={r['k']}" if r["k"] else "-"


def _where(r: dict) -> str:
    """`AMD EPYC (cpu, 2 threads, no native bf16), float32`: the hardware a speedup belongs to."""
    bf16 = {True: "native bf16", False: "no native bf16", None: "native bf16 unknown"}[r.get("native_bf16")]
    return f"{r.get('device_name', '?')} ({r.get('device', '?')}, {r.get('threads', '?')} threads, {bf16}), {r.get('dtype', '?')}"


def _markdown(r: dict) -> str:
    return "\n".join(
        [
            f"# Speculative decoding eval: {r['drafter']} vs {r['target']}",
            "",
            f"Holdout `{r['holdout']}`, {r['num_prompts']} prompts, {r['new_tokens']} new tokens, "
            f"temperature {r['temperature']}, batch size {r.get('batch_size', 1)}, draft: {_shape(r)}.",
            f"Measured on {_where(r)}; chat template thinking mode: {r.get('thinking', 'template default')}.",
            "",
            *(
                [
                    f"**Stale drafter**: trained for target fingerprint `{r['stale']['trained_for']}`, evaluated on "
                    f"`{r['stale']['evaluated_on']}` (`--allow-stale`).",
                    "",
                ]
                if r.get("stale")
                else []
            ),
            format_table([r]),
            "",
            "τ = tokens emitted per target verification pass (bonus token included), pooled over prompts.",
            "Per-position acceptance j = P(draft token j accepted | tokens < j accepted); on a tree, j is the depth.",
            *_rule(r),
            "*sampled: outputs differ by design at temperature > 0; the rejection rule's exactness is",
            "checked as a distribution (chi-square test in draftsmith's test suite).",
            "",
            *_drift(r),
            *_levels(r),
            *_calibration(r),
            *_adaptive(r),
            *_batch_curve(r),
        ]
    )


def _calibration(r: dict) -> list[str]:
    """A drafter with a confidence head: how well its confidences match what verification accepted."""
    cal = r.get("calibration")
    if not cal:
        return []
    ece = "-" if cal["ece"] is None else f"{cal['ece']:.3f}"
    return [
        "## Confidence calibration",
        "",
        f"Expected calibration error {ece} over {cal['n']} verified drafts ({len(cal['bins'])} equal-width bins; "
        "outcome: the draft was accepted, given the drafts before it were). Reliability diagram: reliability.png.",
        "",
        *_calibration_verdict(cal),
        "| confidence bin | drafts | mean confidence | accepted |",
        "|---|---|---|---|",
        *[
            f"| {b['lo']:.1f}-{b['hi']:.1f} | {b['n']} | {b['confidence']:.2f} | {b['accuracy']:.2f} |"
            for b in cal["bins"]
            if b["n"]
        ],
        "",
    ]


def _calibration_verdict(cal: dict) -> list[str]:
    """The ECE against what true confidences give on as many drafts (draftsmith/util/calibration.py
    `verdict`), from the report's bins, so reports written before the verdict get it too."""
    v = verdict(cal)
    if v["calibrated"] is None:
        return []
    word = "calibrated" if v["calibrated"] else "**miscalibrated**"
    return [
        f"Verdict: {word}: confidences that were true give an ECE of at most {v['ece_bound']:.3f} on these "
        f"{cal['n']} drafts ({1 - LEVEL:.0%} of the time, consistency resampling of each bin).",
        "",
    ]


def _adaptive(r: dict) -> list[str]:
    """Adaptive verification (vLLM 0.32) beside full-block verification on the same prompts."""
    a = r.get("adaptive")
    if not a:
        return []
    rows = [("full block", a["full_block"]), ("adaptive", a["adaptive"])]
    return [
        "## Adaptive verification",
        "",
        f"Each round verifies the prefix of the chain that maximizes expected tokens per cost: {a['rule']}; "
        f"costs in target passes ({a['costs']}): draft_cost {a['draft_cost']:.3f}, beta {a['beta']:.3f}.",
        "",
        "| verification | τ | drafts verified / round | acceptance | spec tok/s | speedup |",
        "|---|---|---|---|---|---|",
        *[
            f"| {name} | {x['tau']:.2f} | {x['verified_per_round']:.2f} | {x['acceptance_rate']:.2f} | "
            f"{x['spec_tokens_per_s']:.1f} | {x['speedup']:.2f}x |"
            for name, x in rows
        ],
        "",
        *(
            [f"Adaptive verification lossless: {lossless_cell({**r, **a['adaptive']})}.", ""]
            if a["adaptive"].get("lossless") is not None
            else []
        ),
    ]


def _levels(r: dict) -> list[str]:
    """Cascades: τ at each level; hybrids: where the drafts came from."""
    out = []
    if r.get("levels"):
        lv = r["levels"]
        out += [
            "## Cascade levels",
            "",
            f"Target level: τ {r['tau']:.2f} (tokens per target pass). Intermediate level: τ {lv['mid_tau']:.2f} "
            f"(tokens per intermediate pass), {lv['mid_passes_per_round']:.2f} intermediate passes per target pass; "
            f"the cheap level's drafts were accepted by the intermediate at rate {lv['low_acceptance_rate']:.2f}.",
            "",
        ]
    if r.get("draft_sources"):
        out += [f"Hybrid drafts by source: {', '.join(f'{k} {v}' for k, v in r['draft_sources'].items())}.", ""]
    return out


def _batch_curve(r: dict) -> list[str]:
    """`--batch-sizes`: τ and speedup per batch size, batched target-only vs batched speculative."""
    curve = r.get("batch_curve")
    if not curve:
        return []
    return [
        "## Batch-size curve (greedy, chain drafts, batched verification; drafting row by row)",
        "",
        "| batch size | τ | acceptance | target tok/s | spec tok/s | speedup | identical to target-only |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {c['batch_size']} | {c['tau']:.2f} | {c['acceptance_rate']:.2f} | {c['target_tokens_per_s']:.1f} | "
            f"{c['spec_tokens_per_s']:.1f} | {c['speedup']:.2f}x | {LOSSLESS[c['lossless']]} |"
            for c in curve
        ],
        "",
    ]


def _rule(r: dict) -> list[str]:
    """The two greedy checks behind the lossless column, explained once."""
    if r.get("lossless") is None:
        return []
    n, mism = r["num_prompts"], r.get("lossless_mismatches") or 0
    return [
        "Lossless, two checks (greedy):",
        f"- **the rule** (`rule_exact`: {'yes' if r.get('rule_exact') else 'NO' if r.get('rule_exact') is False else 'not checked'}): "
        "every round emitted exactly what the verification rule gives for the target's own logits of that pass "
        "(the drafts the target's argmax agrees with, then the target's own token). This is the guarantee "
        "that makes speculative decoding lossless, and the column's yes/NO;",
        f"- **identity** ({n - mism} of {n} prompts): outputs identical to target-only decoding of the same prompt, "
        "run by the same engine with no drafter. In fp32 it follows from the rule. In bf16 a verification pass "
        "scores several tokens at once, and kernels of another shape round differently, so where the target's top "
        "two logits are within bf16 resolution (a near-tie) the two runs can pick different tokens while both follow "
        'the rule (docs/troubleshooting.md, "bf16 near-ties").',
        f"Target logit gap at each first divergence: {r.get('mismatch_logit_gaps') or '-'}.",
        "",
    ]


def _drift(r: dict) -> list[str]:
    """Medusa-2 trains its verifier: how far the trained backbone moved from the original target."""
    d = r.get("drift")
    if not d:
        return []
    return [
        "## Backbone drift (the verifier is the trained backbone)",
        "",
        f"Prompts whose greedy output is unchanged: {d['unchanged_fraction']:.0%}; next-token agreement along "
        f"the original's outputs: {d['token_agreement']:.1%}; τ of the same heads on the original target: "
        f"{d['original_tau']:.2f}.",
        "",
    ]


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = list(range(1, len(r["per_position"]) + 1))
    ax.bar(xs, r["per_position"], color="#3b7dd8")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accept | previous accepted)")
    ax.set_title(f"{r['drafter']}: τ={r['tau']:.2f}, speedup {r['speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if r.get("batch_curve"):
        fig, ax = plt.subplots(figsize=(5, 3))
        sizes = [c["batch_size"] for c in r["batch_curve"]]
        ax.plot(sizes, [c["speedup"] for c in r["batch_curve"]], "o-", color="#3b7dd8")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup vs batched target-only")
        ax.set_title(f"{r['drafter']}: speedup by batch size")
        fig.tight_layout()
        fig.savefig(path.with_name("batch_curve.png"), dpi=100)
        plt.close(fig)
    if r.get("calibration"):
        _reliability(r, path.with_name("reliability.png"), plt)


def _reliability(r: dict, path: Path, plt) -> None:
    """Reliability diagram: accepted fraction against mean confidence per bin, the diagonal = calibrated."""
    cal = r["calibration"]
    full = [b for b in cal["bins"] if b["n"]]
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.bar(
        [(b["lo"] + b["hi"]) / 2 for b in full],
        [b["accuracy"] for b in full],
        width=[b["hi"] - b["lo"] for b in full],
        color="#3b7dd8",
        edgecolor="white",
        alpha=0.8,
        label="accepted",
    )
    ax.plot([b["confidence"] for b in full], [b["accuracy"] for b in full], "o", color="#d83b3b", label="bin mean")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accepted fraction")
    ece = "-" if cal["ece"] is None else f"{cal['ece']:.3f}"
    ax.set_title(f"{r['drafter']}: ECE {ece} (n={cal['n']})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(r: dict, out: Path) -> None:
    """Write all three files into a temp folder, then rename it into place."""
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "report.json").write_text(json.dumps(r, indent=2))
    (tmp / "report.md").write_text(_markdown(r))
    _plot(r, tmp / "acceptance.png")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def write_before_after(rows: list[tuple[str, dict]], out: Path) -> str:
    """Domain fine-tuning: τ and speedup of the init ("before") and the fine-tuned drafter ("after")
    on each holdout, side by side -> before_after.json / .md; returns the markdown table."""
    table: dict[str, dict] = {}
    for when, r in rows:
        table.setdefault(r["holdout"], {})[when] = {
            k: r.get(k)
            for k in (
                "tau",
                "acceptance_rate",
                "speedup",
                "lossless",
                "rule_exact",
                "lossless_mismatches",
                "num_prompts",
                "dtype",
            )
        }
    lines = [
        "| holdout | τ before | τ after | acceptance before | after | speedup before | after | lossless before / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for holdout, r in table.items():
        b, a = r["before"], r["after"]
        lines.append(
            f"| {holdout} | {b['tau']:.2f} | {a['tau']:.2f} | {b['acceptance_rate']:.2f} | "
            f"{a['acceptance_rate']:.2f} | {b['speedup']:.2f}x | {a['speedup']:.2f}x | "
            f"{lossless_cell(b)} / {lossless_cell(a)} |"
        )
    md = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "before_after.json").write_text(json.dumps(table, indent=2))
    (out / "before_after.md").write_text("# Before and after domain fine-tuning\n\n" + md + "\n")
    return md
