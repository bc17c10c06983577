"""Read training/holdout records in any format design.md lists and tokenize them with the
target's chat template, masking the loss to assistant tokens."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.data.bench import bench_records, refuse_unanswered
from draftsmith.data.corpus import builtin_corpus

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# What transformers looks for to track assistant spans (`return_assistant_tokens_mask`).
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Malformed:
    """The records refused as malformed (`data.malformed`): `error` raises at the first; `skip` drops
    them, and `report` prints one line with their count and the first reasons (each with file:line)."""

    def __init__(self, spec: str, mode: str = "skip"):
        if mode not in ("skip", "error"):
            raise DraftsmithError(f"data.malformed: expected skip or error, got {mode!r}")
        self.spec, self.mode = spec, mode
        self.reasons: list[str] = []

    def refuse(self, reason: str) -> None:
        if self.mode == "error":
            raise DraftsmithError(reason)
        self.reasons.append(reason)

    def keep(self, convert, row: dict | DraftsmithError, where: str):
        """convert(row, where), or None for a malformed record (refused)."""
        try:
            if isinstance(row, DraftsmithError):  # a line that is no JSON object (located_records)
                raise row
            return convert(row, where)
        except DraftsmithError as e:
            self.refuse(str(e))
            return None

    def report(self, total: int) -> None:
        """After `total` records: one line about the skipped ones; an error if none was usable."""
        if not self.reasons:
            return
        first = "; ".join(self.reasons[:3])
        if len(self.reasons) == total:
            raise DraftsmithError(f"{self.spec}: all {total} records are malformed ({first})")
        print(f"{self.spec}: skipped {len(self.reasons)} of {total} malformed records ({first})", file=sys.stderr)


def _read_jsonl(path: Path) -> list[tuple[str, dict | DraftsmithError]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = DraftsmithError(f"{where}: malformed JSON line ({e.msg})")
            if not isinstance(row, (dict, DraftsmithError)):
                row = DraftsmithError(f"{where}: expected a JSON object per line")
            rows.append((where, row))
    return rows


def _load_dataset(spec: str, split: str):
    import datasets

    path = Path(spec)
    try:
        if path.suffix in (".json", ".parquet"):
            if not path.is_file():
                raise DraftsmithError(f"{path}: data file not found")
            kind = "json" if path.suffix == ".json" else "parquet"
            return datasets.load_dataset(kind, data_files=str(path), split="train")
        return datasets.load_dataset(spec, split=split)  # a dataset folder, or a hub name (needs network)
    except DraftsmithError:
        raise
    except Exception as e:
        # datasets says `Unknown split "x". Should be one of ['train_sft', ...]`: hub chat datasets
        # often have no `train` split (ultrachat_200k: train_sft / test_sft).
        known = re.search(r"Unknown split .*Should be one of \[(.*)\]", str(e))
        if known:
            raise DraftsmithError(
                f"{spec}: no split {split!r} (data.split / data.holdout_split); its splits are "
                f"{known.group(1).replace(chr(39), '')}"
            ) from None
        raise DraftsmithError(f"{spec}: cannot load data ({str(e).splitlines()[0]})") from None


def joined_sources(spec: str, where: str = "") -> list[str]:
    """The sources of `A+B+...` in order (a file whose name holds a '+' is that one file); an empty
    one (`builtin:code+`, `a++b`) is an error naming it (`where`: the recipe key, e.g. data.train)."""
    if "+" not in spec or Path(spec).exists():
        return [spec]
    parts = [part.strip() for part in spec.split("+")]
    empty = next((i for i, part in enumerate(parts) if not part), None)
    if empty is not None:
        at = "before '+'" if empty == 0 else "after '+'"
        raise DraftsmithError(f"{where + ': ' if where else ''}{spec!r} has an empty part {at}")
    return parts


def located_records(spec: str, split: str = "train") -> list[tuple[str, dict | DraftsmithError]]:
    """Every record of `spec` with where it is: `file:line` in a jsonl file, `spec: record N`
    otherwise. A jsonl line that is no JSON object comes as the error saying so, for the caller to
    skip or raise (`Malformed`). `split`: as in `read_records`.
    `A+B+...` (no such file): the records of each source in that order, so a recipe mixes domains
    (`data.max_examples` then cuts the joined list: put the sources to keep whole first)."""
    parts = joined_sources(spec)
    if len(parts) > 1:
        return [row for part in parts for row in located_records(part, split)]
    if spec.startswith("builtin:"):
        rows = builtin_corpus(spec.removeprefix("builtin:"))
    elif spec.startswith("bench:"):  # a standard benchmark (data/bench.py); it fixes its own split
        rows = bench_records(spec.removeprefix("bench:"))
    elif Path(spec).suffix == ".jsonl":
        if not Path(spec).is_file():
            raise DraftsmithError(f"{spec}: data file not found")
        return _read_jsonl(Path(spec))
    else:
        rows = _load_dataset(spec, split)
    return [(f"{spec}: record {n}", row) for n, row in enumerate(rows)]


def read_records(spec: str, split: str = "train") -> list[dict]:
    """A jsonl/json/parquet file, `builtin:<name>`, `bench:<name>` (data/bench.py), or what
    `datasets.load_dataset` reads (a dataset folder or a hub name) -> its records; a malformed jsonl
    line is an error naming file:line. `split` picks the split of a dataset folder or hub dataset. A single file and a built-in corpus
    hold one split, so it is ignored for them (a jsonl holdout serves any data.holdout_split)."""
    rows = []
    for _, row in located_records(spec, split):
        if isinstance(row, DraftsmithError):
            raise row
        rows.append(row)
    return rows


def _brief(value) -> str:
    """A value for an error message, cut short (a malformed turn may hold a whole document)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# OpenAI chat roles (`developer` is the newer name of `system`; `tool` carries a tool call's result).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _sharegpt_turn(m, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
        raise DraftsmithError(f"{where}: ShareGPT turn needs 'from' and 'value' strings, got {_brief(m)}")
    role = SHAREGPT_ROLES.get(m["from"].lower())
    if role is None:
        raise DraftsmithError(f"{where}: ShareGPT turn 'from' must be human, gpt or system, got {_brief(m['from'])}")
    return {"role": role, "content": m["value"]}


