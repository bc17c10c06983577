"""Self-distillation in one target pass: the answers are exactly the target's greedy tokens, the
features captured while answering equal a fresh forward pass over the same tokens, and training
reads those ids verbatim."""

import json

import pytest
import torch

from draftsmith.data.batching import build_dataset
from draftsmith.data.features import FeatureCache
from draftsmith.data.regenerate import regenerate
from draftsmith.target.features import target_features
from draftsmith.target.generate import generate_batch
from draftsmith.target.load import ensure_pad, eos_ids, fingerprint

NAMES = ("hidden.0", "last_hidden")


@pytest.mark.fp32_exact
def test_answers_equal_unbatched_greedy_and_features_equal_a_fresh_forward(tiny_target):
    target, tok = tiny_target
    ensure_pad(tok)
    # Different lengths, so left padding and per-row positions are exercised.
    prompts = [tok("say hello")["input_ids"], tok("a much longer prompt, padded less")["input_ids"], [5, 6]]
    results = generate_batch(target, prompts, 12, eos_ids(target, tok), tok.pad_token_id, NAMES)
    for prompt, (answer, feats) in zip(prompts, results):
        ref = target.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
        )[0, len(prompt) :].tolist()
        eos = eos_ids(target, tok)
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert answer == ref[:cut]  # exactly the target's tokens, EOS included, nothing after it
        fresh = target_features(target, {"input_ids": torch.tensor([prompt + answer])}, NAMES)
        for n in NAMES:
            assert feats[n].shape == (len(prompt) + len(answer), target.config.hidden_size)
            assert feats[n].dtype == torch.float32
            torch.testing.assert_close(feats[n], fresh[n][0], atol=1e-4, rtol=1e-4)


@pytest.mark.fp32_exact
def test_regenerated_records_and_feature_cache_are_consistent(tiny_target, chat_jsonl, tmp_path):
    target, tok = tiny_target
    ensure_pad(tok)
    out, feats = tmp_path / "regen.jsonl", tmp_path / "feats"
    regenerate(
        target,
        tok,
        str(chat_jsonl),
        out,
        batch_size=5,
        max_new_tokens=10,
        max_examples=12,
        names=NAMES,
        features_out=feats,
        fingerprint=fingerprint(target),
    )
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(12))  # sorted by id although batched by length
    ds = build_dataset(str(out), tok, max_length=64)
    cache = FeatureCache(feats, NAMES, fingerprint(target))
    assert cache.index["dtype"] == "F32" and cache.index["num_examples"] == 12
    for ex in ds:
        row = rows[ex["idx"]]
        # The exact ids the target produced, never re-tokenized; loss on the answer only.
        assert ex["input_ids"] == (row["prompt_ids"] + row["completion_ids"])[:64]
        assert ex["loss_mask"] == ([0] * len(row["prompt_ids"]) + [1] * len(row["completion_ids"]))[:64]
        batch = {"input_ids": torch.tensor([ex["input_ids"]]), "idx": torch.tensor([ex["idx"]])}
        fresh = target_features(target, batch, NAMES)
        for n in NAMES:
            torch.testing.assert_close(cache(batch)[n], fresh[n], atol=1e-4, rtol=1e-4)


def test_cached_regeneration_reuses_one_pass_for_a_subset_of_features(tiny_target, chat_jsonl, tmp_path):
    from draftsmith.data.regenerate import cached_regeneration

    target, tok = tiny_target
    ensure_pad(tok)
    args = (target, tok, str(chat_jsonl), fingerprint(target), tmp_path, 6, 8, 4)
    records, wide = cached_regeneration(*args, names=NAMES)  # e.g. EAGLE-3's tensors
    mtime = records.stat().st_mtime_ns
    again, narrow = cached_regeneration(*args, names=("last_hidden",))  # e.g. EAGLE-1's, a subset
    assert again == records and narrow == wide and records.stat().st_mtime_ns == mtime  # no second pass
    assert cached_regeneration(*args, names=("hidden.1",))[1] is None  # not cached: a separate pass
