"""`draftsmith publish`: the folder and model card, the parity check, refusals, and the upload
through huggingface_hub's API boundary (mocked; no network)."""

import importlib.util
import json
import re

import pytest

from benchmarks.tiny_target import TINY_DRAFTERS
from draftsmith.cli import main


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    """publish and export --verify also serve the export in vLLM when it is installed; these tiny
    targets (head dim 8) are below what vLLM's CPU attention takes, so here it is switched off
    (tests/ship/test_serve_check.py serves real exports)."""
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """Three layers in this module: speculators' loader refuses repeated EAGLE-3 aux layers."""
    from tests.conftest import save_target

    return save_target(tmp_path_factory.mktemp("tiny-target-3"), layers=3)


@pytest.fixture
def run(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    return train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path,
                **{
                    "drafter.type": "eagle3",
                    "drafter.aux_layers": [0, 1, 2],
                    "drafter.draft_vocab_size": 60,
                    "eval.enabled": True,
                    "eval.num_prompts": 2,
                    "eval.max_new_tokens": 10,
                    "eval.k": 3,
                },
            ),
        )
    )


class FakeApi:
    calls = []

    def __init__(self, token=None):
        FakeApi.calls.append(("init", token))

    def create_repo(self, repo_id, private=False, exist_ok=False):
        FakeApi.calls.append(("create_repo", repo_id, private))

    def create_branch(self, repo_id, branch, exist_ok=False):
        FakeApi.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, folder_path, repo_id, revision=None, commit_message=""):
        FakeApi.calls.append(("upload_folder", folder_path, repo_id, revision))


def test_dry_run_writes_the_folder_with_a_model_card_and_uploads_nothing(run, tiny_target_dir, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any upload attempt would fail loudly
    out = run / "publish"
    assert (
        main(
            [
                "publish",
                str(run / "final"),
                "--repo-id",
                "me/eagle3-tiny",
                "--format",
                "sglang",
                "--dry-run",
                "--out",
                str(out),
                "--target",
                str(tiny_target_dir),
                "--license",
                "apache-2.0",
            ]
        )
        == 0
    )
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "README.md",
        "report.json",
        "acceptance.png",
        "resolved_config.yaml",
    } <= files
    card = (out / "README.md").read_text()
    head = card.split("---")[1]
    assert f"base_model: {tiny_target_dir}" in head and "license: apache-2.0" in head and "- eagle3" in head
    assert "| drafter | draft | τ |" in card and "Measured on" not in card and "measured on" in card
    assert "--speculative-algorithm EAGLE3" in card and "--speculative-draft-model-path me/eagle3-tiny" in card
    assert "draft-token agreement 100.0%" in card and "(passed)" in card
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_upload_goes_through_huggingface_hub_and_the_token_never_shows(run, tiny_target_dir, monkeypatch, capsys):
    import huggingface_hub

    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_token_123")
    assert (
        main(
            [
                "publish",
                str(run / "final"),
                "--repo-id",
                "me/eagle3-tiny",
                "--private",
                "--revision",
                "v1",
                "--target",
                str(tiny_target_dir),
            ]
        )
        == 0
    )
    out = run / "publish-speculators"  # eagle3's default format
    assert FakeApi.calls[0] == ("init", "hf_SECRET_token_123")
    assert ("create_repo", "me/eagle3-tiny", True) in FakeApi.calls and (
        "create_branch",
        "me/eagle3-tiny",
        "v1",
    ) in FakeApi.calls
    assert ("upload_folder", str(out), "me/eagle3-tiny", "v1") in FakeApi.calls
    printed = capsys.readouterr()
    assert "hf_SECRET" not in printed.out + printed.err
    assert not any("hf_SECRET" in p.read_bytes().decode("latin-1") for p in out.iterdir())
    card = (out / "README.md").read_text()
    assert "vllm serve me/eagle3-tiny" in card
    if importlib.util.find_spec("speculators"):  # the card states that speculators ran the drafter too
        assert "and ran it (first draft step, every prompt position)" in card and "argmax agreement 100.0%." in card


