"""Dependencies point one way: data <- models <- eval <- train (the loop runs the eval stage), so
the imports tell a newcomer which room is built on which. Pure helpers that everyone may use sit in
leaf modules that import nothing from draftsmith but its error type."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"data": 0, "models": 1, "eval": 2, "train": 3}
LEAVES = {"draftsmith.train.losses", "draftsmith.train.precision", "draftsmith.train.parse", "draftsmith.train.kernels"}


def _imports(path: Path) -> set[str]:
    """Every draftsmith module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith"):
            if node.module.count(".") == 1:  # `from draftsmith.train import precision`: the submodules
                found.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("draftsmith"))
    return found


def test_packages_import_only_downwards_and_leaves_import_nothing():
    wrong = []
    for package, level in LAYERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            name = "draftsmith." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if name.startswith("draftsmith.eval.bench."):  # benchmarks are scripts over everything, as the CLI is
                continue
            for imported in _imports(path):
                parts = imported.split(".")
                if name in LEAVES:
                    if imported != "draftsmith":
                        wrong.append(f"{name} (a leaf) imports {imported}")
                    continue
                if len(parts) < 2 or imported in LEAVES or any(imported.startswith(leaf + ".") for leaf in LEAVES):
                    continue
                if parts[1] == "cli" or LAYERS.get(parts[1], -1) > level:
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)
