"""Distilled students: truncation, the tokenizer check, chain drafting with the student's own KV
cache, transformers' assisted generation, the loop, and the hf export."""

import json
import types

import pytest
import torch
import transformers

from draftsmith import DraftsmithError
from draftsmith.engine.speculative import Sampler, Stats, speculative_decode, target_decode
from draftsmith.models import distill
from tests.conftest import lossless_ok, make_target, make_tokenizer


@pytest.mark.fp32_exact
def test_a_student_keeping_every_layer_is_the_target_and_spaced_layers_span_the_depth(tiny_target):
    target, tok = tiny_target
    ids = torch.tensor([tok("say 12")["input_ids"]])
    full = distill.truncated_student(target, distill.DrafterConfig(num_layers=2))
    torch.testing.assert_close(full(ids).logits, target(ids).logits, rtol=0, atol=0)
    assert distill.kept_layers(distill.DrafterConfig(num_layers=4), 30) == [0, 10, 19, 29]
    assert distill.kept_layers(distill.DrafterConfig(num_layers=3, layers="first"), 30) == [0, 1, 2]
    one = distill.truncated_student(target, distill.DrafterConfig(num_layers=1, layers="first"))
    assert one.config.num_hidden_layers == 1
    torch.testing.assert_close(one.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(DraftsmithError, match="num_layers: 3 is more than the target's 2 layers"):
        distill.truncated_student(target, distill.DrafterConfig(num_layers=3))


def test_a_student_equal_to_the_target_is_always_accepted_greedy_and_sampled(tiny_target):
    target, tok = tiny_target
    student = distill.truncated_student(target, distill.DrafterConfig(num_layers=2))
    prompt = tok("say 7")["input_ids"]
    stats = Stats(k=4)
    out = speculative_decode(target, distill.StudentProposer(student), prompt, 4, 25, set(), None, stats)
    assert out == target_decode(target, prompt, 25, set())
    assert stats.acceptance_rate == 1.0 and stats.tau == pytest.approx(5.0, abs=0.5)  # last round is cut short
    sampled = Stats(k=3)
    speculative_decode(target, distill.StudentProposer(student), prompt, 3, 20, set(), Sampler(0.8, 1.0, 0), sampled)
    assert sampled.acceptance_rate == 1.0  # q == p: min(1, p/q) = 1 for every draft token


def test_a_truncated_student_is_lossless_and_reuses_its_cache(tiny_target):
    target, tok = tiny_target
    student = distill.truncated_student(target, distill.DrafterConfig(num_layers=1))
    proposer = distill.StudentProposer(student)
    prompt = tok("say 3")["input_ids"]
    assert speculative_decode(target, proposer, prompt, 3, 30, set()) == target_decode(target, prompt, 30, set())
    # The cache holds what the student was fed: the prompt, the accepted tokens and the last draft.
    assert proposer.cache.get_seq_length() == len(proposer.fed) > len(prompt)


def test_transformers_assisted_generation_with_the_student_equals_plain_greedy(tiny_target):
    target, tok = tiny_target
    student = distill.truncated_student(target, distill.DrafterConfig(num_layers=1)).eval()
    ids = torch.tensor([tok("say 21")["input_ids"]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assisted = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=student, pad_token_id=0)
    assert torch.equal(plain, assisted)


def test_a_student_with_another_tokenizer_is_rejected(tiny_target, tmp_path):
    target, _ = tiny_target
    tok = make_tokenizer()
    tok.add_tokens(["<extra>"])
    make_target(vocab=len(tok)).save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    with pytest.raises(
        DraftsmithError,
        match=r"tokenizer differs from the target's: token '<extra>' is id \d+ in the "
        r"student and None in the target",
    ):
        distill.build(distill.DrafterConfig(init=str(tmp_path / "student")), target)


def test_bad_distill_configs_fail_when_the_recipe_loads():
    from draftsmith.train.config import load_config

    with pytest.raises(
        DraftsmithError, match=r"drafter.divergence: unknown 'kld' \(valid: fkl, rkl, jsd, tvd, nla, lk_hybrid\)"
    ):
        load_config(None, ["drafter.type=distill", "drafter.divergence=kld"])
    with pytest.raises(DraftsmithError, match="0 < beta < 1"):
        load_config(None, ["drafter.type=distill", "drafter.beta=1.5"])


@pytest.mark.parametrize("divergence", ["fkl", "tvd"])
def test_distillation_in_the_shared_loop_evaluates_and_exports_a_plain_causal_lm(
    tiny_target_dir, chat_jsonl, tmp_path, divergence
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.models.readers import import_export
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    run = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path,
                **{
                    "drafter.type": "distill",
                    "drafter.num_layers": 1,
                    "drafter.divergence": divergence,
                    "optim.max_steps": 8,
                    "optim.lr": 3e-3,
                    "eval.enabled": True,
                    "eval.num_prompts": 2,
                    "eval.max_new_tokens": 12,
                    "eval.k": 3,
                },
            ),
        )
    )
    log = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] and log[-1]["accept"] > log[0]["accept"]
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["drafter"] == "distill" and lossless_ok(report) and report["k"] == 3

    target, tok = load_target(str(tiny_target_dir))
    out = export(run / "final", target, "hf", tmp_path / "hf", tok)
    student = AutoModelForCausalLM.from_pretrained(out)  # what vLLM / SGLang / transformers load
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    _, _, back = import_export(out, target)
    ids = torch.tensor([tok("say 4")["input_ids"]])
    from draftsmith.models.registry import load_drafter

    _, _, trained = load_drafter(run / "final", target)
    torch.testing.assert_close(student(ids).logits, trained(ids).logits)
    torch.testing.assert_close(back(ids).logits, trained(ids).logits)


