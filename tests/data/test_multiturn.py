"""Multi-turn regeneration: every assistant turn of a conversation is answered by the target, in
order, each prompt holding the target's own earlier answers; the record keeps the exact ids, and the
loss covers exactly those answers."""

import json
import re

import pytest
import torch

from draftsmith.data.batching import build_dataset
from draftsmith.data.load import answer_points, encode_prompt, tokenized_example
from draftsmith.data.regenerate import _done_ids, regenerate
from draftsmith.target.load import ensure_pad, eos_ids

U, A, S = "user", "assistant", "system"
CONVERSATIONS = [
    [(U, "abc"), (A, "not the target's"), (U, "cfi"), (A, "nor this"), (U, "dhl"), (A, "bye")],
    [(S, "be brief"), (U, "bcd")],  # no answer in the data: the target answers at the end
    [(U, "egi"), (A, "ok"), (U, "xyz")],  # a trailing user turn: answered too
]
# Real Qwen3 with thinking off: the generation prompt opens an empty think block, which the template
# leaves out when it renders earlier assistant turns, so a prompt never starts with the previous
# prompt + answer: every answer becomes a record line of its own.
NO_PREFIX = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


def _write(path, conversations=CONVERSATIONS):
    rows = [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in conversations]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _greedy(target, tok, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    answer, eos = out[0, len(prompt) :].tolist(), eos_ids(target, tok)
    return answer[: next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))]


