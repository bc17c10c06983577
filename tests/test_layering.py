"""The rule, in one line: draftsmith.util imports nothing of draftsmith but its error type, and every
other package imports only util and the packages below it in data <- models <- eval <- train (the
loop runs the eval stage), so the imports tell a newcomer which room is built on which."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"util": -1, "data": 0, "models": 1, "eval": 2, "train": 3}


def _imports(path: Path) -> set[str]:
    """Every draftsmith module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith"):
            if node.module.count(".") == 1:  # `from draftsmith.util import precision`: the submodules
                found.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("draftsmith"))
    return found


def test_packages_import_only_downwards_and_util_imports_nothing():
    wrong = []
    for package, level in LAYERS.items():
        folder = ROOT / ("draftsmith/util" if package == "util" else package)
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("").parts
            name = "draftsmith." + ".".join(rel[1:] if package == "util" else rel)
            if name.startswith("draftsmith.eval.bench."):  # benchmarks are scripts over everything, as the CLI is
                continue
            for imported in _imports(path):
                parts = imported.split(".")
                if imported == "draftsmith" or len(parts) < 2:
                    continue  # the error type
                if parts[1] == "cli" or (package == "util" and parts[1] != "util") or LAYERS.get(parts[1], -1) > level:
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)
