"""`draftsmith data inspect`: one training example printed token by token, its loss mask coloured
(trained tokens bold green, masked dim), as training would build it from the recipe's data."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text
from transformers import AutoTokenizer

from draftsmith import DraftsmithError
from draftsmith.data.batching import mask_counts
from draftsmith.data.load import encode_record, located_records, thinking_kwargs
from draftsmith.target.load import resolve_target


def encoded_example(
    spec: str, split: str, index: int, target: str, cache_dir: str, max_length: int, malformed: str, thinking: str = ""
) -> tuple[str, dict, str, object]:
    """(file:line, the encoded example, how its loss mask was found, the tokenizer) of record `index`
    of `spec`, rendered with the recipe's thinking mode: the target's tokenizer only, no weights."""
    records = located_records(spec, split)
    if not 0 <= index < len(records):
        raise DraftsmithError(f"data inspect: --index {index}, but {spec} has {len(records)} records")
    try:
        tok = AutoTokenizer.from_pretrained(resolve_target(target, cache_dir))
    except OSError as e:
        raise DraftsmithError(f"target '{target}': cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    where, row = records[index]
    try:
        if isinstance(row, DraftsmithError):
            raise row
        ex, method = encode_record(tok, row, max_length, where, thinking_kwargs(thinking))
    except DraftsmithError as e:  # why, then what training does with such a record
        raise DraftsmithError(
            f"{e} (data.malformed={malformed}: training {'skips' if malformed == 'skip' else 'stops at'} such a record)"
        ) from None
    return where, ex, method, tok


def print_example(where: str, ex: dict, method: str, tok) -> None:
    """The tokens, coloured by the loss mask, then one line counting them."""
    text = Text()
    for token, trained in zip(ex["input_ids"], ex["loss_mask"]):
        text.append(tok.decode([token]), style="bold green" if trained else "dim")
    # Spans of trained tokens: one per answer (a multi-turn record trains every regenerated turn).
    counts = mask_counts(ex)
    trained, spans = counts["trained"], counts["spans"]
    dropped = "; training drops it (no assistant tokens within data.max_length)" if trained <= 2 else ""
    console = Console()
    console.print(text, soft_wrap=True)
    console.print(
        Text.assemble(
            f"{where}: {len(ex['input_ids'])} tokens, ",
            (f"{trained} trained in {spans} span{'s' * (spans != 1)}", "bold green"),
            ", ",
            (f"{len(ex['input_ids']) - trained} masked", "dim"),
            f"; loss mask from {method}{dropped}",
        ),
        soft_wrap=True,
    )
