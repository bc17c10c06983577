"""The staleness alarm: a drafter is refused on a target other than the one it was trained for (its
fingerprint, draftsmith/target/load.py), unless `--allow-stale`, which the report then states. Planted:
targets changed by the smallest realistic updates, each refused in bf16 and fp32."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.models import eagle
from draftsmith.models.folder import save_drafter
from draftsmith.target.load import fingerprint, load_target

pytestmark = pytest.mark.filterwarnings("ignore:.*no native bf16")  # explicit bf16 on an AVX2 CPU warns: expected


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")


@pytest.fixture(scope="module")
def drafter_dir(tiny_target_dir, tmp_path_factory):
    """An (untrained) EAGLE head saved for the tiny target: what training writes, fingerprint included."""
    target, _ = load_target(str(tiny_target_dir), "float32")
    torch.manual_seed(0)
    cfg = eagle.DrafterConfig()
    meta = {"drafter": "eagle", "drafter_config": {"type": "eagle", **cfg.__dict__}, "target": str(tiny_target_dir)}
    out = tmp_path_factory.mktemp("drafter") / "final"
    return save_drafter(eagle.build(cfg, target), out, {**meta, "target_fingerprint": fingerprint(target)})


def one_weight(model) -> None:
    """One weight of one layer moved by 1e-3 (the first of layer 0's q_proj: a position the
    fingerprint samples in every tensor; bf16 keeps the move, the weight being ~0.02)."""
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3


def one_step(model) -> None:
    """One AdamW step of fine-tuning at lr 1e-7 on one batch (every weight moves by <= ~1e-7)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, weight_decay=0.0)
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()


def _updated(tiny_target_dir, tmp_path, update):
    """The tiny target after `update`, saved as a folder with the same tokenizer."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, torch_dtype=torch.float32)
    update(model)
    out = tmp_path / f"updated-{update.__name__}"
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(out)
    return out


def _eval(drafter_dir, target_dir, chat_jsonl, out, dtype, *extra) -> int:
    args = ["eval", "--drafter", str(drafter_dir), "--target", str(target_dir), "--data", str(chat_jsonl)]
    args += ["--num-prompts", "1", "--max-new-tokens", "4", "--k", "2", "--dtype", dtype, "--out", str(out)]
    return main(args + list(extra))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("update", [None, one_weight, one_step], ids=["unbroken", "one-weight-1e-3", "one-step-lr1e-7"])
def test_planted_target_update_is_refused_without_allow_stale(
    drafter_dir, tiny_target_dir, chat_jsonl, tmp_path, capsys, dtype, update
):
    target_dir = tiny_target_dir if update is None else _updated(tiny_target_dir, tmp_path, update)
    if update is None:  # the target it was trained for: evaluated, nothing marked
        assert _eval(drafter_dir, target_dir, chat_jsonl, tmp_path / "e", dtype) == 0
        assert json.loads((tmp_path / "e" / "report.json").read_text())["stale"] is None
        return
    assert _eval(drafter_dir, target_dir, chat_jsonl, tmp_path / "e", dtype) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "drafter was trained for target" in err[0] and not (tmp_path / "e").exists()
    assert _eval(drafter_dir, target_dir, chat_jsonl, tmp_path / "e", dtype, "--allow-stale") == 0
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["stale"]["trained_for"] != report["stale"]["evaluated_on"]
    assert "**Stale drafter**" in (tmp_path / "e" / "report.md").read_text()
