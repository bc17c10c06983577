"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv:2401.10774). Medusa-1 (`backbone: frozen`) trains the heads on a
frozen target; Medusa-2 (`backbone: lora` or `full`) trains heads and backbone together.

K heads sit on the target's last (post-norm) hidden state h_t, the input of its lm_head. The
target's own lm_head at t predicts token t+1; **head k (0-based) at t predicts token t+k+2**. Each
head is `num_layers` ResBlocks h + SiLU(W h + b) with W zero-initialised (a fresh head is the
identity on h) and then its own Linear(H -> V) initialised from the target's lm_head, so a fresh
head k predicts token t+k+2 with the target's next-token distribution at t.

All heads fire from the same hidden state in one pass: a chain takes each head's top-1, a static
tree each head's top-k (draftsmith/engine/drafts.py). Loss: sum_k decay^k * CE_k, against the target's own
distribution at t+k+1 (soft labels: self-distilled data, whose tokens the target chose itself) or
the hard token t+k+2 (fixed data). Tensor names follow vLLM's `MedusaModel` (draftsmith/ship/export.py).

Medusa-2 (paper section 2.2.2) adds the backbone's self-distillation: loss = KL(p_original || p_trained)
on the backbone's own next-token distribution + lambda0 * sum_k decay^k CE_k, lambda0 ramped up
(constant / linear / sine) so that untrained heads do not pull the backbone away early. With LoRA the
original is the same model with its adapters disabled, so no second copy is held; `full` trains a copy
of the decoder and keeps the frozen target as the original. The two-stage recipe (heads only for
`heads_only_steps`, then joint) is one run: the backbone's optimizer group starts its schedule late.
The trained backbone becomes the new target: the eval verifies with it (adapters merged) and reports
how far it drifted from the original.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.models.family import Family
from draftsmith.models.folder import load_state
from draftsmith.models.formats import vllm_snippet, write_tensors
from draftsmith.models.training import check_draft_vocab, draft_vocab, layer_activation_bytes, lora_config
from draftsmith.target.features import layer_masks
from draftsmith.target.load import freeze
from draftsmith.util.losses import forward_kl, soft_cross_entropy
from draftsmith.util.masks import documents, model_inputs, same_document

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
    vocabulary EAGLE-3 uses). On CPU a full 49152-token head costs about a fifth of a target forward
    per token. vLLM 0.32 serves a reduced vocabulary only with `original_lm_head: true` (draftsmith/ship/export.py)."""
    original_lm_head: bool = False
    """Every head reuses the target's own lm_head (no vocabulary parameters; vLLM `original_lm_head`);
    with draft_vocab_size, only its rows of the draft vocabulary (vLLM `token_map`)."""
    # --- Medusa-2 --------------------------------------------------------------------------------
    backbone: str = "frozen"
    """`frozen` (Medusa-1), `lora` (Medusa-2 through peft adapters) or `full` (Medusa-2, every decoder
    weight; embeddings and lm_head stay frozen)."""
    backbone_lr: float = 0.0
    """Learning rate of the backbone (adapters or decoder); required for Medusa-2. The heads keep
    `optim.lr`, so optim.lr / backbone_lr is Medusa's heads learning-rate multiplier."""
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the target's linear layers, or `all-linear` (the lm_head is never adapted)."""
    lambda0: float = 0.2
    """Weight of the heads' loss next to the backbone's KL once the ramp is done (Medusa-2)."""
    lambda0_schedule: str = "sine"
    """How lambda0 ramps up from 0 over `lambda0_warmup_steps` of joint training: constant, linear or sine."""
    lambda0_warmup_steps: int = 0
    heads_only_steps: int = 0
    """Two-stage Medusa-2: train only the heads (Medusa-1 on the unchanged backbone) for this many
    optimizer steps, then heads and backbone together."""

    def __post_init__(self):  # checked when the recipe loads, before any model does
        if self.num_heads < 1 or self.num_layers < 1 or self.draft_vocab_size < 0:
            raise DraftsmithError(
                f"drafter: expected num_heads >= 1, num_layers >= 1 and draft_vocab_size >= 0, "
                f"got {self.num_heads}, {self.num_layers}, {self.draft_vocab_size}"
            )
        if self.backbone not in ("frozen", "lora", "full"):
            raise DraftsmithError(f"drafter.backbone: expected frozen, lora or full, got {self.backbone!r}")
        if self.lambda0_schedule not in ("constant", "linear", "sine"):
            raise DraftsmithError(
                f"drafter.lambda0_schedule: expected constant, linear or sine, got {self.lambda0_schedule!r}"
            )
        if self.backbone != "frozen" and not self.backbone_lr > 0:
            raise DraftsmithError(
                f"drafter.backbone_lr: a Medusa-2 run (backbone: {self.backbone}) needs the backbone's "
                "learning rate, e.g. backbone_lr: 1.0e-4 (the heads use optim.lr)"
            )
        if self.lora_rank < 1 or self.heads_only_steps < 0 or self.lambda0_warmup_steps < 0:
            raise DraftsmithError(
                "drafter: expected lora_rank >= 1, heads_only_steps >= 0 and lambda0_warmup_steps >= 0"
            )


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
    """blocks[h].layers[l] and lm_heads[h]: vLLM's MedusaModel names, without its `medusa_heads.` prefix.
    With `shared_lm_head` (vLLM's `original_lm_head`) every head ends in the target's own lm_head,
    held by reference: not a parameter of the heads, never trained, saved or copied."""

    # Indexing or iterating a ModuleList types as a bare Module: blocks[h] is a plain nn.Module whose
    # `layers` (ResBlocks) are set at run time, lm_heads[h] an nn.Linear. Typed Any.
    blocks: Any
    lm_heads: Any
    token_map: torch.Tensor  # a buffer, registered only on a reduced vocabulary (hasattr tells)
    shared_lm_head: nn.Linear | None  # the target's lm_head: a plain attribute (object.__setattr__)

    def __init__(
        self,
        hidden: int,
        vocab: int,
        num_heads: int,
        num_layers: int,
        bias: bool,
        draft_vocab: int = 0,
        shared_lm_head: nn.Linear | None = None,
    ):
        super().__init__()
        if draft_vocab:  # token_map[i] = the target id of draft id i (vLLM's name)
            self.register_buffer("token_map", torch.arange(draft_vocab))
            vocab = draft_vocab
        self.blocks = nn.ModuleList(nn.Module() for _ in range(num_heads))
        for block in self.blocks:
            block.layers = nn.ModuleList(ResBlock(hidden, bias) for _ in range(num_layers))
        object.__setattr__(self, "shared_lm_head", shared_lm_head)  # a plain attribute: not a submodule
        self.vocab_size = vocab  # what lm_heads map onto: train/optimizer.py keeps them with AdamW, off Muon
        n_own = 0 if shared_lm_head is not None else num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(n_own))

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].layers[0].linear.weight.dtype

    def head_logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        for layer in self.blocks[k].layers:
            h = layer(h)
        if len(self.lm_heads):
            return self.lm_heads[k](h)
        assert self.shared_lm_head is not None  # no own lm_heads: every head ends in the shared one
        if not hasattr(self, "token_map"):
            return self.shared_lm_head(h.to(self.shared_lm_head.weight.dtype))
        weight = self.shared_rows()
        return nn.functional.linear(h.to(weight.dtype), weight)

    def shared_rows(self) -> torch.Tensor:
        """The target lm_head's rows of the draft vocabulary, [draft_vocab, H], gathered once per
        token_map (a loaded checkpoint bumps its version) instead of on every head call."""
        assert self.shared_lm_head is not None  # only heads that share the target's lm_head gather its rows
        key = (self.token_map.data_ptr(), self.token_map._version, self.shared_lm_head.weight.data_ptr())
        if getattr(self, "_rows_key", None) != key:
            self._rows = self.shared_lm_head.weight.detach()[self.token_map]
            self._rows_key = key
        return self._rows

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


