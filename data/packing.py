"""Packed batches: whole examples laid end to end in rows of `data.max_length` tokens, each example
attending only to itself (per-document attention), as speculators and SpecForge pack theirs.

A padded batch (`data.packing: false`) computes every row out to its longest example; a packed one
fills each row with several examples, so a micro-batch is a fixed budget of `optim.batch_size` rows x
`data.max_length` tokens and little of it is padding. The examples stay separate sequences: their
positions restart at 0, their tokens attend only to their own earlier tokens, and no label crosses
from one to the next. The batch says which tokens belong together in `documents` [B, T]: the
example's number within its row, from 1, and 0 on padding; a padded batch has documents =
attention_mask (one example a row), so the families read both layouts through the same helpers
(draftsmith/util/masks.py `document_causal_mask`, `same_document`).
"""

from __future__ import annotations

import random

import torch

from draftsmith.data.batching import collate, epoch_batches
from draftsmith.data.config import DataConfig


def pack_rows(lengths: list[int], order: list[int], width: int) -> list[list[int]]:
    """Example indices (in `order`) into rows of total length <= width: first fit, in order, over the
    rows opened so far, so a short example fills the gap a long one left. Deterministic."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = min(lengths[i], width)  # an example is never longer than max_length (build_dataset cuts it)
        at = next((r for r, free in enumerate(room) if free >= n), None)
        if at is None:
            rows.append([i])
            room.append(width - n)
        else:
            rows[at].append(i)
            room[at] -= n
    return rows


def epoch_packed_batches(
    lengths: list[int], width: int, rows_per_batch: int, seed: int, epoch: int
) -> list[list[list[int]]]:
    """The packed micro-batches of one epoch, a pure function of (seed, epoch) so a resumed run
    replays them: every example once, shuffled, packed (`pack_rows`) by windows of 50 batches (a
    window's rows mix lengths; its order is the shuffle's), then the rows shuffled into batches of
    `rows_per_batch`. The last batch may hold fewer rows (the loop drops it, as a padded epoch's)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = max(1, rows_per_batch * 50 * width // max(1, max(lengths, default=1)))
    rows = [row for s in range(0, len(order), window) for row in pack_rows(lengths, order[s : s + window], width)]
    rng.shuffle(rows)
    return [rows[s : s + rows_per_batch] for s in range(0, len(rows), rows_per_batch)]


def collate_packed(rows: list[list[dict]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of examples -> a batch laid end to end, right-padded to the longest row.

    input_ids, loss_mask, attention_mask (1 = a token), position_ids (restarting at 0 for every
    example), documents (the example's number in its row, from 1; 0 = padding): [B, T]; idx [B, D]:
    the examples of each row in order (-1 past its last), which a feature cache reads them by."""
    t = max(sum(len(e["input_ids"]) for e in row) for row in rows)
    d = max(len(row) for row in rows)

    def laid(values) -> list[int]:
        return values + [0] * (t - len(values))

    batch: dict[str, list] = {k: [] for k in ("input_ids", "loss_mask", "attention_mask", "position_ids", "documents")}
    for row in rows:
        ids = [tok for e in row for tok in e["input_ids"]]
        batch["input_ids"].append(ids + [pad_id] * (t - len(ids)))
        batch["loss_mask"].append(laid([m for e in row for m in e["loss_mask"]]))
        batch["attention_mask"].append(laid([1] * len(ids)))
        batch["position_ids"].append(laid([p for e in row for p in range(len(e["input_ids"]))]))
        batch["documents"].append(laid([n + 1 for n, e in enumerate(row) for _ in e["input_ids"]]))
    out = {k: torch.tensor(v) for k, v in batch.items()}
    out["idx"] = torch.tensor([[e["idx"] for e in row] + [-1] * (d - len(row)) for row in rows])
    return out


def document_lengths(batch: dict) -> list[list[int]]:
    """Each row's example lengths in order, from `documents` (a feature cache lays its reads so)."""
    docs = batch["documents"]
    return [[int((row == n).sum()) for n in range(1, int(row.max()) + 1)] for row in docs]


def epoch_rows(
    lengths: list[int], data: DataConfig, rows_per_batch: int, seed: int, epoch: int
) -> list[list[list[int]]]:
    """Every micro-batch of an epoch as rows of example indices: several examples a row (packed) or
    one (padded, `epoch_batches`' length-grouped batches)."""
    if data.packing:
        return epoch_packed_batches(lengths, data.max_length, rows_per_batch, seed, epoch)
    return [[[i] for i in b] for b in epoch_batches(lengths, rows_per_batch, seed, epoch, data.group_by_length)]


def collate_rows(ds, rows: list[list[int]], pad_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """A micro-batch's rows of example indices (`epoch_rows`) -> its tensors, laid end to end
    (`collate_packed`) or padded one example a row (`collate`)."""
    if packed:
        return collate_packed([[ds[i] for i in row] for row in rows], pad_id)
    return collate([ds[row[0]] for row in rows], pad_id)
