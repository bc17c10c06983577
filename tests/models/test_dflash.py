"""DFlash: block packing and masks, training slots = the proposer's block, learning, lossless decoding,
the speculators export vLLM reads, the native z-lab layout, one-line config errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Sampler, Stats, speculative_greedy, target_greedy
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.run import evaluate
from draftsmith.models import dflash
from draftsmith.models.folder import load_state
from draftsmith.models.readers import export_family, init_weights
from draftsmith.ship.export import export
from tests.models.conftest import block_feats, train_on_random_tokens
from tests.ship.test_export import _same_decoding, _save


def _cfg(**kw):
    return dflash.DrafterConfig(**{"aux_layers": [0, 1, 2], "num_layers": 2, "block_size": 4, "mask_token_id": 3, **kw})


def _feats(target, cfg, ids):
    return block_feats(dflash, target, cfg, ids)


def test_block_mask_sees_ctx_before_the_anchor_and_its_whole_block():
    ids = torch.arange(10, 20)[None]
    attn = torch.ones_like(ids)
    block_ids, pos, mask = dflash.block_inputs(ids, attn, [torch.tensor([3, 6])], 3, mask_id=99)
    assert block_ids.tolist() == [[13, 99, 99, 16, 99, 99]] and pos.tolist() == [[3, 4, 5, 6, 7, 8]]
    m = mask[0, 0]
    assert m.shape == (6, 10 + 6)
    for q in range(3):  # block 0, anchor 3: ctx 0..2, its own 3 slots (no causal structure)
        assert m[q, :10].tolist() == [True] * 3 + [False] * 7
        assert m[q, 10:].tolist() == [True] * 3 + [False] * 3
    for q in range(3, 6):  # block 1, anchor 6
        assert m[q, :10].tolist() == [True] * 6 + [False] * 4
        assert m[q, 10:].tolist() == [False] * 3 + [True] * 3
    # A shorter sequence's padding slots see themselves only.
    _, _, mask = dflash.block_inputs(
        ids.repeat(2, 1), attn.repeat(2, 1), [torch.tensor([3, 6]), torch.tensor([5])], 3, 99
    )
    assert (
        mask[1, 0, 3:, :10].sum() == 0 and mask[1, 0, 3:, 10:].tolist() == torch.eye(6, dtype=torch.bool)[3:].tolist()
    )
    # causal: the same ctx keys; inside its block slot k sees slots 0..k only.
    _, _, causal = dflash.block_inputs(ids, attn, [torch.tensor([3, 6])], 3, mask_id=99, causal=True)
    c = causal[0, 0]
    assert torch.equal(c[:, :10], m[:, :10])
    assert c[:, 10:].tolist() == [
        [True, False, False, False, False, False],
        [True, True, False, False, False, False],
        [True, True, True, False, False, False],
        [False, False, False, True, False, False],
        [False, False, False, True, True, False],
        [False, False, False, True, True, True],
    ]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_training_slots_equal_the_proposers_block(target4, causal):
    """The packed training forward gives, at slot k of anchor a, the logits the proposer (with its
    ctx K/V cache over rounds) gives for draft k after verifying x_0..x_a; and the ctx is strictly
    before the anchor, the block bidirectional (`causal`: a slot never reads a later slot)."""
    torch.manual_seed(0)
    cfg = _cfg(causal=causal)
    d = dflash.build(cfg, target4).eval()
    ids = torch.randint(5, 90, (1, 20))
    feats = _feats(target4, cfg, ids)
    aux = dflash.aux_features(feats, dflash.feature_names(cfg, target4.config))
    embed, lm_head = target4.get_input_embeddings(), target4.get_output_embeddings()
    anchors = torch.tensor([5, 9, 14])
    block_ids, pos, mask = dflash.block_inputs(
        ids, torch.ones_like(ids), [anchors], 4, cfg.mask_token_id, causal=causal
    )
    with torch.no_grad():
        out = d(aux, torch.arange(20)[None], embed(block_ids), pos, mask)
    proposer = dflash.make_proposer(d, target4, cfg)
    proposer.reset()
    for j, a in enumerate(anchors.tolist()):  # rounds: the cache grows from 5 to 9 to 14 verified positions
        ref = proposer.block_logits(ids[:, : a + 1], {n: f[:, :a] for n, f in feats.items()}, 3)
        assert torch.allclose(lm_head(out[0, j * 4 + 1 : j * 4 + 4]), ref, atol=1e-5), a
    assert proposer.n_real == 14 and proposer.kv[0][0].shape[2] == 14
    # Features at or after the anchor change nothing; the last mask slot's input changes slot 1 (causal:
    # slot 3 only).
    noisy = aux.clone()
    noisy[:, 9:] += 1.0
    emb = embed(block_ids)
    emb[0, 7] += 1.0  # block 1 (anchor 9), slot 3
    with torch.no_grad():
        same = d(noisy, torch.arange(20)[None], embed(block_ids), pos, mask)
        moved = d(aux, torch.arange(20)[None], emb, pos, mask)
    assert torch.allclose(same[0, :8], out[0, :8], atol=1e-6)
    assert torch.allclose(moved[0, 5], out[0, 5], atol=1e-6) == causal
    assert not torch.allclose(moved[0, 7], out[0, 7], atol=1e-4)
    assert torch.allclose(moved[0, :4], out[0, :4], atol=1e-6) and torch.allclose(moved[0, 8:], out[0, 8:], atol=1e-6)


@pytest.mark.parametrize(
    "extra", [{}, {"position_weighting": "dpace"}, {"causal": True}], ids=["decay", "dpace", "causal"]
)
def test_training_learns_and_greedy_stays_lossless(target4, extra):
    torch.manual_seed(0)
    cfg = _cfg(num_layers=1, num_anchors=8, **extra)
    d = dflash.build(cfg, target4)
    ids, log = train_on_random_tokens(dflash, d, target4, cfg, 40, {"acc", "acc1", "acc2"})
    assert log[-1]["acc"] > log[0]["acc"] + 0.3
    prompt = ids[0, :8].tolist()
    proposer = dflash.make_proposer(d.eval(), target4, cfg)
    stats = Stats(k=3)
    assert speculative_greedy(target4, proposer, prompt, 3, 30, {2}, stats) == target_greedy(target4, prompt, 30, {2})
    assert stats.passes  # (a random target decodes off the training rows: acceptance is not asserted)
    # Sampled drafts carry their distribution q for the rejection rule; the engine refuses trees.
    proposer.reset()  # a new sequence: none of the last one's ctx K/V
    draft = proposer.propose(
        torch.tensor([prompt + [7]]), _feats(target4, cfg, torch.tensor([prompt])), 3, Sampler(1.0, seed=0)
    )
    assert len(draft.tokens) == 3 and all(q is not None and abs(float(q.sum()) - 1) < 1e-5 for q in draft.qs)
    with pytest.raises(DraftsmithError, match="proposes chains only"):
        tree = EvalConfig(tree="dynamic:depth=2,top_k=2,tokens=3")
        evaluate(Resolved("dflash", proposer, target4, None), None, None, None, tree)
    assert proposer.max_depth == dflash.max_draft_depth(cfg) == 3


@pytest.mark.parametrize("loss", ["ce", "lk_hybrid"])
def test_blocks_past_the_sequence_end_are_masked(target4, loss):
    """Anchors 1..6 of 8 tokens have a slot 1; slot k of anchor a exists iff a + k <= 7. A slot past
    the end has weight 0: its loss and its hits do not count."""
    torch.manual_seed(0)
    cfg = _cfg(num_anchors=100, loss=loss)
    ids = torch.randint(5, 60, (1, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = _feats(target4, cfg, ids)
    d = dflash.build(cfg, target4)
    total, n, m = dflash.compute_loss(d, target4, batch, feats, cfg)
    assert int(n) == 6 and torch.isfinite(total) and total > 0
    assert all(0 <= float(v) / int(n) <= 1 for v in m.values())  # acc{d}: draft d+1's agreement on its own slots
    # Slot weights: decay exp(-(k-1)/4) on existing slots; the sum over blocks matches the grid.
    w = dflash.slot_weights(cfg, torch.ones(6, 4), torch.tensor([[0, 1, 1, 1]] * 4 + [[0, 1, 1, 0], [0, 1, 0, 0]]))
    assert torch.allclose(w[5], torch.tensor([0, 1.0, 0, 0])) and torch.allclose(w[0, 3], torch.exp(torch.tensor(-0.5)))


def test_speculators_export_is_what_vllm_reads_and_round_trips(target4, tmp_path):
    cfg = _cfg()
    path = _save(tmp_path, dflash, cfg, target4)
    out = export(path, target4, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashSpeculator"]
    assert c["aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer inputs = draftsmith's outputs + 1
    assert c["mask_token_id"] == 3 and c["block_size"] == 4 and c["draft_vocab_size"] == target4.config.vocab_size
    assert c["sliding_window_non_causal"] is True and c["sample_from_anchor"] is False
    assert c["target_hidden_size"] == 32 and c["transformer_layer_config"]["num_hidden_layers"] == 2
    sc = c["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == "tiny"
    assert state["fc.weight"].shape == (32, 3 * 32)
    for i in range(2):
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            assert f"layers.{i}.{name}.weight" in state
    assert {"hidden_norm.weight", "norm.weight"} <= set(state)
    assert not {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight"} & set(state)  # vLLM shares the target's
    assert export_family(out) == "dflash"
    _same_decoding(path, out, target4)
    assert "dflash" in dflash.serving_snippet("speculators", "me/x", "tiny", 3)
    # causal: vLLM's update_dflash reads `dflash_config.causal = not sliding_window_non_causal`.
    causal_path = _save(tmp_path / "causal", dflash, _cfg(causal=True), target4)
    causal = export(causal_path, target4, "speculators", tmp_path / "causal-spec")
    cc = json.loads((causal / "config.json").read_text())
    assert cc["sliding_window_non_causal"] is False
    assert dflash.from_init(dflash.DrafterConfig(), cc, target4.config).causal is True
    assert dflash.from_init(dflash.DrafterConfig(causal=True), c, target4.config).causal is False
    _same_decoding(causal_path, causal, target4)
    assert dflash.vllm_serving(out, c, 3)[0] == {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}


def test_native_zlab_layout_is_read_by_init_from(target4, tmp_path):
    cfg = _cfg()
    out = export(_save(tmp_path, dflash, cfg, target4), target4, "speculators", tmp_path / "spec")
    native = tmp_path / "native"
    native.mkdir()
    state = load_file(out / "model.safetensors")
    save_file(state, native / "model.safetensors")
    (native / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "model_type": "qwen3",
                "num_hidden_layers": 2,
                "block_size": 4,
                "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1, 2]},
            }
        )
    )
    assert export_family(native) == "dflash"
    got = dflash.from_init(dflash.DrafterConfig(), json.loads((native / "config.json").read_text()), target4.config)
    assert (got.aux_layers, got.num_layers, got.block_size, got.mask_token_id) == ([0, 1, 2], 2, 4, 5)
    with pytest.raises(DraftsmithError, match="trained on layers"):
        dflash.from_init(
            dflash.DrafterConfig(aux_layers=[0, 1]), {"dflash_config": {"target_layer_ids": [0, 1, 2]}}, target4.config
        )
    fresh = dflash.build(got, target4)
    init_weights(fresh, "dflash", native, target4)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    # The speculators export names layer inputs: from_init reads them back as outputs.
    assert dflash.from_init(
        dflash.DrafterConfig(), json.loads((out / "config.json").read_text()), target4.config
    ).aux_layers == [0, 1, 2]


def _vocab_data(tokens: list[int]) -> dict:
    """A dataset whose most frequent trained tokens are `tokens` (twice each; 0..4 once, untrained)."""
    return {"input_ids": [tokens * 2 + [0, 1, 2, 3, 4]], "loss_mask": [[1] * (2 * len(tokens)) + [0] * 5]}


def test_reduced_vocabulary_scores_the_draft_tokens_only_and_stays_lossless(target4, tmp_path):
    """draft_vocab_size: the head is the target's lm_head rows of the most frequent trained tokens
    (frozen: buffers, no parameter), and the slots' logits are the whole-vocabulary drafter's on those
    tokens (-inf elsewhere over the target's vocabulary); greedy decoding stays lossless; the export
    ships lm_head, d2t and t2d under vLLM's names and decodes alike when read back."""
    torch.manual_seed(0)
    vocab, keep = target4.config.vocab_size, list(range(20, 50))
    cfg = _cfg(draft_vocab_size=len(keep))
    d = dflash.build(cfg, target4, _vocab_data(keep)).eval()
    assert d.t2d.nonzero().flatten().tolist() == keep and (d.d2t + torch.arange(30)).tolist() == keep
    assert torch.equal(d.lm_head.weight, target4.get_output_embeddings().weight[keep])
    assert not any("lm_head" in n or "d2t" in n for n, _ in d.named_parameters())  # never trained
    whole = dflash.build(_cfg(), target4).eval()
    assert not hasattr(whole, "d2t")
    whole.load_state_dict({k: v for k, v in d.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")})
    ids = torch.randint(5, 90, (1, 12))
    feats = _feats(target4, cfg, ids)
    mine, theirs = (dflash.make_proposer(m, target4, cfg) for m in (d, whole))
    small = mine.block_logits(ids, {n: f[:, :10] for n, f in feats.items()}, 3)
    full = theirs.block_logits(ids, {n: f[:, :10] for n, f in feats.items()}, 3)
    assert small.shape == (3, 30) and torch.allclose(small, full[:, keep], atol=1e-6)
    lifted = dflash.target_vocab(d, small)
    assert lifted.shape == (3, vocab) and torch.equal(lifted[:, keep], small)
    assert lifted.isinf().sum() == 3 * (vocab - 30)
    draft = mine.propose(ids[:, :11], {n: f[:, :10] for n, f in feats.items()}, 3)
    assert draft.tokens == [keep[i] for i in small.argmax(-1).tolist()]  # target ids
    prompt = ids[0, :8].tolist()
    stats = Stats(k=3)
    assert speculative_greedy(target4, mine, prompt, 3, 30, {2}, stats) == target_greedy(target4, prompt, 30, {2})
    path = _save(tmp_path, dflash, cfg, target4)
    out = export(path, target4, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["draft_vocab_size"] == 30 and state["lm_head.weight"].shape == (30, 32)
    assert state["d2t"].shape == (30,) and state["t2d"].shape == (vocab,) and "embed_tokens.weight" not in state
    _same_decoding(path, out, target4)
    assert dflash.from_init(dflash.DrafterConfig(), c, target4.config).draft_vocab_size == 30
    # A peer's export without t2d (vLLM needs none) reads back with t2d rebuilt from d2t.
    del state["t2d"]
    save_file(state, out / "model.safetensors")
    assert torch.equal(dflash.read_export(out, target4)["t2d"], load_state(path)["t2d"])


def test_labels_off_the_draft_vocabulary_are_misses_without_loss(target4):
    """A slot whose target argmax is not a draft token cannot be drafted: `ce` gives it no loss and
    the acceptance metrics count it as a miss. With none of the target's choices in the draft
    vocabulary, the loss and every acc are 0; with all of them in it, every trained slot counts."""
    torch.manual_seed(0)
    ids = torch.randint(5, 90, (1, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        chosen = sorted(set(target4(ids).logits.argmax(-1)[0].tolist()))
    others = [t for t in range(target4.config.vocab_size) if t not in chosen]
    for tokens, empty in ((others[: len(others) // 2], True), (chosen + others[:5], False)):
        cfg = _cfg(num_anchors=100, draft_vocab_size=len(tokens))
        d = dflash.build(cfg, target4, _vocab_data(tokens))
        blocks = dflash.block_targets(target4, batch, _feats(target4, cfg, ids), cfg, False, d.t2d)
        assert (blocks.top < 0).all() if empty else (blocks.top >= 0).all(), tokens
        total, n, m = dflash.compute_loss(d, target4, batch, _feats(target4, cfg, ids), cfg)
        assert (total.item() == 0 and all(v.item() == 0 for v in m.values())) if empty else total.item() > 0


def test_bad_configs_are_one_line_errors(target4):
    for kw, match in [
        ({"block_size": 1}, "drafter.block_size"),
        ({"draft_vocab_size": -1}, "drafter.draft_vocab_size"),
        ({"aux_layers": [0, 1, 1]}, "repeated layer ids"),
        ({"loss": "kl"}, "unknown loss 'kl'"),
        ({"position_weighting": "x"}, "position_weighting"),
        ({"causal": "yes"}, "drafter.causal"),
    ]:
        with pytest.raises(DraftsmithError, match=match) as e:
            dflash.DrafterConfig(**kw)
        assert "\n" not in str(e.value)
    with pytest.raises(DraftsmithError, match="drafter.mask_token_id"):
        dflash.build(_cfg(mask_token_id=10_000), target4)
    with pytest.raises(DraftsmithError, match="last layer"):
        dflash.build(_cfg(aux_layers=[1, 3]), target4)
    default = dflash.resolve(dflash.DrafterConfig(aux_layers=[0]), target4.config)
    assert default.mask_token_id == target4.config.pad_token_id  # the documented default
