"""P-EAGLE: the packed training pass sees what the one-pass proposer sees, its chains are contiguous,
it learns and stays lossless, and its speculators export round-trips."""

import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Stats, speculative_greedy, target_greedy
from draftsmith.models import eagle3, peagle
from draftsmith.target.features import target_features

VOCAB_DATA = {"input_ids": [list(range(5, 90))], "loss_mask": [[1] * 85]}  # every token, for the draft vocabulary


def _cfg(**kw):
    return peagle.DrafterConfig(**{"aux_layers": [0, 1, 1], "draft_vocab_size": 60, "depths": 4, **kw})


def _batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def test_sampled_chains_are_contiguous_and_thin_out_with_depth():
    torch.manual_seed(0)
    t = 40
    row_of = torch.arange(t + 1)[None].repeat(2, 1)  # every label row trained
    row_of[1, 30:] = -1  # the second sequence's labels stop at row 29
    for slots, last in zip(peagle.sample_chains(row_of, t, _cfg()), (t, 29)):
        by_depth = {d: {a for a, dd in slots if dd == d} for d in range(1, 4)}
        assert by_depth[3] <= by_depth[2] <= by_depth[1]  # depth d only where depth d-1 was kept
        assert len(by_depth[1]) > len(by_depth[2]) > len(by_depth[3]) > 0
        assert all(a + d + 1 <= last for a, d in slots)  # every kept slot has a trained label row


@pytest.mark.fp32_exact
def test_the_packed_pass_gives_each_slot_the_logits_the_proposer_drafts_with(tiny_target):
    """Mask slot d of anchor a in training = draft d+1 of a proposer whose newest token is x_{a+1}."""
    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = peagle.resolve(_cfg(), target.config)  # the exact mask token the packed pass feeds
    d = peagle.build(cfg, target, VOCAB_DATA).eval()
    names = peagle.feature_names(cfg, target.config)
    ids = torch.randint(5, 90, (1, 16))
    feats = target_features(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, names)
    t, anchor, embed = ids.shape[1] - 1, 7, target.get_input_embeddings()
    aux = peagle.aux_features(feats, names)[:, :t]
    mask_embed = embed(torch.tensor([[cfg.mask_token_id]]))
    chains = [[(anchor, 1), (anchor, 2), (anchor, 3), (2, 1)]]
    with torch.no_grad():
        out = d(aux, embed(ids[:, 1:]), mask_embed, torch.ones(1, t), chains)
        train = eagle3.target_vocab_logits(d, out[0, [anchor, t, t + 1, t + 2]])
        proposer = peagle.make_proposer(d, target, cfg)
        real = {n: f[:, : anchor + 1] for n, f in feats.items()}
        draft = proposer.propose(ids[:, : anchor + 2], real, 4)
    assert draft.tokens == train.argmax(-1).tolist() and draft.parents == [-1, 0, 1, 2]
    # The same logits, not only their argmax: rerun the proposer's pass by hand.
    with torch.no_grad():
        real_hidden = eagle3.fuse(d, peagle.aux_features(real, names))
        m = 3
        hidden = torch.cat([real_hidden, eagle3.fuse(d, d.mask_hidden).expand(1, m, -1)], 1)
        emb = embed(torch.cat([ids[:, 1 : anchor + 2], torch.full((1, m), cfg.mask_token_id)], 1))
        from draftsmith.util.masks import causal_mask

        o = eagle3.decoder_step(
            d, hidden, emb, torch.arange(anchor + 1 + m)[None], causal_mask(anchor + 1 + m, anchor + 1 + m)
        )
        logits = eagle3.target_vocab_logits(d, o[0, -(m + 1) :])
    assert torch.allclose(logits, train, atol=1e-5)