def _reference(target, tok, conversation, n: int, turns: str = "all") -> list[tuple[list[int], list[int]]]:
    """Turn by turn, one prompt at a time: (prompt ids, the target's greedy answer) per answer point."""
    msgs, pairs = [{"role": r, "content": c} for r, c in conversation], []
    for at in answer_points(msgs, turns):
        prompt = encode_prompt(tok, msgs[:at])
        answer = _greedy(target, tok, prompt, n)
        pairs.append((prompt, answer))
        reply = {"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)}
        msgs[at : at + 1] = [reply]
    return pairs


def _pairs(rows: list[dict]) -> dict[int, list[tuple[list[int], list[int]]]]:
    """(whole prompt ids, answer ids) of every answer in the records, rebuilt from each line's turns."""
    out = {}
    for row in rows:
        tokens = []
        for turn in row.get("turns", [row]):
            tokens += turn["prompt_ids"]
            out.setdefault(row["id"], []).append((list(tokens), turn["completion_ids"]))
            tokens += turn["completion_ids"]
    return out


def _runs(joins: list[bool]) -> list[int]:
    """Answers per line: a new line at every answer that does not join the previous one."""
    runs = [1]
    for j in joins:
        runs[-1:] = [runs[-1] + 1] if j else [runs[-1], 1]
    return runs


def test_answer_points():
    msgs = [{"role": r, "content": ""} for r in (S, U, A, U, A, U)]
    assert answer_points(msgs, "all") == [2, 4, 6]  # every assistant turn, then after the trailing user turn
    assert answer_points(msgs, "last") == [4]  # the last assistant turn (eval's prompt); what follows is dropped
    assert answer_points(msgs[:5], "all") == [2, 4] and answer_points(msgs[:2], "all") == [2]
    with pytest.raises(Exception, match="data.turns: expected all or last, got 'both'"):
        answer_points(msgs, "both")


@pytest.mark.fp32_exact
@pytest.mark.parametrize("template", ["chatml", "no-prefix"])
def test_every_turn_is_answered_in_order_with_the_targets_own_answers(tiny_target, tmp_path, template):
    from tokenizers import decoders

    target, tok = tiny_target
    ensure_pad(tok)
    # Decoded text re-reads as the same tokens, as with real BPE tokenizers (the test tokenizer's
    # default decoder puts a space between characters).
    tok.backend_tokenizer.decoder = decoders.Fuse()
    if template == "no-prefix":
        tok.chat_template = NO_PREFIX
    out = regenerate(target, tok, _write(tmp_path / "chats.jsonl"), tmp_path / "regen.jsonl", 4, 8, turns="all")
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    got, ref = _pairs(rows), {i: _reference(target, tok, conv, 8) for i, conv in enumerate(CONVERSATIONS)}
    # Batched turn by turn across conversations, the answers are the one-prompt-at-a-time reference's.
    assert got == ref
    # An answer joins the previous one's sequence exactly when its prompt starts with everything read
    # and written so far (the template re-renders an answer as its tokens); else a new line starts.
    joins = {i: [p[: len(q) + len(a)] == q + a for (q, a), (p, _) in zip(pairs, pairs[1:])] for i, pairs in ref.items()}
    assert [len(r.get("turns", [r])) for r in rows] == [n for i in ref for n in _runs(joins[i])] and all(
        r.get("parts", 1) == 1 + joins[r["id"]].count(False) for r in rows
    )
    if template == "chatml":  # this template re-renders the random target's answers token for token
        assert joins[0] == [True, True] and joins[2] == [True]
    else:  # never: a line per answer, numbered, so that a resume can tell a whole conversation
        assert not any(any(j) for j in joins.values())
        assert [(r["id"], r.get("part"), r.get("parts")) for r in rows][:3] == [(0, 0, 3), (0, 1, 3), (0, 2, 3)]
    # Training reads those ids verbatim, the loss on the answers and nowhere else.
    ds = build_dataset(str(out), tok, max_length=10_000)
    assert len(ds) == sum(sum(len(c) for _, c in _pairs([r])[r["id"]]) > 2 for r in rows)  # (<= 2: dropped)
    for ex in ds:
        row, expect = rows[ex["idx"]], []
        for turn in row.get("turns", [row]):
            expect += [0] * len(turn["prompt_ids"]) + [1] * len(turn["completion_ids"])
        assert ex["loss_mask"] == expect
    # The record's messages are the conversation with the target's answers, through its last one.
    assert rows[0]["messages"][1]["content"] == tok.decode(got[0][0][1], skip_special_tokens=True)


@pytest.mark.fp32_exact
def test_last_answers_the_last_assistant_turn_only(tiny_target, tmp_path):
    target, tok = tiny_target
    ensure_pad(tok)
    out = regenerate(target, tok, _write(tmp_path / "chats.jsonl"), tmp_path / "regen.jsonl", 4, 8, turns="last")
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert all("turns" not in r for r in rows)  # one answer: the single-turn record, as before
    assert _pairs(rows) == {i: _reference(target, tok, conv, 8, "last") for i, conv in enumerate(CONVERSATIONS)}


def test_a_conversation_cut_by_an_interruption_is_answered_again(tmp_path):
    partial = tmp_path / "regen.jsonl.partial"
    lines = [
        {"id": 3, "prompt_ids": [1], "completion_ids": [2]},
        {"id": 0, "part": 0, "parts": 2, "turns": []},
        {"id": 0, "part": 1, "parts": 2, "turns": []},
        {"id": 5, "part": 0, "parts": 2, "turns": []},  # its second line never made it to disk
    ]
    partial.write_text("".join(json.dumps(l) + "\n" for l in lines) + '{"id": 7, "prom')
    assert _done_ids(partial) == {0, 3}
    assert [json.loads(l)["id"] for l in partial.read_text().splitlines()] == [3, 0, 0]


def test_a_turns_record_is_one_sequence_and_bad_ids_are_one_line(tmp_path):
    row = {"turns": [{"prompt_ids": [1, 2], "completion_ids": [3]}, {"prompt_ids": [4], "completion_ids": [5, 6]}]}
    ex = tokenized_example(row, 10, 100, "f.jsonl:1")
    assert ex["input_ids"] == [1, 2, 3, 4, 5, 6] and ex["loss_mask"] == [0, 0, 1, 0, 1, 1]
    with pytest.raises(Exception, match=r"f.jsonl:1: 'completion_ids' must be a list of token ids in \[0, 10\)"):
        tokenized_example({"turns": [{"prompt_ids": [1], "completion_ids": [12]}]}, 10, 100, "f.jsonl:1")


# Qwen3's switch: with enable_thinking false the generation prompt opens an empty think block (and,
# as Qwen3's, the last assistant turn of a whole conversation renders one).
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.mark.fp32_exact
def test_thinking_mode_renders_the_prompts_and_is_recorded(tiny_target, tmp_path):
    from draftsmith.data.load import thinking_kwargs

    target, tok = tiny_target
    ensure_pad(tok)
    tok.chat_template = THINKING
    chat = [{"role": "user", "content": "abc"}]
    on, off = encode_prompt(tok, chat, thinking_kwargs("on")), encode_prompt(tok, chat, thinking_kwargs("off"))
    assert (
        encode_prompt(tok, chat) == on
        and off[: len(on)] == on
        and tok.decode(off[len(on) :]).replace(" ", "") == ("<think>\n\n</think>\n\n".replace(" ", ""))
    )
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": chat}, {"messages": chat, "enable_thinking": True}]  # the record's own switch wins
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = regenerate(target, tok, str(data), tmp_path / "regen.jsonl", 4, 6, chat=thinking_kwargs("off"))
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["prompt_ids"] for r in got] == [off, on]
    assert [r["chat_template_kwargs"] for r in got] == [{"enable_thinking": False}, {"enable_thinking": True}]
    assert got[0]["sampling"] == {"temperature": 0.0, "top_p": 1.0}  # what the eval compares its decoding with
    # Training on the dataset's own answers renders them with the same switches: the prompt (the
    # empty think block included, with thinking off) is masked, the answer trained.
    answered = [{**r, "messages": chat + [{"role": "assistant", "content": "xyz"}]} for r in rows]
    data.write_text("".join(json.dumps(r) + "\n" for r in answered))
    ds = build_dataset(str(data), tok, 100, chat=thinking_kwargs("off"))
    for ex, prompt in zip(ds, [off, on]):
        assert ex["input_ids"][: len(prompt)] == prompt and ex["loss_mask"].index(1) == len(prompt)


