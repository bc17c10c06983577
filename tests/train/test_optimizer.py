"""optim.optimizer: Muon over the hidden matrices and AdamW over the rest, stepped as one optimizer."""

import copy
import dataclasses

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.registry import DRAFTERS
from draftsmith.train.config import OptimConfig
from draftsmith.train.loop import make_scheduler
from draftsmith.train.optimizer import Muon, MuonAdamW, build_optimizer, check_sharding, map_widths


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 6)  # weight: hidden matrix; bias: 1-D
        self.norm = torch.nn.LayerNorm(6)
        self.gate = torch.nn.Linear(6, 1, bias=False)  # [1, 6]: a vector, not a matrix
        self.lm_head = torch.nn.Linear(6, 11, bias=False)

    def forward(self, ids):
        h = self.norm(self.fc(self.embed_tokens(ids)))
        return self.lm_head(h).logsumexp(-1).mean() + self.gate(h).mean()


def _optim(**kw):
    return OptimConfig(**{"lr": 1e-3, "warmup_steps": 0, **kw})


def _step(model, opt):
    opt.zero_grad()
    model(torch.arange(8).view(2, 4)).backward()
    opt.step()


def test_muon_takes_the_hidden_matrices_at_ten_times_lr_and_adamw_the_rest():
    model = Toy()
    groups = [{"name": "drafter", "params": list(model.parameters()), "lr": 1e-3, "start_step": 2}]
    opt = build_optimizer(model, groups, _optim(optimizer="muon"))
    assert isinstance(opt, MuonAdamW)
    muon, adamw = opt.parts["muon"], opt.parts["adamw"]
    assert [p for g in muon.param_groups for p in g["params"]] == [model.fc.weight]
    names = {id(p): n for n, p in model.named_parameters()}
    rest = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert rest == {"embed_tokens.weight", "fc.bias", "norm.weight", "norm.bias", "gate.weight", "lm_head.weight"}
    assert muon.param_groups[0]["lr"] == pytest.approx(1e-2) and adamw.param_groups[0]["lr"] == 1e-3
    assert muon.param_groups[0]["start_step"] == adamw.param_groups[0]["start_step"] == 2  # family keys kept
    assert build_optimizer(model, groups, _optim(optimizer="muon", muon_lr=5e-3)).param_groups[0]["lr"] == 5e-3


def test_a_schedule_on_the_pair_sets_both_optimizers_and_both_update():
    model = Toy()
    groups = [{"params": list(model.parameters()), "lr": 1e-3}]
    opt = build_optimizer(model, groups, _optim(optimizer="muon", schedule="linear"))
    sched = make_scheduler(type("C", (), {"optim": _optim(schedule="linear", warmup_steps=0)})(), opt, total_steps=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt)
    sched.step()
    assert opt.parts["muon"].param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)
    assert opt.parts["adamw"].param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 4)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_the_pair_state_round_trips_and_continues_identically():
    torch.manual_seed(0)
    a, b = Toy(), Toy()
    b.load_state_dict(a.state_dict())
    cfg = _optim(optimizer="muon")
    opt_a = build_optimizer(a, [{"params": list(a.parameters()), "lr": 1e-3}], cfg)
    for _ in range(2):
        _step(a, opt_a)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, [{"params": list(b.parameters()), "lr": 1e-3}], cfg)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as saved and loaded: no shared tensors
    _step(a, opt_a)
    _step(b, opt_b)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    opt_b.param_groups[0]["lr"] = 0.5  # what a resumed schedule sets still reaches the inner optimizer
    assert opt_b.parts["muon"].param_groups[0]["lr"] == 0.5
    with pytest.raises(DraftsmithError, match="optim.optimizer changed"):
        opt_b.load_state_dict({"adamw": opt_a.state_dict()["adamw"]})


def test_muon_is_refused_where_weights_are_sharded_and_adamw_stays_plain():
    with pytest.raises(DraftsmithError, match="optim.optimizer: muon needs each weight matrix whole"):
        check_sharding(_optim(optimizer="muon"), sharded=True)
    check_sharding(_optim(optimizer="muon"), sharded=False)
    check_sharding(_optim(), sharded=True)
    model = Toy()
    assert (
        type(build_optimizer(model, [{"params": list(model.parameters()), "lr": 1e-3}], _optim())) is torch.optim.AdamW
    )


