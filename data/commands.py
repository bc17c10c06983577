"""The data room's commands: `draftsmith data regenerate`, `data corpus`, `data inspect` and `data
features` (their flags: data/args.py).

`data inspect` and `data features` read a recipe: its `data:` section and the target's keys, through
data/config.py `recipe_data` (draftsmith/util/parse.py, as train/config.py reads the whole recipe), so
data never imports train, which sits above it. `data features` also needs the feature names of the
recipe's drafter family, which only models/ (above data) knows: its entry point in the CLI's table is
train/commands.py `run_features`, three lines that read the whole recipe (the drafter's config checked
as `draftsmith train` checks it) and pass the family's `feature_names` to `features` here, which does
the work. Everything else about the data, end to end, is this room's (data/pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from draftsmith.data.args import CorpusArgs, FeaturesArgs, InspectArgs, RegenerateArgs
from draftsmith.data.config import RecipeData, recipe_data
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
    out.parent.mkdir(parents=True, exist_ok=True)  # datasets/ on first use
    tmp = out.with_name(out.name + ".tmp")  # written whole, then renamed: never a half-written file
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    print(f"wrote {len(rows)} records to {out}")


def run_inspect(args: InspectArgs) -> None:
    from draftsmith.data.inspect import encoded_example, print_example  # transformers: only when it runs

    recipe = recipe_data(args.recipe, args.overrides)
    data = recipe.data
    print_example(
        *encoded_example(
            data.train,
            data.split,
            args.index,
            recipe.target,
            recipe.cache_dir,
            data.max_length,
            data.malformed,
            data.thinking,
        )
    )


def features(args: FeaturesArgs, recipe: RecipeData, feature_names: Callable[[Any], tuple[str, ...]]) -> None:
    """`data features`: the offline feature cache of the recipe's training data at `args.out`.
    `feature_names`: the target's config -> the tensors the recipe's drafter trains on (its family's
    `feature_names`, passed in by the entry point, train/commands.py `run_features`)."""
    from draftsmith.data.batching import build_dataset
    from draftsmith.data.pipeline import write_features
    from draftsmith.target.features import stored_names
    from draftsmith.target.load import fingerprint, load_target

    data = recipe.data
    target, tok = load_target(recipe.target, recipe.target_dtype, recipe.cache_dir)
    ds = build_dataset(
        data.train,
        tok,
        data.max_length,
        data.max_examples,
        split=data.split,
        malformed=data.malformed,
        chat=thinking_kwargs(data.thinking),
    )
    names = stored_names(feature_names(target.config))  # derived ones are computed when the cache is read
    out = write_features(
        data,
        target,
        tok,
        ds,
        names,
        Path(args.out),
        fingerprint(target),
        recipe.target,
        recipe.cache_dir,
        args.batch_size,
    )
    print(f"wrote {out} ({len(ds)} examples); train with data.offline_features={out}")
