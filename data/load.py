"""Read training/holdout records in any format design.md lists and tokenize them with the
target's chat template, masking the loss to assistant tokens."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith import DraftsmithError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path}:{n}: malformed JSON line ({e.msg})") from None
            if not isinstance(row, dict):
                raise DraftsmithError(f"{path}:{n}: expected a JSON object per line")
            rows.append(row)
    return rows


def read_records(spec: str) -> list[dict]:
    """A jsonl/json/parquet path, `builtin:<name>`, or a `datasets` hub name (train split)."""
    if spec.startswith("builtin:"):
        from draftsmith.data.corpus import builtin_corpus

        return builtin_corpus(spec.removeprefix("builtin:"))
    path = Path(spec)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise DraftsmithError(f"{path}: data file not found")
        return _read_jsonl(path)
    import datasets

    try:
        if path.suffix in (".json", ".parquet"):
            if not path.is_file():
                raise DraftsmithError(f"{path}: data file not found")
            kind = "json" if path.suffix == ".json" else "parquet"
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(spec, split="train")  # a hub name; needs network
    except DraftsmithError:
        raise
    except Exception as e:
        raise DraftsmithError(f"{spec}: cannot load data ({str(e).splitlines()[0]})") from None
    return list(ds)


def to_messages(row: dict, where: str) -> list[dict] | str:
    """Normalise one record to OpenAI-style messages, or plain text for `text` records."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise DraftsmithError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if "conversations" in row:
        out = []
        for m in row["conversations"]:
            role = SHAREGPT_ROLES.get(str(m.get("from", "")).lower())
            if role is None or "value" not in m:
                raise DraftsmithError(f"{where}: ShareGPT turn needs 'from' (human/gpt/system) and 'value', got {m}")
            out.append({"role": role, "content": m["value"]})
        return out
    if "prompt" in row:
        msgs = [{"role": "user", "content": row["prompt"]}]
        if row.get("completion") is not None:
            msgs.append({"role": "assistant", "content": row["completion"]})
        return msgs
    if "text" in row:
        return str(row["text"])
    raise DraftsmithError(f"{where}: expected one of 'messages', 'conversations', 'prompt'(+'completion') or 'text', got keys {sorted(row)}")


def prompt_messages(msgs: list[dict]) -> list[dict]:
    """The conversation up to (not including) the last assistant turn: what eval/regenerate answer."""
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
    return msgs[:last]


def _template_ids(tok, msgs: list[dict], add_generation_prompt: bool) -> list[int]:
    return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=add_generation_prompt,
                                   return_dict=False)


def require_chat_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DraftsmithError(f"{where}: chat data needs a chat template, but the target's tokenizer has none")


def tokenize_example(tok, item: list[dict] | str, max_length: int, where: str) -> dict:
    """-> {input_ids, loss_mask}; loss_mask is 1 on assistant tokens (all tokens for plain text).

    Assistant spans are found by rendering growing prefixes of the conversation: the tokens a turn
    adds beyond `template(prefix, add_generation_prompt=True)` are that assistant turn's tokens.
    """
    if isinstance(item, str):
        ids = tok(item, add_special_tokens=True)["input_ids"][:max_length]
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    require_chat_template(tok, where)
    ids = _template_ids(tok, item, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i, m in enumerate(item):
        if m["role"] != "assistant":
            continue
        start = len(_template_ids(tok, item[:i], add_generation_prompt=True))
        end = len(_template_ids(tok, item[: i + 1], add_generation_prompt=False))
        mask[start:end] = [1] * (end - start)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def tokenized_example(row: dict, vocab: int, max_length: int, where: str) -> dict:
    """A record that already holds the exact tokens (`data regenerate` writes `prompt_ids` +
    `completion_ids`): used verbatim, never re-tokenized; loss on the completion only."""
    ids = {}
    for key in ("prompt_ids", "completion_ids"):
        value = row.get(key)
        if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in value):
            raise DraftsmithError(f"{where}: '{key}' must be a list of token ids in [0, {vocab}) for this target")
        ids[key] = value
    input_ids = (ids["prompt_ids"] + ids["completion_ids"])[:max_length]
    mask = ([0] * len(ids["prompt_ids"]) + [1] * len(ids["completion_ids"]))[:max_length]
    return {"input_ids": input_ids, "loss_mask": mask, "length": len(input_ids)}


def load_prompts(spec: str, max_prompts: int = 0) -> list[list[dict] | str]:
    """Prompts of a holdout: chat records lose their last assistant turn; text records are kept."""
    out = []
    for n, row in enumerate(read_records(spec)):
        item = to_messages(row, f"{spec}: record {n}")
        out.append(item if isinstance(item, str) else prompt_messages(item))
        if max_prompts and len(out) >= max_prompts:
            break
    if not out:
        raise DraftsmithError(f"{spec}: holdout has no prompts")
    return out


def encode_prompt(tok, item: list[dict] | str) -> list[int]:
    if isinstance(item, str):
        return tok(item, add_special_tokens=True)["input_ids"]
    require_chat_template(tok, "prompt")
    return _template_ids(tok, item, add_generation_prompt=True)
