import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.batching import build_dataset, collate, epoch_batches
from draftsmith.data.corpus import builtin_corpus
from draftsmith.data.load import read_records, to_messages, tokenize_example
from tests.conftest import make_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"}]


def _masked_text(tok, ex):
    return tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m], skip_special_tokens=False).replace(" ", "")  # char-level decode joins with spaces


@pytest.mark.parametrize("row", [
    {"messages": CHAT},
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                       {"from": "gpt", "value": "hello!"}, {"from": "human", "value": "more"},
                       {"from": "gpt", "value": "ok"}]},
])
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
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "idx": 0},
                     {"input_ids": [8], "loss_mask": [1], "idx": 1}], pad_id=0)
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
