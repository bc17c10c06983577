"""scripts/gpu-check.sh: it parses, refuses bad arguments, and its CPU dry path runs (every family's
launch command, then one family trained, evaluated with the rule checked and exported with --verify).
On a GPU it is run by hand (docs/scale-out.md); CI has none."""

import re
import subprocess
from pathlib import Path

import pytest

from draftsmith.models.registry import DRAFTERS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def listing(capsys) -> dict[str, tuple[str, list[str]]]:
    """What gpu-check.sh reads of the package: family -> (format it exports, its run's overrides)."""
    from benchmarks.tiny_target import main

    main(["--families", "3"])
    return {name: (fmt, args) for name, fmt, *args in (line.split() for line in capsys.readouterr().out.splitlines())}


def test_it_keeps_no_copy_of_the_families_their_tiny_runs_or_formats():
    """They come from the package (`python -m benchmarks.tiny_target --families`): the script names no
    family but the one its CPU dry path runs, and holds no drafter settings nor a format map."""
    text = SCRIPT.read_text()
    named = [f for f in DRAFTERS if re.search(rf"(?<![\w.-]){re.escape(f)}(?![\w.-])", text)]
    assert len(named) <= 1, named
    assert "drafter." not in text and not re.search(r"\[\w+\]=", text)


def test_the_family_listing_is_the_registry(capsys):
    from draftsmith.train.config import load_config

    families = listing(capsys)
    assert list(families) == list(DRAFTERS)
    for name, (fmt, args) in families.items():
        assert fmt == (DRAFTERS[name].SERVE_FORMAT or next(iter(DRAFTERS[name].EXPORTS)))
        cfg = load_config(None, args)  # one shell word each; eval.k within what the family drafts
        assert cfg.drafter == {"type": name, **DRAFTERS[name].tiny} and 1 <= cfg.eval.k <= 3


def test_it_parses_and_refuses_bad_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "--steps", "0"], capture_output=True, text=True)
    assert (
        r.returncode == 2
        and r.stderr.strip() == "gpu-check.sh: error: --steps: expected a positive whole number, got '0'"
    )


@pytest.mark.script
def test_the_cpu_dry_path_trains_evaluates_and_verifies_one_family(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-dry", "--out", str(tmp_path / "gc")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "launch commands: every family's parses (launch.sh --dry-run)" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("| eagle3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("ok") and cells[4].startswith("yes (identical") and cells[8].startswith("ok"), row
    assert float(cells[5]) > 0 and float(cells[6]) > 0
