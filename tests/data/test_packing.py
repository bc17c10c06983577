"""Packed batches (data/packing.py): every example once per epoch, rows within max_length, and the
same features, losses and gradients as the padded batch of the same examples, for every family."""

import dataclasses

import datasets
import pytest
import torch

from draftsmith.data.batching import collate
from draftsmith.data.packing import collate_packed, epoch_packed_batches, pack_rows
from draftsmith.models.registry import DRAFTERS, drafter_family
from draftsmith.target.features import target_features
from draftsmith.util.masks import document_causal_mask, same_document


def _examples(lengths=(19, 7, 12, 16, 9), prompts=(4, 0, 3, 1, 4), seed=0) -> list[dict]:
    """Examples of different lengths, each a prompt (no loss) then an answer (loss), ids in 5..99.
    Examples 1 and 3 carry loss from their first tokens on, so a label that crossed from the example
    before them in a packed row would be counted (and fail the equality)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(5, 100, (n,), generator=g).tolist(),
            "loss_mask": [0] * p + [1] * (n - p),
            "idx": i,
        }
        for i, (n, p) in enumerate(zip(lengths, prompts))
    ]


# Laid out as packed rows: [0, 1] (26 tokens), [2, 3] (28), [4] (9), against 5 padded rows of 19.
ROWS = [[0, 1], [2, 3], [4]]


@pytest.fixture(scope="module")
def target3(tmp_path_factory):
    from draftsmith.target.load import load_target
    from tests.conftest import save_target

    return load_target(str(save_target(tmp_path_factory.mktemp("tiny3"), layers=3)), "fp32")[0]


def test_pack_rows_keeps_every_example_once_within_the_width():
    lengths = [30, 5, 12, 30, 8, 20, 1, 17]
    rows = pack_rows(lengths, list(range(len(lengths))), 32)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    assert rows[0] == [0, 6] and [1, 2, 4] in rows  # first fit: a short example fills an earlier row's gap


def test_packed_epochs_are_a_pure_function_of_seed_and_epoch():
    lengths = [((7 * i) % 40) + 3 for i in range(200)]
    a = epoch_packed_batches(lengths, 64, 4, seed=3, epoch=1)
    assert a == epoch_packed_batches(lengths, 64, 4, seed=3, epoch=1)
    assert a != epoch_packed_batches(lengths, 64, 4, seed=3, epoch=2)
    assert sorted(i for batch in a for row in batch for i in row) == list(range(200))
    assert all(len(b) == 4 for b in a[:-1]) and all(sum(lengths[i] for i in row) <= 64 for b in a for row in b)
    # Packing fills rows: far fewer rows than examples, little of them padding.
    used = sum(lengths) / (64 * sum(len(b) for b in a))
    assert used > 0.9, used


def test_collate_packed_restarts_positions_and_numbers_the_documents():
    ex = _examples()
    b = collate_packed([[ex[i] for i in row] for row in ROWS], pad_id=0)
    assert b["input_ids"].shape == (3, 28)
    assert b["input_ids"][0].tolist() == ex[0]["input_ids"] + ex[1]["input_ids"] + [0, 0]
    assert b["position_ids"][0].tolist() == list(range(19)) + list(range(7)) + [0, 0]
    assert b["documents"][0].tolist() == [1] * 19 + [2] * 7 + [0, 0]
    assert b["loss_mask"][2].tolist() == ex[4]["loss_mask"] + [0] * 19
    assert b["idx"].tolist() == [[0, 1], [2, 3], [4, -1]]


def test_document_masks_keep_each_example_to_itself():
    docs = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mask = document_causal_mask(docs)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False]  # its own earlier tokens only
    assert mask[1].tolist() == [True, True, False, False, False, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # padding sees itself (no NaN), carries no loss
    assert same_document(docs, 1)[0].tolist() == [True, False, True, True, False, False]
    assert same_document(docs, 2)[0].tolist() == [False, False, True, False, False, False]


def test_packed_target_features_equal_each_examples_own(target3):
    ex = _examples()
    packed = collate_packed([[ex[i] for i in row] for row in ROWS], pad_id=0)
    names = ("hidden.0", "hidden.2", "last_hidden")
    got = target_features(target3, packed, names)
    for r, row in enumerate(ROWS):
        start = 0
        for i in row:
            n = len(ex[i]["input_ids"])
            own = target_features(target3, collate([ex[i]], 0), names)
            for name in names:
                torch.testing.assert_close(got[name][r, start : start + n], own[name][0], rtol=1e-5, atol=1e-5)
            start += n


def test_a_feature_cache_reads_a_packed_batch_as_the_target_computes_it(target3, tmp_path):
    from draftsmith.data.features import FeatureCache, write_cache

    ex = _examples()
    names = ("hidden.1", "last_hidden", "argmax")
    folder = write_cache(target3, datasets.Dataset.from_list(ex), names, tmp_path / "f", "fp", pad_id=0)
    packed = collate_packed([[ex[i] for i in row] for row in ROWS], pad_id=0)
    got, want = FeatureCache(folder, names, "fp", target3)(packed), target_features(target3, packed, names)
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


# Every candidate kept where a family draws at random (block anchors, P-EAGLE's chains), so the
# packed and the padded step train the same positions; no feature noise (EAGLE-1's draws differ with
# the batch's shape).
EVERY = {"num_anchors": 10_000, "keep_ratio": 1.0, "keep_min": 1.0, "feature_noise": 0.0}


def _step(fam, cfg, drafter, target, batch):
    feats = target_features(target, batch, fam.feature_names(cfg, target.config))
    drafter.zero_grad()
    loss, n, metrics = fam.compute_loss(drafter, target, batch, feats, cfg)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
    return loss.detach(), int(n), {k: float(v) for k, v in metrics.items()}, grads


# Every family at its tiny sizes, and its LoRA variant where it has one (Medusa-2's backbone, a LoRA
# student): those run a backbone over the batch themselves.
CASES = {name: (name, {}) for name in DRAFTERS}
CASES |= {f"{name}+lora": (name, fam.tiny_lora) for name, fam in DRAFTERS.items() if fam.tiny_lora}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_packed_batch_gives_every_family_the_padded_loss_and_gradients(case, target3):
    name, lora = CASES[case]
    fam = drafter_family(name)
    fields = {f.name for f in dataclasses.fields(fam.DrafterConfig)}
    cfg = fam.DrafterConfig(**fam.tiny, **lora, **{k: v for k, v in EVERY.items() if k in fields})
    ex = _examples()
    torch.manual_seed(0)
    drafter = fam.build(cfg, target3, datasets.Dataset.from_list(ex))
    padded = _step(fam, cfg, drafter, target3, collate(ex, 0))
    packed = _step(fam, cfg, drafter, target3, collate_packed([[ex[i] for i in row] for row in ROWS], 0))
    assert packed[1] == padded[1] > 0  # the same trained tokens
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-5)
    assert packed[2].keys() == padded[2].keys()
    for k in padded[2]:
        assert packed[2][k] == pytest.approx(padded[2][k], rel=1e-4, abs=1e-4), k
    assert packed[3].keys() == padded[3].keys() and padded[3]
    for k in padded[3]:
        torch.testing.assert_close(packed[3][k], padded[3][k], rtol=1e-4, atol=1e-5, msg=k)
