import json
import re

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.batching import build_dataset, collate, epoch_batches
from draftsmith.data.corpus import builtin_corpus
from draftsmith.data.load import read_records, to_messages, tokenize_example
from tests.conftest import make_tokenizer

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello!"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "ok"},
]


def _masked_text(tok, ex):
    return tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m], skip_special_tokens=False).replace(
        " ", ""
    )  # char-level decode joins with spaces


@pytest.mark.parametrize(
    "row",
    [
        {"messages": CHAT},
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello!"},
                {"from": "human", "value": "more"},
                {"from": "gpt", "value": "ok"},
            ]
        },
    ],
)
def test_loss_mask_covers_exactly_the_assistant_turns(row):
    tok = make_tokenizer()
    ex = tokenize_example(tok, to_messages(row, "t"), 512, "t")
    # Both assistant turns, each with its end-of-turn marker; nothing from system/user turns.
    assert _masked_text(tok, ex) == "hello!<|im_end|>\nok<|im_end|>\n"


def test_prompt_completion_and_text_formats():
    tok = make_tokenizer()
    ex = tokenize_example(tok, to_messages({"prompt": "2+2?", "completion": "4"}, "t"), 512, "t")
    assert _masked_text(tok, ex).startswith("4<|im_end|>")
    text = tokenize_example(tok, to_messages({"text": "plain words"}, "t"), 512, "t")
    assert all(text["loss_mask"]) and len(text["input_ids"]) >= len("plain words")
    with pytest.raises(DraftsmithError, match="expected one of 'messages'"):
        to_messages({"question": "x"}, "f.jsonl: record 3")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DraftsmithError, match=r"bad.jsonl:2: malformed JSON line"):
        read_records(str(bad))


def test_json_and_parquet_load(tmp_path):
    import datasets

    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert read_records(str(tmp_path / "d.json")) == rows
    assert read_records(str(tmp_path / "d.parquet")) == rows


def test_sources_joined_by_plus_keep_their_order_and_locations(tmp_path):
    from draftsmith.data.load import located_records

    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    joined = located_records(f"builtin:prose-holdout+{tmp_path / 'd.jsonl'}")
    prose = builtin_corpus("prose-holdout")
    assert [row for _, row in joined] == prose + rows
    assert joined[-1][0] == f"{tmp_path / 'd.jsonl'}:2"  # each record still names its own source
    with pytest.raises(DraftsmithError, match=r"missing.jsonl: data file not found"):
        read_records(f"builtin:prose+{tmp_path / 'missing.jsonl'}")
    # A file whose name holds a '+' is that file, not two sources.
    (tmp_path / "a+b.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert read_records(str(tmp_path / "a+b.jsonl")) == rows[:1]


@pytest.mark.parametrize(
    "spec, where",
    [("builtin:code+", "after '+'"), ("+builtin:code", "before '+'"), ("builtin:code++builtin:prose", "after '+'")],
)
def test_an_empty_source_in_a_plus_join_is_named(spec, where):
    """`builtin:code+` once read '' as a dataset name: `: cannot load data (list index out of range)`."""
    from draftsmith.data.config import DataConfig
    from draftsmith.train.config import load_config

    message = f"{re.escape(repr(spec))} has an empty part {re.escape(where)}$"
    with pytest.raises(DraftsmithError, match=f"^{message}"):
        read_records(spec)
    # ... and a recipe says so when it is read, naming the key, before any data or model loads.
    with pytest.raises(DraftsmithError, match=f"^data.train: {message}"):
        load_config(None, [f"data.train={spec}"])
    with pytest.raises(DraftsmithError, match=f"^data.holdout: {message}"):
        DataConfig(holdout=spec)


def test_missing_chat_template_and_empty_dataset(tmp_path, chat_jsonl):
    with pytest.raises(DraftsmithError, match="chat template"):
        build_dataset(str(chat_jsonl), make_tokenizer(chat_template=None), 128)
    only_prompts = tmp_path / "p.jsonl"
    only_prompts.write_text('{"prompt": "no answer"}\n')
    with pytest.raises(DraftsmithError, match="no examples left after filtering"):
        build_dataset(str(only_prompts), make_tokenizer(), 128)


def test_batches_are_deterministic_and_cover_every_example():
    lengths = [5 + (i * 37) % 50 for i in range(103)]
    a = epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=True)
    assert a == epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=True)
    assert a != epoch_batches(lengths, 8, seed=3, epoch=2, group_by_length=True)
    assert sorted(i for b in a for i in b) == list(range(103))
    batch = collate(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "idx": 0}, {"input_ids": [8], "loss_mask": [1], "idx": 1}],
        pad_id=0,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_builtin_corpus_splits_by_module():
    train = {r["source"].split(".")[0] for r in builtin_corpus("code")}
    hold = {r["source"].split(".")[0] for r in builtin_corpus("code-holdout")}
    assert train and hold and not train & hold
    prose = builtin_corpus("prose")
    assert prose and not {r["source"] for r in prose} & {r["source"] for r in builtin_corpus("prose-holdout")}
    with pytest.raises(DraftsmithError, match="unknown built-in corpus"):
        builtin_corpus("poetry")


