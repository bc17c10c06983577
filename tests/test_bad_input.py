"""Bad input that used to get past: each is a one-line error naming what was wrong, a non-zero exit,
and no model loaded before the inputs were checked."""

import json
import subprocess
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.data.load import load_prompts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any target load fails the test: the inputs must be refused first."""
    from draftsmith.ship import serve_check

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(serve_check, "load_target", refuse)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_serve_check_on_a_folder_that_is_not_an_export(tmp_path, capsys, no_model_loads):
    folder = tmp_path / "not-an-export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    servers = ["--server", "http://127.0.0.1:9", "--target-server", "http://127.0.0.1:9"]  # no vLLM lookup either
    assert (
        main(["serve-check", str(folder), "--data", "builtin:code-holdout", "--out", str(tmp_path / "o"), *servers])
        == 1
    )
    line = _one_line(capsys)
    assert f"{folder}/config.json: not a draftsmith drafter or export" in line and "'draftsmith' section" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("levels", ["0", "1,0", "-2", "two"])
def test_serve_check_concurrency_errors_name_concurrency(levels, tmp_path, capsys, no_model_loads):
    assert (
        main(["serve-check", str(tmp_path), "--data", "x", "--out", str(tmp_path / "o"), "--concurrency", levels]) == 1
    )
    line = _one_line(capsys)
    assert "--concurrency: expected positive integers" in line and "--batch-sizes" not in line


def test_a_chat_role_outside_openais_is_refused_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "boop"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DraftsmithError,
        match=rf"^{path}:2: 'messages' role must be one of system, developer, user, "
        r"assistant, tool, got 'robot'$",
    ):
        load_prompts(str(path), malformed="error")
    assert len(load_prompts(str(path))) == 1  # skip mode: counted and named, never rendered
    assert f"skipped 1 of 2 malformed records ({path}:2: 'messages' role must be one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", "-1"], "--gpus: expected a whole number >= 0, got '-1'"),
        (["--cpu-procs", "two"], "--cpu-procs: expected a whole number >= 0, got 'two'"),
        (["--nodes", "0"], "--nodes: expected a whole number >= 1, got '0'"),
        (["--gpus", "8", "--nodes", "2", "--node-rank", "2"], "--node-rank: expected 0..1 for --nodes 2, got 2"),
    ],
)
def test_launch_refuses_impossible_counts(flags, message):
    r = subprocess.run(
        ["bash", "launch.sh", "recipes/cpu/eagle-smollm2.yaml", *flags, "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip() == f"launch.sh: error: {message}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["publish", "{run}", "--repo-id", "not a repo id!", "--dry-run"], "not a valid Hub repo id"),
        (
            ["publish", "{run}", "--repo-id", "me/x", "--format", "hf", "--dry-run"],
            "a eagle drafter exports to vllm, sglang",
        ),
        (["eval", "--drafter", "{run}", "--data", "{missing}"], "data file not found"),
        (["eval", "--drafter", "ngram", "--lookup", "--data", "builtin:code-holdout"], "'ngram' is not one"),
        (["eval", "--drafter", "ngram", "--timing-runs", "0", "--data", "builtin:code-holdout"], "--timing-runs >= 1"),
        (
            ["compare", "--drafter", "ngram", "--timing-runs", "0", "--data", "builtin:code-holdout", "--out", "{out}"],
            "--timing-runs >= 1",
        ),
        (["compare", "--drafter", "{run}", "--data", "{missing}", "--out", "{out}"], "data file not found"),
        (
            ["export", "{run}", "--format", "vllm", "--out", "{out}", "--verify", "--data", "{missing}"],
            "data file not found",
        ),
        (["data", "regenerate", "--data", "{missing}", "--out", "{out}"], "data file not found"),
        (["layerskip", "--data", "{missing}", "--out", "{out}"], "data file not found"),
    ],
)
def test_commands_check_their_inputs_before_loading_a_model(args, message, tmp_path, capsys, monkeypatch):
    """A drafter folder whose files are readable metadata only: any model load would fail loudly."""
    from draftsmith.target import load as target_module

    run = tmp_path / "final"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps(
            {
                "drafter": "eagle",
                "target": "smollm2-135m",
                "target_fingerprint": "x",
                "drafter_config": {},
                "draftsmith_format": 1,
            }
        )
    )
    (run / "model.safetensors").write_bytes(b"")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps({"rule_exact": True, "lossless": True}))

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(target_module, "load_target", refuse)
    fill = {"run": str(run), "missing": str(tmp_path / "missing.jsonl"), "out": str(tmp_path / "out")}
    assert main([a.format(**fill) for a in args]) == 1
    assert message in _one_line(capsys)


@pytest.mark.parametrize("command", [["train"], ["plan"], ["data", "inspect"], ["data", "features", "--out", "f"]])
def test_an_empty_source_in_a_plus_join_is_one_line(command, capsys, monkeypatch):
    """It once read '' as a dataset name: `draftsmith: error: : cannot load data (list index out of range)`."""
    monkeypatch.chdir(ROOT)
    assert main([*command, "recipes/cpu/eagle-smollm2.yaml", "data.train=builtin:code+"]) == 1
    assert _one_line(capsys) == "draftsmith: error: data.train: 'builtin:code+' has an empty part after '+'"


def test_regenerate_refuses_malformed_tool_use_before_loading_a_model(tmp_path, capsys, monkeypatch):
    """Tool calls whose arguments are no JSON, and a tool result that answers no call, are malformed
    records (tests/data/test_multiturn.py skips them among good ones); here every record is one."""
    from draftsmith.target import load as target_module

    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    user, result = {"role": "user", "content": "2+2?"}, {"role": "tool", "tool_call_id": "c1", "content": "4"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "add", "arguments": "{not json"}}],
    }
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in ([user, call, result], [user, result])))
    assert main(["data", "regenerate", "--data", str(path), "--out", str(tmp_path / "out.jsonl")]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"draftsmith: error: {path}: all 2 records are malformed ({path}:1: 'messages' turn 1")
    assert "'arguments' are not JSON" in line and f"{path}:2: 'messages' turn 1 is a tool result" in line
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.muon_lr=-1", "optim.muon_lr must be a finite number >= 0 (0: 10 x optim.lr), got -1.0"),
        ("optim.lr=-1e-3", "optim.lr must be a finite number > 0, got -0.001"),
        ("optim.lr=0", "optim.lr must be a finite number > 0, got 0.0"),  # muon's lr ratio divides by it
        ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
        ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0, got -0.1"),
        ("optim.muon_weight_decay=-1", "optim.muon_weight_decay must be a finite number >= 0, got -1.0"),
        ("optim.muon_momentum=1", "optim.muon_momentum must be a number in [0, 1), got 1.0"),
        ("optim.muon_momentum=-0.5", "optim.muon_momentum must be a number in [0, 1), got -0.5"),
        ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1), as [0.9, 0.95], got (0.9, 1.0)"),
        ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), as [0.9, 0.95], got (0.9,)"),
        ("optim.epochs=0", "optim.epochs must be a finite number > 0, got 0.0"),  # once: one silent step
        ("optim.max_steps=-1", "optim.max_steps must be an integer >= 0 (0: from optim.epochs), got -1"),
        ("optim.warmup_steps=-5", "optim.warmup_steps must be an integer >= 0, got -5"),
        ("optim.clip_grad=-1", "optim.clip_grad must be a finite number >= 0 (0: no clipping), got -1.0"),
        ("optim.seed=-1", "optim.seed must be an integer in 0 .. 2**31 - 1, got -1"),
        ("optim.grad_accum=0", "optim.grad_accum must be an integer >= 1, got 0"),
        ("optim.batch_size=0", "optim.batch_size must be an integer >= 1, got 0"),
        ("optim.schedule=step", "optim.schedule must be cosine, linear or constant, got 'step'"),
        ("optim.optimizer=sgd", "optim.optimizer must be adamw or muon, got 'sgd'"),
        ("optim.mixed_precision=fp8", "optim.mixed_precision"),
    ],
)
def test_every_optimizer_key_is_checked_when_the_recipe_is_read(override, message, tmp_path, capsys, monkeypatch):
    """`optim.muon_lr=-1` once ended in torch's traceback ("Learning rate should be >= 0") after the
    run folder was made, and the folder stayed."""
    from draftsmith.train import loop

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(loop, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "runs"
    assert main(["train", "recipes/cpu/dflash-smollm2.yaml", override, f"output_dir={out}"]) == 1
    assert _one_line(capsys).startswith(f"draftsmith: error: recipes/cpu/dflash-smollm2.yaml: {message}")
    assert not out.exists()
