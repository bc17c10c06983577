"""The commands that read a whole recipe: `draftsmith train` and `plan` (their flags: train/args.py),
and the entry point of `data features`, whose work is data/commands.py `features`: it runs from here
because the feature names are the drafter family's (models/, above data), checked with the whole
recipe as `draftsmith train` checks it."""

from __future__ import annotations

import os
import sys

from draftsmith import DraftsmithError
from draftsmith.data.args import FeaturesArgs
from draftsmith.data.commands import features
from draftsmith.data.config import RecipeData
from draftsmith.models.registry import drafter_family
from draftsmith.train.args import PlanArgs, RecipeArgs
from draftsmith.train.config import drafter_config, load_config
from draftsmith.train.loop import train
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
    family, dcfg = drafter_family(cfg.drafter["type"]), drafter_config(cfg)
    recipe = RecipeData(cfg.data, cfg.target, cfg.target_dtype, cfg.cache_dir)
    features(args, recipe, lambda target_config: family.feature_names(dcfg, target_config))