def test_domain_holdouts_ship_with_python_and_split_by_source():
    """Summarisation, translation and chat prompt sets, with no download; train and holdout never
    share a module (summarise, chat) or a language-reference topic (translate)."""
    from draftsmith.data.load import load_prompts

    def group(r):  # the module, or the topic, a record comes from
        return r["source"].split(":")[0].split(".")[0] if "topics" not in r["source"] else r["source"].split(":")[1]

    for kind, word in (("summarise", "Summarise"), ("translate", "Translate into"), ("chat", "import")):
        train, hold = builtin_corpus(kind), builtin_corpus(f"{kind}-holdout")
        assert len(train) >= 50 and len(hold) >= 10, kind
        assert not {group(r) for r in train} & {group(r) for r in hold}, kind
        prompts = load_prompts(f"builtin:{kind}-holdout", 5)
        assert len(prompts) == 5 and all(word in p if isinstance(p, str) else word in p[0]["content"] for p in prompts)


CHAT_NO_SYSTEM = CHAT[1:]


def _write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_split_of_a_dataset_folder(tmp_path):
    """Files named like the hub's (data/SPLIT-00000-of-00001.*) give a folder its splits; a chat
    dataset such as ultrachat_200k has train_sft / test_sft and no `train`."""
    from draftsmith.data.load import load_prompts

    folder = tmp_path / "ultrachat"
    (folder / "data").mkdir(parents=True)

    def chat(i):
        return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}

    train, test = [chat(i) for i in range(5)], [chat(9)]
    _write_jsonl(folder / "data" / "train_sft-00000-of-00001.jsonl", train)
    _write_jsonl(folder / "data" / "test_sft-00000-of-00001.jsonl", test)
    assert read_records(str(folder), split="test_sft") == test
    ds = build_dataset(str(folder), make_tokenizer(), 128, split="train_sft")
    assert sorted(ds["idx"]) == list(range(5))
    assert load_prompts(str(folder), split="test_sft") == [[{"role": "user", "content": "q9"}]]
    with pytest.raises(
        DraftsmithError,
        match=r"ultrachat: no split 'train' \(data.split / data.holdout_split\); "
        r"its splits are (test_sft, train_sft|train_sft, test_sft)$",
    ):
        read_records(str(folder))
    # A single file holds one split: the split asked for is ignored (so a jsonl holdout serves any holdout_split).
    assert read_records(_write_jsonl(tmp_path / "t.jsonl", test), split="test_sft") == test


def test_malformed_records_are_skipped_with_a_count_or_stop_the_build(tmp_path, capsys):
    from draftsmith.data.load import load_prompts

    good = {"messages": CHAT}
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            good,
            good,
            '{"messages": oops}',
            good,
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
            {"messages": "hello"},
            {"question": "x"},
            good,
        ],
    )
    ds = build_dataset(path, make_tokenizer(), 128)
    assert sorted(ds["idx"]) == [0, 1, 3, 7]  # record numbers, kept through the skips
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if "skipped" in line]  # not progress bars
    assert len(lines) == 1, lines
    # ... and the step's accounting, which counts them among what was dropped (tests/data/test_multiturn.py)
    assert any(line.startswith(f"{path}: 8 records -> 4 examples") and "dropped 4 malformed" in line for line in err)
    assert lines[0].startswith(f"{path}: skipped 4 of 8 malformed records ({path}:3: malformed JSON line")
    assert f"; {path}:5: ShareGPT turn needs 'from' and 'value' strings, got {{'from': 'gpt'}}; " in lines[0]
    assert f"; {path}:6: 'messages' must be a non-empty list of {{role, content}} strings, got 'hello')" in lines[0]
    assert ":7:" not in lines[0]  # the first 3 reasons only
    assert len(load_prompts(path)) == 4
    for build in (
        lambda: build_dataset(path, make_tokenizer(), 128, malformed="error"),
        lambda: load_prompts(path, malformed="error"),
    ):
        with pytest.raises(DraftsmithError, match=rf"^{path}:3: malformed JSON line"):
            build()
    with pytest.raises(
        DraftsmithError, match=r"bad.jsonl: all 2 records are malformed \(.*bad.jsonl:1: .*bad.jsonl:2: "
    ):
        build_dataset(_write_jsonl(tmp_path / "bad.jsonl", ["[1]", {"messages": []}]), make_tokenizer(), 128)


