"""Adding a family = its module ending in `FAMILY = Family(...)`, one line in models/registry.py, its
recipes and its row in docs/families.md. Everything that runs every family (benchmarks/tiny_target.py,
the tests' parametrizations, scripts/gpu-check.sh) reads the registry: a throwaway family of only what
a record must give (the entries without defaults, borrowed from EAGLE's module), registered for one
test, is listed by all of them and runs through train -> eval -> every export read back (--verify)."""

import dataclasses
import json

import pytest

from benchmarks import tiny_target
from draftsmith.cli import main as cli
from draftsmith.models.family import Family
from draftsmith.models.registry import DRAFTERS, load_drafter
from draftsmith.target.load import load_target
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from tests.architecture.test_registry import interface_problems
from tests.train.test_train import _overrides

# What a new family must give: the record's entries without a default.
REQUIRED = [
    f.name
    for f in dataclasses.fields(Family)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


@pytest.fixture
def toy(monkeypatch):
    """A family named `toy`, in the registry for this test only (saved folders record the name: they
    load through the registry, so only while it is there)."""
    borrowed = DRAFTERS["eagle"]
    family = Family(**{name: getattr(borrowed, name) for name in REQUIRED if name != "NAME"}, NAME="toy")
    monkeypatch.setitem(DRAFTERS, "toy", family)
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")  # no engine-side check: a tiny target
    return family


def test_a_new_family_needs_only_the_entries_without_defaults():
    assert REQUIRED == [
        "NAME",
        "DrafterConfig",
        "feature_names",
        "build",
        "rebuild",
        "compute_loss",
        "activation_bytes",
        "make_proposer",
        "EXPORTS",
        "recognises",
        "read_export",
        "from_export",
        "serving_snippet",
    ]


def test_a_registered_family_is_listed_everywhere_and_trains_evaluates_and_exports(
    toy, tiny_target_dir, chat_jsonl, tmp_path, capsys
):
    assert interface_problems(toy) == []
    assert tiny_target.tiny_drafters()["toy"] == {} and tiny_target.tiny_runs()["toy"] == {"drafter.type": "toy"}
    tiny_target.main(["--families", "3"])  # what scripts/gpu-check.sh runs
    listed = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert list(listed) == list(DRAFTERS) and listed["toy"] == ["vllm", "drafter.type=toy", "eval.k=3"]

    overrides = {
        **tiny_target.tiny_runs()["toy"],
        "optim.max_steps": 3,
        "eval.enabled": True,
        "eval.num_prompts": 2,
        "eval.max_new_tokens": 10,
        "eval.k": 2,
    }
    run = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **overrides)))
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["rule_exact"] is True and report["new_tokens"] > 0, report
    assert json.loads((run / "final" / "config.json").read_text())["drafter"] == "toy"
    target, _ = load_target(str(tiny_target_dir))
    assert load_drafter(run / "final", target)[0] is toy
    one = tmp_path / "one.jsonl"  # --verify decodes up to 3 holdout prompts: one is enough here
    one.write_text(chat_jsonl.read_text().splitlines()[0] + "\n")
    for fmt in toy.EXPORTS:
        out = tmp_path / fmt
        assert (
            cli(["export", str(run / "final"), "--format", fmt, "--out", str(out), "--verify", "--data", str(one)]) == 0
        )
        assert json.loads((out / "config.json").read_text())["draftsmith"]["drafter"] == "toy"
