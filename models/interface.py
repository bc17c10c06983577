"""The family interface's defaults: what a family binds when it has nothing of its own to say."""

from __future__ import annotations

from contextlib import contextmanager


def trains_target_never(drafter_config: dict) -> bool:
    """`trains_target` of a family that never changes the target's weights."""
    return False


def no_held_out_metrics(drafter, verifier, sequences) -> dict:
    """`held_out_metrics` of a family with nothing to add to the eval's figures (benchmarks)."""
    return {}


def no_consumer_check(exported, target, ours, prompt_ids) -> None:
    """`consumer_check` of a family whose formats' engine-side loaders draftsmith does not run."""
    return None


@contextmanager
def target_as_original(drafter, target):
    """`original` of a family that leaves the target untouched: the target is the original."""
    yield target
