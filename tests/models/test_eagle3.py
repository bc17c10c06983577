"""EAGLE-3: draft vocabulary, training-time-test masks, TTT loss offsets, cached inference."""

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Stats, speculative_greedy, target_greedy
from draftsmith.models import eagle3
from draftsmith.models.training import draft_vocab
from draftsmith.target.features import target_features
from draftsmith.util.masks import causal_mask


def _cfg(**kw):
    return eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40, ttt_steps=3, **kw)


def _dataset():
    # Token 7 is the most frequent trained token; token 9 is frequent but never trained (mask 0).
    return {
        "input_ids": [[9, 9, 9, 7, 7, 8], [9, 9, 7, 50, 51, 7]],
        "loss_mask": [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]],
    }


def test_draft_vocab_is_most_frequent_trained_tokens_with_consistent_maps(tiny_target):
    target, _ = tiny_target
    ids = draft_vocab(_dataset(), 105, 4)
    assert ids.tolist() == [7, 8, 50, 51]
    d = eagle3.build(eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=4), target, _dataset())
    assert (eagle3.to_target_ids(d, torch.arange(4)) == ids).all()  # d2t: draft id -> target id
    assert d.t2d.nonzero().flatten().tolist() == ids.tolist()  # t2d marks the same ids
    assert torch.equal(d.lm_head.weight, target.get_output_embeddings().weight[ids])  # warm start
    with pytest.raises(DraftsmithError, match="larger than the target vocabulary"):
        draft_vocab(_dataset(), 105, 500)
    with pytest.raises(DraftsmithError, match="aux_layers"):
        eagle3.build(eagle3.DrafterConfig(aux_layers=[0, 1, 5]), target)


def test_ttt_mask_sees_real_prefix_and_own_chain_only():
    m = eagle3.ttt_mask(4, 2, torch.ones(1, 4))[0, 0]
    assert m.shape == (4, 12)
    root = 2
    assert m[root, :4].tolist() == [True, True, True, False]  # real pairs 0..r
    assert m[root, 4:8].tolist() == [False, False, True, False]  # own step-1 state only
    assert m[root, 8:].tolist() == [False, False, True, False]  # own step-2 state only


@pytest.mark.fp32_exact
def test_ttt_step_j_matches_inference_draft_step_j(tiny_target):
    """The unrolled training forward gives, at step j, the logits that cached inference gives
    at draft step j for the same chain when the earlier drafts were the true tokens."""
    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = _cfg()
    d = eagle3.build(cfg, target, _dataset()).eval()
    names = eagle3.feature_names(cfg, target.config)
    ids = torch.randint(5, 90, (1, 14))
    feats = target_features(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, names)
    t = ids.shape[1] - 1
    aux = torch.cat([feats[n][:, :t] for n in names if n.startswith("hidden.")], dim=-1)
    embed = target.get_input_embeddings()
    embeds = embed(torch.nn.functional.pad(ids, (0, 4))[:, 1:])
    root = 6
    sel = [(torch.tensor([0]), torch.tensor([root]))] * cfg.ttt_steps
    with torch.no_grad():
        train_logits = d(aux, embeds, torch.ones(1, t), sel)
        # Inference: real pairs 0..root, then draft steps fed with the true tokens.
        from transformers import DynamicCache

        cache = DynamicCache()
        h = d.fc(aux[:, : root + 1])
        out = eagle3.decoder_step(
            d, h, embed(ids[:, 1 : root + 2]), torch.arange(root + 1)[None], causal_mask(root + 1, root + 1), cache
        )
        out = out[:, -1:]
        for j in range(cfg.ttt_steps):
            assert torch.allclose(eagle3.draft_logits(d, out)[0, 0], train_logits[j][0], atol=1e-5), j
            pos = root + 1 + j
            out = eagle3.decoder_step(
                d, out, embed(ids[:, pos + 1 : pos + 2]), torch.tensor([[pos]]), causal_mask(1, pos + 1), cache
            )


@pytest.mark.fp32_exact
def test_ttt_loss_learns_and_greedy_stays_lossless(tiny_target):
    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = _cfg()
    ids = torch.randint(5, 60, (2, 16))
    ds = {"input_ids": ids.tolist(), "loss_mask": [[1] * 16] * 2}
    d = eagle3.build(cfg, target, ds)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = target_features(target, batch, eagle3.feature_names(cfg, target.config))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    accs = []
    for _ in range(40):
        loss, n, m = eagle3.compute_loss(d, target, batch, feats, cfg)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        accs.append((m["acc"] / n).item())
    # A random tiny target is near-uniform, so the soft-CE barely moves above its entropy floor;
    # its argmax is still learnable: step-0 top-1 agreement must rise.
    assert accs[-1] > accs[0] + 0.3
    prompt = ids[0, :8].tolist()
    stats = Stats(k=4)
    out = speculative_greedy(target, eagle3.make_proposer(d.eval(), target, cfg), prompt, 4, 30, {2}, stats)
    assert out == target_greedy(target, prompt, 30, {2})


# --- EAGLE-3.1's switches ----------------------------------------------------------------------------
SWITCH_SETS = [
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_output": True},
    {"norm_before_fc": True, "norm_output": True},
]


