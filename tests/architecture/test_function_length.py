"""No function in the package runs over 100 lines: a body that long does several things (decode and
report, say), and a reader has to hold all of them at once. Every function counts on its own, nested
ones and methods included, from its `def` line to its last line (docstring and comments count: they
are part of what a reader reads)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("draftsmith", "models", "train", "data", "eval")  # the package's rooms (pyproject package-dir)
MAX_LINES = 100


def long_functions(max_lines: int = MAX_LINES) -> list[str]:
    """`file:function:lines` for every function of the package longer than `max_lines`."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > max_lines:
                        found.append(f"{path.relative_to(ROOT)}:{node.name}:{lines}")
    return found


def test_no_function_is_over_100_lines():
    too_long = long_functions()
    assert not too_long, f"functions over {MAX_LINES} lines (split them): " + ", ".join(too_long)


def test_the_check_sees_long_functions():
    """The walk finds functions at all: a limit of 1 line flags nearly everything, nested ones too."""
    flagged = long_functions(1)
    assert any(f.startswith("eval/run.py:") for f in flagged)
    assert any(f.startswith("draftsmith/ship/serve_check.py:") for f in flagged)
