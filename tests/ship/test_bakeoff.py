"""`draftsmith bakeoff` end to end on a tiny target: a recipe trained at the step budget and served
through a stand-in for vLLM's server (tests/ship/fake_vllm: it starts in a fraction of a second and
answers token ids, so what is timed is real HTTP round trips, not vLLM), a given drafter whose family
vLLM does not serve measured in draftsmith's engine, and the table, plot and deploy config checked
against what bakeoff.json says was measured. vLLM itself serving exports, its verdicts and its reading
of a deploy config are tested against a real vLLM in tests/ship/test_serve_check.py."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.ship import bakeoff as bk
from draftsmith.ship import deploy
from draftsmith.target import vllm_server

FAKE = Path(__file__).parent / "fake_vllm"


def _fake_python(folder: Path) -> str:
    """A Python whose `vllm` is the stand-in (as test_serve_check's server start/stop test makes it)."""
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return str(python)


def _holdout(path: Path, words: list[str]) -> str:
    rows = [{"messages": [{"role": "user", "content": f"{w} {i}"}]} for i, w in enumerate(words)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny 4-layer target, its training chats, two domains, an eagle3 recipe and a trained eagle folder."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.conftest import save_target
    from tests.train.test_train import _overrides

    root = tmp_path_factory.mktemp("bakeoff")
    target = save_target(root / "target", layers=4)
    chats = root / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": "abcdefgh"[i % 8] * 9}]}
        for i in range(24)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = root / "eagle3-tiny.yaml"
    recipe.write_text(
        f"target: {target}\ndrafter:\n  type: eagle3\n  aux_layers: [0, 1, 2]\n  draft_vocab_size: 60\n"
        f"data:\n  train: {chats}\n  max_length: 64\noptim:\n  batch_size: 4\n  warmup_steps: 1\n"
    )
    overrides = _overrides(target, chats, root / "runs", **{"run": "eagle-tiny", "optim.max_steps": 2})
    eagle = train(load_config(None, overrides)) / "final"
    return {
        "root": root,
        "recipe": str(recipe),
        "eagle": str(eagle),
        "code": _holdout(root / "code.jsonl", ["def", "class", "import"]),
        "prose": _holdout(root / "prose.jsonl", ["once", "upon", "time"]),
    }


def _what_vllm_reads(config: dict, model: str, python: str, max_model_len: int = 1024, max_num_seqs: int = 16):
    """deploy.in_vllm's answer as vLLM's config code gives it (the stand-in has no config code): the
    schedule, each range's K over its batch sizes, the last carried on."""
    ks = []
    for lo, hi, k in config[deploy.SCHEDULE_KEY]:
        ks += [k] * (hi - lo + 1)
    ks += [ks[-1]] * (max_num_seqs - len(ks))
    return {
        "method": config["method"],
        "num_speculative_tokens": config["num_speculative_tokens"],
        "schedule": config[deploy.SCHEDULE_KEY],
        "k_per_batch_size": ks[:max_num_seqs],
    }


def _train_in_process(argv: list[str], log: Path) -> int:
    """bakeoff's `draftsmith train` command line, run in this process (a new one costs ~8 s of imports
    on 2 cores; `test_a_failed_training_is_one_line_naming_the_recipe_and_its_log` starts a real one)."""
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        return main(argv)


def _cells(md: str) -> tuple[list[str], list[list[str]]]:
    """The first table of bakeoff.md -> (its header, its rows), cells stripped."""
    lines = [l for l in md.split("\n\n") if l.startswith("| drafter | family")][0].splitlines()
    split = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    return split(lines[0]), [split(l) for l in lines[2:]]


def test_bakeoff_trains_serves_falls_back_and_writes_table_plot_and_deploy_config(setup, tmp_path, monkeypatch):
    from draftsmith.models import eagle

    monkeypatch.setenv(vllm_server.PYTHON_ENV, _fake_python(tmp_path))
    monkeypatch.setattr(eagle.FAMILY, "SERVE_FORMAT", None)  # vLLM "does not serve" EAGLE-1: draftsmith's engine
    monkeypatch.setattr(deploy, "in_vllm", _what_vllm_reads)
    real = bk.sc.serve_check

    def passing(*args, **kwargs):  # the stand-in answers 7s, not the target's tokens: its verdict is moot here
        return {**real(*args, **kwargs), "passed": True, "why": None}

    monkeypatch.setattr(bk.sc, "serve_check", passing)
    monkeypatch.setattr(bk, "train_process", _train_in_process)
    out = tmp_path / "out"
    argv = ["bakeoff", "--drafter", setup["recipe"], "--drafter", setup["eagle"], "--steps", "2"]
    argv += ["--data", setup["code"], "--data", setup["prose"], "--concurrency", "1,2", "--k", "2"]
    argv += ["--num-prompts", "3", "--max-new-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "bakeoff.json").read_text())

    # The recipe trained here at the budget; the given folder taken as it is.
    trained, given = r["rows"]
    assert trained["drafter"] == "eagle3-tiny" and trained["recipe"] == setup["recipe"] and trained["steps"] == 2
    assert (out / "train" / "eagle3-tiny" / "final" / "model.safetensors").is_file()
    assert trained["train_seconds"] > 0 and given["recipe"] is None and given["path"] == setup["eagle"]
    # eagle3 in vLLM, eagle (not served) in draftsmith's engine, both on both domains at both levels.
    assert trained["engine"] == "vllm" and given["engine"] == "draftsmith"
    assert given["vllm_refused"] == "vLLM serves no export of this family" and trained["vllm_refused"] is None
    assert {(c["drafter"], c["domain"], c["engine"]) for c in r["cells"]} == {
        (d, h, e)
        for d, e in (("eagle3-tiny", "vllm"), ("eagle-tiny", "draftsmith"))
        for h in (setup["code"], setup["prose"])
    }
    for c in r["cells"]:
        assert [p["concurrency"] for p in c["curve"]] == [1, 2] and c["k"] == 2
        for p in c["curve"]:
            assert p["speedup"] == pytest.approx(p["spec_tokens_per_s"] / p["target_tokens_per_s"], rel=0.01)
    vllm_cell = next(c for c in r["cells"] if c["engine"] == "vllm")
    check = json.loads(Path(vllm_cell["report"]).read_text())  # serve-check's own report of that cell
    assert (
        vllm_cell["tau"] == check["vllm_tau"] and vllm_cell["curve"][1]["speedup"] == check["concurrency"][1]["speedup"]
    )

    # Geomean across domains per level, recomputed here from the cells.
    for row in r["rows"]:
        for i, c in enumerate((1, 2)):
            xs = [bk.speedup_at(x, c) for x in r["cells"] if x["drafter"] == row["drafter"]]
            assert row["geomean_speedup"][i]["speedup"] == pytest.approx(math.prod(xs) ** (1 / len(xs)), abs=1e-3)

    # The table: every measured cell as bakeoff.json has it; one row per engine, so none is in bold (a lone
    # row of an engine has no rival: test_bold_is_the_best_passed_row_of_one_engine).
    header, rows = _cells((out / "bakeoff.md").read_text())
    assert header[:4] == ["drafter", "family", "engine", "trained"] and header[-1] == "geomean c=2"
    assert [row[:3] for row in rows] == [["eagle3-tiny", "eagle3", "vLLM"], ["eagle-tiny", "eagle", "draftsmith"]]
    cols = bk.measured_columns(r)
    assert header[4:] == [head for head, _, _ in cols] and "code τ" in header and "prose c=1" in header
    for j, (head, fmt, values) in enumerate(cols):
        for row, value in zip(rows, values):
            shown = row[4 + j]
            assert shown.strip("*") == fmt.format(value), head
            assert "**" not in shown, head
    # The plot, and the deploy config from the one drafter vLLM served, measured again on the first domain.
    assert (out / "bakeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = r["deploy"]
    assert (
        d["drafter"] == "eagle3-tiny"
        and d["domain"] == setup["code"]
        and d["path"] == str(out / "deploy" / "vllm.json")
    )
    config = deploy.read(out / "deploy" / "vllm.json")
    measured = json.loads((out / "deploy" / "measured.json").read_text())
    runs = {int(k): {int(c): v for c, v in by_c.items()} for k, by_c in measured["tokens_per_s_runs"].items()}
    best = deploy.choose_k(runs[0], {k: v for k, v in runs.items() if k})  # the rule, on the runs it wrote
    assert measured["runs"] == 3 and all(len(v) == 3 for by_c in runs.values() for v in by_c.values())
    assert config == d["speculative_config"] and config["method"] == "eagle3"
    assert config[deploy.SCHEDULE_KEY] == deploy.schedule(best) and sorted(measured["spec_tokens_per_s"]) == ["2"]
    assert not list(out.glob("*.tmp")) and not (out / "deploy.tmp").exists()


def test_a_failed_training_is_one_line_naming_the_recipe_and_its_log(tmp_path):
    with pytest.raises(DraftsmithError) as e:
        bk.train_recipe(str(tmp_path / "gone.yaml"), "gone", 2, tmp_path / "train", [])
    log = tmp_path / "train" / "gone.log"
    assert (
        str(e.value)
        == f"--drafter {tmp_path}/gone.yaml: training failed ({tmp_path}/gone.yaml: recipe file not found; log {log})"
    )


def _bakeoff_result(rows: list[tuple[str, str, bool, float, float]]) -> dict:
    """A bakeoff.json of one domain at concurrency 1: per row (drafter, engine, passed, τ, speedup)."""
    return {
        "data": ["code.jsonl"],
        "concurrency": [1],
        "rows": [
            {
                "drafter": name,
                "family": "eagle3",
                "engine": engine,
                "passed": passed,
                "steps": 2,
                "train_seconds": 1.0,
                "recipe": "r.yaml",
                "geomean_speedup": [{"concurrency": 1, "speedup": speedup}],
            }
            for name, engine, passed, _, speedup in rows
        ],
        "cells": [
            {
                "drafter": name,
                "domain": "code.jsonl",
                "engine": engine,
                "tau": tau,
                "curve": [{"concurrency": 1, "speedup": speedup}],
            }
            for name, engine, _, tau, speedup in rows
        ],
    }


def test_bold_is_the_best_passed_row_of_one_engine():
    """A failed vLLM row best in every column and a draftsmith-engine row best beside the vLLM rows are
    neither in bold; among the passed vLLM rows the best of each column is (ties too). A second
    draftsmith row gives that engine a column best of its own."""
    rows = [
        ("a", "vllm", True, 2.5, 1.5),  # best passed vLLM τ
        ("b", "vllm", True, 2.0, 1.8),  # best passed vLLM speedup
        ("c", "vllm", False, 3.0, 2.5),  # failed: best of all vLLM rows, never bold
        ("d", "draftsmith", True, 3.5, 3.0),  # another engine: best of all rows, alone in its engine
        ("e", "vllm", True, 2.5, 1.0),  # ties a's τ
    ]
    header, shown = _cells(bk.table(_bakeoff_result(rows)))
    assert header[4:] == ["code τ", "code c=1", "geomean c=1"]
    bold = {(row[0], head) for row in shown for head, cell in zip(header[4:], row[4:]) if cell.startswith("**")}
    assert bold == {("a", "code τ"), ("e", "code τ"), ("b", "code c=1"), ("b", "geomean c=1")}
    assert [row[4:] for row in shown][2:4] == [["3.00", "2.50x", "2.50x"], ["3.50", "3.00x", "3.00x"]]
    _, shown = _cells(bk.table(_bakeoff_result([*rows, ("f", "draftsmith", True, 1.5, 0.9)])))
    assert shown[3][4:] == ["**3.50**", "**3.00x**", "**3.00x**"] and "**" not in "".join(shown[5])


def test_no_deploy_config_without_a_drafter_that_vllm_served_and_passed(tmp_path):
    rows = [
        {"drafter": "a", "engine": "vllm", "passed": False, "geomean_speedup": [{"concurrency": 1, "speedup": 2.0}]},
        {
            "drafter": "b",
            "engine": "draftsmith",
            "passed": True,
            "geomean_speedup": [{"concurrency": 1, "speedup": 3.0}],
        },
    ]
    got = bk.deploy_best(rows, [], "builtin:code-holdout", tmp_path, {}, [3])
    assert got == {"path": None, "why": "no drafter was served by vLLM with its serve-check passed"}
    assert not list(tmp_path.iterdir())


def test_a_refused_export_is_tried_on_the_first_domain_only(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(
        bk.sc, "serve_check", lambda *a, **k: asked.append(a[1]) or {"loaded": False, "why": "ValueError: no"}
    )
    d = bk.Drafter("x", tmp_path, None, "eagle3")
    assert bk.in_vllm(d, ["builtin:code-holdout", "builtin:prose-holdout"], tmp_path, {}) == "ValueError: no"
    assert asked == ["builtin:code-holdout"]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any target load or training fails the test: the inputs must be refused first."""
    from draftsmith.ship import serve_check
    from draftsmith.target import load

    def refuse(*a, **k):
        raise AssertionError("a model was loaded or trained before the inputs were checked")

    monkeypatch.setattr(serve_check, "load_target", refuse)
    monkeypatch.setattr(load, "load_target", refuse)
    monkeypatch.setattr(bk, "train_recipe", refuse)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--drafter", "nowhere"], "--drafter nowhere: neither a trained drafter folder"),
        (["--data", "builtin:nope"], "--data builtin:nope: unknown built-in corpus"),
        (["--steps", "0"], "--steps: give the training budget"),
        (["--train-arg", "optim.max_steps=9"], "--train-arg optim.max_steps=9: optim.max_steps is set by bakeoff"),
        (["--concurrency", "1,4"], "--concurrency (raise --num-prompts"),
        (["--concurrency", "1,0"], "--concurrency: expected positive integers"),
        (["--vllm-python", "/no/python"], "vLLM not found (/no/python does not exist)"),
    ],
)
def test_bad_input_is_one_line_before_any_model_loads(setup, flags, message, tmp_path, capsys, no_model_loads):
    base = {
        "--drafter": setup["recipe"],
        "--data": setup["code"],
        "--steps": "2",
        "--num-prompts": "3",
        "--concurrency": "1,2",
    }
    base.update(dict(zip(flags[::2], flags[1::2])))
    argv = ["bakeoff", *[x for kv in base.items() for x in kv], "--out", str(tmp_path / "o")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_drafters_of_two_targets_or_one_name_twice_are_refused(setup, tmp_path, no_model_loads):
    other = tmp_path / "other" / "final"
    other.mkdir(parents=True)
    meta = json.loads((Path(setup["eagle"]) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**meta, "target": "another-target"}))
    (other / "model.safetensors").write_bytes((Path(setup["eagle"]) / "model.safetensors").read_bytes())
    with pytest.raises(DraftsmithError, match="--drafter: drafters of different targets"):
        bk.bakeoff([setup["eagle"], str(other)], [setup["code"]], tmp_path / "o", num_prompts=3)
    with pytest.raises(DraftsmithError, match="--drafter: two drafters named eagle-tiny"):
        bk.bakeoff([setup["eagle"], setup["eagle"]], [setup["code"]], tmp_path / "o", num_prompts=3)


@pytest.mark.vllm
@pytest.mark.vllm_families
@pytest.mark.skipif(not vllm_server.available(), reason="no vLLM: bash scripts/setup.sh --vllm")
def test_bakeoff_in_real_vllm_writes_a_deploy_config_vllm_reads_and_serves(tmp_path, monkeypatch):
    """The same flow against vLLM itself (about 5 server starts): an EAGLE-3 drafter of the pattern
    target (tests/conftest.py: a tiny target with learnable answers, which vLLM's CPU attention takes)."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.conftest import save_pattern_target, write_pattern_chats
    from tests.train.test_train import _overrides

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one engine process (test_serve_check.py)
    target = save_pattern_target(tmp_path / "target")
    chats = write_pattern_chats(tmp_path / "train.jsonl", range(130))
    holdout = write_pattern_chats(tmp_path / "holdout.jsonl", range(200, 204))
    extra = {"run": "eagle3", "data.regenerate": True, "optim.max_steps": 60, "optim.lr": 3e-3, "optim.batch_size": 8}
    extra.update({"drafter.type": "eagle3", "drafter.aux_layers": [0, 1, 2], "drafter.draft_vocab_size": 60})
    final = train(load_config(None, _overrides(target, chats, tmp_path / "runs", **extra))) / "final"
    r = bk.bakeoff([str(final)], [holdout], tmp_path / "out", concurrency=[1, 2], num_prompts=4, max_new_tokens=24)
    (row,), d = r["rows"], r["deploy"]
    assert row["engine"] == "vllm" and row["passed"], [c["why"] for c in r["cells"]]
    assert r["vllm_version"].startswith("vllm") and r["cells"][0]["tau"] > 1.2
    config = deploy.read(out := tmp_path / "out" / "deploy" / "vllm.json")
    assert d["path"] == str(out) and config["method"] == "eagle3"
    # vLLM's own config code read the schedule back as the K chosen at each measured concurrency.
    assert d["vllm_reads"]["k_per_batch_size"][:2] == [d["chosen_k"][1], d["chosen_k"][2]]
    assert (tmp_path / "out" / "bakeoff.png").is_file() and "Deploy config" in (
        tmp_path / "out" / "bakeoff.md"
    ).read_text()