class Medusa2(nn.Module):
    """Medusa-2: the heads plus the backbone they read, trained together in one forward (so DDP sees
    one forward per backward). `lora`: peft injects adapters into the target in place, so the target
    object *is* the backbone and disabling the adapters gives back the original. `full`: the backbone
    is a trainable copy of the target and the target itself stays frozen as the original.

    Only what training changes is in state_dict (adapters or decoder weights, and the heads): a
    checkpoint of a LoRA run holds no copy of the target."""

    def __init__(self, cfg: DrafterConfig, target, heads: MedusaHeads):
        super().__init__()
        self.lora = cfg.backbone == "lora"
        if self.lora:
            from peft import get_peft_model

            self.backbone = get_peft_model(target, lora_config(cfg, target))
            for name, m in self.backbone.named_modules():  # the frozen target is in eval mode; its
                if "lora_dropout" in name and isinstance(m, nn.Dropout):  # adapters' dropout trains
                    m.train()
        else:
            # fp32 master weights whatever the target's dtype: AdamW's updates at Medusa-2's backbone
            # learning rates (~1e-5 of a weight) are below bf16's resolution (2^-8 relative) and would
            # mostly round away. bf16 autocast (accelerate) still runs the matmuls in bf16.
            self.backbone = copy.deepcopy(target).float().requires_grad_(False)
            self.backbone.get_decoder().requires_grad_(True)
            self.backbone.get_input_embeddings().requires_grad_(False)  # tied to the lm_head in many targets
            object.__setattr__(self, "frozen", target)  # the original: not a submodule, never trained or saved
        self.heads = heads

    @property
    def model(self):
        """The transformers model being trained (adapters injected, for LoRA)."""
        return self.backbone.get_base_model() if self.lora else self.backbone

    @contextmanager
    def original(self):
        """The target as it was before training: the adapters disabled, or the frozen original."""
        if self.lora:
            with self.backbone.disable_adapter():
                yield self.model
        else:
            yield self.frozen

    def merged(self):
        """A plain transformers model of the trained backbone (adapters merged into a copy), frozen:
        the new target that verifies the heads' drafts."""

        if not self.lora:
            return freeze(copy.deepcopy(self.backbone))
        return freeze(copy.deepcopy(self.backbone).merge_and_unload())

    def _saved(self) -> set[str]:
        # Not peft's get_peft_model_state_dict: that covers only `lora` and renames keys old checkpoints use.
        return {n for n, p in self.named_parameters() if p.requires_grad} | {
            f"heads.{n}" for n in self.heads.state_dict()
        }

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        keep = self._saved()
        for name in [n for n in out if n.startswith(prefix) and n[len(prefix) :] not in keep]:
            del out[name]
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        keep = self._saved()
        missing = [n for n in missing if n in keep]  # the frozen target's weights are never saved
        if strict and (missing or unexpected):
            raise RuntimeError(f"Medusa-2 state: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def forward(self, input_ids, attention_mask, rows, teach, joint: bool, position_ids=None):
        """rows[k]: (b, t) positions of head k's inputs; teach: (b, p) positions whose next token is
        trained. attention_mask, position_ids: `model_inputs` of the batch (a packed batch's 4-D
        per-document mask and restarting positions). -> (head logits per head, the trained backbone's
        logits at `teach` [N, V] or None before joint training, the original's logits at `teach` [N, V])."""

        def decode(model):
            mask = layer_masks(model.config, attention_mask)  # a 4-D mask keeps sliding layers to their window
            return model.get_decoder()(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids
            ).last_hidden_state

        with torch.no_grad(), self.original() as original:
            h0 = decode(original)
            teacher = original.get_output_embeddings()(h0[teach]).float()
        if joint:
            h = decode(self.model)
            trained = self.model.get_output_embeddings()(h[teach])
        else:  # heads only: the backbone is still the original, so its hidden states are h0
            h, trained = h0, None
        logits = self.heads([h[b, t] for b, t in rows])
        if not joint:  # every trainable parameter must get a gradient for DDP; a zero one changes nothing
            # (DeepSpeed ZeRO does not need the anchor, and under ZeRO-3 a parameter read outside its
            # module's forward is an empty shard: `ds_id` marks ZeRO-managed parameters.)
            anchor = sum(
                p.sum()
                for n, p in self.named_parameters()
                if p.requires_grad and not n.startswith("heads.") and not hasattr(p, "ds_id")
            )
            logits[0] = logits[0] + 0.0 * anchor
        return logits, trained, teacher


def feature_names(cfg: DrafterConfig, target_config) -> tuple[str, ...]:
    # Medusa-1 reads the post-norm hidden state the target's lm_head reads (cacheable); Medusa-2
    # computes it itself, with gradients, from the backbone being trained.
    return ("last_hidden",) if cfg.backbone == "frozen" else ()


def max_draft_depth(cfg: DrafterConfig) -> int | None:
    return cfg.num_heads  # one head per draft position: no deeper chain or tree


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """Its config as given, once the draft vocabulary is known to fit the target's."""
    check_draft_vocab(cfg.draft_vocab_size, target_config)
    return cfg


def build(cfg: DrafterConfig, target, dataset=None) -> MedusaHeads | Medusa2:
    tc = target.config
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads(
        tc.hidden_size,
        tc.vocab_size,
        cfg.num_heads,
        cfg.num_layers,
        cfg.fc_bias,
        cfg.draft_vocab_size,
        shared_lm_head=lm_head if cfg.original_lm_head else None,
    )
    rows = torch.arange(tc.vocab_size)
    if cfg.draft_vocab_size and dataset is not None:
        rows = draft_vocab(dataset, tc.vocab_size, cfg.draft_vocab_size)
        heads.token_map.copy_(rows)
    with torch.no_grad():  # every head starts as the target's own lm_head (rows of the draft vocabulary)
        for lm in heads.lm_heads:
            lm.weight.copy_(lm_head.weight[rows[: lm.out_features]].float())
    return heads if cfg.backbone == "frozen" else Medusa2(cfg, target, heads)


def rebuild(meta: dict, target) -> MedusaHeads | Medusa2:
    cfg = DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"})
    return build(cfg, target)


def param_groups(drafter, cfg: DrafterConfig, lr: float) -> list[dict]:
    """Heads at optim.lr; a Medusa-2 backbone at backbone_lr, its schedule starting after the
    heads-only stage (`start_step`, read by the loop's scheduler)."""
    if not isinstance(drafter, Medusa2):
        return [{"name": "heads", "params": list(drafter.parameters()), "lr": lr}]
    backbone = [p for n, p in drafter.named_parameters() if p.requires_grad and not n.startswith("heads.")]
    return [
        {"name": "heads", "params": list(drafter.heads.parameters()), "lr": lr},
        {"name": "backbone", "params": backbone, "lr": cfg.backbone_lr, "start_step": cfg.heads_only_steps},
    ]


def lambda0(cfg: DrafterConfig, step: int) -> float:
    """The heads' loss weight at optimizer step `step`: ramped from 0 at the start of joint training."""
    done = (
        1.0
        if cfg.lambda0_warmup_steps == 0
        else min(1.0, max(0, step - cfg.heads_only_steps) / cfg.lambda0_warmup_steps)
    )
    ramp = {"constant": 1.0, "linear": done, "sine": math.sin(math.pi / 2 * done)}[cfg.lambda0_schedule]
    return cfg.lambda0 * ramp


def compute_loss(model, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_tokens, metric_sums); n_tokens counts head-0 positions.

    batch: input_ids, attention_mask, loss_mask [B, T]; feats["last_hidden"]: [B, T, H] (Medusa-1;
    Medusa-2 computes it). Medusa-1: sum_k decay^k CE_k. Medusa-2: KL(p_original || p_trained) +
    lambda0(step) * sum_k decay^k CE_k; heads only (no KL) before `heads_only_steps`.
    """
    forward = model if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    ids, lmask = batch["input_ids"], batch["loss_mask"].bool()
    heads = model.heads if isinstance(model, Medusa2) else model
    # Which example each token is (a batch without an attention_mask is all tokens, one example a row).
    docs, t_len = documents({"attention_mask": torch.ones_like(ids), **batch}), ids.shape[1]
    # Head k at position t predicts token t+k+2: its inputs are positions t with token t+k+2 trained
    # (loss mask), i.e. the nonzeros of lmask[:, k+2:] indexed by t; in a packed row token t+k+2 may
    # already be the next example's, which is no label for t: it must be t's own (same_document).
    rows = [
        (lmask[:, k + 2 :] & same_document(docs, k + 2)[:, : t_len - k - 2]).nonzero(as_tuple=True)
        for k in range(min(cfg.num_heads, t_len - 2))
    ]
    # Positions p whose next token p+1 is trained (and p's own, not the next example's): the target's
    # distribution at p labels token p+1, computed once for every head (head k's label for token
    # t+k+2 is the distribution at p = t+k+1, in t's example as t+k+2 is).
    teach = (lmask[:, 1:] & same_document(docs, 1)[:, :-1]).nonzero(as_tuple=True)
    if not rows:  # fewer than 3 tokens: nothing to learn, but every trainable weight joins the backward (DDP)
        return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0, torch.tensor(0, device=ids.device), {}
    joint = isinstance(model, Medusa2) and step >= cfg.heads_only_steps
    if isinstance(model, Medusa2):
        inputs = model_inputs(batch)  # the backbone decodes each example of a packed row on its own
        logits, trained, teacher = forward(ids, inputs["attention_mask"], rows, teach, joint, inputs["position_ids"])
    else:
        last = feats["last_hidden"]
        with torch.no_grad():
            teacher = target.get_output_embeddings()(last[teach].to(target.dtype)).float() if cfg.soft_labels else None
        h = last.to(heads.dtype)
        logits = forward([h[b, t] for b, t in rows])  # one call through the wrapper for all heads
    row_of = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    row_of[teach] = torch.arange(len(teach[0]), device=ids.device)
    heads_loss: float | torch.Tensor = 0.0  # a Tensor once head 0's loss is added
    metrics: dict[str, torch.Tensor] = {}
    n = None
    for k, ((b, t), lg) in enumerate(zip(rows, logits)):
        soft = teacher[row_of[b, t + k + 1]] if cfg.soft_labels else None
        wanted = soft.argmax(-1) if soft is not None else ids[b, t + k + 2]
        # With a draft vocabulary, only positions whose wanted token is in it can be learned (as EAGLE-3).
        wanted = heads.to_draft(wanted)
        keep = wanted >= 0
        if soft is not None:
            soft = soft[:, heads.token_map] if hasattr(heads, "token_map") else soft
            loss = soft_cross_entropy(lg, soft, keep.float())
        else:
            loss = nn.functional.cross_entropy(lg.float()[keep], wanted[keep], reduction="sum")
        heads_loss = heads_loss + cfg.decay**k * loss
        metrics["acc" if k == 0 else f"acc{k}"] = ((lg.argmax(-1) == wanted) & keep).float().sum().detach()
        n = keep.sum() if k == 0 else n
    if not joint:
        return heads_loss, n, metrics
    assert isinstance(heads_loss, torch.Tensor)  # rows is not empty (returned above): head 0's loss is in
    kl = forward_kl(trained, teacher, torch.ones(len(teacher), device=ids.device))
    metrics.update(heads_loss=heads_loss.detach(), kl_loss=kl.detach())
    return kl + lambda0(cfg, step) * heads_loss, n, metrics


class MedusaProposer(Proposer):
    """Medusa drafting: every head reads the hidden state of the last token the target processed.

    The engine passes the target features of x_0..x_{n-2}; the target's lm_head at x_{n-2} already
    chose x_{n-1} (the newest token), so head k at x_{n-2} predicts x_{n+k}: draft position k+1.
    """

    feature_names = ("last_hidden",)
    drafts_trees = True  # static trees

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()
        self.max_depth = len(heads.blocks)  # one head per draft position
        self.logits = lambda rows: rows  # [heads, V]: what the heads computed (a tap for `export --verify`)

    def reset(self):
        pass  # stateless: one pass over one hidden state per round

    def _head_logits(self, feats: dict) -> torch.Tensor:
        h = feats["last_hidden"][0, -1].to(self.heads.dtype)
        return self.logits(torch.stack(self.heads([h] * len(self.heads.blocks))))

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
            raise DraftsmithError(
                "--tree: Medusa heads build static trees (static:PATHS); dynamic trees need a "
                "drafter that conditions on its own drafts"
            )
        logits = self._head_logits(feats)
        ranked = [self.heads.to_target(lg.topk(spec.top_k).indices).tolist() for lg in logits[: spec.depth]]
        draft = Draft()
        index: dict[tuple[int, ...], int] = {}  # a path -> its node in the draft
        for path in spec.paths:  # sorted by depth, so a parent always precedes its children
            index[path] = draft.add(ranked[len(path) - 1][path[-1]], index.get(path[:-1], -1))
        return draft


def make_proposer(drafter, target, cfg: DrafterConfig) -> MedusaProposer:
    return MedusaProposer(drafter.heads if isinstance(drafter, Medusa2) else drafter)


def verifier(drafter, target):
    """The model that verifies drafts: the target for Medusa-1; Medusa-2's trained backbone (merged)."""
    return drafter.merged() if isinstance(drafter, Medusa2) else target


# vLLM serves this family's `vllm` export as speculative method `medusa` (draftsmith/ship/serve_check.py).
SERVE_FORMAT = "vllm"


def vllm_serving(export_dir, export_config: dict, k: int) -> tuple[dict, list[str]]:
    """(`vllm serve --speculative-config`, extra server flags) for a Medusa export. vLLM's MedusaProposer
    stacks the top-1 of every head, so it drafts exactly num_heads tokens whatever k asks for. A reduced
    vocabulary needs the strict weight check off: vLLM 0.32's MedusaModel.load_weights loads `token_map`
    (and scatters the logits through it) but leaves it out of the names it reports loaded, so the
    default loader then refuses the checkpoint ("weights were not initialized from checkpoint: token_map")."""
    spec = {"method": "medusa", "model": str(export_dir), "num_speculative_tokens": export_config["num_heads"]}
    reduced = export_config.get("truncated_vocab_size") not in (None, export_config["vocab_size"])
    return spec, ["--model-loader-extra-config", '{"enable_weights_track": false}'] if reduced else []


# --- format: vLLM `MedusaModel` (a Medusa-2 export adds `backbone/`, the new target) ----------------


def write_export(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    """vLLM `MedusaModel`: blocks.{h}.layers.{l}.weight (+ .bias only with medusa_fc_bias: vLLM builds
    the ResBlock linears without bias otherwise) and lm_heads.{h}.weight, or one lm_head.weight
    (the target's) with original_lm_head. A Medusa-2 drafter also writes `out/backbone/`: the trained
    backbone with its adapters merged, a plain transformers folder with the target's tokenizer
    (`tok`), which serves as the new target (vLLM `--model out/backbone`, `speculative_config.model: out`)."""
    heads = getattr(drafter, "heads", drafter)  # Medusa-2: the heads, then the backbone below
    state = {k.replace(".linear.", "."): v for k, v in heads.state_dict().items()}
    shared, vocab = heads.shared_lm_head is not None, target.config.vocab_size
    reduced = hasattr(heads, "token_map")
    if reduced and not shared:
        # vLLM 0.32 MedusaModel builds each head's own lm_head over the full vocabulary and asserts
        # that the checkpoint's rows fill it (ParallelLMHead.weight_loader), so per-head draft-vocabulary
        # heads have no encoding it loads; only one shared lm_head is built at truncated_vocab_size.
        raise DraftsmithError(
            f"--format vllm: vLLM's MedusaModel serves a reduced head vocabulary only through one "
            f"shared lm_head; these {len(heads.lm_heads)} heads each have their own "
            f"{heads.lm_heads[0].out_features}-row lm_head. Train with drafter.original_lm_head=true "
            f"(the target's rows of the draft vocabulary) or drafter.draft_vocab_size=0"
        )
    if shared:  # vLLM gives every head this one lm_head (with token_map: its rows of the draft vocabulary)
        state["lm_head.weight"] = heads.shared_rows() if reduced else heads.shared_lm_head.weight.detach()
    hidden = heads.blocks[0].layers[0].linear.in_features
    # A reduced head vocabulary: vLLM scatters the heads' logits through `token_map` (-inf elsewhere).
    truncated = len(heads.token_map) if reduced else None
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_heads": len(heads.blocks),
        "num_hidden_layers": len(heads.blocks[0].layers),
        "medusa_fc_bias": heads.blocks[0].layers[0].linear.bias is not None,
        "truncated_vocab_size": truncated,
        "original_lm_head": shared,
    }
    config["draftsmith"] = info
    backbone = verifier(drafter, target)
    if backbone is not target:
        if tok is None:
            raise DraftsmithError(f"{info['target']}: exporting a trained backbone needs the target's tokenizer")
        backbone.save_pretrained(Path(out) / "backbone")
        tok.save_pretrained(Path(out) / "backbone")
        info["backbone"] = "backbone"  # the new target, relative to this folder
    write_tensors(out, config, state)


EXPORTS = {"vllm": write_export}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    return (config.get("architectures") or ["?"])[0] == "MedusaModel"


def read_export(path, target) -> dict[str, torch.Tensor]:
    state = load_state(path)
    state.pop("lm_head.weight", None)  # original_lm_head: the target's own, not a head weight
    # blocks.h.layers.l.weight -> the ResBlock's .linear
    return {
        (k.rsplit(".", 1)[0] + ".linear." + k.rsplit(".", 1)[1]) if k.startswith("blocks.") else k: v
        for k, v in state.items()
    }


def from_export(path, config: dict, cfg: DrafterConfig, target) -> MedusaHeads:
    cfg.backbone = "frozen"  # exported heads are plain Medusa heads; a Medusa-2 backbone is `backbone/`
    heads = build(cfg, target)
    assert isinstance(heads, MedusaHeads)  # backbone frozen: build returns the plain heads
    heads.load_state_dict(read_export(path, target), strict=True)
    return heads


def trains_target(drafter_config: dict) -> bool:
    """Medusa-2 changes the backbone it is loaded on: it needs its own copy of the target."""
    return drafter_config.get("backbone", "frozen") != "frozen"


@contextmanager
def original(drafter, target):
    """The target as it was before training: Medusa-2's backbone with adapters off, or its frozen original."""
    if isinstance(drafter, Medusa2):
        with drafter.original() as model:
            yield model
    else:
        yield target


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    return vllm_snippet("medusa", repo_id, target, k)


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: per head its logits, log-softmax and the soft labels' slice; the teacher's distribution
    once; with a trained backbone its own logits and KL to the original, gradients through every layer."""
    n, f, vd, h = batch * length, 4, cfg.draft_vocab_size or tc.vocab_size, tc.hidden_size
    act = n * cfg.num_heads * (f * 3 * vd + elem * 8 * h) + n * f * tc.vocab_size
    if cfg.backbone != "frozen":
        act += (
            n * tc.num_hidden_layers * layer_activation_bytes(h, tc.intermediate_size, elem) + n * f * 7 * tc.vocab_size
        )
    return act


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=feature_names,
    max_draft_depth=max_draft_depth,
    build=build,
    rebuild=rebuild,
    compute_loss=compute_loss,
    activation_bytes=activation_bytes,
    make_proposer=make_proposer,
    EXPORTS=EXPORTS,
    recognises=recognises,
    read_export=read_export,
    from_export=from_export,
    serving_snippet=serving_snippet,
    SERVE_FORMAT=SERVE_FORMAT,
    vllm_serving=vllm_serving,
    param_groups=param_groups,
    verifier=verifier,
    trains_target=trains_target,
    original=original,
    resolve=resolve,
    tiny={"num_heads": 2},
    tiny_lora={"backbone": "lora", "lora_rank": 4, "backbone_lr": 1e-3},
)
