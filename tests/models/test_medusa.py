"""Medusa-1 heads: the t+k+2 label offset, identity initialisation, a frozen target, drafting
(chain and static tree), and the vLLM MedusaModel export contract."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import parse_tree
from draftsmith.engine.speculative import Stats, speculative_decode, target_decode
from draftsmith.models import medusa
from draftsmith.models.folder import save_drafter
from draftsmith.target.load import fingerprint
from tests.conftest import lossless_ok


class PositionOracle(torch.nn.Module):
    """Stands in for the heads in compute_loss: reads the position t out of the hidden state and
    puts all mass on ids[t + k + shift]. The loss is ~0 and accuracy 1 only with shift = 2."""

    def __init__(self, ids, vocab, shift):
        super().__init__()
        self.ids, self.vocab, self.shift = ids, vocab, shift
        self.lm_heads = torch.nn.ModuleList([torch.nn.Linear(1, 1)])

    dtype = torch.float32

    def to_draft(self, ids):  # full vocabulary
        return ids

    def forward(self, hs):
        return [self.head_logits(h, k) for k, h in enumerate(hs)]

    def head_logits(self, h, k):
        t = h[:, 0].round().long()
        label = self.ids[0, (t + k + self.shift).clamp(max=self.ids.shape[1] - 1)]
        return torch.nn.functional.one_hot(label, self.vocab).float() * 50.0


class NextTokenTarget:
    """A target whose lm_head at position p (read from the hidden state) is one-hot on ids[p + 1]:
    soft labels then carry the same offsets as hard ones."""

    dtype = torch.float32

    def __init__(self, ids, vocab):
        self.head = PositionOracle(ids, vocab, shift=1)

    def get_output_embeddings(self):
        return lambda h: self.head.head_logits(h, 0)


@pytest.mark.parametrize("soft", [False, True])
def test_head_k_at_t_is_trained_on_token_t_plus_k_plus_2(soft):
    ids = torch.tensor([[7, 3, 9, 4, 8, 2, 6, 5]])
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    feats = {"last_hidden": torch.arange(8.0)[None, :, None].expand(1, 8, 4)}  # hidden state at t encodes t
    cfg, target = medusa.DrafterConfig(num_heads=3, soft_labels=soft), NextTokenTarget(ids, 10)
    right, n, metrics = medusa.compute_loss(PositionOracle(ids, 10, shift=2), target, batch, feats, cfg)
    assert right < 1e-3 and n == 6  # head 0 has T - 2 positions
    assert metrics["acc"] == 6 and metrics["acc1"] == 5 and metrics["acc2"] == 4
    wrong, _, _ = medusa.compute_loss(PositionOracle(ids, 10, shift=1), target, batch, feats, cfg)
    assert wrong > 100  # one position off (what the target's own lm_head predicts) is heavily penalised


@pytest.mark.fp32_exact
def test_fresh_heads_are_the_targets_lm_head_shifted(tiny_target):
    target, _ = tiny_target
    heads = medusa.build(medusa.DrafterConfig(num_heads=3, num_layers=2), target)
    h = torch.randn(5, target.config.hidden_size)
    for k in range(3):  # zero-initialised ResBlocks are the identity: head k starts as lm_head
        torch.testing.assert_close(heads.head_logits(h, k), target.get_output_embeddings()(h))


def test_medusa1_trains_heads_only(tiny_target):
    target, _ = tiny_target
    cfg = medusa.DrafterConfig(num_heads=2)
    heads = medusa.build(cfg, target)
    ids = torch.randint(5, 60, (2, 12))
    from draftsmith.target.features import target_features

    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, n, _ = medusa.compute_loss(heads, target, batch, target_features(target, batch, ("last_hidden",)), cfg)
    (loss / n).backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None for p in heads.parameters())


class Oracle(medusa.MedusaProposer):
    """Heads that know the target's greedy continuation, with a decoy ranked above the truth."""

    def __init__(self, heads, ref, prompt_len, vocab):
        super().__init__(heads)
        self.ref, self.prompt_len, self.vocab = ref, prompt_len, vocab

    def _head_logits(self, feats):
        generated = feats["last_hidden"].shape[1] + 1 - self.prompt_len  # features cover all but the newest token
        out = []
        for k in range(len(self.heads.blocks)):
            i = generated + k  # head k predicts the token k+1 places after the newest: generated index i
            true = self.ref[min(i, len(self.ref) - 1)]
            logits = torch.zeros(self.vocab)
            logits[(true + 1) % self.vocab], logits[true] = 2.0, 1.0  # rank 0 decoy, rank 1 truth
            out.append(logits)
        return out


