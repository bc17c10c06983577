"""Attention masks the drafters and the batched engine build: causal with left padding, and
EAGLE-3's training-time-test mask."""

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


def ttt_mask(t: int, step: int, padding: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, t, t*(step+1)] for unrolled step `step` of training-time test
    (EAGLE-3) and of HASS context alignment (EAGLE-1 with `hass: true`): the same unroll.

    Chains are indexed by their root r (the last position with a real target feature). Keys are
    the real pairs of step 0 (block 0: causal, r' <= r) and, for steps 1..step, only the chain's own
    earlier draft states (diagonal blocks). That is exactly what draft step `step` sees at
    inference: the real KV cache up to r plus its own previous drafts.
    """
    blocks = [causal_mask(t, t, padding, device=padding.device)]
    eye = torch.eye(t, dtype=torch.bool, device=padding.device)[None, None].expand(padding.shape[0], 1, t, t)
    blocks += [eye] * step
    return torch.cat(blocks, dim=-1)
