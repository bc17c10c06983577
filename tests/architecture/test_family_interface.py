"""A family is one module plus a registry line: shared modules call the registry interface and name
no family. Checked on code (identifiers, imports and string values), not on prose: docstrings,
comments and the CLI's help and examples may name families to explain them."""

import ast
import re
from pathlib import Path

from draftsmith.models.registry import DRAFTERS

ROOT = Path(__file__).resolve().parents[2]
OWN = {f"models/{name}.py" for name in DRAFTERS} | {"models/registry.py"}
HELP_KEYWORDS = {"help", "epilog", "description"}
# Parts only some families' drafters have: shared code that reaches for them knows the family.
FAMILY_PARTS = {"heads", "student"}
# Engines' own config keys that contain a family's name but belong to no family: vLLM reads the layers
# to tap from this key whatever the method (extract_hidden_states too: draftsmith/target/vllm_features.py).
ENGINE_KEYS = {"eagle_aux_hidden_state_layer_ids"}


def _prose(tree: ast.AST) -> set[int]:
    """ids of string nodes that are prose: docstrings (of modules, functions, classes, attributes),
    argparse help/epilog/description values and module-level *_HELP texts."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for i, stmt in enumerate(body):
                doc = (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                )
                if doc and (i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))):
                    out.add(id(stmt.value))
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id.endswith("_HELP") for t in stmt.targets
                ):
                    out |= {id(n) for n in ast.walk(stmt.value)}
        if isinstance(node, ast.keyword) and node.arg in HELP_KEYWORDS:
            out |= {id(n) for n in ast.walk(node.value)}
    return out


def family_mentions(source: str, families, strings: bool = True) -> list[str]:
    """Where code names a family: identifiers, attributes, imports and (with `strings`) string values."""
    tree, found = ast.parse(source), []
    prose = _prose(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if not strings:
                continue
            if node.value in ENGINE_KEYS:
                continue
            if node.value in FAMILY_PARTS:  # getattr(drafter, "heads", ...)
                found.append(f"line {node.lineno}: {node.value!r} (a family's own part)")
            texts = [node.value]
        elif isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
            if node.attr in FAMILY_PARTS:
                found.append(f"line {node.lineno}: attribute .{node.attr} (a family's own part)")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            texts = [node.name]
        elif isinstance(node, ast.alias):
            texts = [node.name]
        elif isinstance(node, ast.ImportFrom) and node.module:
            texts = [node.module]
        else:
            continue
        for text in texts:
            hit = set(families) & set(re.split(r"[^a-z0-9]+", text.lower()))
            if hit:
                found.append(f"line {getattr(node, 'lineno', '?')}: {sorted(hit)} in {text[:50]!r}")
    return found


def test_shared_modules_name_no_family():
    wrong = []
    for package in ("data", "models", "eval", "train", "draftsmith", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            # Benchmarks measure named runs, as recipes are: they may name a family in what a user would
            # type (a run, a recipe path, `drafter.type=...`), never in code (an import, a name, an attribute).
            strings = package != "benchmarks"
            if rel not in OWN:
                wrong += [f"{rel} {m}" for m in family_mentions(path.read_text(), DRAFTERS, strings)]
    assert not wrong, "family knowledge outside its module (use the registry interface):\n" + "\n".join(wrong)


def test_the_check_sees_a_planted_family_name():
    planted = 'def fmt(module):\n    """Docstrings may say medusa."""\n    return "vllm" if module.NAME == "medusa" else "hf"\n'
    assert family_mentions(planted, DRAFTERS) == ["line 3: ['medusa'] in 'medusa'"]
    assert family_mentions("from draftsmith.models import eagle3\n", DRAFTERS)
    assert not family_mentions('p.add_argument("--x", help="a medusa tree")\n', DRAFTERS)
    assert family_mentions("n = drafter.heads\n", DRAFTERS) == ["line 1: attribute .heads (a family's own part)"]
    assert not family_mentions('c = {"eagle_aux_hidden_state_layer_ids": ids}\n', DRAFTERS)  # vLLM's key
    assert family_mentions('c = {"eagle_aux_layers": ids}\n', DRAFTERS)  # ... but only that one
    assert family_mentions('m = getattr(p, "student", p)\n', DRAFTERS) == ["line 1: 'student' (a family's own part)"]


def test_no_family_unwraps_a_distributed_wrapper_itself():
    """DDP and DeepSpeed wrap the drafter; the loop hands `compute_loss` the drafter itself and the
    wrapper as its `forward`, so no family reads, or reaches inside, a wrapper."""
    wrong = [
        f"{path.name} line {node.lineno}"
        for path in sorted((ROOT / "models").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "getattr"
            and any(isinstance(a, ast.Constant) and a.value == "module" for a in node.args)
        )
        or (isinstance(node, (ast.Name, ast.Attribute)) and "unwrap" in getattr(node, "id", getattr(node, "attr", "")))
    ]
    assert not wrong, wrong
