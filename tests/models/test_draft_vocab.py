"""A draft vocabulary larger than the target's never becomes a head larger than the target's vocabulary:
the block families and Medusa refuse it when a run resolves its config (right after the target loads,
before any data is read or a head built), naming the target's vocabulary size; EAGLE-3 and P-EAGLE
clamp it (their default, 32,000, is larger than a small target's vocabulary)."""

import dataclasses

import pytest

from draftsmith import DraftsmithError
from draftsmith.models.registry import DRAFTERS

SIZED = [
    name for name, f in DRAFTERS.items() if "draft_vocab_size" in {x.name for x in dataclasses.fields(f.DrafterConfig)}
]


@pytest.mark.parametrize("name", SIZED)
def test_a_draft_vocabulary_larger_than_the_targets_is_refused_or_clamped(target4, name):
    family = DRAFTERS[name]
    vocab = target4.config.vocab_size
    tiny = {k: v for k, v in family.tiny.items() if k != "draft_vocab_size"}
    try:
        cfg = family.resolve(family.DrafterConfig(**tiny, draft_vocab_size=10_000_000), target4.config)
    except DraftsmithError as e:
        assert f"draft_vocab_size: 10000000 is more than the target's vocabulary ({vocab} tokens)" in str(e)
        assert "\n" not in str(e)
    else:
        rows = [p.shape[0] for n, p in family.build(cfg, target4).named_parameters() if "lm_head" in n]
        assert rows and max(rows) <= vocab, rows
    # Exactly the target's size is the whole vocabulary: accepted.
    family.build(family.resolve(family.DrafterConfig(**tiny, draft_vocab_size=vocab), target4.config), target4)
