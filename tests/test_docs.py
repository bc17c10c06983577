"""The README is the front door: its relative links resolve (docs/ too), and every draftsmith and
launch.sh command of its GPU walkthrough parses as written."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from draftsmith.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    links = [l.split("#")[0] for l in re.findall(r"\]\(([^)\s]+)\)", page.read_text()) if "://" not in l]
    missing = [l for l in links if l and not (page.parent / l).exists()]
    assert not missing, f"{page.name}: broken links {missing}"


def _walkthrough_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## On GPUs", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_the_gpu_walkthrough_has_five_steps_and_its_commands_parse():
    commands = _walkthrough_commands()
    assert sum(c.startswith("draftsmith ") for c in commands) >= 5
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "draftsmith":
            parser.parse_args(argv[1:])  # argparse exits on an unknown flag or a missing argument
        elif argv[0] == "./launch.sh":
            done = subprocess.run(["bash", *argv, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
            assert done.returncode == 0 and "accelerate launch" in done.stdout, done.stderr
        else:
            assert argv[0] == "vllm", command  # the engine's own command, not ours