def _message(m) -> dict | None:
    """One OpenAI-style message with what chat templates read of it, or None if it is malformed: a
    string role and content, except an assistant turn that calls tools (content may then be empty)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return None
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
        return None
    content = m.get("content")
    if not isinstance(content, str) and not (calls and content is None):
        return None
    # A tool result's call id and name, and the calls themselves, are what templates render them with.
    return {"role": m["role"], "content": content or ""} | {k: m[k] for k in TOOL_KEYS if m.get(k) is not None}


def _check_tool_use(msgs: list[dict], where: str, answered: bool = False) -> None:
    """Tool use as templates render it: each call of an assistant turn names its function and carries
    its arguments as a JSON object (or the string of one, as OpenAI sends them), and a `tool` turn
    answers the calls of the assistant turn before it (other results of those calls may stand between).
    `answered`: the assistant turns were replaced by text (data regenerate), so only the calls are checked."""
    calling = False
    for n, m in enumerate(msgs):
        if m["role"] == "tool" and not calling and not answered:
            raise DraftsmithError(
                f"{where}: 'messages' turn {n} is a tool result, but no assistant turn with 'tool_calls' comes before it"
            )
        for c, call in enumerate(m.get("tool_calls", [])):
            _check_call(call, f"{where}: 'messages' turn {n} (assistant), tool call {c}")
        calling = bool(m.get("tool_calls")) or (calling and m["role"] == "tool")


def _check_call(call, where: str) -> None:
    fn = call.get("function", call) if isinstance(call, dict) else None  # OpenAI's {function: {...}}, or bare
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DraftsmithError(f"{where}: needs a function 'name', got {_brief(call)}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DraftsmithError(
                f"{where}: 'arguments' are not JSON ({e.msg}), got {_brief(fn['arguments'])}"
            ) from None
    if not isinstance(args, dict):
        raise DraftsmithError(f"{where}: 'arguments' must be a JSON object, got {_brief(fn['arguments'])}")


def to_messages(row: dict, where: str) -> list[dict] | str:
    """Normalise one record to OpenAI-style messages, or plain text for `text` records."""
    # A file mixing shapes loads (json/parquet, datasets) with every column in every row, None where absent.
    row = {k: v for k, v in row.items() if v is not None}
    if "messages" in row:
        msgs = row["messages"]
        parsed = [_message(m) for m in msgs] if isinstance(msgs, list) else []
        out = [m for m in parsed if m is not None]
        if not out or len(out) < len(parsed):
            raise DraftsmithError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} strings, got {_brief(msgs)}"
            )
        bad = next((m["role"] for m in out if m["role"] not in CHAT_ROLES), None)
        if bad is not None:  # a template would render any role it is given; the target was never trained on it
            raise DraftsmithError(f"{where}: 'messages' role must be one of {', '.join(CHAT_ROLES)}, got {_brief(bad)}")
        # A regenerated record's assistant turns are the target's answers as text, its calls inside them.
        _check_tool_use(out, where, answered="completion_ids" in row or "turns" in row)
        return out
    if "conversations" in row:
        turns = row["conversations"]
        if not turns or not isinstance(turns, list):
            raise DraftsmithError(
                f"{where}: 'conversations' must be a non-empty list of ShareGPT turns, got {_brief(turns)}"
            )
        return [_sharegpt_turn(m, where) for m in turns]
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not isinstance(row.get("completion", ""), str):
            raise DraftsmithError(f"{where}: 'prompt' (and 'completion') must be strings")
        msgs = [{"role": "user", "content": row["prompt"]}]
        if "completion" in row:
            msgs.append({"role": "assistant", "content": row["completion"]})
        return msgs
    if "text" in row:
        return str(row["text"])
    raise DraftsmithError(
        f"{where}: expected one of 'messages', 'conversations', 'prompt'(+'completion') or 'text', got keys {sorted(row)}"
    )


TURNS = ("all", "last")


def answer_points(msgs: list[dict], turns: str = "all") -> list[int]:
    """Where the target answers a conversation: indices into `msgs` at which an assistant turn stands
    (or, == len(msgs), would follow the last message). `last`: the last assistant turn only (what eval
    answers; the conversation after it is dropped); `all`: every assistant turn in order, and one more
    after a trailing user or tool turn."""
    if turns not in TURNS:
        raise DraftsmithError(f"data.turns: expected all or last, got {turns!r}")
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if turns == "last":
        return [assistant[-1] if assistant else len(msgs)]
    return assistant + ([len(msgs)] if not assistant or assistant[-1] < len(msgs) - 1 else [])


def prompt_messages(msgs: list[dict]) -> list[dict]:
    """The conversation up to (not including) the last assistant turn: what eval answers."""
    return msgs[: answer_points(msgs, "last")[0]]


def chat_kwargs(row: dict, default: dict | None, where: str) -> dict:
    """The chat template's variables for one record: the recipe's (data.thinking: {enable_thinking:
    false} for Qwen3's thinking mode off), then the record's own: `chat_template_kwargs` (as vLLM and
    SGLang requests carry them), a bare `enable_thinking`, and the `tools` a tool-calling record offers."""
    own = row.get("chat_template_kwargs") or {}
    if not isinstance(own, dict):
        raise DraftsmithError(f"{where}: 'chat_template_kwargs' must be an object, got {_brief(own)}")
    tools = row.get("tools")
    if tools is not None:  # the functions a tool-calling record offers: the template renders them
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DraftsmithError(f"{where}: 'tools' must be a list of function schemas, got {_brief(tools)}")
        own = {**own, "tools": tools}
    if row.get("enable_thinking") is not None:
        if not isinstance(row["enable_thinking"], bool):
            raise DraftsmithError(
                f"{where}: 'enable_thinking' must be true or false, got {_brief(row['enable_thinking'])}"
            )
        own = {**own, "enable_thinking": row["enable_thinking"]}
    return {**(default or {}), **own}


# YAML reads a bare on/off as true/false, which the config then holds as "true"/"false".
THINKING = {"": "", "on": "on", "true": "on", "off": "off", "false": "off"}


def thinking_switch(value: str, where: str = "thinking") -> str:
    """A recipe's thinking switch (`data.thinking`, `eval.thinking`) as on, off or "" (the default)."""
    if value not in THINKING:
        raise DraftsmithError(f"{where}: expected on, off or empty (the template's default), got {value!r}")
    return THINKING[value]


def thinking_kwargs(switch: str, where: str = "thinking") -> dict:
    """A thinking switch as chat template switches: on/off set `enable_thinking` (Qwen3-style
    templates), empty leaves the template's default."""
    switch = thinking_switch(switch, where)
    return {"enable_thinking": switch == "on"} if switch else {}


def _apply_template(tok, msgs: list[dict], where: str, chat: dict | None = None, **kwargs):
    from jinja2 import TemplateError

    try:
        # `chat`: variables the template reads (enable_thinking), passed as the engines pass them.
        return tok.apply_chat_template(msgs, tokenize=True, **(chat or {}), **kwargs)
    except TemplateError as e:  # e.g. `raise_exception('roles must alternate')` in the template
        raise DraftsmithError(f"{where}: the chat template refuses this conversation ({e})") from None


def _template_ids(
    tok, msgs: list[dict], add_generation_prompt: bool, where: str, chat: dict | None = None
) -> list[int]:
    return _apply_template(tok, msgs, where, chat, add_generation_prompt=add_generation_prompt, return_dict=False)


def require_chat_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DraftsmithError(f"{where}: chat data needs a chat template, but the target's tokenizer has none")


def marks_generations(tok) -> bool:
    """Whether the chat template marks assistant spans with {% generation %} ... {% endgeneration %}."""
    return isinstance(tok.chat_template, str) and bool(GENERATION_TAG.search(tok.chat_template))


def mask_method(tok) -> str:
    """How `tokenize_example` finds the assistant tokens of a conversation with this tokenizer."""
    return "generation markers" if marks_generations(tok) else "prefix rendering"


def tokenize_example(tok, item: list[dict] | str, max_length: int, where: str, chat: dict | None = None) -> dict:
    """-> {input_ids, loss_mask}; loss_mask is 1 on assistant tokens (all tokens for plain text).

    A template with {% generation %} markers says which tokens are the assistant's. Otherwise each
    assistant turn's span is found by rendering growing prefixes of the conversation: the tokens it
    adds beyond `template(msgs[:i], add_generation_prompt=True)`, up to `template(msgs[:i+1])`.
    `chat`: the template's switches (`chat_kwargs`).
    """
    if isinstance(item, str):
        ids = tok(item, add_special_tokens=True)["input_ids"]
        return {"input_ids": ids[:max_length], "loss_mask": [1] * len(ids[:max_length]), "cut": _cut(ids, max_length)}
    require_chat_template(tok, where)
    if marks_generations(tok):
        out = _apply_template(tok, item, where, chat, return_dict=True, return_assistant_tokens_mask=True)
        ids = out["input_ids"]
        return {
            "input_ids": ids[:max_length],
            "loss_mask": out["assistant_masks"][:max_length],
            "cut": _cut(ids, max_length),
        }
    ids = _template_ids(tok, item, False, where, chat)
    mask = [0] * len(ids)
    for i, m in enumerate(item):
        if m["role"] != "assistant":
            continue
        before = _template_ids(tok, item[:i], True, where, chat)
        through = _template_ids(tok, item[: i + 1], False, where, chat)
        # Prefix spans are right only if the full rendering starts with both prefixes. Templates that
        # render a turn by its position break that: Qwen3's adds an empty <think></think> block to
        # the last assistant turn only, so `through` (turn i last) holds tokens the full rendering
        # has not, and its length would reach into the next turn's header. Refuse the record rather
        # than train on a shifted mask.
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise DraftsmithError(
                f"{where}: the chat template renders turn {i} (assistant) differently once later turns follow, "
                "so its loss mask cannot be found from prefix renderings; a chat template with "
                "{% generation %} markers avoids this"
            )
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "cut": _cut(ids, max_length)}


