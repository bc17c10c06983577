"""A drafter family as a typed record: what the shared code (training, eval, shipping, the planner)
calls, grouped by who calls it. A family module ends with one `FAMILY = Family(...)` that names its
functions and says only what differs from the defaults below; the registry lists the records."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch


def single_group(drafter: torch.nn.Module, cfg, lr: float) -> list[dict]:
    """`param_groups` of a family that trains one module at one learning rate (optim.lr)."""
    return [{"name": "drafter", "params": [p for p in drafter.parameters() if p.requires_grad], "lr": lr}]


def frozen_target(drafter: torch.nn.Module, target):
    """`verifier` of a family that leaves the target untouched: the target verifies the drafts."""
    return target


def keep_config(cfg, target_config, init_config: dict | None = None):
    """`resolve` of a family whose config depends on neither the target nor the drafter it starts from."""
    return cfg


def trains_target_never(drafter_config: dict) -> bool:
    """`trains_target` of a family that never changes the target's weights."""
    return False


@contextmanager
def target_as_original(drafter, target):
    """`original` of a family that leaves the target untouched: the target is the original."""
    yield target


def no_consumer_check(exported, target, ours, prompt_ids) -> None:
    """`consumer_check` of a family whose formats' engine-side loaders draftsmith does not run."""
    return None


@dataclass  # not frozen: tests swap an entry (monkeypatch) to plant a failure
class Family:
    # What it is, and what it reads of the target.
    NAME: str
    DrafterConfig: type
    feature_names: Callable  # (cfg, target_config) -> the target features it trains and drafts on
    max_draft_depth: Callable  # (cfg) -> the most draft tokens per round, or None
    # Training: the drafter, its loss, its parameter groups, `plan`'s activation estimate.
    build: Callable  # (cfg, target, dataset) -> a new drafter (it leaves cfg as it is)
    rebuild: Callable  # (meta, target) -> the drafter a saved folder describes
    # (drafter, target, batch, feats, cfg, step, forward) -> (loss sum, count, metrics). drafter: the module
    # itself (its attributes); forward: what the training pass calls, the loop's DDP/DeepSpeed wrapper
    # around it, whose forward syncs gradients (default: the drafter).
    compute_loss: Callable
    activation_bytes: Callable  # (cfg, target_config, drafter, batch, length, elem) -> bytes at the peak
    # Decoding: the proposer the engine drafts with.
    make_proposer: Callable  # (drafter, verifier, cfg) -> a Proposer
    # Shipping: the formats it writes and reads, and how engines serve them.
    EXPORTS: dict[str, Callable]  # format -> writer(drafter, cfg, target, meta, tok, out, info)
    recognises: Callable  # (config, tensor_names) -> is this folder one of its exports, published by others?
    read_export: Callable  # (path, target) -> its weights under draftsmith's names
    from_export: Callable  # (path, config, cfg, target) -> the drafter rebuilt from an export's files
    serving_snippet: Callable  # (fmt, repo_id, target, k) -> how to serve it, for the model card
    SERVE_FORMAT: str | None = None  # the format vLLM serves it from (None: vLLM does not)
    vllm_serving: Callable | None = None  # (export_dir, config, k) -> (speculative config, extra flags)
    consumer_check: Callable = no_consumer_check  # run the engine-side loader of an export, when installed
    # Optional parts, with the defaults of a family that trains one module beside a frozen target.
    param_groups: Callable = single_group
    verifier: Callable = frozen_target
    # (cfg, target_config, init_config=None) -> the config a run builds with and saves: its
    # target-dependent defaults made exact and, for `init_from`, the fields of the drafter it starts from.
    # Pure (a new config); `build` resolves its own copy the same way.
    resolve: Callable = keep_config
    trains_target: Callable = trains_target_never  # (drafter_config) -> whether it needs its own target copy
    original: Callable = target_as_original  # context: the target before training (staleness, drift)


INTERFACE = tuple(f.name for f in fields(Family))  # what every family has, given or by default