def test_a_bad_thinking_switch_is_one_line(tmp_path):
    from draftsmith import DraftsmithError
    from draftsmith.data.load import chat_kwargs
    from draftsmith.train.config import load_config

    assert load_config(None, ["data.thinking=off"]).eval.thinking == "off"  # the eval renders as training did
    assert load_config(None, ["data.thinking=off", "eval.thinking=on"]).eval.thinking == "on"
    with pytest.raises(DraftsmithError, match=r"data.thinking: expected on, off or empty .*, got 'maybe'"):
        load_config(None, ["data.thinking=maybe"])
    with pytest.raises(DraftsmithError, match=r"f.jsonl:3: 'enable_thinking' must be true or false, got 'yes'"):
        chat_kwargs({"enable_thinking": "yes"}, {}, "f.jsonl:3")


# Tool use as templates render it: the offered functions in a system header, an assistant turn's
# calls as <tool_call> blocks, a tool's result as a turn of its own.
TOOLS = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_RECORD = {
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
    "messages": [
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "it is 42"},
    ],
}


def test_tool_calls_are_trained_and_tool_results_are_kept_verbatim(tiny_target, tmp_path):
    from tokenizers import decoders

    target, tok = tiny_target
    ensure_pad(tok)
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.chat_template = TOOLS
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(TOOL_RECORD) + "\n")
    # The dataset's own turns: the call and the final answer are trained, the tool's result is not.
    ex = build_dataset(str(data), tok, 1000)[0]
    text = lambda ids: tok.decode(ids)  # noqa: E731
    trained = text([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    assert text(ex["input_ids"]).startswith("<|im_start|>system\nadd;<|im_end|>")  # the offered tools, rendered
    assert trained == "<tool_call>add</tool_call><|im_end|>\nit is 42<|im_end|>\n"
    # Regenerated: both assistant turns are the target's; the tool's result stays as it was.
    out = regenerate(target, tok, str(data), tmp_path / "regen.jsonl", 4, 6)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert rows[0]["messages"][2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert rows[0]["chat_template_kwargs"] == {"tools": TOOL_RECORD["tools"]}
    pairs = [p for r in rows for p in _pairs([r])[0]]
    assert len(pairs) == 2 and "<|im_start|>tool\n42<|im_end|>" in text(pairs[1][0])


USER, RESULT, ANSWER = TOOL_RECORD["messages"][0], TOOL_RECORD["messages"][2], TOOL_RECORD["messages"][3]
BAD_TOOL_USE = {
    "arguments that are not JSON": (
        [USER, {**TOOL_RECORD["messages"][1], "tool_calls": [{"function": {"name": "add", "arguments": "{not json"}}]}]
        + [RESULT, ANSWER],
        "'messages' turn 1 (assistant), tool call 0: 'arguments' are not JSON (Expecting property name enclosed in "
        "double quotes), got '{not json'",
    ),
    "a tool result that answers no call": (
        [USER, RESULT, ANSWER],
        "'messages' turn 1 is a tool result, but no assistant turn with 'tool_calls' comes before it",
    ),
}


def test_malformed_tool_use_is_skipped_or_stops_regeneration(tiny_target, tmp_path, capsys):
    """Both once went through `data regenerate` (exit 0, the record written); now they are malformed
    records like any other: skipped with file:line (data.malformed=skip), or the first stops it (error)."""
    from draftsmith import DraftsmithError

    target, tok = tiny_target
    ensure_pad(tok)
    tok.chat_template = TOOLS
    data = tmp_path / "tools.jsonl"
    rows = [TOOL_RECORD] + [{"tools": TOOL_RECORD["tools"], "messages": m} for m, _ in BAD_TOOL_USE.values()]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = regenerate(target, tok, str(data), tmp_path / "regen.jsonl", 4, 4)
    assert {json.loads(l)["id"] for l in out.read_text().splitlines()} == {0}  # the well-formed conversation only
    (first, why_first), (second, why_second) = BAD_TOOL_USE.values()
    assert f"{data}: skipped 2 of 3 malformed records ({data}:2: {why_first}; {data}:3: {why_second})" in (
        capsys.readouterr().err
    )
    for n, (messages, why) in enumerate(BAD_TOOL_USE.values()):
        bad = tmp_path / f"bad{n}.jsonl"
        bad.write_text(json.dumps(TOOL_RECORD) + "\n" + json.dumps({"messages": messages}) + "\n")
        with pytest.raises(DraftsmithError, match=rf"^{re.escape(f'{bad}:2: {why}')}$"):
            regenerate(target, tok, str(bad), tmp_path / f"regen{n}.jsonl", 4, 4, malformed="error")
        assert not (tmp_path / f"regen{n}.jsonl").exists()


def test_every_data_step_accounts_for_what_went_in_and_what_was_dropped(tiny_target, tiny_target_dir, tmp_path, capsys):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    target, tok = tiny_target
    ensure_pad(tok)
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
        {"messages": [{"role": "user", "content": "a question with no answer"}]},  # nothing to train
        {"messages": "not a list"},  # malformed
        {"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": "x" * 200}]},  # cut
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = {}
    build_dataset(str(data), tok, 64, stats=stats)
    assert {k: stats[k] for k in ("records", "examples", "answers", "cut_at_max_length")} == {
        "records": 4,
        "examples": 2,
        "answers": 2,
        "cut_at_max_length": 1,
    }
    assert stats["dropped"]["malformed"]["count"] == 1 and f"{data}:3" in stats["dropped"]["malformed"]["first"][0]
    assert stats["dropped"]["under_3_trained_tokens"] == {"count": 1, "first": [f"{data}:2"]}
    assert 0 < stats["loss_tokens"] < stats["tokens"] and stats["tokens_cut"] > 0
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith(f"{data}: 4 records")][0]
    assert (
        "-> 2 examples (2 answers)" in line
        and f"1 with fewer than 3 trained tokens within data.max_length ({data}:2)" in line
    )
    # A training run records both steps, regeneration's included, in RUN/data.json.
    chats = _write(tmp_path / "chats.jsonl")
    run = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chats,
                tmp_path,
                **{"optim.max_steps": 1, "data.regenerate": True, "data.regenerate_max_new_tokens": 8},
            ),
        )
    )
    recorded = json.loads((run / "data.json").read_text())
    assert recorded["regenerated"]["conversations"] == 3 and recorded["regenerated"]["answers"] == 6
    assert recorded["dataset"]["records"] == recorded["regenerated"]["lines"]


def test_eval_renders_its_prompts_in_the_thinking_mode_asked_and_says_so(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.cli import main

    for mode, said in (("off", "off"), ("", "template default")):
        out = tmp_path / f"eval-{mode or 'default'}"
        args = ["eval", "--drafter", "none", "--data", str(chat_jsonl), "--target", str(tiny_target_dir)]
        assert main([*args, "--num-prompts", "1", "--max-new-tokens", "4", "--thinking", mode, "--out", str(out)]) == 0
        assert json.loads((out / "report.json").read_text())["thinking"] == said
        assert f"chat template thinking mode: {said}." in (out / "report.md").read_text()