def test_refusals_are_one_line_errors(run, tiny_target_dir, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(run / "no-hf-home"))  # no stored token either
    base = ["publish", str(run / "final"), "--target", str(tiny_target_dir)]
    assert main(base + ["--repo-id", "me/x"]) == 1
    assert "not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN" in capsys.readouterr().err
    assert main(base + ["--repo-id", "not a repo id!", "--dry-run"]) == 1
    assert "not a valid Hub repo id" in capsys.readouterr().err
    assert main(base + ["--repo-id", "me/x", "--format", "hf", "--dry-run"]) == 1
    assert "a eagle3 drafter exports to sglang, vllm, speculators" in capsys.readouterr().err
    report = run / "eval" / "report.json"
    data = json.loads(report.read_text())
    # bf16 near-ties: outputs differ from a target-only decode while every round followed the rule.
    report.write_text(json.dumps({**data, "lossless": False, "lossless_mismatches": 1, "rule_exact": True}))
    assert main(base + ["--repo-id", "me/x", "--dry-run"]) == 0
    card = (run / "publish-speculators" / "README.md").read_text()
    assert "rule-exact (every round emitted what the verification rule gives" in card
    assert (
        f"identical to a separately run target-only decode on {data['num_prompts'] - 1} of {data['num_prompts']}"
        in card
    )
    report.write_text(json.dumps({**data, "rule_exact": False}))
    assert main(base + ["--repo-id", "me/x", "--dry-run"]) == 1
    assert "broke the verification rule (rule_exact false)" in capsys.readouterr().err
    assert main(base + ["--repo-id", "me/x", "--dry-run", "--force"]) == 1  # --force covers a missing report only
    assert "broke the verification rule" in capsys.readouterr().err
    report.unlink()
    assert main(base + ["--repo-id", "me/x", "--dry-run"]) == 1
    assert "no eval report" in capsys.readouterr().err
    assert main(base + ["--repo-id", "me/x", "--dry-run", "--force"]) == 0
    assert not (run / "publish-speculators.tmp").exists()