def test_a_perfect_static_tree_gets_tau_depth_plus_one_and_is_lossless(tiny_target):
    target, tok = tiny_target
    heads = medusa.build(medusa.DrafterConfig(num_heads=3), target)
    prompt = tok("say 3")["input_ids"]
    ref = target_decode(target, prompt, 30, set())
    spec = parse_tree("static:[[0],[1],[1,0],[1,1],[1,1,0],[1,1,1]]")
    stats = Stats(k=3)
    # 1 token from the prefill, then 7 rounds of 3 accepted drafts + 1 bonus token.
    out = speculative_decode(
        target, Oracle(heads, ref, len(prompt), target.config.vocab_size), prompt, 3, 29, set(), None, stats, spec
    )
    assert out == ref[:29]
    assert stats.per_position == [1.0, 1.0, 1.0] and stats.tau == 4.0  # 3 heads + the bonus token


def test_chain_drafts_are_lossless_with_real_heads(tiny_target):
    target, tok = tiny_target
    heads = medusa.build(medusa.DrafterConfig(num_heads=3), target)
    prompt = tok("say 5")["input_ids"]
    out = speculative_decode(target, medusa.MedusaProposer(heads), prompt, 3, 20, set())
    assert out == target_decode(target, prompt, 20, set())


@pytest.mark.fp32_exact
def test_vllm_export_contract_and_round_trip(tiny_target, tmp_path):
    from draftsmith.models.readers import import_export
    from draftsmith.ship.export import export

    target, _ = tiny_target
    cfg = medusa.DrafterConfig(num_heads=3, num_layers=2)
    heads = medusa.build(cfg, target)
    for p in heads.parameters():  # not the identity: a round trip must carry real weights
        torch.nn.init.normal_(p, std=0.02)
    meta = {
        "drafter": "medusa",
        "drafter_config": {"type": "medusa", **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    path = save_drafter(heads, tmp_path / "final", meta)
    out = export(path, target, "vllm", tmp_path / "vllm")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    H, V = target.config.hidden_size, target.config.vocab_size
    assert c["architectures"] == ["MedusaModel"] and c["model_type"] == "medusa"
    assert (c["hidden_size"], c["vocab_size"], c["num_heads"], c["num_hidden_layers"]) == (H, V, 3, 2)
    assert c["medusa_fc_bias"] is True
    assert sorted(state) == sorted(
        [f"blocks.{h}.layers.{l}.{w}" for h in range(3) for l in range(2) for w in ("weight", "bias")]
        + [f"lm_heads.{h}.weight" for h in range(3)]
    )
    assert state["blocks.0.layers.0.weight"].shape == (H, H) and state["lm_heads.2.weight"].shape == (V, H)
    _, _, back = import_export(out, target)
    h = torch.randn(4, H)
    for k in range(3):
        torch.testing.assert_close(back.head_logits(h, k), heads.head_logits(h, k))


def test_medusa_trains_in_the_shared_loop_and_evaluates_on_a_static_tree(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    cfg = load_config(
        None,
        _overrides(
            tiny_target_dir,
            chat_jsonl,
            tmp_path,
            **{
                "drafter.type": "medusa",
                "drafter.num_heads": 2,
                "drafter.soft_labels": False,
                "optim.max_steps": 8,
                "eval.enabled": True,
                "eval.num_prompts": 2,
                "eval.max_new_tokens": 10,
                "eval.tree": "static:[[0],[1],[0,0]]",
            },
        ),
    )
    run = train(cfg)
    log = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["drafter"] == "medusa" and lossless_ok(report) and report["k"] == 2


@pytest.mark.fp32_exact
def test_reduced_head_vocabulary_maps_back_to_target_ids_and_exports_a_token_map(tiny_target, tmp_path):
    from draftsmith.models.readers import import_export
    from draftsmith.ship.export import export

    target, tok = tiny_target
    rows = [{"input_ids": tok("abcabc hello")["input_ids"], "loss_mask": [1] * 12}]
    ds = {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    cfg = medusa.DrafterConfig(num_heads=2, draft_vocab_size=20)
    heads = medusa.build(cfg, target, ds)
    kept = set(heads.token_map.tolist())
    assert set(rows[0]["input_ids"]) <= kept and len(kept) == 20
    h = torch.randn(3, target.config.hidden_size)
    full = target.get_output_embeddings()(h)
    # A fresh reduced head is the target's lm_head restricted to the draft vocabulary.
    torch.testing.assert_close(heads.head_logits(h, 1), full[:, heads.token_map])
    draft = medusa.MedusaProposer(heads).propose(None, {"last_hidden": h[None]}, 2)
    assert set(draft.tokens) <= kept
    missing = next(i for i in range(target.config.vocab_size) if i not in kept)
    assert heads.to_draft(torch.tensor([int(heads.token_map[5]), missing])).tolist() == [5, -1]

    def saved(cfg, heads, name):
        meta = {
            "drafter": "medusa",
            "drafter_config": {"type": "medusa", **cfg.__dict__},
            "target": "tiny",
            "target_fingerprint": fingerprint(target),
        }
        return save_drafter(heads, tmp_path / name, meta)

    # vLLM 0.32 loads no per-head reduced lm_heads (tests/ship/test_serve_check.py): refused, nothing written.
    with pytest.raises(DraftsmithError, match="original_lm_head=true"):
        export(saved(cfg, heads, "own"), target, "vllm", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()
    # The encoding it serves: one shared lm_head, the target's rows of the draft vocabulary.
    cfg = medusa.DrafterConfig(num_heads=2, draft_vocab_size=20, original_lm_head=True)
    heads = medusa.build(cfg, target, ds)
    torch.testing.assert_close(heads.head_logits(h, 1), full[:, heads.token_map])
    out = export(saved(cfg, heads, "shared"), target, "vllm", tmp_path / "vllm")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["truncated_vocab_size"] == 20 and c["vocab_size"] == target.config.vocab_size and c["original_lm_head"]
    assert torch.equal(state["token_map"], heads.token_map) and state["lm_head.weight"].shape[0] == 20
    _, _, back = import_export(out, target)
    assert torch.equal(back.token_map, heads.token_map)


def test_bad_medusa_configs_fail_when_the_recipe_loads():
    from draftsmith import DraftsmithError
    from draftsmith.train.config import load_config

    with pytest.raises(DraftsmithError, match="expected num_heads >= 1"):
        load_config(None, ["drafter.type=medusa", "drafter.num_heads=0"])
    with pytest.raises(
        DraftsmithError, match="eval.tree drafts 3 deep, but a medusa drafter with this config drafts at most 2"
    ):
        load_config(None, ["drafter.type=medusa", "drafter.num_heads=2", "eval.tree=static:[[0],[0,0],[0,0,0]]"])
    with pytest.raises(DraftsmithError, match="eval.k drafts 5 deep"):
        load_config(None, ["drafter.type=medusa", "drafter.num_heads=4", "eval.k=5"])
    assert load_config(None, ["drafter.type=medusa", "drafter.num_heads=4", "eval.k=4"]).drafter["num_heads"] == 4


# --- Medusa-2: heads and backbone trained together -------------------------------------------------

MEDUSA2 = {
    "drafter.type": "medusa",
    "drafter.num_heads": 2,
    "drafter.backbone": "lora",
    "drafter.backbone_lr": 1e-2,
    "drafter.lora_rank": 4,
}


def _batch(seed=0):
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.mark.fp32_exact
def test_medusa2_lora_starts_at_zero_kl_and_changes_only_adapters_and_heads(tiny_target):
    target, _ = tiny_target
    cfg = medusa.DrafterConfig(num_heads=2, backbone="lora", backbone_lr=1e-2, lora_rank=4)
    ids = _batch(9)["input_ids"]
    reference = target(ids).logits  # the target before any adapter exists
    model = medusa.build(cfg, target)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(medusa.param_groups(model, cfg, 1e-2), weight_decay=0.01)
    for step in range(3):
        loss, n, metrics = medusa.compute_loss(model, target, _batch(step), {}, cfg, step=step)
        if step == 0:  # fresh adapters are the identity (lora_B = 0): trained == original exactly
            assert metrics["kl_loss"] == 0.0 and metrics["heads_loss"] > 0
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in changed) and any(n.startswith("heads.") for n in changed)
    assert all("lora_" in n or n.startswith("heads.") for n in changed), changed
    _, _, metrics = medusa.compute_loss(model, target, _batch(9), {}, cfg, step=3)
    assert metrics["kl_loss"] > 0  # the backbone moved...
    with model.original() as original:  # ...and the original is still there, adapters disabled
        torch.testing.assert_close(original(ids).logits, reference, rtol=0, atol=0)
    merged = medusa.verifier(model, target)  # the new target: adapters merged into a copy
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(ids).logits, model.model(ids).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(merged(ids).logits, reference, atol=1e-4)


@pytest.mark.fp32_exact
def test_two_stage_keeps_the_backbone_fixed_during_the_heads_only_stage(tiny_target):
    from draftsmith.train.config import Config, OptimConfig
    from draftsmith.train.loop import make_scheduler

    target, _ = tiny_target
    cfg = medusa.DrafterConfig(num_heads=2, backbone="lora", backbone_lr=1e-2, lora_rank=4, heads_only_steps=2)
    model = medusa.build(cfg, target)
    opt = torch.optim.AdamW(medusa.param_groups(model, cfg, 1e-2), weight_decay=0.01)
    sched = make_scheduler(Config(optim=OptimConfig(warmup_steps=0, schedule="constant")), opt, 4)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    moved, kl = [], []
    for step in range(4):
        before = [p.detach().clone() for p in adapters]
        loss, n, metrics = medusa.compute_loss(model, target, _batch(step), {}, cfg, step=step)
        kl.append("kl_loss" in metrics)
        (loss / n).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        moved.append(any(not torch.equal(a, b) for a, b in zip(adapters, before)))
    assert moved == [False, False, True, True] and kl == [False, False, True, True]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]  # heads from the start, backbone from step 2


@pytest.mark.parametrize("schedule,mid", [("constant", 1.0), ("linear", 0.5), ("sine", 2**-0.5)])
def test_lambda0_ramps_up_from_the_start_of_joint_training(schedule, mid):
    cfg = medusa.DrafterConfig(
        backbone="lora",
        backbone_lr=1e-4,
        lambda0=0.2,
        lambda0_schedule=schedule,
        lambda0_warmup_steps=10,
        heads_only_steps=4,
    )
    assert medusa.lambda0(cfg, 4) == pytest.approx(0.2 if schedule == "constant" else 0.0)
    assert medusa.lambda0(cfg, 9) == pytest.approx(0.2 * mid)
    assert medusa.lambda0(cfg, 14) == medusa.lambda0(cfg, 100) == pytest.approx(0.2)


def test_medusa2_trains_is_verified_by_its_backbone_and_exports_it(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.eval.config import EvalConfig
    from draftsmith.eval.drafters import Resolved
    from draftsmith.eval.run import evaluate
    from draftsmith.models.readers import import_export
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides, _weights

    run = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path,
                **MEDUSA2,
                **{
                    "drafter.heads_only_steps": 2,
                    "optim.max_steps": 6,
                    "eval.enabled": True,
                    "eval.num_prompts": 3,
                    "eval.max_new_tokens": 12,
                    "eval.k": 2,
                },
            ),
        )
    )
    log = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines()]
    assert "kl_loss" not in log[1] and log[2]["kl_loss"] == 0.0 and log[-1]["kl_loss"] > 0  # joint from step 3
    assert all("lora_" in k or k.startswith("heads.") for k in _weights(run))  # no copy of the target in final/
    report = json.loads((run / "eval" / "report.json").read_text())
    assert lossless_ok(report) and set(report["drift"]) == {"unchanged_fraction", "token_agreement", "original_tau"}
    assert 0 <= report["drift"]["unchanged_fraction"] <= 1 and 0 < report["drift"]["token_agreement"] <= 1
    assert "Backbone drift" in (run / "eval" / "report.md").read_text()

    target, tok = load_target(str(tiny_target_dir))
    out = export(run / "final", target, "vllm", tmp_path / "vllm", tok)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["MedusaModel"] and c["draftsmith"]["backbone"] == "backbone"
    new_target, new_tok = load_target(str(out / "backbone"))  # a plain transformers folder, tokenizer included
    assert not any("lora" in n for n, _ in new_target.named_parameters())
    original, _ = load_target(str(tiny_target_dir))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(new_target.state_dict()[q], original.state_dict()[q])  # the adapters are merged in
    # Round trip: the exported heads drafting for the exported backbone give the eval stage's τ.
    _, _, heads = import_export(out, new_target)
    again = evaluate(
        Resolved("medusa", medusa.MedusaProposer(heads), new_target, None),
        new_tok,
        str(chat_jsonl),
        None,
        EvalConfig(k=2, num_prompts=3, max_new_tokens=12),
    )
    assert again["tau"] == report["tau"] and lossless_ok(again)


