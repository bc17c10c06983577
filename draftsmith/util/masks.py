"""Attention masks the drafters and the batched engine build: causal with left padding, EAGLE-3's
training-time-test mask, and per-document masks and labels for packed batches."""

from __future__ import annotations

import torch


def causal_mask(q_len: int, kv_len: int, padding: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean attention mask [B|1, 1, q_len, kv_len]; True = may attend.

    The q_len queries are the *last* q_len positions of the kv_len keys (a KV cache may hold
    kv_len - q_len earlier positions), so query i sits at absolute position kv_len - q_len + i.
    `padding` [B, kv_len] marks real (1) vs padded (0) keys.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :].bool()
    # A fully padded query row would make softmax NaN; let it see itself (its loss is masked).
    eye = (k_pos == q_pos)[None, None]
    return mask | eye


def ttt_mask(t: int, step: int, docs: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, t, t*(step+1)] for unrolled step `step` of training-time test
    (EAGLE-3) and of HASS context alignment (EAGLE-1 with `hass: true`): the same unroll.

    Chains are indexed by their root r (the last position with a real target feature). Keys are
    the real pairs of step 0 (block 0: causal within r's own document, r' <= r) and, for steps
    1..step, only the chain's own earlier draft states (diagonal blocks). That is exactly what draft
    step `step` sees at inference: the real KV cache of its example up to r plus its own previous
    drafts. `docs` [B, t]: the roots' document numbers (`documents`, 0 = padding); a padding mask
    (1 = real) is the one-example-a-row case.
    """
    blocks = [document_causal_mask(docs)]
    eye = torch.eye(t, dtype=torch.bool, device=docs.device)[None, None].expand(docs.shape[0], 1, t, t)
    blocks += [eye] * step
    return torch.cat(blocks, dim=-1)


# --- packed batches (data/packing.py): several examples a row, each its own sequence ---------------
def documents(batch: dict) -> torch.Tensor:
    """[B, T]: which example of its row each token belongs to (from 1; 0 = padding). A padded batch
    has one example a row, so its attention_mask says the same."""
    return batch["documents"] if "documents" in batch else batch["attention_mask"]


def positions(batch: dict) -> torch.Tensor:
    """[B, T] position ids: restarting at every example of a packed row, 0..T-1 in a padded one."""
    if "position_ids" in batch:
        return batch["position_ids"]
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)


def document_causal_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, T] document numbers -> boolean mask [B, 1, T, T]: a token attends to the earlier tokens of
    its own example (per-document attention); a padding query sees itself (no NaN; it carries no loss)."""
    t = docs.shape[1]
    mask = causal_mask(t, t, docs != 0, device=docs.device)
    return mask & (docs[:, None, :, None] == docs[:, None, None, :])


def same_document(docs: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: position p and p + k are tokens of the same example (False where p + k is past
    the row): a label k tokens ahead is that example's own, not the next one's in a packed row."""
    later = torch.nn.functional.pad(docs[:, k:], (0, k))
    return (docs != 0) & (later == docs)


def model_inputs(batch: dict) -> dict[str, torch.Tensor | None]:
    """attention_mask (and position_ids) for a transformers model's forward over `batch`: the [B, T]
    padding mask of a padded batch; a packed one's 4-D per-document mask and restarting positions."""
    if "documents" not in batch:
        return {"attention_mask": batch.get("attention_mask"), "position_ids": batch.get("position_ids")}
    return {"attention_mask": document_causal_mask(batch["documents"]), "position_ids": batch["position_ids"]}
