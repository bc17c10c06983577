"""Self-speculative layer skipping: no skipped layer means acceptance 1.0, skipping stays lossless,
the calibration search returns a valid choice that compare can load; bad skip sets are errors."""

import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.engine import selfspec
from draftsmith.engine.speculative import Stats, speculative_decode, target_decode
from tests.conftest import make_target, make_tokenizer


@pytest.fixture
def deep_target(tmp_path):
    tok = make_tokenizer()
    target = make_target(vocab=len(tok), layers=4).requires_grad_(False)
    target.save_pretrained(tmp_path / "t4")
    tok.save_pretrained(tmp_path / "t4")
    return target, tok, tmp_path / "t4"


def test_no_skipped_layer_is_always_accepted_and_skipping_stays_lossless(deep_target):
    target, tok, _ = deep_target
    prompt = tok("say 9")["input_ids"]
    ref = target_decode(target, prompt, 24, set())
    stats = Stats(k=3)
    assert (
        speculative_decode(target, selfspec.layer_skip_proposer(target, []), prompt, 3, 24, set(), None, stats) == ref
    )
    assert stats.acceptance_rate == 1.0
    stats = Stats(k=3)
    assert (
        speculative_decode(target, selfspec.layer_skip_proposer(target, [1, 2]), prompt, 3, 24, set(), None, stats)
        == ref
    )
    assert len(target.get_decoder().layers) == 4  # the target is whole again after every draft


def test_bad_skip_sets_are_errors(deep_target):
    target, _, _ = deep_target
    with pytest.raises(DraftsmithError, match="skip layer 0 or every layer"):
        selfspec.SkipLayers(target, [0, 2])
    with pytest.raises(DraftsmithError, match="layers must be in 0..3"):
        selfspec.SkipLayers(target, [7])


def test_calibration_picks_layers_saves_them_and_compare_loads_them(deep_target, chat_jsonl, tmp_path):
    from draftsmith.eval.compare import compare
    from draftsmith.eval.config import EvalConfig

    target, tok, path = deep_target
    prompts = [encode_prompt(tok, p) for p in load_prompts(str(chat_jsonl), 2)]
    choice = selfspec.calibrate(
        target, tok, prompts, str(chat_jsonl), k=2, max_new_tokens=8, budget=5, log=lambda s: None
    )
    assert 0 not in choice["skip"] and len(choice["skip"]) < 3 and choice["evaluations"] <= 5
    assert choice["cost_fraction"] <= 1 and choice["tau"] >= 1
    out = selfspec.save(choice, target, str(path), tmp_path / "skip")
    assert json.loads((out / "layerskip.json").read_text())["skip"] == choice["skip"]
    reports = compare(
        [str(out)], [str(chat_jsonl)], target, tok, None, EvalConfig(k=2, num_prompts=2, max_new_tokens=8)
    )
    assert reports[0]["drafter"].startswith("layerskip") and reports[0]["lossless"]


def test_teacher_forced_tau_equals_decoded_tau(deep_target, chat_jsonl):
    """Calibration scores skip sets without decoding; for greedy chains its τ is exactly the τ that
    speculative decoding measures (drafts accepted so far are the target's own tokens)."""
    target, tok, _ = deep_target
    prompts = [encode_prompt(tok, p) for p in load_prompts(str(chat_jsonl), 3)]
    for skip, k in (([1], 2), ([1, 3], 3), ([2], 4)):
        decoded = selfspec.measure_tau(target, tok, prompts, skip, k, 16)
        runs = []
        for p in prompts:
            answer = target_decode(target, p, 16, set())
            runs.append(selfspec.replay_tau(selfspec.agreement(target, skip, p + answer[:1], answer[1:]), k))
        assert sum(e for e, _ in runs) / sum(n for _, n in runs) == pytest.approx(decoded)
    # k=2 over [T, T, F, T, T, T]: accept 2 + the target's token (p=3), accept 2 + 1 (p=6): 2 passes.
    assert selfspec.replay_tau([True, True, False, True, True, True], 2) == (6, 2)
    # [T, F, F, T]: accept 1 + 1 (p=2), accept 0 + 1 (p=3), accept the last agreement and stop: 3 passes.
    assert selfspec.replay_tau([True, False, False, True], 2) == (4, 3)
