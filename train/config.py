"""Typed configs: dataclass defaults < recipe YAML < `key=value` command-line overrides
(the parsing itself is draftsmith/util/parse.py; unknown keys are errors naming the closest valid one).
The sections of other rooms are theirs: `data:` is data/config.py DataConfig, `eval:` eval/config.py
EvalConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.data.config import DataConfig
from draftsmith.data.load import thinking_switch
from draftsmith.engine.drafts import parse_tree
from draftsmith.eval.config import EvalConfig
from draftsmith.models.registry import DEFAULT_DRAFTER, drafter_family
from draftsmith.util import precision
from draftsmith.util.parse import _merge, from_dict, parse_overrides, read_yaml


@dataclass
class OptimConfig:
    batch_size: int = 4
    """Examples per device per micro-step. Global batch = batch_size * processes * grad_accum."""
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int = 0
    """Optimizer steps; 0 = derive from epochs."""
    lr: float = 3e-4
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    """`adamw`, or `muon`: Muon over the drafter's hidden 2-D matrices, AdamW over the rest
    (train/optimizer.py; single process or DDP)."""
    muon_lr: float = 0.0
    """Muon's learning rate; 0 = 10 x lr (speculators' default)."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    schedule: str = "cosine"
    """`cosine`, `linear` or `constant` (after warmup)."""
    clip_grad: float = 0.5
    mixed_precision: str = "auto"
    """`auto` (bf16 where the hardware runs it natively, else fp32), `no`/`fp32`, `bf16` or `fp16` (CUDA
    only); see draftsmith/util/precision.py. Passed to accelerate."""
    seed: int = 0


def _default_drafter() -> str:

    return DEFAULT_DRAFTER


@dataclass
class Config:
    target: str = "smollm2-135m"
    """Hub id, local folder, `.gguf` file, or the embedded alias `smollm2-135m`."""
    drafter: dict = field(default_factory=lambda: {"type": _default_drafter()})
    """`type` picks a family in models/registry.py (default: its DEFAULT_DRAFTER); the other keys are
    that family's config."""
    init_from: str = ""
    """Start from a trained drafter of the same family: a draftsmith `final/` folder or any format
    `draftsmith export` writes (vLLM/SGLang EAGLE, official or speculators EAGLE-3, vLLM Medusa, a
    plain causal LM), e.g. a head published for your target, to fine-tune it on your domain."""
    init_from_stale: bool = False
    """Let `init_from` start from a drafter trained for another target (its fingerprint differs): the
    refresh after the target was fine-tuned or RLHF-updated. Without it that is an error."""
    run: str = "run"
    output_dir: str = "checkpoints"
    save_every: int = 0
    """Save a resumable `step-NNNNNN/` every N optimizer steps (0 = only at the end)."""
    keep_last: int = 2
    resume: str = "false"
    """`false`, `true` (latest step in this run's folder) or a path to a `step-NNNNNN/` folder."""
    log_every: int = 10
    tracker: str = "none"
    """`none`, `wandb` or `tensorboard` (through accelerate)."""
    target_dtype: str = "auto"
    """dtype the frozen target is loaded in for training and feature caching: `auto`, `float32`/`no`,
    `bfloat16` or `float16` (CUDA only)."""
    cache_dir: str = ""
    """Where the embedded target is cached as safetensors (default ~/.cache/draftsmith)."""
    deepspeed: str = ""
    """A DeepSpeed JSON config (e.g. recipes/deepspeed/zero3.json) for a `torchrun` launch, on GPUs or
    CPUs; `accelerate launch --config_file recipes/accelerate/zero3.yaml` (launch.sh --preset zero3)
    names it through accelerate instead. Its `auto` batch, accumulation and clipping values are
    filled from `optim.*`; numbers that differ from them are an error. Empty = DDP."""
    dist_timeout_minutes: float = 60.0
    """Process-group timeout of a multi-process run: how long a rank waits in a collective (all-reduce,
    barrier) before the run fails. Rank-0-only work never runs inside one (train/loop.py)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Defaults < recipe YAML < overrides. Drafter keys are validated by the drafter's own config."""
    raw = read_yaml(recipe) if recipe else {}
    raw = _merge(raw, parse_overrides(overrides or []))
    where = str(recipe) if recipe else "config"
    cfg = from_dict(Config, raw, where)
    drafter = dict(cfg.drafter)
    family = drafter_family(drafter.pop("type", _default_drafter()), f"{where}: drafter.type")
    # Validate now so a typo fails before any model is loaded; keep the dict form in Config.
    dcfg = from_dict(family.DrafterConfig, drafter, f"{where}: drafter")
    cfg.drafter = {"type": family.NAME, **drafter}
    # The eval renders its prompts as training did, unless told otherwise.
    cfg.eval.thinking = thinking_switch(cfg.eval.thinking, f"{where}: eval.thinking") or cfg.data.thinking
    _validate(cfg, where)
    limit = family.max_draft_depth(dcfg)
    depth = parse_tree(cfg.eval.tree, f"{where}: eval.tree").depth if cfg.eval.tree else cfg.eval.k
    if limit is not None and cfg.eval.enabled and depth > limit:
        raise DraftsmithError(
            f"{where}: {'eval.tree' if cfg.eval.tree else 'eval.k'} drafts {depth} deep, but a "
            f"{family.NAME} drafter with this config drafts at most {limit} tokens per round"
        )
    return cfg