def test_muon_in_bf16_is_torch_muon_bit_for_bit_and_in_fp32_the_same_iteration_unrounded():
    torch.manual_seed(0)
    w = torch.randn(12, 7)
    grads = [torch.randn(12, 7) for _ in range(3)]
    runs = {}
    for name, make in {
        "torch": lambda p: torch.optim.Muon([p], lr=0.02, adjust_lr_fn="match_rms_adamw"),
        "bf16": lambda p: Muon([p], lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16),
        "fp32": lambda p: Muon([p], lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32),
        # without weight decay, each rule's steps are the same orthogonalised updates times its lr factor
        "match": lambda p: Muon([p], lr=0.02, weight_decay=0, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32),
        "original": lambda p: Muon([p], lr=0.02, weight_decay=0, ns_dtype=torch.float32),
    }.items():
        p = torch.nn.Parameter(w.clone())
        opt = make(p)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        runs[name] = p.detach()
    assert torch.equal(runs["bf16"], runs["torch"])
    step = (runs["torch"] - w).abs().max()
    assert 0 < (runs["fp32"] - runs["torch"]).abs().max() < 0.05 * step  # only bf16's rounding apart
    ratio = (12 / 7) ** 0.5 / (0.2 * 12**0.5)  # original sqrt(A/B) over match_rms_adamw 0.2 sqrt(max(A, B))
    assert torch.allclose(runs["original"] - w, (runs["match"] - w) * ratio, atol=1e-6)


def test_orthogonalising_leaves_the_momentum_buffer_alone_without_nesterov():
    p = torch.nn.Parameter(torch.randn(5, 3))
    p.grad = torch.randn(5, 3)
    opt = Muon([p], lr=0.01, nesterov=False, ns_dtype=torch.float32)
    opt.step()  # the update is the buffer itself: orthogonalised in place, it would be lost
    assert torch.allclose(opt.state[p]["momentum_buffer"], 0.05 * p.grad)


class Renamed(torch.nn.Module):
    """Toy's kinds of parameters under names that say nothing, and a hidden map named like a table."""

    def __init__(self):
        super().__init__()
        self.lookup = torch.nn.Embedding(11, 6)  # a table however it is named
        self.embed_proj = torch.nn.Linear(6, 6)  # a hidden map though its name says `embed`
        self.codes = torch.nn.Parameter(torch.randn(11, 3))  # a codebook: rows indexed by token id
        self.out = torch.nn.Linear(6, 11, bias=False)  # onto the vocabulary: a head


