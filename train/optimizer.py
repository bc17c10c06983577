"""The optimizer a run trains with (`optim.optimizer`): AdamW over every group, or Muon over the
drafter's hidden maps with AdamW over the rest, stepped as one optimizer.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; torch.optim.Muon) orthogonalises
each matrix's momentum with a few Newton-Schulz steps, so every direction of a weight moves at the
same rate. speculators trains its block drafters with it by default (after the sweeps of its PR #607):
Muon over 2-D weights at 10x the base learning rate, AdamW over norms, biases, embeddings and lm_head.
`optim.muon_lr` 0 keeps that 10x. Orthogonalising suits a map between hidden states, not a table whose
rows are tokens (an embedding, a head onto the vocabulary, DSpark's Markov factors, DFlash2's codebooks:
each row moves only when its token occurs), so Muon's share is told by what a parameter is
(`hidden_maps`), not by its name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from draftsmith import DraftsmithError


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


def map_widths(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) widths of a module that is a linear map x -> W x, else None: nn.Linear, and
    transformers' Conv1D (GPT-2-style students: a Linear stored as [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.nf
    return None


def vocab_sizes(drafter: nn.Module) -> set[int]:
    """The vocabularies (target's, draft) the drafter's tables are indexed by and its heads map onto,
    read from what its modules are: a `vocab_size` of a module or of its `config` (the backbone config
    the block drafters and students carry; Medusa's heads declare their own), the rows of every
    nn.Embedding, and the length of every token map (a 1-D integer or boolean buffer: d2t, t2d,
    Medusa's token_map)."""
    sizes: set[int] = set()
    for m in drafter.modules():
        for owner in (m, getattr(m, "config", None)):
            size = getattr(owner, "vocab_size", None)
            if isinstance(size, int) and not isinstance(size, bool):
                sizes.add(size)
        if isinstance(m, nn.Embedding):
            sizes.add(m.num_embeddings)
        sizes |= {len(b) for b in m.buffers(recurse=False) if b.ndim == 1 and not b.is_floating_point()}
    return sizes


def check_heads_told_apart(drafter: nn.Module, vocab: set[int]) -> None:
    """A map whose output width is a vocabulary size is a head onto it; that holds only while no map
    reads a hidden state of that width too (a draft vocabulary equal to the hidden size: then q_proj and
    the head have one shape). Refused rather than guessed."""
    widths = [w for m in drafter.modules() if (w := map_widths(m)) is not None]
    clash = sorted(vocab & {w[0] for w in widths} & {w[1] for w in widths})
    if clash:
        raise DraftsmithError(
            f"optim.optimizer: muon keeps the drafter's vocabulary heads with AdamW by their width, but the "
            f"vocabulary size {clash[0]} is also a hidden width of this drafter (drafter.draft_vocab_size "
            "equal to a hidden size?); pick another drafter.draft_vocab_size or use optim.optimizer=adamw"
        )


def hidden_maps(drafter: nn.Module) -> set[int]:
    """ids of the parameters Muon updates: the weight of every linear map between hidden states (a
    matrix, both sides > 1, neither a vocabulary size). With AdamW stay what is no hidden map, whatever
    its name: nn.Embedding tables, heads onto a vocabulary (lm_head, DSpark's markov_w2), 2-D parameters
    of other modules (DFlash2's codebooks, indexed by token id), norms, biases, vectors. A weight tied
    to a table (a student's lm_head) is a table."""
    vocab = vocab_sizes(drafter)
    check_heads_told_apart(drafter, vocab)
    maps: set[int] = set()
    tables: set[int] = set()
    for m in drafter.modules():
        widths = map_widths(m)
        for name, p in m.named_parameters(recurse=False):
            hidden = widths is not None and name == "weight" and min(widths) > 1 and not vocab & set(widths)
            (maps if hidden else tables).add(id(p))
    return maps - tables


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
    lr ratios hold) and the rest (at its lr): what goes to Muon is told by what each parameter is
    (`hidden_maps`), not by its name."""

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)

    if optim.optimizer == "adamw":
        return adamw(groups)
    matrices = hidden_maps(drafter)
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
