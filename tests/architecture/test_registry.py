"""The registry is explicit; this keeps it in sync with the modules, the record's types, the recipes and the docs."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import pytest
import torch
import yaml

import draftsmith.models as models_pkg
from draftsmith.models.family import Family
from draftsmith.models.registry import DRAFTERS, INTERFACE
from tests.train.test_config import RECIPES

HINTS = typing.get_type_hints(Family)
ROOT = Path(__file__).resolve().parents[2]


def call_shapes(kind) -> list[tuple[int, tuple[str, ...]]]:
    """The calls a signature type of models/family.py allows, as (positional count, keyword names):
    a Callable[[...], R] one; a Protocol its shortest (required arguments) and its longest."""
    if getattr(kind, "_is_protocol", False):
        params = list(inspect.signature(kind.__call__).parameters.values())[1:]
        positional = [p for p in params if p.kind is p.POSITIONAL_ONLY]
        required = [p for p in positional if p.default is p.empty]
        return [(len(required), ()), (len(positional), tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY))]
    return [(len(typing.get_args(kind)[0]), ())]


def binds(fn, kind) -> bool:
    """Whether `fn` can be called as the signature type `kind` says."""
    try:
        sig = inspect.signature(fn)
        for n, keywords in call_shapes(kind):
            sig.bind(*range(n), **dict.fromkeys(keywords))
    except (TypeError, ValueError):
        return False
    return True


def interface_problems(family: Family) -> list[str]:
    """Where a record does not hold what models/family.py types it as: every callable callable as its
    signature says, DrafterConfig a dataclass, every writer a writer, SERVE_FORMAT one it writes, and
    its tiny sizes fields of its config."""
    problems = []
    for name in INTERFACE:
        value, kind = getattr(family, name), HINTS[name]
        if typing.get_origin(kind) in (typing.Union, type(int | None)):  # X | None
            if value is None:
                continue
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if name == "EXPORTS":
            writer = typing.get_args(kind)[1]
            problems += [f"EXPORTS[{fmt!r}] is no writer" for fmt, w in value.items() if not binds(w, writer)]
        elif name == "DrafterConfig":
            if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
                problems.append("DrafterConfig is not a dataclass")
        elif name in ("tiny", "tiny_lora"):
            if not dataclasses.is_dataclass(family.DrafterConfig):
                continue  # said above
            unknown = set(value) - {f.name for f in dataclasses.fields(family.DrafterConfig)}
            problems += [f"{name} sets {sorted(unknown)}, no fields of its DrafterConfig"] if unknown else []
        elif kind in (str, dict):
            problems += [] if isinstance(value, kind) else [f"{name} is not a {kind.__name__}"]
        elif not binds(value, kind):
            calls = " and ".join(f"{n} positional" + "".join(f", {k}=" for k in kw) for n, kw in call_shapes(kind))
            problems.append(f"{name}: {getattr(value, '__qualname__', value)} must take {calls} arguments")
    if family.SERVE_FORMAT is not None and family.SERVE_FORMAT not in family.EXPORTS:
        problems.append(f"SERVE_FORMAT {family.SERVE_FORMAT!r} is not one of its EXPORTS {list(family.EXPORTS)}")
    return problems


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_registered_family_has_the_shared_interface(name):
    family = DRAFTERS[name]
    assert family.NAME == name
    assert interface_problems(family) == []


def test_the_interface_check_sees_a_wrong_entry():
    eagle = DRAFTERS["eagle"]
    planted = {
        "feature_names": {"feature_names": lambda cfg: ()},  # one parameter short
        "compute_loss": {"compute_loss": lambda drafter, target, batch, feats, cfg: 0},  # no step=, forward=
        "resolve": {"resolve": lambda cfg, target_config: cfg},  # no init_config
        "EXPORTS": {"EXPORTS": {"vllm": lambda drafter, out: None}},
        "DrafterConfig": {"DrafterConfig": dict},
        "SERVE_FORMAT": {"SERVE_FORMAT": "sglang-official"},
        "tiny": {"tiny": {"num_heads": 2}},
    }
    for field, change in planted.items():
        problems = interface_problems(dataclasses.replace(eagle, **change))
        assert len(problems) == 1 and field in problems[0], (field, problems)


# Tests that keep a list of families by hand, and why. Every other test that runs every family reads the
# registry (DRAFTERS, or benchmarks/tiny_target.py's TINY_DRAFTERS / TINY_RUNS), so none lags a new one.
HAND_LISTS = {
    "tests/ship/test_serve_check.py": "the variants vLLM serves (marker vllm), at sizes its kernels take",
    "tests/ship/test_export.py": "the side-by-side benchmark's rows: four families (not yet from the registry)",
    "tests/test_bench.py": "benchmarks/block_step_cost.py measures the block drafters only",
}


def hand_lists(source: str) -> list[str]:
    """Literals (list, tuple, set, dict) that name three families or more, as strings or modules."""
    found, inside = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and id(node) not in inside:
            names = {getattr(n, "id", getattr(n, "value", None)) for n in ast.walk(node)} & set(DRAFTERS)
            if len(names) >= 3:
                found.append(f"line {node.lineno}: {sorted(names)}")
                inside |= {id(n) for n in ast.walk(node)}
    return found


def test_no_test_lists_the_families_by_hand():
    wrong = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in HAND_LISTS
        for hit in hand_lists(path.read_text())
    ]
    assert not wrong, "parametrize from the registry instead:\n" + "\n".join(wrong)
    assert hand_lists('CASES = [("eagle", {}), ("medusa", {}), ("distill", {})]\n') == [
        "line 1: ['distill', 'eagle', 'medusa']"
    ]


def test_every_family_module_is_registered():
    families = []
    for info in pkgutil.iter_modules(models_pkg.__path__):
        module = importlib.import_module(f"draftsmith.models.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "compute_loss"):
            families.append(module.NAME)
    assert sorted(families) == sorted(DRAFTERS)


def test_every_recipe_names_a_registered_drafter():
    for recipe in RECIPES:
        data = yaml.safe_load(recipe.read_text())
        assert data["drafter"]["type"] in DRAFTERS, recipe


def test_every_registered_family_has_a_recipe_and_a_row_in_the_docs():
    """Adding a family = its module, its registry line, its recipes and its docs."""
    trained = {yaml.safe_load(recipe.read_text())["drafter"]["type"] for recipe in RECIPES}
    docs = (ROOT / "docs" / "families.md").read_text()
    assert [name for name in DRAFTERS if name not in trained] == []
    assert [name for name in DRAFTERS if f"| `{name}`" not in docs] == []


def test_fingerprint_ignores_load_dtype_and_sees_an_update_of_any_one_matrix(tiny_target_dir):
    from draftsmith.target.load import fingerprint, load_target

    fp32, _ = load_target(str(tiny_target_dir), "fp32")
    bf16, _ = load_target(str(tiny_target_dir), "bf16")
    assert fingerprint(fp32) == fingerprint(bf16)
    before = fingerprint(fp32)
    with torch.no_grad():  # what a merged LoRA update does to one projection, and nothing else
        fp32.model.layers[-1].self_attn.v_proj.weight.add_(0.05)
    assert fingerprint(fp32) != before
