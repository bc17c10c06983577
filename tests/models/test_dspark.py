"""DSpark: the Markov stage drafts left to right (a chain equals stepping the head by hand, greedy and
sampled), the training logits are the teacher-forced Markov correction, learning with a calibrated
confidence head, lossless greedy decoding, the speculators export vLLM reads (and read back by
vLLM's own loader, `vllm_families`), export --verify, init_from, one-line config errors; each in both
layouts where they differ: anchor-as-first (`sample_from_anchor: true`, the default) and fill-in."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Sampler, Stats, speculative_greedy, target_greedy
from draftsmith.models import dflash, dspark
from draftsmith.models.folder import load_state
from draftsmith.models.readers import export_family, init_weights
from draftsmith.ship.export import export
from tests.models.conftest import block_feats, train_on_random_tokens
from tests.ship.test_export import _same_decoding, _save

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = pytest.mark.parametrize("anchor", [True, False], ids=["anchor-as-first", "fill-in"])


def _cfg(**kw):
    return dspark.DrafterConfig(
        **{"aux_layers": [0, 1, 2], "num_layers": 2, "block_size": 4, "mask_token_id": 3, "markov_rank": 6, **kw}
    )


def _feats(target, cfg, ids):
    return block_feats(dspark, target, cfg, ids)


def _strong_markov(d, scale=3.0):
    """A Markov head that matters: W2 starts at zero (DFlash's drafts); here W1 W2 move the argmax."""
    torch.manual_seed(1)
    with torch.no_grad():
        d.markov_head.markov_w1.weight.normal_()
        d.markov_head.markov_w2.weight.normal_(std=scale)
        d.confidence_head.proj.weight.normal_(std=0.3)
    return d


def _hidden(d, target, cfg, tokens, feats, m):
    """The outputs [m, H] of the slots drafting 1..m in cfg's layout (dflash.BlockProposer's pass)."""
    return dflash.BlockProposer(d, target, cfg).block_hidden(tokens, feats, m, cfg.sample_from_anchor)


def _by_hand(d, target, cfg, tokens, feats, m, sampled=None):
    """Step the heads by hand on one backbone pass: l_i = z_i + W2 W1[prev_i], prev_1 = the bonus,
    prev_{i+1} = draft i (greedy) or `sampled[i]`; c_i = sigmoid(w . [h_i ; W1[prev_i]] + b)."""
    h = _hidden(d, target, cfg, tokens, feats, m)
    z = target.get_output_embeddings()(h)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    proj = d.confidence_head.proj
    prev, out, logits, conf = int(tokens[0, -1]), [], [], []
    for i in range(m):
        row = z[i] + w2 @ w1[prev]
        conf.append(torch.sigmoid(proj.weight[0] @ torch.cat([h[i], w1[prev]]) + proj.bias[0]).item())
        out.append(int(row.argmax()) if sampled is None else sampled[i])
        logits.append(row)
        prev = out[-1]
    return out, logits, conf


@LAYOUTS
def test_markov_stage_drafts_left_to_right_as_stepping_the_head_by_hand(target4, anchor):
    torch.manual_seed(0)
    cfg = _cfg(sample_from_anchor=anchor)
    d = _strong_markov(dspark.build(cfg, target4).eval())
    ids = torch.randint(5, 90, (1, 14))
    feats = _feats(target4, cfg, ids[:, :-1])  # the engine's call: features of every token but the newest
    proposer = dspark.make_proposer(d, target4, cfg)
    with torch.no_grad():
        draft = proposer.propose(ids, feats, 3)
        want, logits, conf = _by_hand(d, target4, cfg, ids, feats, 3)
        plain = target4.get_output_embeddings()(_hidden(d, target4, cfg, ids, feats, 3))
    assert draft.tokens == want and draft.parents == [-1, 0, 1] and draft.qs == [None] * 3
    assert want != plain.argmax(-1).tolist()  # the Markov bias changed the chain: the test sees it
    assert draft.confidence == pytest.approx(conf, abs=1e-6) and all(isinstance(c, float) for c in draft.confidence)
    assert proposer.drafts_confidence and proposer.max_depth == (4 if anchor else 3)
    # Sampled: draft i is drawn from the Markov-corrected distribution of the tokens actually drawn.
    proposer.reset()
    with torch.no_grad():
        drawn = proposer.propose(ids, feats, 3, Sampler(1.0, seed=0))
        _, logits, conf = _by_hand(d, target4, cfg, ids, feats, 3, sampled=drawn.tokens)
    for q, row in zip(drawn.qs, logits):
        assert torch.allclose(q, torch.softmax(row, -1), atol=1e-6)
    assert drawn.confidence == pytest.approx(conf, abs=1e-6)
    # A fresh head (W2 = 0) drafts exactly as the DFlash backbone; no confidence head: None.
    fresh_cfg = _cfg(enable_confidence_head=False, sample_from_anchor=anchor)
    fresh = dspark.build(fresh_cfg, target4).eval()
    with torch.no_grad():
        chain = dspark.make_proposer(fresh, target4, fresh_cfg).propose(ids, feats, 3)
        backbone = target4.get_output_embeddings()(_hidden(fresh, target4, fresh_cfg, ids, feats, 3))
    assert chain.tokens == backbone.argmax(-1).tolist() and chain.confidence is None


@LAYOUTS
def test_training_logits_are_the_teacher_forced_markov_correction(target4, monkeypatch, anchor):
    """At draft d of anchor a, the training loss sees z_d + W2 W1[x_{a+d-1}]: the proposer's logits when
    its earlier drafts were the data tokens (the anchor x_a for draft 1), in either layout: K drafts, the
    proposer's block of K drafts being the training block (anchor-as-first: [x_a, m x (B-1)] for K = B)."""
    torch.manual_seed(0)
    cfg = _cfg(loss="tvd", sample_from_anchor=anchor)
    k_drafts = dspark.drafts(cfg)
    d = _strong_markov(dspark.build(cfg, target4).eval())
    ids = torch.randint(5, 90, (1, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = _feats(target4, cfg, ids)
    seen = {}
    real = dflash.slot_token_loss

    def spy(cfg_, logits, blocks):
        seen["logits"], seen["blocks"] = logits, blocks
        return real(cfg_, logits, blocks)

    monkeypatch.setattr(dflash, "slot_token_loss", spy)
    with torch.no_grad():
        dspark.compute_loss(d, target4, batch, feats, cfg)
    blocks, logits = seen["blocks"], seen["logits"]
    assert logits.shape[1] == k_drafts and blocks.lab.shape[1] == k_drafts
    for j, a in enumerate((blocks.lab[:, 0] - 1).tolist()[:3]):
        if a + k_drafts >= 16:
            continue
        prefix = ids[:, : a + 1]
        h = _hidden(d, target4, cfg, prefix, {n: f[:, :a] for n, f in feats.items()}, k_drafts)
        z = target4.get_output_embeddings()(h)
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        for k in range(k_drafts):  # draft k+1 drafts x_{a+k+1}; its previous token is the data token x_{a+k}
            want = z[k] + w2 @ w1[ids[0, a + k]]
            assert torch.allclose(logits[j, k], want, atol=1e-4), (a, k)


def _blocks_of(monkeypatch):
    """Spy on dflash.block_targets: every call's Blocks, in order."""
    seen, real = [], dflash.block_targets

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(dflash, "block_targets", spy)
    return seen


def test_anchor_as_first_loss_by_hand_and_its_gradients(target4, monkeypatch):
    """Anchor-as-first's loss, by hand: draft d of anchor a is slot d-1 (draft 1 the anchor slot itself),
    CE of z_d + W2 W1[x_{a+d-1}] (x_a for draft 1) against the target's argmax at a+d-1, weight
    exp(-(d-1)/gamma) (draft 1: 1, speculators' decay when sampling from the anchor), trained iff x_{a+d}
    is loss-masked and inside the row. The gradient reaches the anchor slot's output (fill-in: none
    there), the anchor token's W1 row and every trained part, finite."""
    ids = torch.randint(5, 60, (1, 20))
    lmask = torch.ones_like(ids)
    lmask[:, 14:16] = 0  # drafts labelled x_14, x_15 are not trained
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lmask}
    cfg = _cfg(num_anchors=4, confidence_weight=0.0)
    feats, d = _feats(target4, cfg, ids), _strong_markov(dspark.build(cfg, target4))
    seen = _blocks_of(monkeypatch)
    torch.manual_seed(5)
    loss, n, _ = dspark.compute_loss(d, target4, batch, feats, cfg)
    head, top = target4.get_output_embeddings(), target4.get_output_embeddings()(feats["last_hidden"])[0].argmax(-1)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    want = torch.zeros(())
    with torch.no_grad():
        for a in (seen[0].lab[:, 0] - 1).tolist():
            h = _hidden(d.eval(), target4, cfg, ids[:, : a + 1], {k: f[:, :a] for k, f in feats.items()}, 4)
            for dd in range(1, 5):  # draft dd: slot dd-1, label the target at a+dd-1, prev x_{a+dd-1}
                if a + dd < 20 and lmask[0, a + dd]:
                    row = head(h[dd - 1]) + w2 @ w1[ids[0, a + dd - 1]]
                    ce = torch.nn.functional.cross_entropy(row[None], top[a + dd - 1][None])
                    want += torch.exp(torch.tensor(-(dd - 1) / cfg.gamma)) * ce
    assert int(n) == 4 and torch.allclose(loss, want, atol=1e-4)
    # Gradients, with the BCE: spy on the pass's output to read each slot's gradient.
    outs, real = {}, dflash.block_pass

    def keep(*args, **kwargs):
        outs["out"] = real(*args, **kwargs)
        outs["out"].retain_grad()
        return outs["out"]

    monkeypatch.setattr(dflash, "block_pass", keep)
    for anchor in (True, False):
        layout = _cfg(num_anchors=4, sample_from_anchor=anchor)
        torch.manual_seed(5)
        d.train().zero_grad()
        dspark.compute_loss(d, target4, batch, feats, layout)[0].backward()
        anchor_slots = outs["out"].grad[0, :: layout.block_size]  # slot 0 of every block
        assert bool(anchor_slots.abs().sum() > 0) is anchor
        grads = {k: p.grad for k, p in d.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        for name in ("fc.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
            assert grads[name].abs().sum() > 0, name
        first = seen[-1].lab[:, 0] - 1  # every block's anchor: draft 1's previous token is its real token
        assert grads["markov_head.markov_w1.weight"][ids[0, first]].abs().sum() > 0


def test_the_layout_switch_moves_each_draft_one_slot_left_and_adds_one(target4, monkeypatch):
    """What sample_from_anchor changes. Training, same anchors: the same blocks [x_a, m x (B-1)] (inputs,
    positions, mask) and the same labels x_{a+d} and previous tokens for the drafts both have; anchor-
    as-first reads draft d at slot d-1 (fill-in: slot d) and has one more draft, x_{a+B}. Inference, k
    drafts: the queries [bonus, m x (k-1)] at positions n-1 .. n+k-2, every one drafting (vLLM's
    DSparkSpeculator with sample_from_anchor: N queries), against fill-in's [bonus, m x k] (1 + N)."""
    ids = torch.randint(5, 60, (2, 18))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    cfgs = {anchor: _cfg(num_anchors=3, sample_from_anchor=anchor) for anchor in (True, False)}
    feats, seen = _feats(target4, cfgs[True], ids), _blocks_of(monkeypatch)
    d = dspark.build(cfgs[True], target4)
    for anchor in (True, False):
        torch.manual_seed(7)  # the same anchors
        dspark.compute_loss(d, target4, batch, feats, cfgs[anchor])
    first, fill = seen
    for name in ("block_ids", "pos", "mask", "blk_b", "blk_j"):
        assert torch.equal(getattr(first, name), getattr(fill, name)), name
    assert (first.block_ids[:, ::4] != 3).all() and (first.block_ids.view(2, -1, 4)[..., 1:] == 3).all()
    anchors = fill.lab[:, 0] - 1
    assert torch.equal(first.lab[:, :3], fill.lab) and torch.equal(first.lab[:, 3], anchors + 4)
    (b1, s1), (b0, s0) = (dspark.draft_slots(blk, cfgs[a]) for blk, a in ((first, True), (fill, False)))
    assert torch.equal(s1[:, :3], s0 - 1) and torch.equal(s1[:, 0], first.blk_j * 4)  # draft 1 = the anchor slot
    assert torch.equal(s0, dflash.slot_index(fill, 4)[1])  # fill-in: DFlash's slots
    assert [dspark.FAMILY.max_draft_depth(c) for c in cfgs.values()] == [4, 3]
    # Inference: what the backbone pass is fed for k = 3 drafts.
    fed, real = [], dflash.block_pass
    monkeypatch.setattr(
        dflash, "block_pass", lambda m, x, pos, *a, **kw: fed.append((x, pos)) or real(m, x, pos, *a, **kw)
    )
    tokens = ids[:1, :10]
    embed = target4.get_input_embeddings()
    for anchor in (True, False):
        draft = dspark.make_proposer(d.eval(), target4, cfgs[anchor]).propose(
            tokens, _feats(target4, cfgs[anchor], tokens[:, :-1]), 3
        )
        x, pos = fed[-1]
        assert len(draft.tokens) == 3 and pos.tolist() == [list(range(9, 9 + (3 if anchor else 4)))]
        assert torch.equal(x[0, 0], embed.weight[tokens[0, 9]]) and torch.equal(
            x[0, 1:], embed.weight[3].expand_as(x[0, 1:])
        )


@pytest.mark.parametrize(
    "extra",
    [{}, {"loss": "tvd", "confidence_head_with_markov": False}, {"sample_from_anchor": False}],
    ids=["ce", "soft", "fill-in"],
)
def test_training_learns_calibrates_and_greedy_stays_lossless(target4, extra):
    torch.manual_seed(0)
    cfg = _cfg(num_layers=1, num_anchors=8, **extra)
    d = dspark.build(cfg, target4)
    k = dspark.drafts(cfg)  # 4 anchor-as-first (block 4), 3 fill-in: one accuracy per draft
    metrics = {"acc", *(f"acc{i}" for i in range(1, k)), "conf_bce", "accept", "confidence"}
    ids, log = train_on_random_tokens(dspark, d, target4, cfg, 40, metrics)
    if cfg.loss == "ce":
        assert log[-1]["acc"] > log[0]["acc"] + 0.3
    assert log[-1]["accept"] > log[0]["accept"]  # the drafts' soft acceptance rises
    assert d.markov_head.markov_w2.weight.abs().max() > 0  # the Markov head trained (it starts at zero)
    # Calibration: the mean confidence moves to the mean soft acceptance, and the BCE falls.
    assert abs(log[-1]["confidence"] - log[-1]["accept"]) < abs(log[0]["confidence"] - log[0]["accept"])
    assert log[-1]["conf_bce"] < log[0]["conf_bce"]
    prompt = ids[0, :8].tolist()
    proposer = dspark.make_proposer(d.eval(), target4, cfg)
    stats = Stats(k=k)
    assert speculative_greedy(target4, proposer, prompt, k, 30, {2}, stats) == target_greedy(target4, prompt, 30, {2})
    assert stats.passes


def test_reduced_vocabulary_trains_drafts_losslessly_and_exports_what_vllm_reads(target4, tmp_path):
    """draft_vocab_size: z, W2's bias and the drafts live on the draft tokens (W1 still embeds target
    ids); training on a vocabulary holding the target's choices learns and calibrates as on the whole
    one; greedy decoding stays lossless; the export ships lm_head, d2t, t2d and W2 [V_d, r]."""
    torch.manual_seed(0)
    ids = torch.randint(5, 60, (2, 24))
    with torch.no_grad():
        chosen = sorted(set(target4(ids).logits.argmax(-1).flatten().tolist()))
    tokens = sorted(chosen + [t for t in range(5, 100) if t not in chosen][:8])
    cfg = _cfg(num_layers=1, num_anchors=8, draft_vocab_size=len(tokens))
    data = {"input_ids": [tokens * 2], "loss_mask": [[1] * 2 * len(tokens)]}
    d = dspark.build(cfg, target4, data)
    vocab, n = target4.config.vocab_size, len(tokens)
    assert d.markov_head.markov_w1.weight.shape == (vocab, 6) and d.markov_head.markov_w2.weight.shape == (n, 6)
    metrics = {"acc", "acc1", "acc2", "acc3", "conf_bce", "accept", "confidence"}  # 4 drafts (anchor-as-first)
    _, log = train_on_random_tokens(dspark, d, target4, cfg, 40, metrics, ids=ids)
    # (The soft acceptance is bounded by the target's mass on the draft tokens, small for this flat
    # random target, and starts near that bound: only the top-1 agreement and the calibration move.)
    assert log[-1]["acc"] > log[0]["acc"] + 0.3
    assert abs(log[-1]["confidence"] - log[-1]["accept"]) < abs(log[0]["confidence"] - log[0]["accept"])
    prompt = ids[0, :8].tolist()
    proposer = dspark.make_proposer(d.eval(), target4, cfg)
    draft = proposer.propose(ids[:1, :9], _feats(target4, cfg, ids[:1, :8]), 3)
    assert set(draft.tokens) <= set(tokens) and len(draft.confidence) == 3  # target ids of draft tokens
    assert speculative_greedy(target4, proposer, prompt, 3, 30, {2}, Stats(k=3)) == target_greedy(
        target4, prompt, 30, {2}
    )
    path = _save(tmp_path, dspark, cfg, target4)
    out = export(path, target4, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["draft_vocab_size"] == n and state["markov_head.markov_w2.weight"].shape == (n, 6)
    assert state["lm_head.weight"].shape == (n, 32) and state["d2t"].shape == (n,) and state["t2d"].shape == (vocab,)
    _same_decoding(path, out, target4)
    assert dspark.from_init(dspark.DrafterConfig(), c, target4.config).draft_vocab_size == n


@pytest.mark.chi_square
def test_sampled_markov_chains_are_lossless(peaked_target):
    """Draft i is sampled from the Markov-corrected q_i, which depends on the drafts before it: the
    rule only needs q_i known, so the output keeps the target's distribution (chi-square against
    target-only sampling); accepting every draft does not (the negative control)."""
    from tests.engine.test_sampling import assert_samples_losslessly

    target = peaked_target
    torch.manual_seed(0)
    cfg = dspark.DrafterConfig(aux_layers=[0], block_size=4, markov_rank=4)
    proposer = dspark.make_proposer(_strong_markov(dspark.build(cfg, target).eval(), scale=1.0), target, cfg)
    assert_samples_losslessly(target, proposer)


def test_confidence_weight_adds_the_bce_and_no_head_adds_nothing(target4):
    ids = torch.randint(5, 60, (1, 20))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = _feats(target4, _cfg(), ids)
    d = _strong_markov(dspark.build(_cfg(num_anchors=4), target4))
    losses = {}
    for w in (0.0, 1.0, 2.0):
        torch.manual_seed(5)  # the same anchors
        losses[w] = dspark.compute_loss(d, target4, batch, feats, _cfg(num_anchors=4, confidence_weight=w))[0]
    bce = losses[1.0] - losses[0.0]  # the BCE sum over trained slots
    assert bce > 0 and torch.allclose(losses[2.0] - losses[0.0], 2 * bce, atol=1e-4)
    headless = _cfg(num_anchors=4, enable_confidence_head=False)
    d2 = dspark.build(headless, target4)
    assert d2.confidence_head is None and not any("confidence" in k for k in d2.state_dict())
    torch.manual_seed(5)
    _, _, m = dspark.compute_loss(d2, target4, batch, feats, headless)
    assert set(m) == {"acc", "acc1", "acc2", "acc3"}


@LAYOUTS
def test_speculators_export_is_what_vllm_reads_and_round_trips(target4, tmp_path, anchor):
    cfg = _cfg(sample_from_anchor=anchor)
    path = _save(tmp_path, dspark, cfg, target4)
    state = load_state(path)  # a Markov head that matters (it is saved at zero), as if trained
    torch.manual_seed(2)
    state["markov_head.markov_w2.weight"] = torch.randn_like(state["markov_head.markov_w2.weight"])
    save_file(state, path / "model.safetensors")
    out = export(path, target4, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["speculators_model_type"] == "dspark" and c["speculators_config"]["algorithm"] == "dspark"
    assert c["aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer inputs = draftsmith's outputs + 1
    assert c["markov_rank"] == 6 and c["markov_head_type"] == "vanilla"
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    # vLLM's update_dspark reads sample_from_anchor (default false: written either way) and its
    # DSparkSpeculator drafts N = num_speculative_tokens (default block_size) anchor-as-first.
    assert c["sample_from_anchor"] is anchor and c["mask_token_id"] == 3 and c["block_size"] == 4
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (4 if anchor else 3)
    v, h = target4.config.vocab_size, 32
    assert state["markov_head.markov_w1.weight"].shape == (v, 6)
    assert state["markov_head.markov_w2.weight"].shape == (v, 6)
    assert state["confidence_head.proj.weight"].shape == (1, h + 6) and state["confidence_head.proj.bias"].shape == (1,)
    assert state["fc.weight"].shape == (32, 3 * 32) and "layers.1.self_attn.k_norm.weight" in state
    assert not {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight"} & set(state)  # vLLM shares the target's
    assert export_family(out) == "dspark"
    _same_decoding(path, out, target4)
    assert '"method": "dspark"' in dspark.serving_snippet("speculators", "me/x", "tiny", 3)
    assert dspark.vllm_serving(out, c, 3)[0] == {"method": "dspark", "model": str(out), "num_speculative_tokens": 3}
    # A peer's folder (no draftsmith section) is recognised and init_from reads its fields and weights.
    del c["draftsmith"]
    (out / "config.json").write_text(json.dumps(c))
    assert export_family(out) == "dspark"
    got = dspark.from_init(dspark.DrafterConfig(), c, target4.config)
    assert (got.aux_layers, got.num_layers, got.block_size, got.mask_token_id, got.markov_rank) == (
        [0, 1, 2],
        2,
        4,
        3,
        6,
    )
    assert got.sample_from_anchor is anchor  # the layout is the weights': init_from keeps it
    fresh = dspark.build(got, target4)
    init_weights(fresh, "dspark", out, target4)
    assert all(torch.equal(fresh.state_dict()[k], t) for k, t in state.items())
    # A peer's config without the key: speculators' default, anchor-as-first.
    bare = {k: x for k, x in c.items() if k != "sample_from_anchor"}
    assert dspark.from_init(dspark.DrafterConfig(sample_from_anchor=False), bare, target4.config).sample_from_anchor
    with pytest.raises(DraftsmithError, match="'gated'"):
        dspark.from_init(dspark.DrafterConfig(), {**c, "markov_head_type": "gated"}, target4.config)


@pytest.mark.fp32_exact
def test_export_verify_passes_after_training(tmp_path, chat_jsonl, monkeypatch):
    from draftsmith.cli import main
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.conftest import save_target
    from tests.train.test_train import _overrides

    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")  # tiny head dims: below vLLM's CPU attention
    target_dir = save_target(tmp_path / "target", layers=3)
    extra = {"drafter.type": "dspark", "drafter.aux_layers": [0, 1], "drafter.block_size": 4, "drafter.markov_rank": 8}
    run = train(load_config(None, _overrides(target_dir, chat_jsonl, tmp_path, **{**extra, "optim.max_steps": 3})))
    out = tmp_path / "spec"
    args = ["export", str(run / "final"), "--format", "speculators", "--out", str(out), "--verify", "--data"]
    assert main([*args, str(chat_jsonl)]) == 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dspark"


def test_bad_configs_are_one_line_errors(target4):
    for kw, match in [
        ({"markov_rank": 0}, "drafter.markov_rank"),
        ({"confidence_weight": -1.0}, "drafter.confidence_weight"),
        ({"sample_from_anchor": "yes"}, "drafter.sample_from_anchor"),
        ({"block_size": 1}, "drafter.block_size"),  # dflash's checks, shared
        ({"loss": "kl"}, "unknown loss 'kl'"),
    ]:
        with pytest.raises(DraftsmithError, match=match) as e:
            dspark.DrafterConfig(**kw)
        assert "\n" not in str(e.value)


# --- vLLM's own loader (its CPU build refuses to serve dspark; models/dspark.py) ----------------------


@pytest.mark.vllm  # vLLM's environment: not a unit test (scripts/test.sh)
@pytest.mark.vllm_families
@pytest.mark.parametrize(
    "extra",
    [{}, {"confidence_head_with_markov": False}, {"draft_vocab_size": 40}, {"sample_from_anchor": False}],
    ids=["conf-markov", "conf-hidden", "draft-vocab", "fill-in"],
)
def test_vllm_load_weights_accepts_every_tensor_of_the_export(tmp_path, extra):
    """vLLM's own config parser, Qwen3DSparkForCausalLM and its load_weights, in vLLM's environment
    (tests/models/vllm_dspark_load.py): every exported tensor is accepted and lands, values and all,
    in the parameter vLLM drafts with (q/k/v and gate/up stacked at their row offsets); what no
    tensor fills is exactly what vLLM shares with the target (embed_tokens, lm_head) or drops. A
    reduced vocabulary's lm_head and d2t land in vLLM's own; its t2d is training-only (vLLM skips it)."""
    from draftsmith.target.load import load_target
    from draftsmith.target.vllm_server import available, find_python
    from tests.conftest import save_target

    if not available():
        pytest.skip("vLLM is not installed (.venv-vllm: bash scripts/setup.sh --vllm)")
    target_dir = save_target(tmp_path / "target", layers=4)
    target = load_target(str(target_dir), "fp32")[0]
    cfg = _cfg(**extra)
    path = _save(tmp_path, dspark, cfg, target)
    state = load_state(path)
    torch.manual_seed(3)  # every tensor distinct (norms are ones and W2 zeros when fresh)
    noisy = {k: t + 0.1 * torch.randn_like(t) if t.is_floating_point() else t for k, t in state.items()}
    save_file(noisy, path / "model.safetensors")
    out = export(path, target, "speculators", tmp_path / "spec")
    result = subprocess.run(
        [find_python(), str(ROOT / "tests" / "models" / "vllm_dspark_load.py"), str(out), str(target_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    state = load_file(out / "model.safetensors")
    skipped = ["t2d"] if extra.get("draft_vocab_size") else []
    assert report["loaded"] == sorted(set(state) - set(skipped)) and report["not_landed"] == skipped
    if skipped:
        assert report["landed"]["d2t"][0] == "draft_id_to_target_id" and report["landed"]["lm_head.weight"]
        assert report["config"]["draft_vocab_size"] == 40
    c, anchor = report["config"], extra.get("sample_from_anchor", True)
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["markov_rank"] == 6
    # The layout as vLLM's runtime reads it: DSparkSpeculator (and VllmConfig.num_lookahead_tokens) read
    # hf_config.sample_from_anchor, update_dspark sets dspark_bonus_anchor = its negation, and a
    # num_speculative_tokens left out defaults to block_size: the K = B drafts of anchor-as-first.
    assert c["sample_from_anchor"] is anchor and c["dspark_bonus_anchor"] is (not anchor) and c["block_size"] == 4
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and c["mask_token_id"] == 3
    assert (
        c["confidence_head_with_markov"] is ("confidence_head_with_markov" not in extra) and report["confidence_head"]
    )
    q, kv, inter = 4 * 8, 2 * 8, 64  # n_h * d, n_kv * d, I of the tiny target
    for i in range(2):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        assert report["landed"][f"{attn}.q_proj.weight"] == [f"model.{attn}.qkv_proj.weight", 0]
        assert report["landed"][f"{attn}.k_proj.weight"] == [f"model.{attn}.qkv_proj.weight", q]
        assert report["landed"][f"{attn}.v_proj.weight"] == [f"model.{attn}.qkv_proj.weight", q + kv]
        assert report["landed"][f"{mlp}.up_proj.weight"] == [f"model.{mlp}.gate_up_proj.weight", inter]
    assert report["landed"]["markov_head.markov_w2.weight"] == ["model.markov_head.markov_w2.weight", 0]
    shared = ([] if skipped else ["lm_head.weight"]) + ["model.embed_tokens.weight", "model.mask_embedding"]
    assert report["not_from_checkpoint"] == shared