def test_what_muon_takes_is_told_by_what_a_parameter_is_not_by_its_name():
    model = Renamed()
    opt = build_optimizer(model, [{"params": list(model.parameters()), "lr": 1e-3}], _optim(optimizer="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for g in opt.parts["muon"].param_groups for p in g["params"]] == ["embed_proj.weight"]


# Every registered family at its tiny size (its record's `tiny`: a 3-layer target of 105 tokens, hidden
# 32), its LoRA variant, Medusa-2 over a full backbone copy, and the reduced draft vocabulary of every
# family that has one its tiny size leaves out (DSpark's markov_w2 and Medusa's heads onto it).
CASES = {name: (name, fam.tiny) for name, fam in DRAFTERS.items()}
CASES |= {f"{name}+lora": (name, {**fam.tiny, **fam.tiny_lora}) for name, fam in DRAFTERS.items() if fam.tiny_lora}
CASES |= {
    f"{name}+draft-vocab": (name, {**fam.tiny, "draft_vocab_size": 30})
    for name, fam in DRAFTERS.items()
    if "draft_vocab_size" in {f.name for f in dataclasses.fields(fam.DrafterConfig)}
    and "draft_vocab_size" not in fam.tiny
}
if "medusa" in DRAFTERS:
    CASES["medusa+full"] = ("medusa", {**DRAFTERS["medusa"].tiny, "backbone": "full", "backbone_lr": 1e-4})


@pytest.fixture(scope="module")
def target3_dir(tmp_path_factory):
    from tests.conftest import save_target

    return save_target(tmp_path_factory.mktemp("target3"), layers=3)


def _built(target_dir, name: str, sizes: dict, seed: int = 0):
    """(drafter, its param groups, the vocabularies its tables may span): a fresh target per build, since a
    LoRA backbone injects its adapters into the target in place."""
    from draftsmith.target.load import load_target

    family, target = DRAFTERS[name], load_target(str(target_dir), "fp32")[0]
    cfg = family.DrafterConfig(**sizes)
    torch.manual_seed(seed)
    drafter = family.build(cfg, target, {"input_ids": [list(range(5, 90))], "loss_mask": [[1] * 85]})
    vocab = {target.config.vocab_size, sizes.get("draft_vocab_size", 0)} - {0}
    return drafter, family.param_groups(drafter, cfg, 1e-3), vocab


def expected_partition(drafter, trainable: set[int], vocab: set[int]) -> tuple[set[int], set[int]]:
    """(hidden maps, vocabulary tables) among `trainable`, from the test's own reading: a table is a
    matrix with a side as long as the target's or the draft vocabulary; a hidden map the weight of a
    linear module (every module owning it, as tied weights have several) with neither side one."""
    owners: dict[int, list[bool]] = {}
    for m in drafter.modules():
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(name == "weight" and map_widths(m) is not None)
    params = {id(p): p for p in drafter.parameters() if id(p) in trainable}
    tables = {i for i, p in params.items() if p.ndim == 2 and set(p.shape) & vocab}
    maps = {i for i, p in params.items() if all(owners[i]) and min(p.shape) > 1 and i not in tables}
    return maps, tables


def _partition(target_dir, case: str):
    """(Muon's parameters, the expected hidden maps, the vocabulary tables, names) of one case."""
    name, sizes = CASES[case]
    drafter, groups, vocab = _built(target_dir, name, sizes)
    maps, tables = expected_partition(drafter, {id(p) for g in groups for p in g["params"]}, vocab)
    opt = build_optimizer(drafter, groups, _optim(optimizer="muon"))
    muon = {id(p) for g in opt.parts["muon"].param_groups for p in g["params"]}
    owners = {id(p): type(m) for m in drafter.modules() for p in m.parameters(recurse=False)}
    return muon, maps, {i: owners[i] for i in tables}, {id(p): n for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_vocabulary_table_reaches_muon_and_every_hidden_map_does(case, target3_dir):
    muon, maps, tables, names = _partition(target3_dir, case)
    assert not {names[i] for i in muon & set(tables)}, "vocabulary tables orthogonalised by Muon"
    assert not {names[i] for i in maps - muon}, "hidden maps left to AdamW"
    assert muon == maps and maps  # and nothing else: norms, biases, vectors, 3-D kernels stay with AdamW


def test_the_cases_hold_every_kind_of_vocabulary_table(target3_dir):
    """Not vacuous: among the families' tables are embeddings, heads (nn.Linear onto a vocabulary, the
    target's or a draft one) and bare parameters (codebooks), so each rule of the partition is exercised."""
    kinds = set()
    for case in CASES:
        _, _, tables, _ = _partition(target3_dir, case)
        kinds |= set(tables.values())
    assert {torch.nn.Embedding, torch.nn.Linear} <= kinds and any(
        k not in (torch.nn.Embedding, torch.nn.Linear) for k in kinds
    )


def test_a_draft_vocabulary_as_wide_as_a_hidden_state_is_refused_not_guessed(target3_dir):
    """Draft vocabulary 32 = the hidden size: q_proj and the head have one shape, [32, 32]."""
    drafter, groups, _ = _built(target3_dir, "eagle3", {**DRAFTERS["eagle3"].tiny, "draft_vocab_size": 32})
    with pytest.raises(DraftsmithError, match="the vocabulary size 32 is also a hidden width of this drafter"):
        build_optimizer(drafter, groups, _optim(optimizer="muon"))
    assert type(build_optimizer(drafter, groups, _optim())) is torch.optim.AdamW  # AdamW needs no partition