def test_a_standalone_eval_leaves_the_runs_report_and_card_alone(run, tiny_target_dir, chat_jsonl, capsys):
    from pathlib import Path

    own = {f: (run / "eval" / f).read_bytes() for f in ("report.json", "report.md", "acceptance.png")}
    check = [
        "eval",
        "--drafter",
        str(run / "final"),
        "--target",
        str(tiny_target_dir),
        "--data",
        str(chat_jsonl),
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "6",
        "--k",
        "2",
        "--tree",
        "static:[[0],[1],[0,0]]",
    ]
    for again in ("", "-2"):  # a quick check with a throwaway tree, twice: each beside the run's report, by name
        assert main(check) == 0
        wrote = Path(re.search(r"^wrote (.+)/report\.json", capsys.readouterr().out, re.M).group(1))
        assert wrote == run / "evals" / f"{chat_jsonl.stem}-k2-static-tree-1p{again}"
        assert json.loads((wrote / "report.json").read_text())["num_prompts"] == 1
    assert {f: (run / "eval" / f).read_bytes() for f in own} == own
    # The card states the training run's eval, not the check.
    assert (
        main(
            [
                "publish",
                str(run / "final"),
                "--repo-id",
                "me/x",
                "--dry-run",
                "--out",
                str(run / "pub"),
                "--target",
                str(tiny_target_dir),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (run / "pub" / "report.json").read_bytes() == own["report.json"]
    assert f"{json.loads(own['report.json'])['num_prompts']} prompts" in (run / "pub" / "README.md").read_text()
    # An explicit --out holding a report needs --force; one holding anything else is never replaced.
    for out, message in (
        (run / "eval", "already holds a report (report.json); --force replaces it"),
        (run, "not a report's files"),
    ):
        assert main(check + ["--out", str(out)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main(check + ["--out", str(run), "--force"]) == 1 and (run / "final").is_dir()
    assert {f: (run / "eval" / f).read_bytes() for f in own} == own
    assert main(check + ["--out", str(wrote), "--force"]) == 0


def test_a_medusa2_drafter_publishes_its_heads_and_the_merged_backbone(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.models.test_medusa import MEDUSA2
    from tests.train.test_train import _overrides

    run = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path,
                **MEDUSA2,
                **{"eval.enabled": True, "eval.num_prompts": 2, "eval.max_new_tokens": 10, "eval.k": 2},
            ),
        )
    )
    assert (
        main(
            [
                "publish",
                str(run / "final"),
                "--repo-id",
                "me/medusa2-tiny",
                "--dry-run",
                "--target",
                str(tiny_target_dir),
            ]
        )
        == 0
    )
    out = run / "publish-vllm"
    assert (out / "backbone" / "config.json").is_file() and (out / "backbone" / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert "the `backbone/` folder of this repo" in card and "(passed)" in card and '"method": "medusa"' in card


@pytest.mark.fp32_exact
def test_export_verify_reports_serving_parity_and_catches_a_bad_mapping(
    run, tiny_target_dir, chat_jsonl, capsys, monkeypatch
):
    import torch

    from draftsmith.models import eagle3

    args = [
        "export",
        str(run / "final"),
        "--format",
        "speculators",
        "--out",
        str(run / "spec"),
        "--verify",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(chat_jsonl),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "serving parity on" in out and "draft-token agreement 100.0%" in out
    assert "max |Δ logits| 0.00e+00" in out and "(argmax agreement 100.0%)" in out
    if importlib.util.find_spec("speculators"):  # scripts/setup.sh installs it; the check says when it is absent
        assert "`SpeculatorModel.from_pretrained` loaded it as Eagle3DraftModel" in out and "unused none" in out
        # speculators' own forward ran next to the drafter: fp32 rounding only, same argmax everywhere
        ran = re.search(
            r"and ran it \(first draft step, every prompt position\): max \|Δ logits\| (\S+) over (\d+) "
            r"rows, argmax agreement 100\.0%\.",
            out,
        )
        assert ran and float(ran[1]) < 1e-5 and int(ran[2]) > 0, out
    else:
        assert "speculators' own loader was not run (speculators is not installed)" in out
    real = eagle3.read_export

    def misread(path, target):  # a consumer that maps one tensor wrongly
        state = real(path, target)
        state["lm_head.weight"] = torch.flip(state["lm_head.weight"], dims=[0])
        return state

    monkeypatch.setattr(eagle3, "read_export", misread)
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "does not draft like the drafter" in captured.err
    assert "max |Δ logits| 0.00e+00" not in captured.out


@pytest.mark.skipif(not importlib.util.find_spec("speculators"), reason="speculators is not installed")
def test_speculators_forward_catches_what_the_load_check_and_our_reading_cannot(
    run, tiny_target_dir, chat_jsonl, capsys, monkeypatch
):
    """Reversed aux layer ids in the exported config: every tensor still loads unchanged, and our own
    re-reading (which takes the layers from the draftsmith section) drafts the same, but speculators'
    forward fuses the wrong order of layers."""
    from draftsmith.models import eagle3

    real = eagle3.EXPORTS["speculators"]

    def reversed_ids(drafter, cfg, target, meta, tok, out, info):
        real(drafter, cfg, target, meta, tok, out, info)
        config = json.loads((out / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"][::-1]
        (out / "config.json").write_text(json.dumps(config))

    monkeypatch.setitem(eagle3.EXPORTS, "speculators", reversed_ids)
    assert (
        main(
            [
                "export",
                str(run / "final"),
                "--format",
                "speculators",
                "--out",
                str(run / "spec"),
                "--verify",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert (
        "draft-token agreement 100.0%" in out
        and "max |Δ logits| 0.00e+00" in out
        and "unused none, max |Δ| 0.0e+00" in out
    )
    assert "— FAILED: " in out and "> 1e-04" in out, out


def _train(target_dir, data, tmp_path, family: str, extra: dict):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    return train(
        load_config(
            None,
            _overrides(
                target_dir, data, tmp_path, run=family, **{"drafter.type": family, "optim.max_steps": 2, **extra}
            ),
        )
    )


@pytest.mark.parametrize("family", TINY_DRAFTERS)
def test_parity_compares_logits_of_every_family(tiny_target_dir, chat_jsonl, tmp_path, family):
    """The logits tap finds each family's logits (EAGLE's function, Medusa's heads, the student's forward,
    a block's pass), in the format vLLM serves it from, for every registered family at its tiny size."""
    from draftsmith.models.registry import DRAFTERS
    from draftsmith.ship.export import export
    from draftsmith.ship.publish import verify_export
    from draftsmith.target.load import load_target

    target, tok = load_target(str(tiny_target_dir))
    fmt = DRAFTERS[family].SERVE_FORMAT or next(iter(DRAFTERS[family].EXPORTS))
    run = _train(tiny_target_dir, chat_jsonl, tmp_path, family, TINY_DRAFTERS[family])
    out = export(run / "final", target, fmt, tmp_path / f"{family}-export", tok)
    parity = verify_export(run / "final", out, target, tok, str(chat_jsonl), k=2, prompts=1, max_new_tokens=8)
    # fp32 rounding only: the hf export saves the student with its LoRA merged, the drafter merges on load
    assert parity["logit_rows"] > 0 and parity["max_abs_logit_diff"] < 1e-5, family
    assert parity["logit_argmax_agreement"] == 1.0 and parity["passed"], family


@pytest.mark.skipif(not importlib.util.find_spec("speculators"), reason="speculators is not installed")
@pytest.mark.parametrize("switches", [{"norm_before_fc": True}, {"fc_norm": True}], ids=lambda s: "+".join(s))
def test_eagle31_exports_carry_their_switches_where_vllm_reads_them_and_speculators_runs_them(
    tiny_target_dir, chat_jsonl, tmp_path, capsys, switches
):
    """speculators' own forward (its input_norm / fc_norm code, not ours) on the exported folder gives
    our logits; the switches sit at the config's top level with vLLM's tensor names; SGLang's format,
    which has no such switches, refuses the head."""
    from safetensors.torch import load_file

    run = _train(
        tiny_target_dir,
        chat_jsonl,
        tmp_path,
        "eagle3",
        {
            "drafter.aux_layers": [0, 1, 2],
            "drafter.draft_vocab_size": 60,
            "drafter.norm_output": True,
            **{f"drafter.{k}": v for k, v in switches.items()},
        },
    )
    spec = tmp_path / "spec"
    assert (
        main(
            [
                "export",
                str(run / "final"),
                "--format",
                "speculators",
                "--out",
                str(spec),
                "--verify",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "loaded it as Eagle3DraftModel" in out and "unused none" in out and "argmax agreement 100.0%." in out, out
    config, state = json.loads((spec / "config.json").read_text()), load_file(spec / "model.safetensors")
    assert config["norm_output"] is True and all(config[k] is v for k, v in switches.items())
    expect = {"input_norm.weight"} if "norm_before_fc" in switches else {f"fc_norm.{i}.weight" for i in range(3)}
    assert expect <= set(state) and not any("norm_before_fc" in k for k in config["transformer_layer_config"])
    assert (
        main(
            [
                "export",
                str(run / "final"),
                "--format",
                "sglang",
                "--out",
                str(tmp_path / "sg"),
                "--target",
                str(tiny_target_dir),
            ]
        )
        == 1
    )
    assert "exports only as --format speculators" in capsys.readouterr().err and not (tmp_path / "sg").exists()


def _moved(real, name: str, step):
    """The speculators writer, then one weight of the file moved by `step(w)` (an exporter that
    rounds, scales or mis-copies one value): the realistic partial defect of a weight mapping."""
    import torch
    from safetensors.torch import load_file, save_file

    def writer(drafter, cfg, target, meta, tok, out, info):
        real(drafter, cfg, target, meta, tok, out, info)
        state = load_file(out / "model.safetensors")
        w = state[name].clone()
        w.view(-1)[0] = step(w.view(-1)[0])
        assert not torch.equal(w, state[name])  # the file holds the move
        save_file({**state, name: w}, out / "model.safetensors", metadata={"format": "pt"})

    return writer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planted_export_with_one_weight_moved_fails_export_verify(
    tiny_target_dir, chat_jsonl, tmp_path, capsys, monkeypatch, dtype
):
    """One weight of the drafter's one layer moved by 1e-3 moves its logits by 1e-5 (fp32) to 2e-3
    (bf16), under the logit tolerance (an argmax flips only where an untrained head has a near-tie):
    the weights read back show it, and the smallest move the file can hold (one float step) too."""
    import torch

    from draftsmith.models import eagle3
    from draftsmith.ship.export import export
    from draftsmith.ship.publish import speculators_line, verify_export
    from draftsmith.target.load import load_target

    run = _train(
        tiny_target_dir,
        chat_jsonl,
        tmp_path,
        "eagle3",
        {"drafter.aux_layers": [0, 1, 2], "drafter.draft_vocab_size": 60},
    )
    args = ["export", str(run / "final"), "--format", "speculators", "--out", str(tmp_path / "spec"), "--verify"]
    assert main(args + ["--target", str(tiny_target_dir), "--data", str(chat_jsonl), "--dtype", dtype]) == 0
    assert "Weights read back: 15 tensors, identical." in capsys.readouterr().out  # the unbroken export passes
    target, tok = load_target(str(tiny_target_dir), {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    real, name = eagle3.EXPORTS["speculators"], "layers.0.self_attn.k_proj.weight"
    for step in (lambda w: w + 1e-3, lambda w: torch.nextafter(w, torch.tensor(1.0, dtype=w.dtype))):
        monkeypatch.setitem(eagle3.EXPORTS, "speculators", _moved(real, name, step))
        out = export(run / "final", target, "speculators", tmp_path / "moved", tok)
        parity = verify_export(run / "final", out, target, tok, str(chat_jsonl), prompts=1, max_new_tokens=8)
        assert not parity["passed"] and parity["weight_diff_at"] == "Eagle3Drafter.midlayer.self_attn.k_proj.weight"
        assert 0 < parity["max_abs_weight_diff"] < 1.01e-3 and parity["max_abs_logit_diff"] <= parity["logit_tolerance"]
        assert "— they differ from the trained drafter's." in speculators_line(parity)
