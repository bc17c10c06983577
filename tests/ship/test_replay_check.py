"""serve-check's same-text verdict (draftsmith/ship/replay_check.py): the bootstrap tolerance over
prompts, and what passes and fails it, on counts made up to the shape vLLM reports."""

import random

from draftsmith.engine.replay import Round
from draftsmith.ship import replay_check
from draftsmith.ship.replay_check import _stats, bootstrap, compare, failures


def _prompts(p_accept: float, seed: int, n: int = 12, rounds: int = 40, k: int = 3) -> list[list[Round]]:
    """n prompts of chain-K rounds, each draft accepted with a prompt's own probability (prompts differ,
    as real ones do: p ± 0.15), a round stopping at its first rejection."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        p = min(max(p_accept + rng.uniform(-0.15, 0.15), 0.0), 1.0)
        out.append([Round(0, k, next((j for j in range(k) if rng.random() > p), k)) for _ in range(rounds)])
    return out


def _near_ties(prompts: list[list[Round]], seed: int, rate: float = 0.05) -> list[list[Round]]:
    """The same rounds, a few (`rate`) moved by one accepted draft either way: an engine whose drafter
    breaks its own near-ties of top-two logits its own way (bf16 kernels)."""
    rng = random.Random(seed)
    moved = lambda a: min(max(a + rng.choice([-1, 1]), 0), 3) if rng.random() < rate else a  # noqa: E731
    return [[Round(r.start, r.drafted, moved(r.accepted)) for r in rounds] for rounds in prompts]


def _check(theirs: list[list[Round]], ours: list[list[Round]]) -> dict:
    return {
        "available": True,
        "prompts": len(ours),
        **bootstrap([_stats(r, 3) for r in theirs], [_stats(r, 3) for r in ours], 3),
    }


def test_the_same_counts_pass_with_no_difference():
    ours = _prompts(0.6, seed=0)
    r = _check(ours, ours)
    assert r["per_position_diff"] == [0.0, 0.0, 0.0] and r["tau_diff"] == 0.0 and not failures(r)
    assert r["per_position_tolerance"] == [0.0, 0.0, 0.0] and r["judged"]  # no swap changes identical counts
    assert all(e > 0 for e in r["per_position_sampling_error"])  # prompts differ: their choice moves the figure
    assert r["rounds"] == 12 * 40 and r["reached"][0] == 12 * 40


def test_near_tie_flips_pass_and_a_drafter_ten_percent_worse_fails():
    # Two engines, each breaking the drafter's near-ties its own way on the same text: no difference
    # beyond what the choice of prompts moves the figures by.
    base = _prompts(0.6, seed=1)
    for seed in range(5):
        assert not failures(_check(_near_ties(base, seed), _near_ties(base, 100 + seed)))
    ours = base
    # A drafter whose every round accepts one draft fewer one time in four: τ about 10 % lower.
    rng = random.Random(2)
    worse = [
        [Round(r.start, r.drafted, r.accepted - (r.accepted > 0 and rng.random() < 0.25)) for r in p] for p in ours
    ]
    r = _check(worse, ours)
    assert 0.06 < -r["tau_diff"] / r["draftsmith_tau"] < 0.14
    why = failures(r)
    assert any(w.startswith("τ on vLLM's own text") for w in why) and "chance explains over 12 prompts" in why[-1]


def test_engines_differing_by_chance_fail_at_most_five_percent_of_the_time():
    """The tolerance's promise, checked on 100 draws of engines that differ only by near-tie flips
    (a percentile bootstrap of the paired difference failed 9 of these 100: too narrow for 12 prompts)."""
    failed = 0
    for seed in range(100):
        base = _prompts(0.6, seed=1000 + seed)
        failed += bool(failures(_check(_near_ties(base, seed), _near_ties(base, 500 + seed))))
    assert failed <= 8  # 5 % expected at most; 8 of 100 is 1.4 standard deviations above


def test_too_few_prompts_are_not_judged_and_errors_shrink_with_more():
    assert replay_check.min_prompts(3) == 8  # 2 / 2^8 <= 5 % / 4
    worse = [[Round(0, 3, 0)] * 40] * 6  # every draft rejected: as broken as an export gets
    few = _check(worse, _prompts(0.6, seed=3, n=6))
    assert not few["judged"] and not failures(few)  # 6 prompts: no difference can exceed chance
    many = _check(*[_prompts(0.6, seed=3, n=48)] * 2)
    assert all(m < f for m, f in zip(many["per_position_sampling_error"], few["per_position_sampling_error"]))


def test_without_per_request_rounds_the_comparison_is_not_made():
    r = compare(None, None, [[1, 2]], [[3, 4]], [None], 3)
    assert not r["available"] and "--per-request-spec-decode-metrics detailed" in r["why"] and not failures(r)
    assert replay_check.BOOTSTRAP_SAMPLES >= 1000