class AlwaysX(torch.nn.Module):
    """A student that answers every prompt with token X until its budget ends (never EOS)."""

    X = 42

    def __init__(self):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # where it runs

    def get_decoder(self):
        return lambda input_ids, **kwargs: types.SimpleNamespace(last_hidden_state=torch.zeros(*input_ids.shape, 1))

    def get_output_embeddings(self):
        return lambda hidden: torch.nn.functional.one_hot(torch.full(hidden.shape[:-1], self.X), 105) * 1e3


def test_on_policy_batches_come_from_the_student_for_a_lambda_fraction_of_rows(tiny_target):
    from draftsmith.data.batching import collate

    target, tok = tiny_target
    examples = [
        {"input_ids": [5, 6, 7, 8, 9, 10][: 4 + i % 3], "loss_mask": [0, 0, 1, 1, 1, 1][: 4 + i % 3], "idx": i}
        for i in range(4)
    ]
    batch = collate(examples, 0)
    out = distill.on_policy_batch(AlwaysX(), batch, 2, 3, 1.0, target)
    for i in range(2):  # prompt kept, answer = the student's, loss mask on exactly its tokens
        real = out["attention_mask"][i].bool()
        assert out["input_ids"][i][real].tolist() == [5, 6, 42, 42, 42]
        assert out["loss_mask"][i][real].tolist() == [0, 0, 1, 1, 1]
    for i in range(2, 4):  # the rest keep the data's answers
        n = len(examples[i]["input_ids"])
        assert out["input_ids"][i][:n].tolist() == examples[i]["input_ids"]


def test_a_real_student_generates_its_own_answers_and_the_loss_uses_them(tiny_target):
    target, tok = tiny_target
    cfg = distill.DrafterConfig(num_layers=1, onpolicy_fraction=1.0, onpolicy_max_new_tokens=5, onpolicy_temperature=0)
    student = distill.build(cfg, target)
    from draftsmith.data.batching import collate

    prompt = tok("say 8")["input_ids"]
    batch = collate([{"input_ids": prompt + [7, 7, 7], "loss_mask": [0] * len(prompt) + [1, 1, 1], "idx": 0}], 0)
    on = distill.on_policy_batch(student, batch, 1, 5, 0.0, target)
    greedy = student.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ]
    assert on["input_ids"][0, len(prompt) :].tolist() == greedy.tolist()
    loss, n, _ = distill.compute_loss(student, target, batch, {}, cfg, step=0)
    assert n == len(greedy) and loss > 0


