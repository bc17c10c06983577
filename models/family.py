"""A drafter family as a typed record: what the shared code (training, eval, shipping, the planner)
calls, grouped by who calls it. A family module ends with one `FAMILY = Family(...)` that names its
functions and says only what differs from the defaults below; the registry lists the records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from draftsmith.engine.proposers import Proposer

# The signatures of the record's callables, in one place. `cfg` is the family's own DrafterConfig;
# a family names the parameters as it likes (they are passed by position, `step` and `forward` by
# name). tests/architecture/test_registry.py checks every registered family's entries against them.
Cfg = Any  # an instance of the family's DrafterConfig
Target = Any  # the target: a transformers causal LM

FeatureNames = Callable[[Cfg, Any], tuple[str, ...]]
"""(cfg, target_config) -> the target features it trains on (draftsmith/target/features.py); its
proposer drafts on those less the training labels (EAGLE-3's derived `argmax`)."""
MaxDraftDepth = Callable[[Cfg], int | None]
"""(cfg) -> the most draft tokens it proposes per round, or None: as deep as asked."""


class Build(Protocol):
    """(cfg, target, dataset=None) -> a new drafter; dataset: the tokenized rows (a draft vocabulary)."""

    def __call__(self, cfg: Cfg, target: Target, dataset: dict | None = None, /) -> torch.nn.Module: ...


Rebuild = Callable[[dict, Target], torch.nn.Module]
"""(meta, target) -> the drafter a saved folder's config.json (`meta`) describes, untrained."""


class ComputeLoss(Protocol):
    """(drafter, target, batch, feats, cfg, *, step, forward) -> (loss sum, token count, metric sums)."""

    # drafter: the module itself (its attributes); forward: what the training pass calls, the loop's
    # DDP/DeepSpeed wrapper around it, whose forward syncs gradients (default: the drafter).
    def __call__(
        self,
        drafter: torch.nn.Module,
        target: Target,
        batch: dict,
        feats: dict,
        cfg: Cfg,
        /,
        *,
        step: int = 0,
        forward: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict]: ...


ActivationBytes = Callable[[Cfg, Any, torch.nn.Module, int, int, int], int]
"""(cfg, target_config, drafter, batch, length, elem) -> `plan`'s activation bytes at the peak."""
MakeProposer = Callable[[torch.nn.Module, Any, Cfg], Proposer]
"""(drafter, verifier, cfg) -> the Proposer the engine drafts with."""
Writer = Callable[[torch.nn.Module, Cfg, Target, dict, Any, Path, dict], None]
"""(drafter, cfg, target, meta, tok, out, info) -> None: writes one export format into `out`."""
Recognises = Callable[[dict, set[str]], bool]
"""(config, tensor_names) -> is this folder one of its exports, published by others too?"""
ReadExport = Callable[[Path, Target], dict[str, torch.Tensor]]
"""(path, target) -> an export's weights under draftsmith's names."""
FromExport = Callable[[Path, dict, Cfg, Target], torch.nn.Module]
"""(path, config, cfg, target) -> the drafter rebuilt from an export's files."""
ServingSnippet = Callable[[str, str, str, int], str]
"""(fmt, repo_id, target, k) -> how to serve it, for the model card."""
VllmServing = Callable[[Path, dict, int], tuple[dict, list[str]]]
"""(export_dir, config, k) -> (vLLM's speculative config, extra server flags)."""
ConsumerCheck = Callable[[Path, Target, Proposer, list[list[int]]], dict | None]
"""(exported, target, ours, prompt_ids) -> what the engine-side loader of an export gave, or None."""
ParamGroups = Callable[[torch.nn.Module, Cfg, float], list[dict]]
"""(drafter, cfg, lr) -> the optimizer's parameter groups (name, params, lr, optional start_step)."""
Verifier = Callable[[torch.nn.Module, Target], Any]
"""(drafter, target) -> the model that verifies the drafts."""


class Resolve(Protocol):
    """(cfg, target_config, init_config=None) -> a new config: the target's defaults made exact, init_from's fields."""

    # The config a run builds with and saves: its target-dependent defaults made exact and, for
    # `init_from`, the fields of the drafter it starts from. Pure; `build` resolves its own copy the same way.
    def __call__(self, cfg: Cfg, target_config: Any, init_config: dict | None = None, /) -> Cfg: ...


TrainsTarget = Callable[[dict], bool]
"""(drafter_config) -> whether it trains the target's weights (so a loaded drafter needs its own copy)."""
Original = Callable[[torch.nn.Module, Target], AbstractContextManager]
"""(drafter, target) -> a context that yields the target as it was before training (staleness, drift)."""


# The defaults: a family that trains one module beside a frozen target, drafting autoregressively.
def unbounded_depth(cfg) -> None:
    """`max_draft_depth` of a family that drafts autoregressively over its own drafts: any depth."""
    return None


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
    DrafterConfig: type  # a dataclass: the recipe's `drafter:` section
    feature_names: FeatureNames
    # Training: the drafter, its loss, `plan`'s activation estimate.
    build: Build
    rebuild: Rebuild
    compute_loss: ComputeLoss
    activation_bytes: ActivationBytes
    # Decoding: the proposer the engine drafts with.
    make_proposer: MakeProposer
    # Shipping: the formats it writes and reads, and how engines serve them.
    EXPORTS: Mapping[str, Writer]  # format -> its writer (a dict)
    recognises: Recognises
    read_export: ReadExport
    from_export: FromExport
    serving_snippet: ServingSnippet
    SERVE_FORMAT: str | None = None  # the format vLLM serves it from, one of EXPORTS (None: vLLM does not)
    vllm_serving: VllmServing | None = None  # None: vLLM does not serve it
    consumer_check: ConsumerCheck = no_consumer_check
    # Optional parts, with the defaults above.
    max_draft_depth: MaxDraftDepth = unbounded_depth
    param_groups: ParamGroups = single_group
    verifier: Verifier = frozen_target
    resolve: Resolve = keep_config
    trains_target: TrainsTarget = trains_target_never
    original: Original = target_as_original
    # Its runs on a 3-layer tiny target (benchmarks/tiny_target.py: the precision matrix, the export
    # digests, the registry-wide tests, scripts/gpu-check.sh): DrafterConfig fields at that size, and
    # those of its variant whose frozen base can be bf16 (a LoRA backbone), if it has one.
    tiny: dict = field(default_factory=dict)
    tiny_lora: dict | None = None


INTERFACE = tuple(f.name for f in fields(Family))  # what every family has, given or by default
