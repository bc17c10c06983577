"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv:2401.10774), Medusa-1: the target stays frozen.

K heads sit on the target's last (post-norm) hidden state h_t, the input of its lm_head. The
target's own lm_head at t predicts token t+1; **head k (0-based) at t predicts token t+k+2**. Each
head is `num_layers` ResBlocks h + SiLU(W h + b) with W zero-initialised (a fresh head is the
identity on h) and then its own Linear(H -> V) initialised from the target's lm_head, so a fresh
head k predicts token t+k+2 with the target's next-token distribution at t.

All heads fire from the same hidden state in one pass: a chain takes each head's top-1, a static
tree each head's top-k (eval/tree.py). Loss: sum_k decay^k * CE_k, against the target's own
distribution at t+k+1 (soft labels: self-distilled data, whose tokens the target chose itself) or
the hard token t+k+2 (fixed data). Tensor names follow vLLM's `MedusaModel` (models/export.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.eval.tree import Draft
from draftsmith.models.common import draft_vocab
from draftsmith.train.losses import soft_cross_entropy

NAME = "medusa"


@dataclass
class DrafterConfig:
    num_heads: int = 4
    """Head k (0-based) predicts the token k+2 places after the current one."""
    num_layers: int = 1
    """ResBlocks per head."""
    decay: float = 0.8
    """Loss weight of head k is decay ** k (Medusa paper: 0.8)."""
    soft_labels: bool = True
    """True: head k's label at t is the target's distribution at t+k+1 (use with self-distilled data);
    False: the hard token t+k+2 of the data."""
    fc_bias: bool = True
    """Bias in the ResBlock linears (the Medusa paper's heads have one; vLLM needs `medusa_fc_bias: true`)."""
    draft_vocab_size: int = 0
    """0 = heads over the full target vocabulary; N = over the N most frequent trained tokens (the draft
    vocabulary EAGLE-3 uses; vLLM loads it as `truncated_vocab_size` + `token_map`). On CPU a full
    49152-token head costs about a fifth of a target forward per token."""

    def __post_init__(self):  # checked when the recipe loads, before any model does
        if self.num_heads < 1 or self.num_layers < 1 or self.draft_vocab_size < 0:
            raise DraftsmithError(f"drafter: expected num_heads >= 1, num_layers >= 1 and draft_vocab_size >= 0, "
                                  f"got {self.num_heads}, {self.num_layers}, {self.draft_vocab_size}")


