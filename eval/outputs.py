"""Where a standalone eval writes its report: a default never replaces a result, and an explicit --out
replaces only a report, and only when asked."""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith import DraftsmithError

# The files a report folder holds (eval/report.py; before_after.* from a fine-tuning run's eval stage).
REPORT_FILES = {"report.json", "report.md", "acceptance.png", "batch_curve.png", "before_after.json", "before_after.md"}


def unused_folder(folder: Path) -> Path:
    """`folder`, else the first of `folder-2`, `folder-3`, … that does not exist: a default never replaces a result."""
    out, n = folder, 1
    while out.exists():
        n += 1
        out = folder.with_name(f"{folder.name}-{n}")
    return out


def standalone_folder(
    drafter: str, data: str, k: int, tree: str | None, num_prompts: int, temperature: float, lookup: bool = False
) -> Path:
    """Where an eval of a trained drafter goes without --out:
    RUN/evals/<holdout>-k<K>[-<kind>-tree]-<N>p[-t<T>][-lookup].
    Not RUN/eval/: that holds the training run's own report, which publish puts in the model card."""
    holdout = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(data.split(":", 1)[-1]).stem).strip("-") or "holdout"
    name = f"{holdout}-k{k}" + (f"-{tree.split(':')[0]}-tree" if tree else "") + f"-{num_prompts}p"
    name += (f"-t{temperature:g}" if temperature else "") + ("-lookup" if lookup else "")
    return unused_folder(Path(drafter).parent / "evals" / name)


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
