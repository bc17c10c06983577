"""The deploy config (draftsmith/ship/deploy.py): the fastest K per measured concurrency, turned into
vLLM's batch-size schedule, and the checks that refuse a file vLLM would serve otherwise than it reads.
vLLM's own reading of it is tested against vLLM itself in tests/ship/test_serve_check.py."""

from __future__ import annotations

import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.ship import deploy

SPEC = {"method": "eagle3", "model": "/exports/eagle3", "num_speculative_tokens": 3}


def test_the_fastest_k_per_concurrency_and_none_where_the_target_alone_is_faster():
    target = {1: 20.0, 2: 36.0, 4: 60.0, 8: 90.0}
    spec = {
        1: {1: 25.0, 2: 40.0, 4: 66.0, 8: 85.0},
        2: {1: 30.0, 2: 44.0, 4: 64.0, 8: 80.0},
        3: {1: 32.0, 2: 44.0, 4: 58.0, 8: 70.0},
    }
    # 1: K=3 is fastest; 2: K=2 and K=3 tie, the smaller K wins; 4: K=1; 8: nothing beats the target.
    assert deploy.fastest_k(target, spec) == {1: 3, 2: 2, 4: 1, 8: 0}


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
    path = deploy.write(config, tmp_path / "deploy", {"fastest_k": {1: 3, 4: 2}})
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