class ResBlock(nn.Module):
    def __init__(self, hidden: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=bias)
        nn.init.zeros_(self.linear.weight)  # identity at start: the head begins as the target's lm_head
        if bias:
            nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """blocks[h].layers[l] and lm_heads[h]: vLLM's MedusaModel names, without its `medusa_heads.` prefix."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, bias: bool, draft_vocab: int = 0):
        super().__init__()
        if draft_vocab:  # token_map[i] = the target id of draft id i (vLLM's name)
            self.register_buffer("token_map", torch.arange(draft_vocab))
            vocab = draft_vocab
        self.blocks = nn.ModuleList(
            nn.Module() for _ in range(num_heads))
        for block in self.blocks:
            block.layers = nn.ModuleList(ResBlock(hidden, bias) for _ in range(num_layers))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))

    def head_logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        for layer in self.blocks[k].layers:
            h = layer(h)
        return self.lm_heads[k](h)

    def forward(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """hs[k]: head k's input hidden states [..., H] -> head k's logits [..., V] (V = the draft
        vocabulary when reduced). One call for all heads, so DDP sees one forward per backward."""
        return [self.head_logits(h, k) for k, h in enumerate(hs)]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Head output ids -> target vocabulary ids."""
        return self.token_map[ids] if hasattr(self, "token_map") else ids

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> head output ids, -1 for tokens outside the draft vocabulary."""
        if not hasattr(self, "token_map"):
            return target_ids
        lookup = torch.full((int(self.token_map.max()) + 2,), -1, dtype=torch.long, device=target_ids.device)
        lookup[self.token_map] = torch.arange(len(self.token_map), device=target_ids.device)
        return lookup[target_ids.clamp(max=len(lookup) - 1)]


def feature_names(cfg: DrafterConfig, target_config) -> tuple[str, ...]:
    return ("last_hidden",)  # the post-norm hidden state the target's lm_head reads


def max_draft_depth(cfg: DrafterConfig) -> int | None:
    return cfg.num_heads  # one head per draft position: no deeper chain or tree


def build(cfg: DrafterConfig, target, dataset=None) -> MedusaHeads:
    tc = target.config
    heads = MedusaHeads(tc.hidden_size, tc.vocab_size, cfg.num_heads, cfg.num_layers, cfg.fc_bias, cfg.draft_vocab_size)
    rows = torch.arange(tc.vocab_size)
    if cfg.draft_vocab_size and dataset is not None:
        rows = draft_vocab(dataset, tc.vocab_size, cfg.draft_vocab_size)
        heads.token_map.copy_(rows)
    with torch.no_grad():  # every head starts as the target's own lm_head (rows of the draft vocabulary)
        for lm in heads.lm_heads:
            lm.weight.copy_(target.get_output_embeddings().weight[rows[: lm.out_features]].float())
    return heads


def rebuild(meta: dict, target) -> MedusaHeads:
    cfg = DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"})
    return build(cfg, target)


def compute_loss(heads, target, batch: dict, feats: dict, cfg: DrafterConfig):
    """Returns (loss_sum, n_tokens, metric_sums); n_tokens counts head-0 positions.

    batch: input_ids, loss_mask [B, T]; feats["last_hidden"]: [B, T, H].
    """
    ids, lmask = batch["input_ids"], batch["loss_mask"].bool()
    last = feats["last_hidden"]
    core = getattr(heads, "module", heads)  # DDP wraps the module
    h = last.to(core.lm_heads[0].weight.dtype)
    if cfg.soft_labels:
        with torch.no_grad():
            # The target's distribution at every position p whose next token is trained, computed
            # once for all heads (head k reads position t+k+1 for its label of token t+k+2).
            nb, np_ = lmask[:, 1:].nonzero(as_tuple=True)
            row_of = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
            row_of[nb, np_] = torch.arange(len(nb), device=ids.device)
            all_teacher = target.get_output_embeddings()(last[nb, np_].to(target.dtype)).float()
    selections, labels = [], []
    for k in range(min(cfg.num_heads, ids.shape[1] - 2)):
        # Head k at position t predicts token t+k+2: inputs are positions 0..T-k-3, labels the
        # tokens 2+k.. (counted only where that token is trained, per the loss mask).
        shift = k + 2
        b_idx, t_idx = lmask[:, shift:].nonzero(as_tuple=True)
        if cfg.soft_labels:
            # The target's own distribution for token t+k+2 is its lm_head at position t+k+1.
            full = all_teacher[row_of[b_idx, t_idx + shift - 1]]
            wanted_target = full.argmax(-1)
        else:
            wanted_target = ids[b_idx, t_idx + shift]
        # With a draft vocabulary, only positions whose wanted token is in it can be learned (as EAGLE-3).
        wanted = core.to_draft(wanted_target)
        teacher = None
        if cfg.soft_labels:
            teacher = full[:, core.token_map] if hasattr(core, "token_map") else full
        selections.append(h[b_idx, t_idx])
        labels.append((wanted, teacher))
    if not selections:
        return last.sum() * 0.0, torch.tensor(0, device=ids.device), {}
    total, metrics = 0.0, {}
    for k, (logits, (wanted, teacher)) in enumerate(zip(heads(selections), labels)):
        keep = wanted >= 0
        if teacher is not None:
            loss = soft_cross_entropy(logits, teacher, keep.float())
        else:
            loss = nn.functional.cross_entropy(logits.float()[keep], wanted[keep], reduction="sum")
        total = total + cfg.decay ** k * loss
        metrics["acc" if k == 0 else f"acc{k}"] = ((logits.argmax(-1) == wanted) & keep).float().sum().detach()
    return total, (labels[0][0] >= 0).sum(), metrics


class MedusaProposer:
    """Medusa drafting: every head reads the hidden state of the last token the target processed.

    The engine passes the target features of x_0..x_{n-2}; the target's lm_head at x_{n-2} already
    chose x_{n-1} (the newest token), so head k at x_{n-2} predicts x_{n+k}: draft position k+1.
    """

    feature_names = ("last_hidden",)

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()
        self.max_depth = len(heads.blocks)  # one head per draft position

    def reset(self):
        pass  # stateless: one pass over one hidden state per round

    def _head_logits(self, feats: dict) -> list[torch.Tensor]:
        h = feats["last_hidden"][0, -1].to(self.heads.lm_heads[0].weight.dtype)
        return self.heads([h] * len(self.heads.blocks))

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        """A chain of min(k, num_heads) drafts, each head's top-1 (proposals are deterministic, so
        sampled verification treats them as q = one-hot)."""
        logits = self._head_logits(feats)[:k]
        return Draft.chain([int(self.heads.to_target(lg.argmax())) for lg in logits])

    @torch.no_grad()
    def propose_tree(self, tokens: torch.Tensor, feats: dict, spec) -> Draft:
        """A static tree: path (r_0, .., r_d) is the rank-r_d candidate of head d under its prefix."""
        if spec.kind != "static":
            raise DraftsmithError("--tree: Medusa heads build static trees (static:PATHS); dynamic trees need a "
                                  "drafter that conditions on its own drafts")
        logits = self._head_logits(feats)
        ranked = [self.heads.to_target(lg.topk(spec.top_k).indices).tolist() for lg in logits[: spec.depth]]
        draft, index = Draft(), {}
        for path in spec.paths:  # sorted by depth, so a parent always precedes its children
            index[path] = draft.add(ranked[len(path) - 1][path[-1]], index.get(path[:-1], -1))
        return draft


def make_proposer(heads, target, cfg: DrafterConfig) -> MedusaProposer:
    return MedusaProposer(heads)
