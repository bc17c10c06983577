"""The install floor is honest: pyproject's `torch>=X` is at least the release that added every torch
API the package needs beyond old torch ([tool.draftsmith.torch-apis], kept beside the floor), each of
them exists in the torch installed here, and each is still used by the package (the list does not rot).
torch 2.4-2.8 once passed the floor while train/optimizer.py subclassed torch.optim.Muon (2.9) at import."""

import importlib
import re
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # the standard library from Python 3.11

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("draftsmith", "models", "train", "data", "eval")  # the package's rooms (pyproject package-dir)


def _pyproject(text: str | None = None) -> dict:
    return tomllib.loads(text if text is not None else (ROOT / "pyproject.toml").read_text())


def torch_floor(pyproject: dict) -> Version:
    """The `>=` bound of the torch requirement in [project] dependencies."""
    (req,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if Requirement(d).name == "torch"]
    (floor,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return floor


def resolve(dotted: str):
    """`torch.a.b.c` -> the object, importing the longest module prefix first (torch.distributed.fsdp)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def floor_problems(pyproject: dict) -> list[str]:
    """What is wrong with the floor against the API list: an API newer than the floor, or absent here."""
    floor, apis = torch_floor(pyproject), pyproject["tool"]["draftsmith"]["torch-apis"]
    wrong = [f"{api} was added in torch {v}, the floor is {floor}" for api, v in apis.items() if Version(v) > floor]
    for api in apis:
        try:
            resolve(api)
        except (ModuleNotFoundError, AttributeError):
            wrong.append(f"{api} is not in the installed torch {torch.__version__}")
    return wrong


def test_the_torch_floor_is_at_least_every_api_the_package_needs_and_each_exists():
    pyproject = _pyproject()
    assert pyproject["tool"]["draftsmith"]["torch-apis"], "the list beside the floor is empty"
    assert floor_problems(pyproject) == []
    installed = Version(torch.__version__.split("+")[0])
    (req,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert installed in req.specifier  # the torch these tests run on is one the package allows


def test_every_listed_api_is_used_by_the_package():
    """An entry whose API the package dropped would hold the floor up for nothing; one never used is a typo."""
    source = "\n".join(p.read_text() for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
    for api in _pyproject()["tool"]["draftsmith"]["torch-apis"]:
        module, _, name = api.rpartition(".")
        used = api in source or re.search(rf"from {re.escape(module)} import .*\b{re.escape(name)}\b", source)
        assert used, f"{api} is listed beside the torch floor but the package does not use it"


@pytest.mark.parametrize(
    "edit, message",
    [
        (('"torch>=2.9,', '"torch>=2.4,'), "torch.optim.Muon was added in torch 2.9, the floor is 2.4"),
        (('"torch.optim.Muon" = "2.9"', '"torch.optim.Muon" = "2.10"'), "was added in torch 2.10, the floor is 2.9"),
        (('"torch.optim.Muon"', '"torch.optim.Muonn"'), "torch.optim.Muonn is not in the installed torch"),
        (('"torch.distributed.fsdp.fully_shard"', '"torch.distributed.fsdpp.fully_shard"'), "fsdpp.fully_shard is"),
    ],
)
def test_a_planted_wrong_floor_or_entry_is_caught(edit, message):
    text = (ROOT / "pyproject.toml").read_text()
    assert edit[0] in text  # the edit plants into today's pyproject, not into nothing
    problems = floor_problems(_pyproject(text.replace(edit[0], edit[1])))
    assert any(message in p for p in problems), problems