def _cut(ids: list[int], max_length: int) -> int:
    """How many tokens data.max_length cuts off an example (counted in the data accounting)."""
    return max(0, len(ids) - max_length)


def _token_ids(value, key: str, vocab: int, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in value):
        raise DraftsmithError(f"{where}: '{key}' must be a list of token ids in [0, {vocab}) for this target")
    return value


def tokenized_example(row: dict, vocab: int, max_length: int, where: str) -> dict:
    """A record that already holds the exact tokens, used verbatim and never re-tokenized; loss on
    the target's answers only. `data regenerate` writes `prompt_ids` + `completion_ids` for one
    answer, and for several answers in one sequence `turns`: [{prompt_ids, completion_ids}, ...],
    where each later `prompt_ids` holds the tokens the chat template puts between the previous answer
    and this one (the end of that turn, the next user or tool turn, the assistant header)."""
    turns = row.get("turns", [row])
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise DraftsmithError(f"{where}: 'turns' must be a non-empty list of {{prompt_ids, completion_ids}}")
    input_ids, mask = [], []
    for t in turns:
        prompt = _token_ids(t.get("prompt_ids"), "prompt_ids", vocab, where)
        completion = _token_ids(t.get("completion_ids"), "completion_ids", vocab, where)
        input_ids += prompt + completion
        mask += [0] * len(prompt) + [1] * len(completion)
    return {
        "input_ids": input_ids[:max_length],
        "loss_mask": mask[:max_length],
        "length": min(len(input_ids), max_length),
        "cut": _cut(input_ids, max_length),
    }


