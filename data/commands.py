"""The data room's commands: `draftsmith data regenerate` and `data corpus` (their flags: data/args.py).
`data features` and `data inspect` read a recipe, so they run from train/commands.py."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data.args import CorpusArgs, RegenerateArgs
from draftsmith.data.load import load_prompts, read_records, thinking_kwargs


def run_regenerate(args: RegenerateArgs) -> None:
    load_prompts(args.data, 1)  # bad prompts fail before any model loads or server starts
    # Imported only now: they pull in transformers, seconds that `data corpus` (this module) need not wait for.
    from transformers import AutoTokenizer

    from draftsmith.data.regenerate import regenerate, regenerate_vllm
    from draftsmith.target.load import ensure_pad, load_target, resolve_target

    if args.engine == "vllm":  # the target answers through a vLLM server; only its tokenizer loads here
        where = str(resolve_target(args.target))
        tok = ensure_pad(AutoTokenizer.from_pretrained(where))
        out = regenerate_vllm(
            where,
            tok,
            args.data,
            Path(args.out),
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.max_examples,
            args.concurrency,
            server=args.server,
            python=args.vllm_python,
            dtype=args.dtype,
            extra=tuple(args.vllm_arg),
            turns=args.turns,
            chat=thinking_kwargs(args.thinking),
        )
    else:
        target, tok = load_target(args.target, args.dtype)
        out = regenerate(
            target,
            tok,
            args.data,
            Path(args.out),
            args.batch_size,
            args.max_new_tokens,
            args.temperature,
            args.max_examples,
            turns=args.turns,
            chat=thinking_kwargs(args.thinking),
        )
    print(f"wrote {out}")


def run_corpus(args: CorpusArgs) -> None:
    rows = read_records(args.name)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")  # written whole, then renamed: never a half-written file
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    print(f"wrote {len(rows)} records to {out}")