def test_malformed_dataset_records_are_named_by_record_number(tmp_path, capsys):
    """A json file mixing shapes loads with every key in every row (None where absent)."""
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "a", "completion": "bcd"}, {"question": "x"}]))
    ds = build_dataset(str(tmp_path / "d.json"), make_tokenizer(), 128)
    assert ds["idx"] == [0]
    assert f"{tmp_path / 'd.json'}: record 1: expected one of 'messages'" in capsys.readouterr().err


def test_qwen3_like_multi_turn_is_refused_and_single_turn_kept(tmp_path, capsys):
    """Qwen3 adds its empty think block to the last assistant turn only: rendered alone, turn 2 ends
    differently than inside the whole conversation, so prefix spans would be wrong."""
    from tests.templates import QWEN3_LIKE

    tok = make_tokenizer(QWEN3_LIKE)
    with pytest.raises(
        DraftsmithError,
        match=r"^t: the chat template renders turn 2 \(assistant\) differently once "
        r"later turns follow, .*\{% generation %\} markers avoids this$",
    ):
        tokenize_example(tok, CHAT, 512, "t")
    single = tokenize_example(tok, CHAT[:3], 512, "t")
    # Compared as ids: the test tokenizer has no token for "\n\n" (its unknown token stands in).
    trained = [t for t, m in zip(single["input_ids"], single["loss_mask"]) if m]
    assert trained == tok.encode("<think>\n\n</think>\n\nhello!<|im_end|>\n", add_special_tokens=False)
    path = _write_jsonl(tmp_path / "q.jsonl", [{"messages": CHAT}, {"messages": CHAT[:3]}])
    assert build_dataset(path, tok, 512)["idx"] == [1]
    assert f"skipped 1 of 2 malformed records ({path}:1: the chat template renders turn 2" in capsys.readouterr().err


def test_generation_markers_mask_exactly_the_assistant_tokens():
    from draftsmith.data.load import mask_method
    from tests.templates import GENERATION_MARKED

    tok = make_tokenizer(GENERATION_MARKED)
    ex = tokenize_example(tok, CHAT, 512, "t")
    assert mask_method(tok) == "generation markers"
    assert _masked_text(tok, ex) == "hello!<|im_end|>ok<|im_end|>"
    last = tok.encode("<think>\n\n</think>\n\nok<|im_end|>\n", add_special_tokens=False)  # the think block, unmasked
    assert ex["input_ids"][-len(last) :] == last and ex["loss_mask"][-len(last) :] == [0] * (len(last) - 4) + [
        1
    ] * 3 + [0]
    assert tokenize_example(tok, CHAT, 20, "t")["loss_mask"] == ex["loss_mask"][:20]


@pytest.mark.parametrize(
    "template, masked",
    [
        ("QWEN25_LIKE", "hello!<|im_end|>\nok<|im_end|>\n"),
        ("LLAMA31_LIKE", "hello!<|im_end|>ok<|im_end|>"),
    ],
)
def test_injected_system_headers_keep_prefix_masks_exact(template, masked):
    """A system header the template adds to every rendering (Qwen2.5's default prompt, Llama-3.1's
    knowledge-date lines) is stable across prefixes, so prefix rendering stays exact."""
    from draftsmith.data.load import mask_method
    from tests import templates

    tok = make_tokenizer(getattr(templates, template))
    ex = tokenize_example(tok, CHAT_NO_SYSTEM, 512, "t")
    assert mask_method(tok) == "prefix rendering"
    assert _masked_text(tok, ex) == masked
    injected = "YouareQwen" if template == "QWEN25_LIKE" else "CuttingKnowledgeDate"
    assert injected in tok.decode(ex["input_ids"]).replace(" ", "")
