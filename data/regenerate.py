"""Self-distillation data: the target answers the prompts itself, so the drafter learns the
distribution it will have to predict at serving time (EAGLE-3, Medusa self-distillation).

One target pass does two jobs. While the target answers a batch of prompts (KV-cached, left-padded,
greedy or sampled), the hidden states it computes anyway are the drafter's training features: the
prefill yields the prompt's, every decode step the new token's. So with `names`, the features of
every token of every answer are written in the same pass, and no second pass over the data is
needed. The records keep the exact token ids the target produced (`prompt_ids`, `completion_ids`):
decoding to text and re-tokenizing can change tokens, and the features belong to these ids.

Multi-turn conversations are answered turn by turn (`turns="all"`): turn t's prompt is the
conversation so far with the target's own earlier answers, rendered by the chat template as a client
would send it back, so every answer is one the target gives when it is served that conversation.
Consecutive answers share one training sequence while the template renders the conversation so far
as exactly the tokens the target read and wrote; where it does not (Qwen3 drops earlier think
blocks), the next answer starts a new sequence, a record line of its own with the same id.

Resumable: each finished batch is written as one feature shard, then its records are appended to
`OUT.partial`; a rerun skips answered conversations. OUT (records sorted by id) and the feature
folder appear only when every conversation is answered.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.data.features import ShardWriter
from draftsmith.data.load import answer_points, encode_prompt, load_conversations, require_chat_template
from draftsmith.data.sharding import Shard
from draftsmith.target import vllm_server
from draftsmith.target.features import stored_names
from draftsmith.target.generate import generate_batch
from draftsmith.target.load import eos_ids
from draftsmith.util.kernels import packed_linears
from draftsmith.util.precision import torch_dtype


@dataclass
class Conversation:
    """One record answered turn by turn: its messages (each answered assistant turn replaced by the
    target's words), where the target answers (`answer_points`), and the record lines it becomes."""

    messages: list[dict]
    points: list[int]
    chat: dict = field(default_factory=dict)  # the chat template's switches (enable_thinking)
    lines: list[tuple[list[dict], int]] = field(default_factory=list)  # (turns, index of its last answer)
    tokens: list[int] = field(default_factory=list)  # the last line's tokens so far

    def prompt(self, tok, r: int) -> list[int]:
        """Answer r's prompt: the conversation before its answer point, earlier answers the target's."""
        return encode_prompt(tok, self.messages[: self.points[r]], self.chat)

    def answered(self, tok, r: int, prompt_ids: list[int], answer: list[int]) -> None:
        at = self.points[r]
        # As a chat client sends it back: the answer's text as generated, without special tokens
        # (the end-of-turn token; the template writes its own).
        msg = {"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)}
        if at < len(self.messages):
            self.messages[at] = msg  # the dataset's assistant turn, replaced
        else:
            self.messages.append(msg)
        turn = {"prompt_ids": prompt_ids, "completion_ids": answer}
        if self.lines and prompt_ids[: len(self.tokens)] == self.tokens:
            # The prompt starts with everything the target read and wrote so far: this answer joins
            # that sequence, after the tokens the template adds in between.
            self.lines[-1][0].append({**turn, "prompt_ids": prompt_ids[len(self.tokens) :]})
            self.lines[-1] = (self.lines[-1][0], at)
        else:
            self.lines.append(([turn], at))
        self.tokens = prompt_ids + answer

    def records(self, i: int, sampling: dict) -> str:
        """Its jsonl lines: one answer as `prompt_ids` + `completion_ids` (as ever), several as `turns`;
        a conversation of several lines numbers them (`part` of `parts`), so a resume can tell a whole one.
        `sampling`: the temperature and top-p the answers were drawn with, which the eval compares with its own."""
        out = []
        for k, (turns, last) in enumerate(self.lines):
            row = {"id": i, "messages": self.messages[: last + 1]} | (
                {"chat_template_kwargs": self.chat} if self.chat else {}
            )
            row.update(turns[0] if len(turns) == 1 else {"turns": turns})
            if len(self.lines) > 1:
                row.update(part=k, parts=len(self.lines))
            row["sampling"] = sampling
            out.append(json.dumps(row) + "\n")
        return "".join(out)


def _done_ids(partial: Path, own: bool = True) -> set[int]:
    """Ids of whole conversations; a line cut by an interruption (and everything after it) is
    dropped, and so are the first lines of a conversation whose later lines it cut (in this rank's
    `own` file, cut away before it appends)."""
    keep: list[tuple[Any, str]] = []  # (conversation id, its line)
    parts: dict[Any, list[int]] = {}  # conversation id -> the `parts` count of each of its lines
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                row = json.loads(line)
                parts.setdefault(row["id"], []).append(row.get("parts", 1))
            except (json.JSONDecodeError, KeyError):
                break
            keep.append((row["id"], line))
    done = {i for i, seen in parts.items() if len(seen) == seen[0]}
    if own and partial.is_file():
        partial.write_text("".join(l + "\n" for i, l in keep if i in done))
    return done


def regenerate(
    target,
    tok,
    data: str,
    out: Path,
    batch_size: int = 8,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    max_examples: int = 0,
    seed: int = 0,
    names: tuple[str, ...] = (),
    features_out: Path | None = None,
    fingerprint: str = "",
    shard: Shard = Shard(),
    split: str = "train",
    malformed: str = "skip",
    turns: str = "all",
    chat: dict | None = None,
) -> Path:
    """Answer every conversation of `data` (`turns`: every assistant turn, or the last); write
    records (messages + exact ids) to `out` and, with `names`, the target features of every token to
    `features_out` (data/features.py format), when each record has one answer (several answers'
    features come from a pass over the finished records: `features_in_pass`).

    Over the ranks of a launch (`shard`), every rank answers its share of the batches one process
    would form (a batch keeps its conversations through all their turns), into its own partial file
    and feature shards; rank 0 merges them. Greedy answers are then identical to one process's (each
    batch is the same computation)."""
    convs = _conversations(tok, data, max_examples, split, malformed, turns, chat)
    out, partial = Path(out), _partial(out, shard.rank)
    # Every rank's finished answers (each rank first cuts its own file to whole lines), read by all
    # before any rank appends again: all ranks then split the same remaining prompts.
    _done_ids(partial)
    shard.barrier()
    done = set().union(*(_done_ids(f, own=False) for f in _partials(out)))
    shard.barrier()
    names = stored_names(names) if features_in_pass(convs) else ()  # a derived feature is computed when read
    writer = None
    if names:
        if features_out is None:
            raise ValueError("regenerate: `names` asks for features, but no `features_out` folder is given")
        writer = ShardWriter(
            features_out, names, fingerprint, target.config.hidden_size, resume=True, prefix=f"r{shard.rank}-"
        )
    first = {i: c.prompt(tok, 0) for i, c in enumerate(convs) if i not in done}
    # Longest first, so each batch holds prompts of similar length (little padding to compute).
    todo = sorted(first, key=lambda i: -len(first[i]))
    batches = shard.mine([todo[s : s + batch_size] for s in range(0, len(todo), batch_size)])
    generator = torch.Generator(device=next(target.parameters()).device).manual_seed(seed + shard.rank)
    eos = eos_ids(target, tok)
    # Prepacked fp32 CPU linears (draftsmith/util/kernels.py): decode steps feed [B, 1], a small-batch matmul
    # that torch's default kernel runs several times slower here.
    with open(partial, "a") as f, packed_linears(target):
        for batch in tqdm(batches, desc="regenerate", disable=not shard.main):
            for r in range(max(len(convs[i].points) for i in batch)):  # answer r of every conversation that has one
                live = [i for i in batch if r < len(convs[i].points)]
                prompts = [first[i] if r == 0 else convs[i].prompt(tok, r) for i in live]
                results = generate_batch(
                    target, prompts, max_new_tokens, eos, tok.pad_token_id, names, temperature, generator
                )
                if writer:  # features first: a record is only ever written once its features are on disk
                    writer.write_shard({i: feats for i, (_, feats) in zip(live, results)})
                for i, prompt, (answer, _) in zip(live, prompts, results):
                    convs[i].answered(tok, r, prompt, answer)
            f.write("".join(convs[i].records(i, {"temperature": temperature, "top_p": 1.0}) for i in batch))
            f.flush()
    shard.barrier()  # every rank's share is on disk
    if shard.main:
        _finish(out, writer)
    shard.barrier()
    return out


def _conversations(
    tok,
    data: str,
    max_examples: int,
    split: str = "train",
    malformed: str = "skip",
    turns: str = "all",
    chat: dict | None = None,
) -> list[Conversation]:
    """Every record as a conversation to answer (a text record is one user turn); their assistant
    turns, if any, are what regeneration replaces. `split`, `malformed` and `chat` as in
    `load_conversations`."""
    require_chat_template(tok, "data regenerate")
    convs = []
    for c, switches in load_conversations(data, max_examples, split, malformed, chat):
        msgs = [{"role": "user", "content": c}] if isinstance(c, str) else c
        convs.append(Conversation(msgs, answer_points(msgs, turns), switches))
    return convs


def regeneration_counts(path: Path) -> dict:
    """What a regeneration wrote: conversations, the target's answers and their tokens, record lines."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    answers = [t["completion_ids"] for r in rows for t in r.get("turns", [r])]
    return {
        "conversations": len({r["id"] for r in rows}),
        "answers": len(answers),
        "answer_tokens": sum(map(len, answers)),
        "lines": len(rows),
    }


def sampling_of(data: str) -> dict | None:
    """How the answers of regenerated records were drawn ({temperature, top_p}), from the first
    record; None for other data (or records written before this was recorded)."""
    path = Path(data)
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    with open(path) as f:
        try:
            return json.loads(f.readline()).get("sampling")
        except json.JSONDecodeError:
            return None


def _without_answers(c: Conversation) -> list[dict]:
    """The conversation before its last answer point, the turns the target answers left empty."""
    answered = set(c.points)
    return [{**m, "content": ""} if n in answered else m for n, m in enumerate(c.messages[: c.points[-1]])]


def features_in_pass(convs: list[Conversation]) -> bool:
    """Whether the answering pass can capture the training features: only with one answer per
    record, whose prefill and decode steps then cover every token training reads. (With several,
    later prompts re-render earlier answers, and a line may join turns from several passes.)"""
    return all(len(c.points) == 1 for c in convs)


def _partial(out: Path, rank: int = 0) -> Path:
    """Where a rank appends its answers until every prompt is answered."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return Path(out).with_name(Path(out).name + ".partial" + (f"-{rank}" if rank else ""))


def _partials(out: Path) -> list[Path]:
    """Every rank's partial file (a resumed run may have another number of ranks)."""
    return sorted(Path(out).parent.glob(Path(out).name + ".partial*"))


def _finish(out: Path, writer=None) -> Path:
    """Every prompt answered: OUT sorted by id (and the feature index) appear, the partial files go."""
    lines = sorted((l for f in _partials(out) for l in f.read_text().splitlines()), key=lambda l: json.loads(l)["id"])
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(l + "\n" for l in lines))
    if writer:
        writer.finish(len(lines))
    tmp.replace(out)
    for f in _partials(out):
        f.unlink()
    return out


def regenerate_vllm(
    target: str,
    tok,
    data: str,
    out: Path,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_examples: int = 0,
    concurrency: int = 16,
    seed: int = 0,
    server: str | None = None,
    python: str | None = None,
    dtype: str = "auto",
    extra: tuple[str, ...] = (),
    split: str = "train",
    malformed: str = "skip",
    turns: str = "all",
    chat: dict | None = None,
) -> Path:
    """`--engine vllm`: the target (a folder or hub id vLLM resolves) answers every conversation of
    `data` (turn by turn, as `regenerate`) through a vLLM server (started here, or `server`),
    `concurrency` conversations in flight. Prompts go as token ids and answers come back as token
    ids, stored unchanged in `completion_ids`. Resumable like `regenerate`: each conversation is
    appended to OUT.partial once answered; a rerun skips those. Sampled answers take a seed from the
    conversation's id and the turn, so a resumed run asks each prompt exactly what it would have.
    `extra` passes to `vllm serve` unchanged (e.g. --tensor-parallel-size 8 --data-parallel-size 2)."""

    convs = _conversations(tok, data, max_examples, split, malformed, turns, chat)
    out, partial = Path(out), _partial(out)
    done = _done_ids(partial)
    todo = [i for i in range(len(convs)) if i not in done]
    # The longest context any turn can reach: the conversation without the answers it replaces, plus
    # every answer at its longest.
    need = max(
        (len(encode_prompt(tok, _without_answers(convs[i]))) + len(convs[i].points) * max_new_tokens for i in todo),
        default=1 + max_new_tokens,
    )
    # vLLM's own names for the precision draftsmith resolved from the hardware (auto -> bf16 or fp32).
    name = str(torch_dtype(dtype, "--dtype")).removeprefix("torch.")
    lock = threading.Lock()
    with (
        vllm_server.serve(
            target, url=server, python=python, dtype=name, max_model_len=-(-need // 256) * 256, extra=extra
        ) as engine,
        open(partial, "a") as f,
    ):

        def answer(i: int) -> None:
            c = convs[i]
            for r in range(len(c.points)):
                prompt = c.prompt(tok, r)
                sampled = seed + i + r * 1_000_003 if temperature > 0 else None
                c.answered(
                    tok,
                    r,
                    prompt,
                    vllm_server.complete(engine, prompt, max_new_tokens, temperature, top_p, seed=sampled),
                )
            with lock:  # whole conversations only, so an interruption never leaves half a record
                f.write(c.records(i, {"temperature": temperature, "top_p": top_p}))
                f.flush()

        pool = ThreadPoolExecutor(max_workers=concurrency)
        try:
            for _ in tqdm(pool.map(answer, todo), total=len(todo), desc="regenerate (vLLM)"):
                pass
        finally:  # Ctrl-C or an error: drop the queued prompts instead of answering them all first
            pool.shutdown(wait=True, cancel_futures=True)
    return _finish(out)


def regeneration_path(
    target,
    tok,
    data: str,
    fingerprint: str,
    cache_dir: Path,
    max_examples: int,
    max_new_tokens: int,
    batch_size: int = 0,
    names: tuple[str, ...] = (),
    vllm: dict | None = None,
    split: str = "train",
    malformed: str = "skip",
    turns: str = "all",
    chat: dict | None = None,
) -> Path:
    """Where `cached_regeneration` keeps the answers for these arguments (one file per target, data,
    split, size, turns and engine settings)."""
    what = [fingerprint, data, max_examples, max_new_tokens, 2] + ([split] if split != "train" else [])
    what += ["all turns"] if turns == "all" else []  # (files from before multi-turn answered the last turn)
    what += [chat] if chat else []  # another thinking mode: other prompts, other answers
    if vllm:  # another engine, maybe sampled: other answers, another cache entry
        what += ["vllm", vllm.get("temperature", 0.0), vllm.get("top_p", 1.0)]
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
    return Path(cache_dir) / "regenerated" / f"{key}.jsonl"


def cached_regeneration(
    target,
    tok,
    data: str,
    fingerprint: str,
    cache_dir: Path,
    max_examples: int,
    max_new_tokens: int,
    batch_size: int,
    names: tuple[str, ...] = (),
    vllm: dict | None = None,
    shard: Shard = Shard(),
    split: str = "train",
    malformed: str = "skip",
    turns: str = "all",
    chat: dict | None = None,
) -> tuple[Path, Path | None]:
    """`data.regenerate=true` in a recipe: regenerate once per (target, data, size) and reuse it.
    With `names` (offline features), the same pass caches the features -> (records, feature folder).
    With `vllm` (`regenerate_vllm`'s keyword arguments, `target` included) the answers come from a
    vLLM server instead, and the caller computes the features from the records in one target pass.
    Records of several answers get their features from that pass too (`features_in_pass`). An
    interrupted regeneration resumes from its `.partial` files on the next run. `shard`: this rank's
    share of a launch (every rank calls this; see `regenerate`)."""
    out = regeneration_path(
        target,
        tok,
        data,
        fingerprint,
        cache_dir,
        max_examples,
        max_new_tokens,
        vllm=vllm,
        split=split,
        turns=turns,
        chat=chat,
    )
    key = out.stem
    if vllm:
        if not out.is_file():
            regenerate_vllm(
                tok=tok,
                data=data,
                out=out,
                max_new_tokens=max_new_tokens,
                max_examples=max_examples,
                split=split,
                malformed=malformed,
                turns=turns,
                chat=chat,
                **vllm,
            )
        return out, None
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    feats = (Path(cache_dir) / "regenerated" / f"{key}-{'-'.join(sorted(names))}-{dtype}") if names else None
    if out.is_file() and feats is None:
        return out, None
    if out.is_file():
        # Any cache of this regeneration that holds these features serves (EAGLE-3's four tensors
        # include EAGLE-1's one); otherwise the caller caches them in a separate pass.
        for index in sorted(out.parent.glob(f"{key}-*-{dtype}/index.json")):
            if set(names) <= set(json.loads(index.read_text())["features"]):
                return out, index.parent
        return out, None
    regenerate(
        target,
        tok,
        data,
        out,
        batch_size,
        max_new_tokens,
        0.0,
        max_examples,
        names=names,
        features_out=feats,
        fingerprint=fingerprint,
        shard=shard,
        split=split,
        malformed=malformed,
        turns=turns,
        chat=chat,
    )
    return out, feats if feats and (feats / "index.json").is_file() else None
