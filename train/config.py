"""Typed configs: dataclass defaults < recipe YAML < `key=value` command-line overrides.

Unknown keys are errors that name the key and the closest valid one (as SpecForge's
`extra="forbid"` and torchtune's config checks do).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftsmith import DraftsmithError
from draftsmith.train import precision


@dataclass
class DataConfig:
    train: str = "builtin:code"
    """Training data: a jsonl/json/parquet path, a `datasets` name, or `builtin:code` / `builtin:prose`."""
    holdout: str = "builtin:code-holdout"
    """Domain holdout used by the eval stage (prompts only are used)."""
    regenerate: bool = False
    """Replace responses with the target's own answers before training (self-distillation)."""
    regenerate_max_new_tokens: int = 128
    regenerate_batch_size: int = 32
    max_length: int = 256
    """Tokens per example after the chat template; longer examples are truncated."""
    max_examples: int = 0
    """Keep at most this many training examples (0 = all)."""
    group_by_length: bool = True
    """Batch examples of similar length together to waste less compute on padding."""
    offline_features: str = ""
    """Folder written by `draftsmith data features`; `auto` = build it once in the cache dir and reuse
    it (one target pass over the data, then every epoch is drafter-only); empty = online features."""
    num_proc: int = 1


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
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    schedule: str = "cosine"
    """`cosine`, `linear` or `constant` (after warmup)."""
    clip_grad: float = 0.5
    mixed_precision: str = "auto"
    """`auto` (bf16 where the hardware runs it natively, else fp32), `no`/`fp32`, `bf16` or `fp16` (CUDA
    only); see train/precision.py. Passed to accelerate."""
    seed: int = 0


@dataclass
class EvalConfig:
    enabled: bool = True
    k: int = 5
    """Draft tokens proposed per target verification pass."""
    num_prompts: int = 20
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 = greedy (token-exact lossless check); > 0 = lossless speculative sampling."""
    top_p: float = 1.0
    tree: str | None = None
    """Draft tree instead of a chain, e.g. `dynamic:depth=5,top_k=8,tokens=48` (see eval/tree.py)."""
    dtype: str = "auto"
    """Target and drafter dtype in the eval stage: `auto`, `float32`/`no` or `bfloat16` (train/precision.py)."""
    general_holdout: str = ""
    """With `init_from` (domain fine-tuning): a second holdout, e.g. the init's own domain. The eval then
    reports τ on both holdouts before (the init) and after fine-tuning, side by side."""


@dataclass
class Config:
    target: str = "smollm2-135m"
    """Hub id, local folder, `.gguf` file, or the embedded alias `smollm2-135m`."""
    drafter: dict = field(default_factory=lambda: {"type": "eagle"})
    """`type` picks a family in models/registry.py; the other keys are that family's config."""
    init_from: str = ""
    """Start from a trained drafter of the same family: a draftsmith `final/` folder or any format
    `draftsmith export` writes (vLLM/SGLang EAGLE, official or speculators EAGLE-3, vLLM Medusa, a
    plain causal LM), e.g. a head published for your target, to fine-tune it on your domain."""
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
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run


def _unknown_key(key: str, valid: list[str], where: str) -> DraftsmithError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return DraftsmithError(f"{where}: unknown key '{key}'{hint}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one YAML value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DraftsmithError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (bool, int, float)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    check = origin or tp
    if check is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads `3e-4` as a string
        except ValueError:
            pass
    if not isinstance(value, check) or (check is int and isinstance(value, bool)):
        raise DraftsmithError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def from_dict(cls: type, data: dict, where: str = "config") -> Any:
    """Build dataclass `cls` from a dict; unknown keys and wrong types raise DraftsmithError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(key, names, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def parse_overrides(overrides: list[str]) -> dict:
    """`["optim.lr=1e-4", "drafter.noise=0"]` -> nested dict; values are parsed as YAML scalars."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise DraftsmithError(f"override '{item}': expected key=value, e.g. optim.lr=1e-4")
        key, raw = item.split("=", 1)
        node = nested
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DraftsmithError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: expected a mapping of config keys at the top level")
    return data


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Defaults < recipe YAML < overrides. Drafter keys are validated by the drafter's own config."""
    from draftsmith.eval.tree import parse_tree
    from draftsmith.models.registry import drafter_module

    raw = read_yaml(recipe) if recipe else {}
    raw = _merge(raw, parse_overrides(overrides or []))
    where = str(recipe) if recipe else "config"
    cfg = from_dict(Config, raw, where)
    drafter = dict(cfg.drafter)
    module = drafter_module(drafter.pop("type", "eagle"), f"{where}: drafter.type")
    # Validate now so a typo fails before any model is loaded; keep the dict form in Config.
    dcfg = from_dict(module.DrafterConfig, drafter, f"{where}: drafter")
    cfg.drafter = {"type": module.NAME, **drafter}
    _validate(cfg, where)
    limit = module.max_draft_depth(dcfg)
    depth = parse_tree(cfg.eval.tree, f"{where}: eval.tree").depth if cfg.eval.tree else cfg.eval.k
    if limit is not None and cfg.eval.enabled and depth > limit:
        raise DraftsmithError(f"{where}: {'eval.tree' if cfg.eval.tree else 'eval.k'} drafts {depth} deep, but a "
                              f"{module.NAME} drafter with this config drafts at most {limit} tokens per round")
    return cfg


def drafter_config(cfg: Config) -> Any:
    from draftsmith.models.registry import drafter_module

    d = dict(cfg.drafter)
    module = drafter_module(d.pop("type"), "drafter.type")
    return from_dict(module.DrafterConfig, d, "drafter")


def _validate(cfg: Config, where: str) -> None:
    checks = [
        (cfg.optim.schedule in ("cosine", "linear", "constant"), "optim.schedule", "cosine, linear or constant"),
        (cfg.tracker in ("none", "wandb", "tensorboard"), "tracker", "none, wandb or tensorboard"),
        (cfg.optim.batch_size >= 1, "optim.batch_size", "an integer >= 1"),
        (cfg.optim.grad_accum >= 1, "optim.grad_accum", "an integer >= 1"),
        (cfg.eval.k >= 1, "eval.k", "an integer >= 1"),
        (cfg.data.max_length >= 8, "data.max_length", "an integer >= 8"),
    ]
    for ok, key, expected in checks:
        if not ok:
            raise DraftsmithError(f"{where}: {key} must be {expected}")
    for key in PRECISION_KEYS:  # names only here; `auto` is resolved on the run's device (resolve_precision)
        precision.check(_get(cfg, key), f"{where}: {key}")
    if cfg.eval.tree:
        from draftsmith.eval.tree import parse_tree

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


def save_yaml(data: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
