"""What the block drafters' tests (DFlash, DSpark, DFlash2) share: a tiny 4-layer target and a short
training run on random tokens."""

import pytest
import torch

from draftsmith.target.features import target_features


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """A tiny random 4-layer target: three distinct ctx layers below the last one."""
    from draftsmith.target.load import load_target
    from tests.conftest import save_target

    return load_target(str(save_target(tmp_path_factory.mktemp("tiny4"), layers=4)), "fp32")[0]


def block_feats(module, target, cfg, ids):
    """The target features a drafter of `module` trains on, for ids [B, T]."""
    return target_features(
        target,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        module.FAMILY.feature_names(cfg, target.config),
    )


def train_on_random_tokens(module, drafter, target, cfg, steps: int, metrics: set[str], ids=None):
    """`steps` AdamW steps (lr 3e-3) on 2 random sequences of 24 tokens (or `ids`), the first 4 masked;
    every step trains 16 anchors and reports exactly `metrics`. -> (ids [2, 24], per-step metric means)."""
    ids = torch.randint(5, 60, (2, 24)) if ids is None else ids
    lmask = torch.ones_like(ids)
    lmask[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lmask}
    feats = block_feats(module, target, cfg, ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    log = []
    for _ in range(steps):
        loss, n, m = module.compute_loss(drafter, target, batch, feats, cfg)
        assert int(n) == 16 and set(m) == metrics
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        log.append({k: (v / n).item() for k, v in m.items()})
    return ids, log
