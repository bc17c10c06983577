"""`draftsmith data inspect`: one training example token by token, its loss mask coloured."""

import json
import re

import pytest

from draftsmith.cli import main
from tests.conftest import make_tokenizer, save_target
from tests.templates import GENERATION_MARKED, QWEN3_LIKE

CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello!"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "ok"},
]


def _inspect(tmp_path, capsys, template, *args):
    target = save_target(tmp_path / "target", chat_template=template)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("run: inspect\n")
    capsys.readouterr()  # only what the command prints
    return main(["data", "inspect", str(recipe), f"target={target}", f"data.train={data}", *args]), data


def test_inspect_prints_the_tokens_and_which_are_trained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich colours even into a pipe: the styles are checked
    rc, data = _inspect(tmp_path, capsys, GENERATION_MARKED)
    out = capsys.readouterr().out
    assert rc == 0
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello!<|im_end|>\n" in plain
    tok = make_tokenizer(GENERATION_MARKED)
    total = len(tok.apply_chat_template(CHAT, tokenize=True, return_dict=False))
    assert plain.strip().splitlines()[-1] == (
        f"{data}:1: {total} tokens, 10 trained in 2 spans, {total - 10} masked; loss mask from generation markers"
    )
    # Every token of the rendering is styled: the trained ones bold green, the others dim.
    body = [line for line in out.splitlines()[:-1] if "\x1b[" in line]
    segments = [seg for line in body for seg in re.findall(r"\x1b\[([0-9;]*)m(.*?)\x1b\[0m", line)]
    assert "".join(text for _, text in segments) == "".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in body)
    assert {style for style, _ in segments} == {"1;32", "2"}
    assert "".join(text for style, text in segments if style == "1;32") == "hello!<|im_end|>ok<|im_end|>"


def test_inspect_explains_a_refused_record(tmp_path, capsys):
    rc, data = _inspect(tmp_path, capsys, QWEN3_LIKE)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith(f"draftsmith: error: {data}:1: the chat template renders turn 1 (assistant) differently")
    assert err[0].endswith("(data.malformed=skip: training skips such a record)")


@pytest.mark.parametrize("index", ["1", "-1"])
def test_inspect_index_out_of_range(tmp_path, capsys, index):
    rc, data = _inspect(tmp_path, capsys, GENERATION_MARKED, "--index", index)
    assert rc == 1
    assert f"data inspect: --index {index}, but {data} has 1 records" in capsys.readouterr().err