@pytest.mark.fp32_exact
def test_peagle_learns_every_depth_and_greedy_stays_lossless(tiny_target):
    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = peagle.resolve(_cfg(loss="lk_hybrid"), target.config)
    ids = torch.randint(5, 60, (2, 24))
    d = peagle.build(cfg, target, {"input_ids": ids.tolist(), "loss_mask": [[1] * 24] * 2})
    batch = _batch(ids)
    feats = target_features(target, batch, peagle.feature_names(cfg, target.config))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss, n, m = peagle.compute_loss(d, target, batch, feats, cfg)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        first = first or {k: (v / n).item() for k, v in m.items()}
    last = {k: (v / n).item() for k, v in m.items()}
    assert set(last) == {"acc", "acc1", "acc2", "acc3"} and last["acc"] > first["acc"] + 0.3
    assert d.mask_hidden.grad is None and d.mask_hidden.requires_grad  # trained (zero_grad cleared it)
    prompt = ids[0, :8].tolist()
    stats = Stats(k=4)
    proposer = peagle.make_proposer(d.eval(), target, cfg)
    assert speculative_greedy(target, proposer, prompt, 4, 30, {2}, stats) == target_greedy(target, prompt, 30, {2})
    assert stats.passes < 30  # some drafts were accepted


def _exported(target, tmp_path):
    """A P-EAGLE head with norm_before_fc and mask token 3, saved and exported -> (cfg, head, export)."""
    from draftsmith.models.folder import save_drafter
    from draftsmith.ship.export import export
    from draftsmith.target.load import fingerprint

    torch.manual_seed(0)
    cfg = _cfg(norm_before_fc=True, mask_token_id=3)
    d = peagle.build(cfg, target, VOCAB_DATA)
    meta = {
        "drafter": "peagle",
        "drafter_config": {"type": "peagle", **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    return cfg, d, export(save_drafter(d, tmp_path / "final", meta), target, "speculators", tmp_path / "spec")


def test_speculators_peagle_export_has_what_vllm_reads_and_round_trips(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from draftsmith.models.readers import export_family, import_export

    target, _ = tiny_target
    cfg, d, out = _exported(target, tmp_path)
    config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 3 and config["norm_before_fc"] is True and "fc_norm" not in config
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # layer inputs
    assert state["mask_hidden"].numel() == 3 * target.config.hidden_size and "input_norm.weight" in state
    assert export_family(out) == "peagle"
    module, cfg2, back = import_export(out, target)
    prompt = list(range(10, 22))
    runs = [
        speculative_greedy(target, peagle.make_proposer(x.eval(), target, c), prompt, 4, 20, set(), s)
        for x, c, s in ((d, cfg, Stats(k=4)), (back, cfg2, Stats(k=4)))
    ]
    assert module is peagle.FAMILY and runs[0] == runs[1]


def test_bad_peagle_configs_are_one_line_errors(tiny_target):
    target, _ = tiny_target
    with pytest.raises(DraftsmithError, match=r"drafter.depths: expected >= 2"):
        _cfg(depths=1)
    with pytest.raises(DraftsmithError, match=r"drafter.loss: unknown loss 'kl' \(valid: ce, tvd, nla, lk_hybrid\)"):
        _cfg(loss="kl")
    with pytest.raises(DraftsmithError, match=r"drafter.mask_token_id: expected an id in \[0, "):
        peagle.build(_cfg(mask_token_id=10**6), target)
    with pytest.raises(DraftsmithError, match="drafter.aux_layers"):
        peagle.build(_cfg(aux_layers=[2, 1, 0]), target)


@pytest.mark.fp32_exact
def test_init_from_a_peagle_export_takes_its_layers_norm_and_mask_token(tiny_target, tmp_path):
    from draftsmith.models.readers import init_weights, read_config

    target, _ = tiny_target
    _, d, out = _exported(target, tmp_path)
    fresh_cfg = peagle.from_init(peagle.DrafterConfig(draft_vocab_size=60, depths=4), read_config(out), target.config)
    assert (fresh_cfg.aux_layers, fresh_cfg.norm_before_fc, fresh_cfg.mask_token_id) == ([0, 1, 1], True, 3)
    fresh = peagle.build(fresh_cfg, target, VOCAB_DATA)
    init_weights(fresh, "peagle", out, target)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in d.state_dict().items())
    with pytest.raises(DraftsmithError, match="drafter.aux_layers: the recipe names"):
        peagle.from_init(_cfg(aux_layers=[0, 0, 1]), read_config(out), target.config)