@pytest.mark.fp32_exact
def test_lora_students_train_adapters_only_and_merge_to_the_same_logits(tiny_target):
    target, tok = tiny_target
    cfg = distill.DrafterConfig(num_layers=1, lora_rank=4)
    student = distill.build(cfg, target)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    from draftsmith.target.features import target_features

    ids = torch.randint(5, 60, (2, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    for _ in range(2):
        loss, n, _ = distill.compute_loss(student, target, batch, target_features(target, batch, ("last_hidden",)), cfg)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    merged = distill.plain(student)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(ids).logits, student(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.fp32_exact
def test_offline_top_k_logits_cost_2k_plus_1_floats_and_match_the_full_loss_when_k_is_the_vocabulary(tiny_target):
    from draftsmith.target.features import target_features, topk_logits, unpack_topk

    target, _ = tiny_target
    V = target.config.vocab_size
    ids = torch.randint(5, 60, (2, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = target_features(target, batch, ("last_hidden", "logits_topk.8", f"logits_topk.{V}"))
    assert feats["logits_topk.8"].shape == (2, 10, 17) and feats["logits_topk.8"].dtype == torch.float32  # 68 B/token
    values, top, lse = unpack_topk(feats["logits_topk.8"])
    logits = target(ids).logits
    torch.testing.assert_close(values, logits.topk(8).values)
    torch.testing.assert_close(lse[..., 0], logits.logsumexp(-1))
    assert torch.equal(top, logits.topk(8).indices)
    student = distill.build(distill.DrafterConfig(num_layers=1), target)
    full_feats = {"last_hidden": feats["last_hidden"]}
    for div in ("fkl", "tvd"):
        exact, _, _ = distill.compute_loss(student, target, batch, full_feats, distill.DrafterConfig(divergence=div))
        as_topk, _, _ = distill.compute_loss(
            student,
            target,
            batch,
            {f"logits_topk.{V}": feats[f"logits_topk.{V}"]},
            distill.DrafterConfig(divergence=div, offline_topk=V),
        )
        torch.testing.assert_close(as_topk, exact, rtol=1e-4, atol=1e-4)
    cut, _, _ = distill.compute_loss(
        student, target, batch, {"logits_topk.8": feats["logits_topk.8"]}, distill.DrafterConfig(offline_topk=8)
    )
    cut.backward()  # the student learns through the K+1 classes
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    assert topk_logits(torch.zeros(3, V), 4).shape == (3, 9)


def test_a_narrower_student_keeps_the_targets_embeddings_and_attention(tiny_target):
    target, tok = tiny_target
    student = distill.truncated_student(
        target, distill.DrafterConfig(num_layers=1, layers="first", intermediate_size=16)
    )
    assert student.config.intermediate_size == 16 and student.model.layers[0].mlp.up_proj.weight.shape == (16, 32)
    assert torch.equal(student.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(student.model.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)
    ids = torch.tensor([tok("say 1")["input_ids"]])
    assert student(ids).logits.shape == target(ids).logits.shape


@pytest.mark.fp32_exact
@pytest.mark.parametrize("lora", [False, True])
def test_the_student_scores_only_trained_positions_with_the_full_computations_loss_and_gradients(
    tiny_target, monkeypatch, lora
):
    """The student's lm_head runs at the union of trained positions (`logits_to_keep`); the rows the
    divergence gets, the loss and every gradient equal those of logits at every position cut down to
    the trained rows (how it was computed before), on a padded batch whose rows train different spans."""
    from draftsmith.target.features import target_features

    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = distill.DrafterConfig(num_layers=1, **({"lora_rank": 4} if lora else {}))
    student = distill.build(cfg, target)
    ids = torch.randint(5, 60, (3, 12))
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0
    lmask = torch.zeros_like(ids)
    lmask[0, 4:], lmask[1, 7:], lmask[2, 5:9] = 1, 1, 1  # prompts of 4, 7 and 5 tokens
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": lmask}
    feats = target_features(target, batch, ("last_hidden",))
    divergence, seen = distill.DIVERGENCES[cfg.divergence], {}

    def spy(logits, teacher, mask, **kw):
        seen.update(logits=logits, teacher=teacher, mask=mask, kw=kw)
        return divergence(logits, teacher, mask, **kw)

    monkeypatch.setitem(distill.DIVERGENCES, cfg.divergence, spy)
    loss, n, _ = distill.compute_loss(student, target, batch, feats, cfg)
    (loss / n).backward()
    ours = {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    full = student(input_ids=ids, attention_mask=attn).logits[lmask[:, 1:].bool().nonzero(as_tuple=True)]
    torch.testing.assert_close(seen["logits"].detach(), full.detach(), rtol=1e-6, atol=1e-6)
    reference = divergence(full, seen["teacher"], seen["mask"], **seen["kw"])
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-6, atol=1e-7)
    (reference / n).backward()
    assert len(ours) > 0
    for k, p in student.named_parameters():
        if k in ours:
            torch.testing.assert_close(ours[k], p.grad, rtol=1e-5, atol=1e-7)
