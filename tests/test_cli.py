"""The CLI contract: subcommands, one-line errors with non-zero exit, baselines."""

import importlib
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from draftsmith.cli import COMMANDS, Group, main
from tests.conftest import lossless_ok

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    """publish and export --verify also serve the export in vLLM when it is installed; these tiny
    targets (head dim 8) are below what vLLM's CPU attention takes, so here it is switched off
    (tests/ship/test_serve_check.py serves real exports)."""
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_contract_subcommands(capsys):
    out = _help(capsys)
    for sub in ("train", "eval", "data", "export", "compare", "plan", "publish", "layerskip"):
        assert sub in out
    for sub in ("eval", "export", "compare", "plan", "publish"):
        assert "examples:" in _help(capsys, sub), sub


def _table(table=COMMANDS) -> list:
    """(name, Command) of every command, those of `data` included."""
    return [row for name, e in table.items() for row in (_table(e.commands) if isinstance(e, Group) else [(name, e)])]


def test_every_command_of_the_table_runs_a_function_of_its_arguments():
    """The table names each function as `module:function` (imported only when it runs): a typo there
    would surface only when a user runs that command, so every one is imported here."""
    for name, command in _table():
        module, function = command.run.split(":")
        run = getattr(importlib.import_module(module), function)
        assert typing.get_type_hints(run)["args"] is command.args, name


def test_help_imports_only_the_flags():
    """`draftsmith --help` builds every parser from the argument dataclasses alone: no command module,
    no transformers (seconds on a small CPU)."""
    code = (
        "import json, sys; from draftsmith.cli import build_parser; build_parser(); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('draftsmith', 'transformers')))))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout)
    assert not [m for m in loaded if m == "transformers" or m.endswith(".commands") or ".run" in m], loaded


def test_the_installed_entry_point_exits_non_zero_with_one_line():
    """The in-process tests below call `main`; this one goes through `python -m draftsmith.cli`."""
    r = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "train", "nope.yaml"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 1 and r.stderr.strip() == "draftsmith: error: nope.yaml: recipe file not found"


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "nope.yaml"], "nope.yaml: recipe file not found"),
        (["train", "recipes/cpu/eagle-smollm2.yaml", "optim.lrr=1"], "unknown key 'lrr'; did you mean 'lr'"),
        (
            ["eval", "--drafter", "/nonexistent", "--data", "x.jsonl", "--target", "smollm2-135m"],
            "not a draftsmith drafter folder",
        ),
        (
            ["eval", "--drafter", "none", "--data", "x.jsonl", "--tree", "dynamic:depth=two"],
            "--tree: bad item 'depth=two'",
        ),
        (["plan", "recipes/llama-3.1-8b/eagle3.yaml", "--gpus", "0"], "plan: expected --gpus >= 1"),
        (
            ["eval", "--drafter", "none", "--data", "x.jsonl", "--batch-sizes", "1,0"],
            "--batch-sizes: expected positive integers",
        ),
        (
            ["eval", "--drafter", "none", "--data", "x.jsonl", "--batch-sizes", "two"],
            "--batch-sizes: expected positive integers",
        ),
        (["compare", "--drafter", "/nonexistent", "--data", "x", "--out", "o"], "not a draftsmith drafter folder"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes are named relative to the repository, as a user types them
    assert main(args) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_malformed_jsonl_through_the_cli(tiny_target_dir, tmp_path, capsys):
    bad = tmp_path / "holdout.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    # One bad line is skipped (counted, with its file:line) ...
    assert (
        main(
            [
                "eval",
                "--drafter",
                "none",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(bad),
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "e"),
            ]
        )
        == 0
    )
    assert "skipped 1 of 2 malformed records" in capsys.readouterr().err
    # ... and data with nothing valid in it is an error naming the first reason.
    bad.write_text('{"prompt": \n{"nothing": 1}\n')
    assert (
        main(
            [
                "eval",
                "--drafter",
                "none",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(bad),
                "--out",
                str(tmp_path / "f"),
            ]
        )
        == 1
    )
    assert "holdout.jsonl:1: malformed JSON line" in capsys.readouterr().err


def test_baselines_none_and_ngram(tiny_target_dir, chat_jsonl, tmp_path):
    for drafter in ("none", "ngram"):
        out = tmp_path / drafter
        assert (
            main(
                [
                    "eval",
                    "--drafter",
                    drafter,
                    "--target",
                    str(tiny_target_dir),
                    "--data",
                    str(chat_jsonl),
                    "--num-prompts",
                    "3",
                    "--max-new-tokens",
                    "10",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        r = json.loads((out / "report.json").read_text())
        assert lossless_ok(r) and r["drafter"] == drafter and r["num_prompts"] == 3
        if drafter == "none":
            assert r["tau"] == 1.0 and r["per_position"] == [] and r["k"] == 0
    # Prompt lookup proposes chains; asking it for a tree is a one-line error.
    assert (
        main(
            [
                "eval",
                "--drafter",
                "ngram",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
                "--tree",
                "dynamic",
            ]
        )
        == 1
    )


def test_regenerate_is_resumable(tiny_target_dir, chat_jsonl, tmp_path):
    out = tmp_path / "regen.jsonl"
    partial = tmp_path / "regen.jsonl.partial"
    # An interrupted earlier run left two finished answers and a cut line.
    partial.write_text(
        json.dumps(
            {"id": 0, "messages": [{"role": "user", "content": "say 0"}, {"role": "assistant", "content": "KEEP"}]}
        )
        + "\n"
        + json.dumps(
            {"id": 1, "messages": [{"role": "user", "content": "say 1"}, {"role": "assistant", "content": "KEEP"}]}
        )
        + "\n"
        + '{"id": 2, "mess'
    )
    assert (
        main(
            [
                "data",
                "regenerate",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
                "--out",
                str(out),
                "--max-examples",
                "6",
                "--batch-size",
                "4",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(6)) and not partial.exists()
    assert rows[0]["messages"][-1]["content"] == "KEEP"  # finished work was not redone
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)


def test_data_corpus_makes_the_folder_of_its_out(tmp_path, capsys):
    """Users' records go in datasets/ (git-ignored), which a fresh checkout does not have yet."""
    out = tmp_path / "datasets" / "code-holdout.jsonl"
    assert main(["data", "corpus", "builtin:code-holdout", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and f"wrote {len(rows)} records to {out}" in capsys.readouterr().out
