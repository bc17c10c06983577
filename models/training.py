"""What the families share for training: vocabularies, LoRA,
parameter groups, label rows from the target's lm_head, the mask token, the activation-bytes
estimate of `plan`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftsmith import DraftsmithError
from draftsmith.target.features import max_over_ranks

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def label_rows(need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions `need` [B, T] marks, as (batch ids, positions, row_of [B, T]: position -> its
    row among them, or -1): the row order every teacher tensor over those positions follows."""
    nb, np_ = need.nonzero(as_tuple=True)
    row_of = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
    row_of[nb, np_] = torch.arange(len(nb), device=need.device)
    return nb, np_, row_of


def target_label_rows(lm_head, last: torch.Tensor, need: torch.Tensor, reduce):
    """The target's logits at the positions `need` [B, T] marks (some draft's label), computed in
    chunks of 4096 rows over the full vocabulary, one chunk alive at a time, each cut down by
    `reduce(logits [n, V]) -> tuple of tensors` -> (row_of [B, T]: position -> row or -1, [each
    reduced tensor over all rows]). A sharded target (ZeRO-3, FSDP) gathers lm_head on every call,
    on all ranks together: every rank makes as many calls as the rank with the most rows (extra
    ones on no rows)."""
    nb, np_, row_of = label_rows(need)
    calls = max(max_over_ranks(-(-len(nb) // 4096), need.device), 1)  # one call on no rows: empty outputs
    parts = [
        reduce(lm_head(last[nb[c : c + 4096], np_[c : c + 4096]].to(lm_head.weight.dtype)).float())
        for c in range(0, 4096 * calls, 4096)
    ]
    return row_of, [torch.cat(p) for p in zip(*parts)]


def check_draft_vocab(size: int, target_config) -> None:
    """Refuse a draft vocabulary larger than the target's when the run resolves its config, before
    any data is read or a head is built (a 10M-row request once sat in its first step for minutes)."""
    vocab = target_config.vocab_size
    if size > vocab:
        raise DraftsmithError(
            f"drafter.draft_vocab_size: {size} is more than the target's vocabulary ({vocab} tokens); "
            f"expected 0 (the whole vocabulary) or a count up to {vocab}"
        )


def draft_vocab(dataset, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens among loss-masked (trained) tokens, sorted by id: the
    reduced draft vocabulary of EAGLE-3 heads and Medusa heads (FR-Spec, Zhao et al. 2025).
    Ties and unseen tokens are filled by id order, so the choice is deterministic."""
    if size > vocab:
        raise DraftsmithError(f"drafter.draft_vocab_size: {size} is larger than the target vocabulary ({vocab})")
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids = torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab)[:vocab]
    # Stable sort on -count keeps id order among ties.
    order = torch.sort(-counts, stable=True).indices[:size]
    return order.sort().values


def to_target_vocab(small: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., V_d] -> [..., vocab], -inf off the draft vocabulary (target id =
    draft id + d2t[draft id], the d2t of vLLM and speculators)."""
    ids = torch.arange(small.shape[-1], device=small.device)
    return small.new_full((*small.shape[:-1], vocab), float("-inf")).index_copy(-1, ids + d2t[ids], small)


def lora_config(cfg, model: PreTrainedModel):
    """peft LoraConfig from a family config's lora_rank / lora_alpha / lora_dropout / lora_target_modules
    (Medusa-2's backbone, a distilled student); names that are not linear layers of `model` fail with
    the ones that are."""
    from peft import LoraConfig

    out = model.get_output_embeddings()
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not out}
    )
    wanted = [n.strip() for n in cfg.lora_target_modules.split(",") if n.strip()]
    if wanted != ["all-linear"]:
        unknown = [n for n in wanted if n not in linear]
        if unknown or not wanted:
            raise DraftsmithError(
                f"drafter.lora_target_modules: {', '.join(unknown) or 'nothing given'} not in the "
                f"model; its linear layers are {', '.join(linear)} (or use all-linear)"
            )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear" if wanted == ["all-linear"] else wanted,
        bias="none",
    )


def mask_token(requested: int | None, target_config) -> int:
    """A block drafter's mask token (`drafter.mask_token_id`): the id asked for, else the target's pad
    token, else its eos (speculators' fallback for a tokenizer without a mask token or a spare row)."""
    mid = requested
    if mid is None:
        mid = target_config.pad_token_id if target_config.pad_token_id is not None else target_config.eos_token_id
        mid = mid[0] if isinstance(mid, list) else mid
    if not isinstance(mid, int) or not 0 <= mid < target_config.vocab_size:
        raise DraftsmithError(
            f"drafter.mask_token_id: expected an id in [0, {target_config.vocab_size - 1}] (the "
            f"target's vocabulary), got {mid}"
        )
    return mid


def layer_activation_bytes(hidden: int, intermediate: int, elem: int) -> int:
    """Bytes per token a decoder layer keeps for backward (flash/SDPA attention) in `elem`-byte activations."""
    return elem * (10 * hidden + 4 * intermediate)
