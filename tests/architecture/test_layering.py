"""The rule, in one line: draftsmith.util imports nothing of draftsmith but its error type, and every
other room imports only util and the rooms below it in target <- data <- engine <- models <- eval <-
{ship, train}, so the imports tell a newcomer which room is built on which. Rooms at the same level are
peers and import neither each other: ship (the writers, serve-check, publish) and train (the loop) both
read drafters and exports through models/readers.py. The CLI and the benchmarks sit on top: they may
import any room, and no room imports them (nor the CLI the benchmarks, which are not in the wheel)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = {  # room -> (folder, level)
    "util": ("draftsmith/util", -1),
    "target": ("draftsmith/target", 0),
    "data": ("data", 1),
    "engine": ("draftsmith/engine", 2),
    "models": ("models", 3),
    "eval": ("eval", 4),
    "ship": ("draftsmith/ship", 5),
    "train": ("train", 5),  # ship's peer: neither imports the other
}
TOP = {"cli": ("draftsmith/cli.py", 6), "benchmarks": ("benchmarks", 6)}
LEVEL = {room: lvl for room, (_, lvl) in {**ROOMS, **TOP}.items()}


def _imports(path: Path) -> set[str]:
    """Every draftsmith or benchmarks module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("draftsmith", "benchmarks")
        ):
            if node.module.count(".") == 1 or node.module == "benchmarks":  # `from draftsmith.util import x`
                found.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in ("draftsmith", "benchmarks"))
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks"
    return parts[1] if len(parts) > 1 else None  # `draftsmith` alone: the error type


def forbidden(room: str, other: str) -> bool:
    """Whether `room` may not import `other` (two different rooms)."""
    if room == "util" or other not in LEVEL or LEVEL[other] > LEVEL[room]:
        return True
    # benchmarks/ is not in the wheel: nothing installed, the CLI included, may import it
    if other == "benchmarks":
        return True
    return room in ROOMS and LEVEL[other] == LEVEL[room]  # peers (ship, train) import neither each other


def violations() -> list[str]:
    wrong = []
    for room, (folder, _) in {**ROOMS, **TOP}.items():
        paths = [ROOT / folder] if folder.endswith(".py") else sorted((ROOT / folder).rglob("*.py"))
        for path in paths:
            for imported in _imports(path):
                other = _room(imported)
                if other is not None and other != room and forbidden(room, other):
                    wrong.append(f"{path.relative_to(ROOT)} ({room}) imports {imported}")
    return wrong


def test_rooms_import_only_downwards_and_util_imports_nothing():
    wrong = violations()
    assert not wrong, "\n".join(wrong)


def test_peers_import_neither_each_other():
    """ship and train share a level; the rule must refuse an import either way, as it refuses an upward one."""
    assert LEVEL["ship"] == LEVEL["train"]
    assert forbidden("ship", "train") and forbidden("train", "ship")
    assert not forbidden("train", "models") and not forbidden("ship", "eval")
    assert forbidden("models", "ship") and forbidden("eval", "train")
    assert not forbidden("benchmarks", "cli") and forbidden("cli", "benchmarks")
    assert not forbidden("cli", "train") and not forbidden("benchmarks", "ship")
    assert _room("draftsmith.ship.export") == "ship" and _room("draftsmith.train.loop") == "train"


def test_every_module_lives_in_a_room():
    """A new folder of code must take a place in the order above, or the rule would not see it."""
    covered = {ROOT / folder for folder, _ in {**ROOMS, **TOP}.values()}
    loose = [
        p.relative_to(ROOT).as_posix()
        # Top-level folders first: globbing from the root would walk the virtual environments too.
        for top in sorted(ROOT.iterdir())
        if top.is_dir()
        and top.name not in ("tests", "scripts", "checkpoints", "recipes")
        and not top.name.startswith(".")
        for p in sorted(top.glob("**/*.py"))
        if not p.is_relative_to(ROOT / "draftsmith" / "__init__.py")
        and not any(p == c or p.is_relative_to(c) for c in covered)
        and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.parts)
    ]
    assert loose == [], loose
