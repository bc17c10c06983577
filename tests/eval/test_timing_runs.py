"""`eval.timing_runs`: the speed of every row measured N times, interleaved prompt by prompt with the
target-only run; acceptance counted once; the report's speedup is the median run's, with every run's
speedup and its min-max in the table."""

import statistics

import pytest
import torch

from draftsmith.eval.config import EvalConfig
from draftsmith.eval.report import format_table
from draftsmith.eval.run import evaluate_drafter
from draftsmith.models import eagle3
from draftsmith.models.registry import drafter_family
from draftsmith.ship.publish import _timing_words


@pytest.fixture
def drafter(tiny_target):
    target, _ = tiny_target
    torch.manual_seed(0)
    dcfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1])
    return dcfg, eagle3.build(dcfg, target).to(target.dtype).eval()  # bf16 where `auto` makes the target bf16


def _evaluate(tiny_target, drafter, chat_jsonl, runs: int) -> dict:
    target, tok = tiny_target
    dcfg, model = drafter
    cfg = EvalConfig(num_prompts=3, max_new_tokens=12, k=2, lookup=True, timing_runs=runs)
    return evaluate_drafter(drafter_family("eagle3"), model, dcfg, target, tok, str(chat_jsonl), None, cfg)


def test_three_timing_runs_report_the_median_run_and_count_acceptance_once(tiny_target, drafter, chat_jsonl):
    one, three = (_evaluate(tiny_target, drafter, chat_jsonl, runs) for runs in (1, 3))
    for row in (three, three["with_lookup"]):
        runs = row["speedup_runs"]
        assert len(runs) == 3 and row["speedup"] == statistics.median(runs)  # odd count: the middle run
        # The three speed columns come from that one run.
        assert row["speedup"] == pytest.approx(row["spec_tokens_per_s"] / row["target_tokens_per_s"], abs=2e-3)
    # Only the first run counts acceptance: the same counters as a single run, not three times them.
    for key in ("tau", "per_position", "new_tokens", "acceptance_rate", "lossless"):
        assert three[key] == one[key] and three["with_lookup"][key] == one["with_lookup"][key], key
    assert len(one["speedup_runs"]) == 1 and one["speedup_runs"][0] == one["speedup"]
    lo, hi = min(three["speedup_runs"]), max(three["speedup_runs"])
    lines = format_table([three]).splitlines()
    assert lines[2].endswith(f"| {three['speedup']:.2f}x ({lo:.2f}-{hi:.2f}x, 3 runs) |")
    assert lines[3].startswith("| hybrid") and lines[3].endswith("3 runs) |")
    assert format_table([one]).splitlines()[2].endswith(f"| {one['speedup']:.2f}x |")  # one run: the figure alone
    assert "median of 3 interleaved timing runs" in _timing_words(three)
    assert "one timing run" in _timing_words(one)
