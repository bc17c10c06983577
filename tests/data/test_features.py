"""The feature cache and its derived features (data/features.py)."""

import pytest
import torch

from draftsmith.data.batching import build_dataset, collate
from draftsmith.data.features import FeatureCache, write_cache
from draftsmith.target.features import target_features
from draftsmith.target.load import fingerprint

NAMES = ("hidden.0", "last_hidden", "argmax")


@pytest.mark.fp32_exact
def test_a_cache_stores_last_hidden_and_derives_argmax_once_per_example_as_online_features_do(
    tiny_target, chat_jsonl, tmp_path
):
    target, tok = tiny_target
    ds = build_dataset(str(chat_jsonl), tok, max_length=48, max_examples=6)
    out = write_cache(target, ds, NAMES, tmp_path / "feats", fingerprint(target), tok.pad_token_id, batch_size=4)
    cache = FeatureCache(out, NAMES, fingerprint(target), target)
    assert cache.index["features"] == ["hidden.0", "last_hidden"]  # the derived one is not stored
    batch = collate([ds[i] for i in (4, 1, 2)], tok.pad_token_id)
    read, fresh = cache(batch), target_features(target, batch, NAMES)
    real = batch["attention_mask"].bool()
    assert read["argmax"].shape == batch["input_ids"].shape and read["argmax"].dtype == torch.long
    assert torch.equal(read["argmax"][real], fresh["argmax"][real])
    assert torch.equal(fresh["argmax"], target.get_output_embeddings()(fresh["last_hidden"]).argmax(-1))
    assert len(cache.derived) == 3
    cache(batch)  # read again: taken from memory, not derived again
    assert len(cache.derived) == 3
    # No target (one sharded over the ranks): the derived feature is left out, the stored ones read as before.
    plain = FeatureCache(out, NAMES, fingerprint(target))(batch)
    assert set(plain) == {"hidden.0", "last_hidden"} and torch.equal(plain["last_hidden"], read["last_hidden"])
