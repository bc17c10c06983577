"""Tokenized datasets, length-bucketed deterministic batches, padding collate."""

from __future__ import annotations

import json
import random
import sys

import datasets
import torch

from draftsmith import DraftsmithError
from draftsmith.data.load import (
    Malformed,
    chat_kwargs,
    located_records,
    require_chat_template,
    to_messages,
    tokenize_example,
    tokenized_example,
)


def build_dataset(
    spec: str,
    tok,
    max_length: int,
    max_examples: int = 0,
    num_proc: int = 1,
    split: str = "train",
    malformed: str = "skip",
    chat: dict | None = None,
    stats: dict | None = None,
) -> datasets.Dataset:
    """Records -> datasets.Dataset with input_ids, loss_mask, length, idx (the record's number).
    `split`: of a dataset folder or hub dataset (read_records). Malformed records are skipped with
    one summary line (malformed="skip"; all of them malformed is an error) or stop the build at the
    first ("error"). Examples with fewer than 3 trainable tokens (e.g. a prompt with no answer) are dropped.
    `chat`: the chat template's switches (data.thinking), under each record's own (`chat_kwargs`).
    The step's accounting is printed in one line and, with `stats`, filled into that dict (`_filter`)."""
    refused = Malformed(spec, malformed)
    records = located_records(spec, split)[: max_examples or None]
    first = next((row for _, row in records if isinstance(row, dict)), {})
    if "completion_ids" in first or "turns" in first:  # regenerated: the target's exact ids
        exact = lambda row, where: tokenized_example(row, len(tok), max_length, where)  # noqa: E731
        examples = [(n, refused.keep(exact, row, where)) for n, (where, row) in enumerate(records)]
        refused.report(len(records))
        kept = datasets.Dataset.from_list(
            [{**ex, **mask_counts(ex), "idx": n, "refused": ""} for n, ex in examples if ex is not None]
        )
        return _filter(kept, spec, records, refused, stats)
    convert = lambda row, where: (to_messages(row, where), chat_kwargs(row, chat, where))  # noqa: E731
    converted = [(n, where, refused.keep(convert, row, where)) for n, (where, row) in enumerate(records)]
    items = [(n, where, item[0], item[1]) for n, where, item in converted if item is not None]
    if not items:
        refused.report(len(records))  # every record malformed: an error
        raise DraftsmithError(f"{spec}: no records")
    if any(isinstance(item, list) for _, _, item, _ in items):
        require_chat_template(tok, spec)  # once for the data, not as a reason to refuse each record
    # Formats were validated above (file:line errors); tokenize through datasets.map. A record its
    # template cannot mask (tokenize_example) comes back with the reason, refused below in order.
    ds = datasets.Dataset.from_dict(
        {
            "item": [i if isinstance(i, list) else [{"role": "text", "content": i}] for _, _, i, _ in items],
            "where": [where for _, where, _, _ in items],
            "chat": [json.dumps(c) for _, _, _, c in items],
            "idx": [n for n, _, _, _ in items],
        }
    )

    def encode(ex):
        item = ex["item"]
        item = item[0]["content"] if item and item[0]["role"] == "text" else item
        try:
            out, reason = tokenize_example(tok, item, max_length, ex["where"], json.loads(ex["chat"])), ""
        except DraftsmithError as e:
            out, reason = {"input_ids": [], "loss_mask": [], "cut": 0}, str(e)
        return {**out, **mask_counts(out), "length": len(out["input_ids"]), "refused": reason}

    ds = ds.map(
        encode, remove_columns=["item", "where", "chat"], num_proc=num_proc if num_proc > 1 else None, desc="tokenize"
    )
    for reason in ds["refused"]:
        if reason:
            refused.refuse(reason)
    refused.report(len(records))
    return _filter(ds, spec, records, refused, stats)  # refused records have no token: dropped there


def mask_counts(ex: dict) -> dict:
    """An example's trained tokens and its runs of them (one per answer): `_filter`, `data inspect`."""
    mask = ex["loss_mask"]
    return {"trained": sum(mask), "spans": sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))}


def _filter(ds: datasets.Dataset, spec: str, records: list, refused: Malformed, stats: dict | None) -> datasets.Dataset:
    """Drop the examples with no trainable token, then account for the data step: one line (printed)
    and `stats` (recorded by the caller): records in, examples out, answers, tokens and those that
    carry loss, and every record dropped, by reason, the first ones with file:line."""
    # (records the template refused are counted as malformed already)
    empty = [records[i][0] for i, t, r in zip(ds["idx"], ds["trained"], ds["refused"]) if t <= 2 and not r]
    ds = ds.filter(lambda ex: ex["trained"] > 2)
    counts = {
        "records": len(records),
        "examples": len(ds),
        "answers": sum(ds["spans"]),
        "tokens": sum(ds["length"]),
        "loss_tokens": sum(ds["trained"]),
        "cut_at_max_length": sum(c > 0 for c in ds["cut"]),
        "tokens_cut": sum(ds["cut"]),
        "dropped": {
            "malformed": {"count": len(refused.reasons), "first": refused.reasons[:3]},
            "under_3_trained_tokens": {"count": len(empty), "first": empty[:3]},
        },
    }
    if stats is not None:
        stats.update(counts)
    print(account_line(spec, counts), file=sys.stderr)
    if len(ds) == 0:
        raise DraftsmithError(
            f"{spec}: no examples left after filtering (need assistant tokens within data.max_length)"
        )
    return ds.remove_columns(["trained", "spans", "cut", "refused"])


def account_line(spec: str, c: dict) -> str:
    """`data.jsonl: 48 records -> 46 examples (52 answers), 9,120 tokens, 3,004 with loss; dropped ...`:
    the data step's accounting (`_filter`) in one line."""
    line = (
        f"{spec}: {c['records']} records -> {c['examples']} examples ({c['answers']} answers), "
        f"{c['tokens']:,} tokens, {c['loss_tokens']:,} with loss"
    )
    if c["cut_at_max_length"]:
        line += f"; {c['cut_at_max_length']} cut at data.max_length ({c['tokens_cut']:,} tokens)"
    bad, empty = c["dropped"]["malformed"], c["dropped"]["under_3_trained_tokens"]
    dropped = [f"{bad['count']} malformed"] if bad["count"] else []
    if empty["count"]:
        first = ", ".join(empty["first"]) + (", ..." if empty["count"] > len(empty["first"]) else "")
        dropped.append(f"{empty['count']} with fewer than 3 trained tokens within data.max_length ({first})")
    return line + (f"; dropped {' and '.join(dropped)}" if dropped else "; nothing dropped")


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
        order = [
            i for s in range(0, len(order), window) for i in sorted(order[s : s + window], key=lambda i: -lengths[i])
        ]
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
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
