"""The optimizer a run trains with (`optim.optimizer`): AdamW over every group, or Muon over the
drafter's hidden 2-D matrices with AdamW over the rest, stepped as one optimizer.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; torch.optim.Muon) orthogonalises
each matrix's momentum with a few Newton-Schulz steps, so every direction of a weight moves at the
same rate. speculators trains its block drafters with it by default (after the sweeps of its PR #607):
Muon over 2-D weights at 10x the base learning rate, AdamW over norms, biases, embeddings and lm_head.
`optim.muon_lr` 0 keeps that 10x.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from draftsmith import DraftsmithError

# 2-D weights that stay with AdamW: embeddings and output heads are lookups/classifiers whose rows
# move independently, not hidden maps (Muon's own convention; speculators' `_ADAMW_NAME_HINTS`).
ADAMW_NAME_HINTS = ("embed", "lm_head")


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iterations in `ns_dtype`, the run's compute dtype.

    torch runs them in bf16, which CPUs without native bf16 emulate tens of times slower than fp32
    (AVX2 EPYC, 2 threads: 761 ms against 21 ms per iteration on a 576x1728 matrix), so one step of a
    1-layer DFlash would take ~20 s there. In bf16 this is torch's arithmetic, op for op (a test holds
    it to torch.optim.Muon bit for bit); in fp32 it is the same iteration, unrounded."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * rms_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def orthogonalize(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """~U V^T of g = U S V^T [m, n] by the quintic Newton-Schulz iteration of Muon (its singular values
    land in ~[0.5, 1.5], which trains as well as exact orthogonalisation): X <- aX + (bA + cA^2)X with
    A = X X^T, on the wide orientation so A is the smaller Gram matrix."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # a copy: without Nesterov, g is the momentum buffer itself
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # Frobenius norm >= spectral norm: every singular value <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def rms_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's learning-rate factor for an [A, B] matrix: `match_rms_adamw` 0.2 sqrt(max(A, B)) gives
    the update AdamW's typical RMS (Liu et al. 2025, "Muon is scalable for LLM training"); `original`
    sqrt(max(1, A/B))."""
    rows, cols = shape[:2]
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1, rows / cols))


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Does Muon update `p`: a 2-D matrix (both sides > 1) that is not an embedding or head."""
    return p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS)


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the hidden matrices and torch.optim.AdamW over the rest, as one optimizer:
    its `param_groups` are the two optimizers' own group dicts (a learning-rate schedule set on one is
    set on both), `step`/`zero_grad` step both, and its state dict holds both."""

    def __init__(self, muon: torch.optim.Muon | None, adamw: torch.optim.AdamW | None):
        self.parts = {k: o for k, o in (("muon", muon), ("adamw", adamw)) if o is not None}
        # Optimizer.__init__ appends the very dicts it is given: the groups are shared, not copied.
        super().__init__([g for o in self.parts.values() for g in o.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.parts.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {k: o.state_dict() for k, o in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.parts):
            raise DraftsmithError(
                f"optimizer state holds {sorted(state_dict)}, this run's optimizer is {sorted(self.parts)} "
                "(optim.optimizer changed between the checkpoint and the resume?)"
            )
        for k, o in self.parts.items():
            o.load_state_dict(state_dict[k])
        # Optimizer.load_state_dict replaces its group dicts: share the new ones, or a schedule would
        # set learning rates nobody reads.
        self.param_groups = [g for o in self.parts.values() for g in o.param_groups]


def check_sharding(optim, sharded: bool) -> None:
    """Refuse muon where the weights are sharded: DeepSpeed ZeRO hands the optimizer flattened 1-D
    partitions and FSDP row slices, and orthogonalising a slice is not orthogonalising the matrix."""
    if optim.optimizer == "muon" and sharded:
        raise DraftsmithError(
            "optim.optimizer: muon needs each weight matrix whole on one process; DeepSpeed ZeRO and FSDP "
            "shard them (use optim.optimizer=adamw there, or DDP)"
        )


def build_optimizer(drafter: torch.nn.Module, groups: list[dict], optim) -> torch.optim.Optimizer:
    """`optim.optimizer` over the family's param groups (`family.param_groups`: dicts with "params" and
    their own "lr", possibly more keys such as Medusa-2's "start_step", kept on both sides).

    With muon, each group splits into its hidden matrices (at lr x muon_lr / optim.lr, so a family's own
    lr ratios hold) and the rest (at its lr): matrices are told by their name in the drafter."""

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)

    if optim.optimizer == "adamw":
        return adamw(groups)
    matrices = {id(p) for n, p in drafter.named_parameters() if is_hidden_matrix(n, p)}
    scale = (optim.muon_lr or 10 * optim.lr) / optim.lr
    muon_groups, adamw_groups = [], []
    for g in groups:
        hidden = [p for p in g["params"] if id(p) in matrices]
        rest = [p for p in g["params"] if id(p) not in matrices]
        if hidden:
            muon_groups.append({**g, "params": hidden, "lr": g.get("lr", optim.lr) * scale})
        if rest:
            adamw_groups.append({**g, "params": rest})
    muon = (
        Muon(
            muon_groups,
            # resolved by train.config.resolve_precision: bf16 wherever it is native, float32 elsewhere
            ns_dtype=torch.float32 if optim.mixed_precision == "float32" else torch.bfloat16,
            lr=optim.lr * scale,
            weight_decay=optim.muon_weight_decay,
            momentum=optim.muon_momentum,
            # Scale each update to AdamW's RMS (0.2 sqrt(max(A, B))), so muon_lr reads as an AdamW lr.
            adjust_lr_fn="match_rms_adamw",
        )
        if muon_groups
        else None
    )
    return MuonAdamW(muon, adamw(adamw_groups) if adamw_groups else None)
