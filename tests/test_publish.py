"""`draftsmith publish`: the folder and model card, the parity check, refusals, and the upload
through huggingface_hub's API boundary (mocked; no network)."""

import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.cli import main


@pytest.fixture
def run(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.test_train import _overrides

    return train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{
        "drafter.type": "eagle3", "drafter.aux_layers": [0, 1, 1], "drafter.draft_vocab_size": 60,
        "eval.enabled": True, "eval.num_prompts": 2, "eval.max_new_tokens": 10, "eval.k": 3})))


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
    assert main(["publish", str(run / "final"), "--repo-id", "me/eagle3-tiny", "--format", "sglang", "--dry-run",
                 "--out", str(out), "--target", str(tiny_target_dir), "--license", "apache-2.0"]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "report.json", "acceptance.png", "resolved_config.yaml"} <= files
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
    assert main(["publish", str(run / "final"), "--repo-id", "me/eagle3-tiny", "--private", "--revision", "v1",
                 "--target", str(tiny_target_dir)]) == 0
    out = run / "publish-speculators"  # eagle3's default format
    assert FakeApi.calls[0] == ("init", "hf_SECRET_token_123")
    assert ("create_repo", "me/eagle3-tiny", True) in FakeApi.calls and ("create_branch", "me/eagle3-tiny", "v1") in FakeApi.calls
    assert ("upload_folder", str(out), "me/eagle3-tiny", "v1") in FakeApi.calls
    printed = capsys.readouterr()
    assert "hf_SECRET" not in printed.out + printed.err
    assert not any("hf_SECRET" in p.read_bytes().decode("latin-1") for p in out.iterdir())
    assert "vllm serve me/eagle3-tiny" in (out / "README.md").read_text()


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
    report.write_text(json.dumps({**data, "lossless": False}))
    assert main(base + ["--repo-id", "me/x", "--dry-run"]) == 1
    assert "not lossless; refusing to publish" in capsys.readouterr().err
    assert main(base + ["--repo-id", "me/x", "--dry-run", "--force"]) == 0
    report.unlink()
    assert main(base + ["--repo-id", "me/x", "--dry-run"]) == 1
    assert "no eval report" in capsys.readouterr().err
    assert not (run / "publish-speculators.tmp").exists()


def test_a_medusa2_drafter_publishes_its_heads_and_the_merged_backbone(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.test_medusa import MEDUSA2
    from tests.test_train import _overrides

    run = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **MEDUSA2, **{
        "eval.enabled": True, "eval.num_prompts": 2, "eval.max_new_tokens": 10, "eval.k": 2})))
    assert main(["publish", str(run / "final"), "--repo-id", "me/medusa2-tiny", "--dry-run",
                 "--target", str(tiny_target_dir)]) == 0
    out = run / "publish-vllm"
    assert (out / "backbone" / "config.json").is_file() and (out / "backbone" / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert "the `backbone/` folder of this repo" in card and "(passed)" in card and '"method": "medusa"' in card


def test_export_verify_reports_serving_parity_and_catches_a_bad_mapping(run, tiny_target_dir, chat_jsonl, capsys,
                                                                        monkeypatch):
    import torch

    from draftsmith.models import export as export_module

    args = ["export", str(run / "final"), "--format", "speculators", "--out", str(run / "spec"), "--verify",
            "--target", str(tiny_target_dir), "--data", str(chat_jsonl)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "serving parity on" in out and "draft-token agreement 100.0%" in out
    real = export_module.read_export

    def misread(path, family, target):  # a consumer that maps one tensor wrongly
        state = real(path, family, target)
        state["lm_head.weight"] = torch.flip(state["lm_head.weight"], dims=[0])
        return state

    monkeypatch.setattr(export_module, "read_export", misread)
    assert main(args) == 1
    assert "does not draft like the drafter" in capsys.readouterr().err
