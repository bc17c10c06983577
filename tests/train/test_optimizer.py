"""optim.optimizer: Muon over the hidden matrices and AdamW over the rest, stepped as one optimizer."""

import copy

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.train.config import OptimConfig
from draftsmith.train.loop import make_scheduler
from draftsmith.train.optimizer import Muon, MuonAdamW, build_optimizer, check_sharding


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
