"""The deploy config (draftsmith/ship/deploy.py): the K per measured concurrency that beats the runs' spread, turned into
vLLM's batch-size schedule, and the checks that refuse a file vLLM would serve otherwise than it reads.
vLLM's own reading of it is tested against vLLM itself in tests/ship/test_serve_check.py."""

from __future__ import annotations

import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.ship import deploy

SPEC = {"method": "eagle3", "model": "/exports/eagle3", "num_speculative_tokens": 3}


def _runs(median: float, spread: float = 0.04, n: int = 3) -> list[float]:
    """n timing runs around `median`, `spread` apart at the ends (relative): 0.96x, 1x, 1.04x by default,
    about what one config re-served moves on a 2-core CPU."""
    return [median * (1 - spread / 2 + spread * i / (n - 1)) for i in range(n)]


def test_k_is_chosen_only_where_it_beats_the_target_and_the_smaller_k_by_more_than_the_spread():
    target = {c: _runs(v) for c, v in {1: 20.0, 2: 36.0, 4: 60.0, 8: 90.0}.items()}
    spec = {
        1: {c: _runs(v) for c, v in {1: 25.0, 2: 40.0, 4: 66.0, 8: 85.0}.items()},
        2: {c: _runs(v) for c, v in {1: 30.0, 2: 41.0, 4: 64.0, 8: 80.0}.items()},
        3: {c: _runs(v) for c, v in {1: 32.0, 2: 44.0, 4: 58.0, 8: 70.0}.items()},
    }
    # 1: K=3 beats K=2 by 7 %, more than the runs' 4 % spread; 2: K=2 wins by 2.5 %, within it (K=1 kept),
    # K=3 by 10 %; 4: K=1; 8: nothing beats the target.
    assert deploy.choose_k(target, spec) == {1: 3, 2: 3, 4: 1, 8: 0}


def test_a_tie_within_the_spread_keeps_the_smaller_k_and_a_near_win_over_the_target_writes_no_k():
    target = {1: _runs(20.0)}
    assert deploy.choose_k(target, {1: {1: _runs(24.0)}, 2: {1: _runs(24.5)}}) == {1: 1}
    # 23.2 against 23.0 (the docs' old K=2 over K=1): a tie, whoever is measured faster once.
    assert deploy.choose_k(target, {1: {1: _runs(23.2)}, 2: {1: _runs(23.0)}}) == {1: 1}
    # A drafter 3 % faster than the target alone, inside a 4 % spread: no K is written.
    assert deploy.choose_k(target, {1: {1: _runs(20.6)}}) == {1: 0}


@pytest.mark.parametrize("noise_seed", range(5))
def test_planted_k_that_loses_by_ten_percent_is_never_chosen(noise_seed):
    """K=3 planted 10 % slower than K=2 (and K=1 5 % slower than K=2), runs with 2 % noise: K=2 is
    chosen, whatever the noise; the smallest margin the rule resolves is the runs' spread."""
    import random

    rng = random.Random(noise_seed)
    noisy = lambda m: [m * (1 + rng.uniform(-0.01, 0.01)) for _ in range(3)]  # noqa: E731
    target = {1: noisy(20.0), 4: noisy(50.0)}
    spec = {
        1: {1: noisy(28.5), 4: noisy(57.0)},
        2: {1: noisy(30.0), 4: noisy(60.0)},
        3: {1: noisy(27.0), 4: noisy(54.0)},
    }
    assert deploy.choose_k(target, spec) == {1: 2, 4: 2}


def test_levels_need_as_many_prompts_as_requests_and_three_runs():
    deploy.check_levels(16, [1, 4, 16])
    with pytest.raises(DraftsmithError, match=r"^--concurrency 16: more concurrent requests than the 2 prompts"):
        deploy.check_levels(2, [1, 16])
    with pytest.raises(DraftsmithError, match=r"^--deploy-runs 2: at least 3 runs"):
        deploy.check_levels(16, [1, 4], runs=2)


def test_schedule_covers_every_batch_size_from_one_and_merges_equal_neighbours():
    assert deploy.schedule({1: 3, 2: 3, 4: 2, 8: 0, 16: 0}) == [[1, 3, 3], [4, 7, 2], [8, 16, 0]]
    # The first measured level need not be 1: its K serves from batch size 1, as vLLM requires.
    assert deploy.schedule({2: 2, 8: 1}) == [[1, 7, 2], [8, 8, 1]]
    with pytest.raises(DraftsmithError, match="no measured concurrency"):
        deploy.schedule({})


def test_the_config_keeps_the_familys_keys_and_sizes_k_for_the_largest_choice():
    config = deploy.deploy_config(SPEC, {1: 2, 4: 1, 8: 0})
    assert config == {**SPEC, "num_speculative_tokens": 2, deploy.SCHEDULE_KEY: [[1, 3, 2], [4, 7, 1], [8, 8, 0]]}
    assert deploy.check(config) is config
    # No K ever paid: speculation off at every batch size, the measured K kept for vLLM's buffers.
    off = deploy.deploy_config(SPEC, {1: 0, 2: 0})
    assert off["num_speculative_tokens"] == 3 and off[deploy.SCHEDULE_KEY] == [[1, 2, 0]]


@pytest.mark.parametrize(
    "ranges, top, says",
    [
        ([[1, 3, 4]], 3, r"entry \[1, 3, 4\]: K 4 is outside 0..num_speculative_tokens \(3\)"),
        ([[1, 3, -1]], 3, "K -1 is outside"),
        ([[2, 3, 1]], 3, "the first range must start at batch size 1"),
        ([[1, 4, 2], [3, 8, 1]], 3, "must be sorted, not overlap"),
        ([[1, 4, 2], [6, 5, 1]], 3, "end at or after their start"),
        ([[1, 4]], 3, "is not \\[batch_lo, batch_hi, K\\] integers"),
        ([], 3, "must be a non-empty list"),
        ([[1, 4, 1]], 0, "num_speculative_tokens must be a positive integer"),
    ],
)
def test_a_schedule_vllm_would_serve_otherwise_is_a_one_line_error(ranges, top, says):
    with pytest.raises(DraftsmithError, match=says) as e:
        deploy.check({**SPEC, "num_speculative_tokens": top, deploy.SCHEDULE_KEY: ranges}, "deploy/vllm.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("deploy/vllm.json: ")


def test_read_and_write_go_through_the_checks(tmp_path):
    config = deploy.deploy_config(SPEC, {1: 3, 4: 2})
    path = deploy.write(config, tmp_path / "deploy", {"chosen_k": {1: 3, 4: 2}})
    assert deploy.read(path) == config and sorted(p.name for p in path.parent.iterdir()) == [
        "measured.json",
        "vllm.json",
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**config, deploy.SCHEDULE_KEY: [[1, 2, 9]]}))
    with pytest.raises(DraftsmithError, match=f"{bad}: .*K 9 is outside"):
        deploy.read(bad)
    bad.write_text("{not json")
    with pytest.raises(DraftsmithError, match=f"{bad}: cannot read a deploy config"):
        deploy.read(bad)
    with pytest.raises(DraftsmithError, match="K 9 is outside"):  # nothing half-written either
        deploy.write({**config, deploy.SCHEDULE_KEY: [[1, 2, 9]]}, tmp_path / "refused", {})
    assert not list((tmp_path / "refused").iterdir())
