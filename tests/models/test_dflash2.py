"""DFlash2: the grouped convolution is causal inside a block (and the identity at init, so a fresh
DFlash2 drafts exactly as DFlash), the selector walk equals stepping it by hand (greedy and sampled),
the training scores are the teacher-forced selector's, learning with lossless greedy and sampled
chains, the speculators export vLLM reads (and read back by vLLM's own loader, `vllm_families`),
export --verify, init_from, one-line config errors."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Sampler, Stats, speculative_greedy, target_greedy
from draftsmith.models import dflash, dflash2
from draftsmith.models.folder import load_state
from draftsmith.models.readers import export_family, init_weights
from draftsmith.ship.export import export
from tests.models.conftest import block_feats, train_on_random_tokens
from tests.ship.test_export import _same_decoding, _save

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw):
    base = {"aux_layers": [0, 1, 2], "num_layers": 2, "block_size": 4, "mask_token_id": 3}
    return dflash2.DrafterConfig(**{**base, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5, **kw})


def _feats(target, cfg, ids):
    return block_feats(dflash2, target, cfg, ids)


def _strong(d, scale=1.0, seed=1):
    """Convolutions and a selector that matter: at init both are the identity (DFlash's drafts)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.3 * torch.randn_like(conv.base_kernel))
                conv.kernel_projection.weight.normal_(std=0.1)
        sel = d.candidate_selector
        sel.predecessor_codebook.normal_(std=scale)
        sel.successor_codebook.normal_(std=scale)
        sel.hidden_projection.weight.normal_(std=scale)
    return d


def _manual_conv(x, base, delta, block):
    """The convolution written out element by element: y[n, c] = sum over taps t <= slot(n) of
    (base[t, c] + delta[n, t, c // G]) * x[n - t, c]."""
    n, h = x.shape
    g = h // delta.shape[-1]
    y = torch.zeros_like(x)
    for row in range(n):
        for t in range(base.shape[0]):
            if t <= row % block:
                for c in range(h):
                    y[row, c] += (base[t, c] + delta[row, t, c // g]) * x[row - t, c]
    return y


def test_the_convolution_is_causal_inside_each_block_and_the_identity_at_init():
    torch.manual_seed(0)
    block, h, taps = 4, 8, 3
    x, base, delta = torch.randn(3 * block, h), torch.randn(taps, h), torch.randn(3 * block, taps, 2)
    y = dflash2.block_conv(x, base, delta, block)
    assert torch.allclose(y, _manual_conv(x, base, delta, block), atol=1e-5)
    # Changing slot 2 of block 1 (row 6) changes rows 6 and 7 only: not earlier slots of its block,
    # not slot 0 of the next block (taps stop at the block start), not other blocks.
    x2 = x.clone()
    x2[6] += 1.0
    changed = (dflash2.block_conv(x2, base, delta, block) != y).any(-1).nonzero().flatten().tolist()
    assert changed == [6, 7]
    # Batched rows, and a fresh pair of convolutions is exactly the identity on both sides.
    conv = dflash2.GroupedCausalConv(h, taps, 4, block)
    a = torch.randn(2, 2 * block, h)
    out, kernel = conv.prepare(a)
    assert torch.equal(out, a) and kernel.shape == (2, 2 * block, taps, 2) and not kernel.any()
    assert torch.equal(conv.finish(a, kernel), a)
    assert conv.base_kernel.shape == (2, taps, h) and conv.kernel_projection.weight.shape == (2 * taps * 2, h)


def test_a_fresh_dflash2_drafts_exactly_as_its_dflash_backbone(target4):
    torch.manual_seed(0)
    cfg = _cfg()
    d2 = dflash2.build(cfg, target4).eval()
    plain_cfg = dflash.DrafterConfig(aux_layers=[0, 1, 2], num_layers=2, block_size=4, mask_token_id=3)
    d1 = dflash.build(plain_cfg, target4).eval()
    own = d1.state_dict()
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in own})
    ids = torch.randint(5, 90, (1, 14))
    feats = _feats(target4, cfg, ids[:, :-1])
    with torch.no_grad():
        h2 = dflash.BlockProposer(d2, target4, cfg, around=dflash2.convs).block_hidden(ids, feats, 3)
        h1 = dflash.BlockProposer(d1, target4, plain_cfg).block_hidden(ids, feats, 3)
        chain2 = dflash2.make_proposer(d2, target4, cfg).propose(ids, feats, 3)
        chain1 = dflash.make_proposer(d1, target4, plain_cfg).propose(ids, feats, 3)
    assert torch.equal(h1, h2)
    assert chain2.tokens == chain1.tokens and chain2.parents == [-1, 0, 1]


def _walk_by_hand(d, target, cfg, tokens, feats, m, sampled=None):
    """The selector stepped by hand on one backbone pass: C_i = top-k of z_i, s_i[c] = z_i[C_i[c]] +
    sum_r P[prev, r] (W_hp h_i)[r] S[C_i[c], r]; prev_1 = the bonus, then draft i (or `sampled[i]`)."""
    h = dflash.BlockProposer(d, target, cfg, around=dflash2.convs).block_hidden(tokens, feats, m)
    z = target.get_output_embeddings()(h)
    sel = d.candidate_selector
    p, s_book, w = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    prev, out, rows = int(tokens[0, -1]), [], []
    for i in range(m):
        cand = z[i].topk(cfg.selector_top_k).indices
        s = torch.stack([z[i, c] + (p[prev] * (w @ h[i]) * s_book[c]).sum() for c in cand.tolist()])
        out.append(int(cand[s.argmax()]) if sampled is None else sampled[i])
        rows.append((cand, s))
        prev = out[-1]
    return out, rows, z


def test_the_selector_walk_drafts_left_to_right_as_stepping_it_by_hand(target4):
    torch.manual_seed(0)
    cfg = _cfg()
    d = _strong(dflash2.build(cfg, target4).eval(), scale=1.5)
    ids = torch.randint(5, 90, (1, 14))
    feats = _feats(target4, cfg, ids[:, :-1])  # the engine's call: features of every token but the newest
    proposer = dflash2.make_proposer(d, target4, cfg)
    with torch.no_grad():
        draft = proposer.propose(ids, feats, 3)
        want, _, z = _walk_by_hand(d, target4, cfg, ids, feats, 3)
    assert draft.tokens == want and draft.parents == [-1, 0, 1] and draft.qs == [None] * 3
    assert want != z.argmax(-1).tolist()  # the selector changed the chain: the test sees it
    # Sampled: draft i is drawn from softmax(s_i) on C_i, with the path actually drawn.
    proposer.reset()
    with torch.no_grad():
        drawn = proposer.propose(ids, feats, 3, Sampler(1.0, seed=0))
        _, rows, _ = _walk_by_hand(d, target4, cfg, ids, feats, 3, sampled=drawn.tokens)
    for q, token, (cand, s) in zip(drawn.qs, drawn.tokens, rows):
        assert torch.allclose(q[cand], torch.softmax(s, -1), atol=1e-5)
        assert q.sum().item() == pytest.approx(1.0, abs=1e-5) and q[cand].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert token in cand.tolist()


def test_training_scores_are_the_teacher_forced_selector_with_the_gold_injected(target4, monkeypatch):
    """At slot k of anchor a, the selector loss scores the unary top-k of z_k (its last candidate
    replaced by the target's argmax when missing) with prev = the data token x_{a+k-1}."""
    torch.manual_seed(0)
    cfg = _cfg(selector_top_k=2)  # small k: some golds miss the top-k and are injected
    d = _strong(dflash2.build(cfg, target4).eval())
    ids = torch.randint(5, 90, (1, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = _feats(target4, cfg, ids)
    seen = {}
    real = dflash2.selector_cross_entropy

    def spy(scores, label, weights):
        seen["scores"], seen["label"] = scores, label
        return real(scores, label, weights)

    monkeypatch.setattr(dflash2, "selector_cross_entropy", spy)
    real_targets = dflash.block_targets
    monkeypatch.setattr(dflash, "block_targets", lambda *a, **kw: seen.setdefault("blocks", real_targets(*a, **kw)))
    with torch.no_grad():
        dflash2.compute_loss(d, target4, batch, feats, cfg)
    blocks = seen["blocks"]
    scores, label = seen["scores"].view(-1, 3, 2), seen["label"].view(-1, 3)
    sel = d.candidate_selector
    injected = 0
    for j, a in enumerate((blocks.lab[:, 0] - 1).tolist()[:4]):
        if a + 3 >= 16:
            continue
        h = dflash.BlockProposer(d, target4, cfg, around=dflash2.convs).block_hidden(
            ids[:, : a + 1], {n: f[:, :a] for n, f in feats.items()}, 3
        )
        z = target4.get_output_embeddings()(h)
        gold = target4(ids[:, : a + 3]).logits[0, a:].argmax(-1)  # slot k+1's label: the target at a+k
        for k in range(3):
            cand = z[k].topk(2).indices.tolist()
            if int(gold[k]) not in cand:
                cand[-1], injected = int(gold[k]), injected + 1
            assert label[j, k] == cand.index(int(gold[k]))
            hp = sel.hidden_projection(h[k])
            prev = int(ids[0, a + k])  # the token before slot k+1: the data token x_{a+k}
            want = torch.stack(
                [z[k, c] + (sel.predecessor_codebook[prev] * hp * sel.successor_codebook[c]).sum() for c in cand]
            )
            assert torch.allclose(scores[j, k], want, atol=1e-4), (a, k)
    assert injected  # the injection path ran


@pytest.mark.parametrize("extra", [{}, {"loss": "tvd", "position_weighting": "dpace"}], ids=["ce", "soft-dpace"])
def test_training_learns_and_greedy_stays_lossless(target4, extra):
    torch.manual_seed(0)
    cfg = _cfg(num_layers=1, num_anchors=8, **extra)
    d = dflash2.build(cfg, target4)
    metrics = {"acc", "acc1", "acc2", "sel_ce", "sel_acc", "coverage"}
    ids, log = train_on_random_tokens(dflash2, d, target4, cfg, 30, metrics)
    assert log[-1]["sel_ce"] < log[0]["sel_ce"] and log[-1]["coverage"] >= log[0]["coverage"]
    assert log[-1]["sel_acc"] > log[0]["sel_acc"]
    assert d.candidate_selector.hidden_projection.weight.abs().max() > 0  # it trained (it starts at zero)
    assert any(layer.attention_conv.kernel_projection.weight.abs().max() > 0 for layer in d.layers)
    prompt = ids[0, :8].tolist()
    proposer = dflash2.make_proposer(d.eval(), target4, cfg)
    stats = Stats(k=3)
    assert speculative_greedy(target4, proposer, prompt, 3, 30, {2}, stats) == target_greedy(target4, prompt, 30, {2})
    assert stats.passes


def test_selector_loss_weight_adds_the_selector_ce(target4):
    ids = torch.randint(5, 60, (1, 20))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = _feats(target4, _cfg(), ids)
    d = _strong(dflash2.build(_cfg(num_anchors=4), target4))
    losses = {}
    for w in (0.0, 1.0, 2.0):
        torch.manual_seed(5)  # the same anchors
        losses[w] = dflash2.compute_loss(d, target4, batch, feats, _cfg(num_anchors=4, selector_loss_weight=w))[0]
    ce = losses[1.0] - losses[0.0]
    assert ce > 0 and torch.allclose(losses[2.0] - losses[0.0], 2 * ce, atol=1e-4)


@pytest.mark.chi_square
def test_sampled_selector_chains_are_lossless(peaked_target):
    """Draft i is sampled from the selector's q_i on its top-k, which depends on the drafts before it:
    the rule only needs q_i known, so the output keeps the target's distribution (chi-square against
    target-only sampling); accepting every draft does not (the negative control)."""
    from tests.engine.test_sampling import assert_samples_losslessly

    target = peaked_target
    torch.manual_seed(0)
    cfg = dflash2.DrafterConfig(aux_layers=[0], block_size=4, conv_group_size=8, selector_rank=4, selector_top_k=4)
    proposer = dflash2.make_proposer(_strong(dflash2.build(cfg, target).eval(), scale=0.7), target, cfg)
    assert_samples_losslessly(target, proposer)


def test_speculators_export_is_what_vllm_reads_and_round_trips(target4, tmp_path):
    cfg = _cfg()
    path = _save(tmp_path, dflash2, cfg, target4)
    state = load_state(path)  # convolutions and a selector that matter (saved at identity), as if trained
    torch.manual_seed(2)
    for k in state:
        if "conv" in k or "candidate_selector" in k:
            state[k] = state[k] + 0.2 * torch.randn_like(state[k])
    save_file(state, path / "model.safetensors")
    out = export(path, target4, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["speculators_model_type"] == "dflash2" and c["speculators_config"]["algorithm"] == "dflash2"
    assert c["architectures"] == ["DFlash2DraftModel"]
    assert c["aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer inputs = draftsmith's outputs + 1
    assert (c["conv_kernel_size"], c["conv_group_size"], c["selector_rank"], c["selector_top_k"]) == (2, 8, 6, 5)
    assert c["sample_from_anchor"] is False and c["mask_token_id"] == 3 and c["block_size"] == 4
    assert c["draft_vocab_size"] == target4.config.vocab_size
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    v, h = target4.config.vocab_size, 32
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert state[f"layers.{i}.{conv}.base_kernel"].shape == (2, 2, h)
            assert state[f"layers.{i}.{conv}.kernel_projection.weight"].shape == (2 * 2 * h // 8, h)
    assert state["candidate_selector.predecessor_codebook"].shape == (v, 6)
    assert state["candidate_selector.successor_codebook"].shape == (v, 6)
    assert state["candidate_selector.hidden_projection.weight"].shape == (6, h)
    assert not {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight"} & set(state)  # vLLM shares the target's
    assert export_family(out) == "dflash2"
    _same_decoding(path, out, target4)
    snippet = dflash2.serving_snippet("speculators", "me/x", "tiny", 3)
    assert '"method": "dflash"' in snippet and "dflash2" not in snippet
    assert dflash2.vllm_serving(out, c, 3)[0] == {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}
    # A peer's folder (no draftsmith section) is recognised and init_from reads its fields and weights.
    del c["draftsmith"]
    (out / "config.json").write_text(json.dumps(c))
    assert export_family(out) == "dflash2"
    got = dflash2.from_init(dflash2.DrafterConfig(), c, target4.config)
    assert (got.aux_layers, got.num_layers, got.block_size, got.mask_token_id) == ([0, 1, 2], 2, 4, 3)
    assert (got.conv_kernel_size, got.conv_group_size, got.selector_rank, got.selector_top_k) == (2, 8, 6, 5)
    with pytest.raises(DraftsmithError, match="DFlash2 needs the whole vocabulary") as e:  # as speculators, vLLM
        dflash2.from_init(dflash2.DrafterConfig(), {**c, "draft_vocab_size": 40}, target4.config)
    assert "\n" not in str(e.value)
    fresh = dflash2.build(got, target4)
    init_weights(fresh, "dflash2", out, target4)
    assert all(torch.equal(fresh.state_dict()[k], t) for k, t in state.items())
    # A native z-lab config nests every field in dflash_config (target_layer_ids: layer outputs).
    native = {
        "architectures": ["DFlash2DraftModel"],
        "num_hidden_layers": 2,
        "dflash_config": {
            "block_size": 4,
            "mask_token_id": 3,
            "target_layer_ids": [0, 1, 2],
            "conv_kernel_size": 2,
            "conv_group_size": 8,
            "selector_rank": 6,
            "selector_top_k": 5,
        },
    }
    assert dflash2.recognises(native, set()) and not dflash.recognises(native, set())
    assert dflash2.from_init(dflash2.DrafterConfig(), native, target4.config) == got


@pytest.mark.fp32_exact
def test_export_verify_passes_after_training(tmp_path, chat_jsonl, monkeypatch):
    from draftsmith.cli import main
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.conftest import save_target
    from tests.train.test_train import _overrides

    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")  # tiny head dims: below vLLM's CPU attention
    target_dir = save_target(tmp_path / "target", layers=3)
    extra = {
        "drafter.type": "dflash2",
        "drafter.aux_layers": [0, 1],
        "drafter.block_size": 4,
        "drafter.selector_rank": 8,
        "drafter.selector_top_k": 4,
    }
    run = train(load_config(None, _overrides(target_dir, chat_jsonl, tmp_path, **{**extra, "optim.max_steps": 3})))
    out = tmp_path / "spec"
    args = ["export", str(run / "final"), "--format", "speculators", "--out", str(out), "--verify", "--data"]
    assert main([*args, str(chat_jsonl)]) == 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash2"


def test_bad_configs_are_one_line_errors(target4):
    for kw, match in [
        ({"conv_kernel_size": 0}, "drafter.conv_kernel_size"),
        ({"conv_kernel_size": 9}, "drafter.conv_kernel_size"),  # longer than the block
        ({"conv_group_size": 0}, "drafter.conv_group_size"),
        ({"selector_rank": 0}, "drafter.selector_rank"),
        ({"selector_top_k": 0}, "drafter.selector_top_k"),
        ({"selector_loss_weight": -1.0}, "drafter.selector_loss_weight"),
        ({"block_size": 1}, "drafter.block_size"),  # dflash's checks, shared
        ({"loss": "kl"}, "unknown loss 'kl'"),
    ]:
        with pytest.raises(DraftsmithError, match=match) as e:
            dflash2.DrafterConfig(**kw)
        assert "\n" not in str(e.value)
    for kw, match in [
        ({"conv_group_size": 5}, "does not divide the hidden size 32"),
        ({"selector_top_k": 10_000}, "exceeds"),
    ]:
        with pytest.raises(DraftsmithError, match=match) as e:
            dflash2.build(_cfg(**kw), target4)
        assert "\n" not in str(e.value)


# --- vLLM's own loader (its CPU build refuses to serve DFlash2; models/dflash2.py) ---------------------


@pytest.mark.vllm  # vLLM's environment: not a unit test (scripts/test.sh)
@pytest.mark.vllm_families
def test_vllm_load_weights_accepts_every_tensor_of_the_export(tmp_path):
    """vLLM's own config parser (update_dflash2), DFlash2Qwen3ForCausalLM and its load_weights, in
    vLLM's environment (tests/models/vllm_dflash2_load.py): every exported tensor is accepted and
    lands, values and shape, in the parameter vLLM drafts with (q/k/v and gate/up stacked at their row
    offsets); what no tensor fills is exactly what vLLM shares with the target (embed_tokens, lm_head)
    or leaves unused on this path (the mask embedding)."""
    from draftsmith.target.load import load_target
    from draftsmith.target.vllm_server import available, find_python
    from tests.conftest import save_target

    if not available():
        pytest.skip("vLLM is not installed (.venv-vllm: bash scripts/setup.sh --vllm)")
    target_dir = save_target(tmp_path / "target", layers=4)
    target = load_target(str(target_dir), "fp32")[0]
    path = _save(tmp_path, dflash2, _cfg(), target)
    state = load_state(path)
    torch.manual_seed(3)  # every tensor distinct (norms are ones, the convolutions identity when fresh)
    save_file({k: t + 0.1 * torch.randn_like(t) for k, t in state.items()}, path / "model.safetensors")
    out = export(path, target, "speculators", tmp_path / "spec")
    result = subprocess.run(
        [find_python(), str(ROOT / "tests" / "models" / "vllm_dflash2_load.py"), str(out), str(target_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    state = load_file(out / "model.safetensors")
    assert report["loaded"] == sorted(state) and report["not_landed"] == []
    c = report["config"]
    assert c["architectures"] == ["DFlash2DraftModel"] and c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    own = {k: c["dflash_config"][k] for k in dflash2.OWN_KEYS}
    assert own == {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    assert c["dflash_config"]["mask_token_id"] == 3 and c["dflash_config"]["causal"] is False
    assert report["method"] == "dflash" and report["conv_block"] == 4  # 1 + K: the trained block
    q, kv, inter = 4 * 8, 2 * 8, 64  # n_h * d, n_kv * d, I of the tiny target
    for i in range(2):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        assert report["landed"][f"{attn}.k_proj.weight"] == [f"model.{attn}.qkv_proj.weight", q]
        assert report["landed"][f"{attn}.v_proj.weight"] == [f"model.{attn}.qkv_proj.weight", q + kv]
        assert report["landed"][f"{mlp}.up_proj.weight"] == [f"model.{mlp}.gate_up_proj.weight", inter]
        for conv in ("attention_conv", "mlp_conv"):
            for part in ("base_kernel", "kernel_projection.weight"):
                name = f"layers.{i}.{conv}.{part}"
                assert report["landed"][name] == [f"model.{name}", 0]
                assert report["shapes"][f"model.{name}"] == list(state[name].shape)
    for part in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        name = f"candidate_selector.{part}"
        assert report["landed"][name] == [f"model.{name}", 0]
        assert report["shapes"][f"model.{name}"] == list(state[name].shape)
    # Shared with the target, and the mask_embedding.pt override this export does not ship.
    assert report["not_from_checkpoint"] == ["lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"]
    # vLLM's CPU convolution and selector scores (torch fallbacks) on its inputs = draftsmith's.
    p = {k: torch.tensor(v) for k, v in report["parity"].items()}
    d = dflash2.from_export(out, json.loads((out / "config.json").read_text()), dflash2.DrafterConfig(), target)
    conv, sel = d.layers[0].attention_conv, d.candidate_selector
    with torch.no_grad():
        prepared, kernel = conv.prepare(p["x"])
        assert torch.allclose(prepared, p["prepared"], atol=1e-5)
        assert torch.allclose(conv.finish(p["y"], kernel), p["finished"], atol=1e-5)
        ids, steps = p["ids"], p["ids"].shape[0]
        for i in range(steps):  # E[i, a, c]: the walk at slot i+1 after choosing candidate a before it
            preds = p["anchor"].expand(ids.shape[1]) if i == 0 else ids[i - 1]
            for a, prev in enumerate(preds.tolist()):
                want = p["unary"][i] + sel(p["hidden"][i], torch.tensor(prev), ids[i])
                assert torch.allclose(want, p["edges"][i, a], atol=1e-5), (i, a)