def drafter_config(cfg: Config) -> Any:

    d = dict(cfg.drafter)
    family = drafter_family(d.pop("type"), "drafter.type")
    return from_dict(family.DrafterConfig, d, "drafter")


def _number(value: float, low: float, above: bool = False) -> bool:
    """Finite and >= low (> low with `above`): nan fails every comparison, inf passes them."""
    return math.isfinite(value) and (value > low if above else value >= low)


def _optim_checks(o: OptimConfig) -> list[tuple[bool, str, str]]:
    """Every optimizer key, checked when the recipe is read: a value torch refuses (a negative lr, a beta
    of 1) surfaced as its traceback after the run folder was made, and one it takes silently (an lr of
    inf, a momentum of 1 or more, epochs <= 0 training one step) not at all."""
    return [
        (o.schedule in ("cosine", "linear", "constant"), "optim.schedule", "cosine, linear or constant"),
        (o.optimizer in ("adamw", "muon"), "optim.optimizer", "adamw or muon"),
        (o.batch_size >= 1, "optim.batch_size", "an integer >= 1"),
        (o.grad_accum >= 1, "optim.grad_accum", "an integer >= 1"),
        (_number(o.epochs, 0, above=True), "optim.epochs", "a finite number > 0"),
        (o.max_steps >= 0, "optim.max_steps", "an integer >= 0 (0: from optim.epochs)"),
        (_number(o.lr, 0, above=True), "optim.lr", "a finite number > 0"),
        (_number(o.muon_lr, 0), "optim.muon_lr", "a finite number >= 0 (0: 10 x optim.lr)"),
        (_number(o.weight_decay, 0), "optim.weight_decay", "a finite number >= 0"),
        (_number(o.muon_weight_decay, 0), "optim.muon_weight_decay", "a finite number >= 0"),
        (0 <= o.muon_momentum < 1, "optim.muon_momentum", "a number in [0, 1)"),
        (
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "optim.betas",
            "two numbers in [0, 1), as [0.9, 0.95]",
        ),
        (o.warmup_steps >= 0, "optim.warmup_steps", "an integer >= 0"),
        (_number(o.clip_grad, 0), "optim.clip_grad", "a finite number >= 0 (0: no clipping)"),
        # numpy takes seeds below 2**32, and each rank seeds with seed + rank
        (0 <= o.seed < 2**31, "optim.seed", "an integer in 0 .. 2**31 - 1"),
    ]


def _validate(cfg: Config, where: str) -> None:
    checks = [
        *_optim_checks(cfg.optim),
        (cfg.tracker in ("none", "wandb", "tensorboard"), "tracker", "none, wandb or tensorboard"),
        (cfg.eval.k >= 1, "eval.k", "an integer >= 1"),
        (cfg.eval.timing_runs >= 1, "eval.timing_runs", "an integer >= 1"),
        (cfg.data.max_length >= 8, "data.max_length", "an integer >= 8"),
        (cfg.dist_timeout_minutes > 0, "dist_timeout_minutes", "a number of minutes > 0"),
    ]
    for ok, key, expected in checks:
        if not ok:
            raise DraftsmithError(f"{where}: {key} must be {expected}, got {_get(cfg, key)!r}")
    if cfg.deepspeed and not Path(cfg.deepspeed).is_file():
        raise DraftsmithError(
            f"{where}: deepspeed: {cfg.deepspeed} is not a file (a DeepSpeed JSON config, "
            "e.g. recipes/deepspeed/zero3.json)"
        )
    for key in PRECISION_KEYS:  # names only here; `auto` is resolved on the run's device (resolve_precision)
        precision.check(_get(cfg, key), f"{where}: {key}")
    if cfg.eval.tree:
        parse_tree(cfg.eval.tree, f"{where}: eval.tree")


PRECISION_KEYS = ("optim.mixed_precision", "target_dtype", "eval.dtype")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def resolve_precision(cfg: Config, device=None) -> Config:
    """Replace `auto` and aliases by the dtypes this device runs (float32 | bfloat16 | float16), so
    resolved_config.yaml records what actually ran."""
    for key in PRECISION_KEYS:
        *parents, leaf = key.split(".")
        node = _get(cfg, ".".join(parents)) if parents else cfg
        setattr(node, leaf, precision.resolve(getattr(node, leaf), key, device))
    return cfg