def encode_record(tok, row: dict, max_length: int, where: str, chat: dict | None = None) -> tuple[dict, str]:
    """One record as training tokenizes it, and what its loss mask comes from (`data inspect`);
    `chat`: the chat template's switches from the recipe (data.thinking)."""
    if "completion_ids" in row or "turns" in row:
        spans = len(row.get("turns", [row]))
        source = f"the record's completion_ids ({spans} answer{'s' * (spans != 1)})"
        return tokenized_example(row, len(tok), max_length, where), source
    item = to_messages(row, where)
    if isinstance(item, str):
        return tokenize_example(tok, item, max_length, where), "plain text (every token trained)"
    return tokenize_example(tok, item, max_length, where, chat_kwargs(row, chat, where)), mask_method(tok)


def load_conversations(
    spec: str, max_records: int = 0, split: str = "train", malformed: str = "skip", chat: dict | None = None
) -> list[tuple[list[dict] | str, dict]]:
    """Every usable record of `spec` as messages (or plain text), with its chat template switches
    (`chat_kwargs`, over the recipe's `chat`). Malformed records are skipped with one summary line, or
    with malformed="error" stop at the first."""
    refused, out, read = Malformed(spec, malformed), [], 0
    for where, row in located_records(spec, split):
        read += 1
        item = refused.keep(lambda r, w: (to_messages(r, w), chat_kwargs(r, chat, w)), row, where)
        if item is not None:
            out.append(item)
        if max_records and len(out) >= max_records:
            break
    refused.report(read)
    if not out:
        raise DraftsmithError(f"{spec}: no prompts in the data")
    return out


def load_prompts(
    spec: str, max_prompts: int = 0, split: str = "train", malformed: str = "skip"
) -> list[list[dict] | str]:
    """Prompts of a holdout: chat records lose their last assistant turn (and what follows it); text
    records are kept. Malformed records as in `load_conversations`."""
    for part in joined_sources(spec):
        refuse_unanswered(part)  # bench:mt-bench-2turn: the target answers turn 1 first (data regenerate)
    return [
        c if isinstance(c, str) else prompt_messages(c)
        for c, _ in load_conversations(spec, max_prompts, split, malformed)
    ]


def encode_prompt(tok, item: list[dict] | str, chat: dict | None = None) -> list[int]:
    """A prompt's ids as an engine renders it: the chat template (with its switches `chat`) and the
    assistant header after it; plain text as the tokenizer encodes it."""
    if isinstance(item, str):
        return tok(item, add_special_tokens=True)["input_ids"]
    require_chat_template(tok, "prompt")
    return _template_ids(tok, item, True, "prompt", chat)