@pytest.mark.parametrize("switches", SWITCH_SETS, ids=lambda s: "+".join(s))
@pytest.mark.fp32_exact
def test_eagle31_ttt_unroll_matches_the_proposers_steps(tiny_target, switches):
    """Training feeds step j+1 what the proposer feeds a child: carry(out) (norm(out) under
    norm_output); the norms before fc see target features only. A switch changes the drafts."""
    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = _cfg(**switches)
    d = eagle3.build(cfg, target, _dataset()).eval()
    with torch.no_grad():  # norms that are not the identity, so a misplaced one shows
        for name, p in d.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.5 * torch.rand_like(p))
    names = eagle3.feature_names(cfg, target.config)
    ids = torch.randint(5, 90, (1, 14))
    feats = target_features(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, names)
    t, root, embed = ids.shape[1] - 1, 6, target.get_input_embeddings()
    aux = torch.cat([feats[n][:, :t] for n in names if n.startswith("hidden.")], dim=-1)
    sel = [(torch.tensor([0]), torch.tensor([root]))] * cfg.ttt_steps
    proposer = eagle3.make_proposer(d, target, cfg)
    with torch.no_grad():
        train_logits = d(aux, embed(torch.nn.functional.pad(ids, (0, 4))[:, 1:]), torch.ones(1, t), sel)
        from transformers import DynamicCache

        cache = DynamicCache()
        real = {n: f[:, : root + 1] for n, f in feats.items()}
        out = proposer.step(
            proposer.to_hidden(real),
            embed(ids[:, 1 : root + 2]),
            torch.arange(root + 1)[None],
            causal_mask(root + 1, root + 1),
            cache,
        )[:, -1:]
        for j in range(cfg.ttt_steps):
            assert torch.allclose(eagle3.draft_logits(d, out)[0, 0], train_logits[j][0], atol=1e-5), j
            pos = root + 1 + j
            out = proposer.step(
                out, embed(ids[:, pos + 1 : pos + 2]), torch.tensor([[pos]]), causal_mask(1, pos + 1), cache
            )
        plain = eagle3.build(_cfg(), target, _dataset()).eval()
        plain.load_state_dict({k: v for k, v in d.state_dict().items() if k in plain.state_dict()})
        other = plain(aux, embed(torch.nn.functional.pad(ids, (0, 4))[:, 1:]), torch.ones(1, t), sel)
    # norm_output leaves step 0 alone (lm_head reads norm(out) either way) and changes the later steps.
    first = 1 if switches == {"norm_output": True} else 0
    assert torch.allclose(other[0], train_logits[0]) == (first == 1)
    assert not torch.allclose(other[first + 1], train_logits[first + 1], atol=1e-4)


def test_fc_norm_with_norm_before_fc_is_a_one_line_error():
    with pytest.raises(DraftsmithError, match="drafter.fc_norm and drafter.norm_before_fc: choose one"):
        eagle3.DrafterConfig(fc_norm=True, norm_before_fc=True)


@pytest.fixture(scope="module")
def target3(tmp_path_factory):
    from draftsmith.target.load import load_target
    from tests.conftest import save_target

    return load_target(str(save_target(tmp_path_factory.mktemp("target3"), layers=3)), "float32")[0]


def _argmax_families():
    """The families that train on the target's greedy tokens (`argmax`), from the registry."""
    from draftsmith.models.registry import DRAFTERS

    return [n for n, f in DRAFTERS.items() if f.feature_names is eagle3.training_features]


@pytest.mark.fp32_exact
@pytest.mark.parametrize("name", _argmax_families())
def test_the_draft_vocabulary_teacher_gives_the_full_vocabularys_loss_and_gradients(target3, name):
    """With the `argmax` feature the teacher multiplies only the draft vocabulary's lm_head rows; the
    loss and every gradient equal those of the full-vocabulary teacher (no `argmax`: V-wide logits cut
    down, as before), on a padded batch whose loss mask leaves prompts out."""
    from draftsmith.models.registry import DRAFTERS

    family = DRAFTERS[name]
    torch.manual_seed(0)
    cfg = family.resolve(family.DrafterConfig(**family.tiny), target3.config)
    ids = torch.randint(5, 90, (3, 14))
    attn = torch.ones_like(ids)
    attn[1, 10:] = 0  # a shorter example, padded
    lmask = attn.clone()
    lmask[:, :4] = 0  # its prompt
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": lmask}
    drafter = family.build(cfg, target3, {"input_ids": ids.tolist(), "loss_mask": lmask.tolist()})
    feats = target_features(target3, batch, family.feature_names(cfg, target3.config))
    assert feats["argmax"].shape == ids.shape and feats["argmax"].dtype == torch.long
    results = []
    for with_argmax in (True, False):
        drafter.zero_grad()
        torch.manual_seed(1)  # P-EAGLE samples its chains: the same draw for both
        given = feats if with_argmax else {k: v for k, v in feats.items() if k != "argmax"}
        loss, n, _ = family.compute_loss(drafter, target3, batch, given, cfg)
        (loss / n).backward()
        grads = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), int(n), grads))
    (l1, n1, g1), (l2, n2, g2) = results
    assert n1 == n2 > 0 and torch.allclose(l1, l2, rtol=1e-5, atol=1e-6), (l1, l2)
    assert g1.keys() == g2.keys() and len(g1) > 0
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-6), k