@pytest.mark.fp32_exact
def test_original_lm_head_heads_share_the_targets_and_export_one_lm_head(tiny_target, tmp_path):
    from draftsmith.models.readers import import_export
    from draftsmith.ship.export import export

    target, _ = tiny_target
    cfg = medusa.DrafterConfig(num_heads=2, original_lm_head=True, fc_bias=False)
    heads = medusa.build(cfg, target)
    assert len(heads.lm_heads) == 0 and not any(p is target.lm_head.weight for p in heads.parameters())
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.02)
    meta = {
        "drafter": "medusa",
        "drafter_config": {"type": "medusa", **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    out = export(save_drafter(heads, tmp_path / "final", meta), target, "vllm", tmp_path / "vllm")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["original_lm_head"] is True and c["medusa_fc_bias"] is False
    assert sorted(state) == ["blocks.0.layers.0.weight", "blocks.1.layers.0.weight", "lm_head.weight"]
    torch.testing.assert_close(state["lm_head.weight"], target.lm_head.weight)
    _, _, back = import_export(out, target)
    h = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(back.head_logits(h, 1), heads.head_logits(h, 1))


def test_bad_medusa2_configs_are_one_line_errors(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith import DraftsmithError
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    with pytest.raises(DraftsmithError, match="drafter.backbone_lr: a Medusa-2 run .backbone: lora. needs"):
        load_config(None, ["drafter.type=medusa", "drafter.backbone=lora"])
    with pytest.raises(DraftsmithError, match="expected frozen, lora or full"):
        load_config(None, ["drafter.type=medusa", "drafter.backbone=yes-please"])
    cfg = load_config(
        None,
        _overrides(
            tiny_target_dir, chat_jsonl, tmp_path, **MEDUSA2, **{"drafter.lora_target_modules": "q_proj,qkv_proj"}
        ),
    )
    with pytest.raises(
        DraftsmithError,
        match="qkv_proj not in the model; its linear layers are down_proj, gate_proj, "
        "k_proj, o_proj, q_proj, up_proj, v_proj",
    ):
        train(cfg)
    assert not (tmp_path / "r" / "final").exists()


def test_medusa2_full_trains_a_copy_of_the_decoder_and_keeps_the_target_as_the_original(tiny_target):
    target, _ = tiny_target
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    cfg = medusa.DrafterConfig(num_heads=2, backbone="full", backbone_lr=1e-2)
    model = medusa.build(cfg, target)
    opt = torch.optim.AdamW(medusa.param_groups(model, cfg, 1e-2))
    for step in range(2):
        loss, n, metrics = medusa.compute_loss(model, target, _batch(step), {}, cfg, step=step)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())  # the original is untouched
    trained = dict(model.backbone.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[q], before[q])
    assert torch.equal(
        trained["model.embed_tokens.weight"], before["model.embed_tokens.weight"]
    )  # frozen (tied lm_head)
    saved = model.state_dict()
    assert f"backbone.{q}" in saved and "backbone.model.embed_tokens.weight" not in saved
    with model.original() as original:
        assert original is target
