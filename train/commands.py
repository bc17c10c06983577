"""The commands that read a recipe: `draftsmith train`, `plan`, `data features` and `data inspect`
(their flags: train/args.py). The last two are data work, run from here because recipes are train's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.data.batching import build_dataset
from draftsmith.data.inspect import encoded_example, print_example
from draftsmith.data.load import thinking_kwargs
from draftsmith.models.registry import drafter_module
from draftsmith.target.load import fingerprint, load_target
from draftsmith.train.args import FeaturesArgs, InspectArgs, PlanArgs, RecipeArgs
from draftsmith.train.config import drafter_config, load_config
from draftsmith.train.loop import train, write_features
from draftsmith.train.plan import plan


def run_train(args: RecipeArgs) -> None:
    train(load_config(args.recipe, args.overrides))
    if os.environ.get("RANK", "0") != "0":
        # A non-main rank of a launch is done (rank 0 may still be evaluating): leave without the
        # interpreter's teardown. There, gloo's and DeepSpeed's C++ threads can abort the process
        # ("terminate called without an active exception", SIGABRT), and torchrun then kills rank 0
        # mid-eval; CI saw it once on the ZeRO-3 test (tests/train/test_deepspeed.py). Everything this rank
        # writes is written and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_plan(args: PlanArgs) -> None:
    if args.gpus < 1 or args.nodes < 1:
        raise DraftsmithError("plan: expected --gpus >= 1 and --nodes >= 1")
    print(plan(load_config(args.recipe, args.overrides), args.gpus, args.nodes, args.preset, args.gpu_memory))


def run_features(args: FeaturesArgs) -> None:
    cfg = load_config(args.recipe, args.overrides)
    target, tok = load_target(cfg.target, cfg.target_dtype, cfg.cache_dir)
    ds = build_dataset(
        cfg.data.train,
        tok,
        cfg.data.max_length,
        cfg.data.max_examples,
        split=cfg.data.split,
        malformed=cfg.data.malformed,
        chat=thinking_kwargs(cfg.data.thinking),
    )
    names = drafter_module(cfg.drafter["type"]).feature_names(drafter_config(cfg), target.config)
    out = write_features(cfg, target, tok, ds, names, Path(args.out), fingerprint(target), args.batch_size)
    print(f"wrote {out} ({len(ds)} examples); train with data.offline_features={out}")


def run_inspect(args: InspectArgs) -> None:
    cfg = load_config(args.recipe, args.overrides)
    data = cfg.data
    print_example(
        *encoded_example(
            data.train,
            data.split,
            args.index,
            cfg.target,
            cfg.cache_dir,
            data.max_length,
            data.malformed,
            data.thinking,
        )
    )
