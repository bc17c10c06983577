"""The EAGLE feature/token offset and the drafter's inference-time KV cache."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from draftsmith.models import eagle
from draftsmith.target.features import target_features
from draftsmith.util.masks import causal_mask


class Recorder(nn.Module):
    """Stands in for the drafter: records its inputs and returns a chosen output."""

    def __init__(self, output):
        super().__init__()
        self.output, self.calls = output, []

    def forward(self, features, embeds, padding, steps=1):
        self.calls.append((features, embeds))
        return [self.output]


def _batch(target):
    torch.manual_seed(0)
    ids = torch.randint(5, 90, (2, 12))
    lmask = torch.zeros_like(ids)
    lmask[:, 6:] = 1  # tokens 6..11 are "assistant" tokens
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lmask}


def test_feature_i_is_paired_with_token_i_plus_1(tiny_target):
    target, _ = tiny_target
    batch = _batch(target)
    f = target_features(target, batch, eagle.FEATURES)["last_hidden"]
    cfg = eagle.DrafterConfig(feature_noise=0.0)
    exact = Recorder(f[:, 1:])  # a perfect drafter outputs f_{i+1} at position i
    exact.eval()
    loss, n, m = eagle.compute_loss(exact, target, batch, {"last_hidden": f}, cfg)
    feats_in, embeds_in = exact.calls[0]
    assert torch.equal(feats_in, f[:, :-1])  # position i sees f_i ...
    assert torch.equal(embeds_in, target.get_input_embeddings()(batch["input_ids"][:, 1:]))  # ... and token i+1
    # Loss counts position i iff token i+2 is an assistant token: positions 4..9 of 11.
    assert n.item() == 2 * 6
    assert m["feat_loss"].item() == 0 and m["acc"].item() == n.item()
    # Off by one (predicting f_i instead of f_{i+1}) is penalised.
    lagging = Recorder(f[:, :-1]).eval()
    loss_lag, _, m_lag = eagle.compute_loss(lagging, target, batch, {"last_hidden": f}, cfg)
    assert m_lag["feat_loss"] > 0 and loss_lag > loss


@pytest.mark.fp32_exact
def test_proposer_cache_matches_a_full_recompute(tiny_target):
    """The first draft after each round equals the argmax of a cache-free forward over all real pairs."""
    target, _ = tiny_target
    torch.manual_seed(0)
    drafter = eagle.build(eagle.DrafterConfig(), target).eval()
    proposer = eagle.make_proposer(drafter, target, eagle.DrafterConfig())
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    tokens = torch.randint(5, 90, (1, 20))
    f = target_features(target, {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}, ("last_hidden",))[
        "last_hidden"
    ]
    for n in (8, 11, 12, 17):  # growing context, as rounds accept tokens
        draft = proposer.propose(tokens[:, :n], {"last_hidden": f[:, : n - 1]}, k=3)
        with torch.no_grad():
            t = n - 1
            h = drafter.step(f[:, :t], embed(tokens[:, 1:n]), torch.arange(t)[None], causal_mask(t, t))
        assert draft.tokens[0] == int(lm_head(h[:, -1]).argmax())
        assert draft.parents == [-1, 0, 1]  # a chain


def test_causal_mask_with_cache_offset():
    m = causal_mask(2, 5)[0, 0]
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    padded = causal_mask(3, 3, torch.tensor([[1, 1, 0]]))[0, 0]
    assert padded[1].tolist() == [True, True, False] and padded[2, 2]  # a pad query sees itself only


def test_hass_alignment_step_j_matches_inference_draft_step_j(tiny_target):
    """HASS context alignment: unrolled training pass j gives, for a chain rooted at r, the output
    cached inference gives at draft step j when the earlier drafts were the true tokens."""
    target, _ = tiny_target
    torch.manual_seed(0)
    drafter = eagle.build(eagle.DrafterConfig(hass=True), target).eval()
    ids = torch.randint(5, 90, (1, 14))
    f = target_features(target, {"input_ids": ids}, eagle.FEATURES)["last_hidden"]
    t, steps, root = ids.shape[1] - 1, 3, 5
    embed = target.get_input_embeddings()
    with torch.no_grad():
        train = drafter(f[:, :t], embed(torch.nn.functional.pad(ids, (0, steps - 1))[:, 1:]), torch.ones(1, t), steps)
        cache = DynamicCache()
        out = drafter.step(
            f[:, : root + 1],
            embed(ids[:, 1 : root + 2]),
            torch.arange(root + 1)[None],
            causal_mask(root + 1, root + 1),
            cache,
        )[:, -1:]
        for j in range(steps):
            assert torch.allclose(out[0, 0], train[j][0, root], atol=1e-5), j
            pos = root + 1 + j
            out = drafter.step(
                out, embed(ids[:, pos + 1 : pos + 2]), torch.tensor([[pos]]), causal_mask(1, pos + 1), cache
            )


def test_hass_training_counts_every_alignment_step(tiny_target):
    target, _ = tiny_target
    batch = _batch(target)
    f = target_features(target, batch, eagle.FEATURES)
    torch.manual_seed(0)
    drafter = eagle.build(eagle.DrafterConfig(), target)
    plain, n, m = eagle.compute_loss(drafter, target, batch, f, eagle.DrafterConfig(feature_noise=0.0))
    torch.manual_seed(0)
    hass_cfg = eagle.DrafterConfig(feature_noise=0.0, hass=True, hass_steps=3)
    hass, n_h, m_h = eagle.compute_loss(drafter, target, batch, f, hass_cfg)
    assert n_h == n and set(m_h) >= {"acc", "acc1", "acc2"}
    assert hass > plain  # two more alignment passes and the top-k term add loss
    hass.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
