"""Tokenized datasets, length-bucketed deterministic batches, padding collate."""

from __future__ import annotations

import random

import datasets
import torch

from draftsmith import DraftsmithError
from draftsmith.data.load import read_records, to_messages, tokenize_example, tokenized_example


def build_dataset(spec: str, tok, max_length: int, max_examples: int = 0, num_proc: int = 1) -> datasets.Dataset:
    """Records -> datasets.Dataset with input_ids, loss_mask, length, idx. Examples with no
    trainable token (e.g. a prompt with no answer) are dropped."""
    rows = read_records(spec)
    if max_examples:
        rows = rows[:max_examples]
    if rows and "completion_ids" in rows[0]:
        return _filter(datasets.Dataset.from_list(
            [{**tokenized_example(r, len(tok), max_length, f"{spec}: record {n}"), "idx": n} for n, r in enumerate(rows)]), spec)
    items = [to_messages(r, f"{spec}: record {n}") for n, r in enumerate(rows)]
    # Validate formats eagerly above (clear file errors); tokenize through datasets.map.
    ds = datasets.Dataset.from_dict({"item": [i if isinstance(i, list) else [{"role": "text", "content": i}] for i in items]})

    def encode(ex, idx):
        item = ex["item"]
        item = item[0]["content"] if item and item[0]["role"] == "text" else item
        out = tokenize_example(tok, item, max_length, f"{spec}: record {idx}")
        return {**out, "length": len(out["input_ids"]), "idx": idx}

    ds = ds.map(encode, with_indices=True, remove_columns=["item"], num_proc=num_proc if num_proc > 1 else None,
                desc="tokenize")
    return _filter(ds, spec)


def _filter(ds: datasets.Dataset, spec: str) -> datasets.Dataset:
    ds = ds.filter(lambda ex: sum(ex["loss_mask"]) > 2)
    if len(ds) == 0:
        raise DraftsmithError(f"{spec}: no examples left after filtering (need assistant tokens within data.max_length)")
    return ds


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, group_by_length: bool) -> list[list[int]]:
    """The batches of one epoch, a pure function of (seed, epoch) so a resumed run replays them.

    With group_by_length, examples are sorted by length inside windows of 50 batches, then the
    batch order is shuffled: similar lengths share a batch without a fixed global order.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if group_by_length:
        window = batch_size * 50
        order = [i for s in range(0, len(order), window)
                 for i in sorted(order[s:s + window], key=lambda i: -lengths[i])]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if group_by_length:
        rng.shuffle(batches)
    return batches


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example in the batch."""
    t = max(len(e["input_ids"]) for e in examples)

    def pad(key, value):
        return torch.tensor([e[key] + [value] * (t - len(e[key])) for e in examples])

    return {
        "input_ids": pad("input_ids", pad_id),
        "loss_mask": pad("loss_mask", 0),
        "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * (t - len(e["input_ids"])) for e in examples]),
        "idx": torch.tensor([e["idx"] for e in examples]),
    }
