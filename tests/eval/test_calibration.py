"""Calibration of a drafter's confidences (draftsmith/util/calibration.py) on constructed data, the cost
model measured for adaptive verification, and the eval stage's calibration and adaptive sections:
present for a drafter with confidences, absent (the report unchanged) for every other."""

import json
import random

import pytest
import torch

from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import NgramProposer
from draftsmith.engine.verify import AdaptiveCosts
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import _calibration as _report_calibration
from draftsmith.eval.run import evaluate, measure_costs
from draftsmith.util.calibration import calibration, verdict
from tests.engine.test_speculative import OracleProposer


def test_perfectly_calibrated_confidences_have_ece_near_zero():
    rng = random.Random(0)
    conf = [rng.random() for _ in range(20_000)]
    outcomes = [int(rng.random() < c) for c in conf]  # accepted with exactly the stated probability
    cal = calibration(conf, outcomes)
    assert cal["n"] == 20_000 and cal["ece"] < 0.02
    assert all(abs(b["accuracy"] - b["confidence"]) < 0.04 for b in cal["bins"])


def test_overconfident_constant_has_ece_of_the_gap():
    # Always 0.9 sure, right 60% of the time: one full bin, ECE = |0.6 - 0.9| = 0.3.
    cal = calibration([0.9] * 10, [1] * 6 + [0] * 4)
    assert cal["ece"] == pytest.approx(0.3)
    full = [b for b in cal["bins"] if b["n"]]
    assert len(full) == 1 and full[0]["lo"] == 0.9 and full[0]["accuracy"] == pytest.approx(0.6)


def test_bins_weigh_by_count_and_empty_bins_add_nothing():
    # 3 pairs at 0.25 all accepted (gap 0.75), 1 at 0.75 rejected (gap 0.75): ECE 0.75; 8 bins empty.
    cal = calibration([0.25, 0.25, 0.25, 0.75], [1, 1, 1, 0])
    assert cal["ece"] == pytest.approx(0.75)
    empty = [b for b in cal["bins"] if not b["n"]]
    assert len(empty) == 8 and all(b["confidence"] is None and b["accuracy"] is None for b in empty)
    # Confidence 1 falls in the last bin, 0 in the first; 5 bins split [0, 1] in fifths.
    cal = calibration([1.0, 0.0], [1, 0], n_bins=5)
    assert cal["ece"] == 0.0 and cal["bins"][-1]["n"] == 1 and cal["bins"][0]["n"] == 1
    assert [b["hi"] for b in cal["bins"]] == [0.2, 0.4, 0.6, 0.8, 1.0]


def test_no_data_gives_no_ece_and_mismatched_lengths_are_an_error():
    cal = calibration([], [])
    assert cal["ece"] is None and cal["n"] == 0 and len(cal["bins"]) == 10
    with pytest.raises(ValueError):
        calibration([0.5], [])


def test_costs_are_measured_in_target_passes():
    # Drafting 2 ms a round, a 1-token pass 10 ms, a 1+4-token pass 12 ms: beta = 2 / (4 * 10).
    assert measure_costs(0.002, 0.010, 0.012, 4) == AdaptiveCosts(
        draft_cost=pytest.approx(0.2), beta=pytest.approx(0.05)
    )
    assert measure_costs(0.0, 0.010, 0.009, 4).beta == 0.0  # timing noise: never negative
    assert measure_costs(0.0, 0.010, 0.2, 4).beta == 1.0  # never more than a pass per draft


class Confident(OracleProposer):
    """The target's own greedy continuation, wrong at a position that moves with the context length,
    with falling confidences (0.9, 0.6, 0.3, ...): some verified drafts rejected, some prefixes cut."""

    drafts_confidence = True

    def propose(self, tokens, feats, k, sampler=None):
        good = super().propose(tokens, feats, k).tokens
        wrong_at = tokens.shape[1] % (k + 1)
        drafts = [(t + 1) % self.target.config.vocab_size if j == wrong_at else t for j, t in enumerate(good)]
        return Draft.chain(drafts, confidence=[max(0.9 - 0.3 * j, 0.05) for j in range(len(drafts))])


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.fp32_exact
def test_eval_reports_calibration_and_adaptive_verification_for_a_drafter_with_confidences(
    one_thread, tiny_target, chat_jsonl, tmp_path
):
    target, tok = tiny_target
    cfg = EvalConfig(k=3, num_prompts=2, max_new_tokens=12)
    confident = Resolved("confident", Confident(target), target, None)
    report = evaluate(confident, tok, str(chat_jsonl), tmp_path / "eval", cfg, kernels=False)
    cal, ad = report["calibration"], report["adaptive"]
    assert cal["n"] > 0 and 0.0 <= cal["ece"] <= 1.0 and len(cal["bins"]) == 10
    assert sum(b["n"] for b in cal["bins"]) == cal["n"]
    assert ad["costs"] == "measured" and ad["draft_cost"] >= 0 and 0 <= ad["beta"] <= 1
    assert ad["full_block"]["tau"] == report["tau"] and ad["full_block"]["verified_per_round"] == 3
    assert ad["adaptive"]["lossless"] is True and ad["adaptive"]["rule_exact"] is True
    for run in ("full_block", "adaptive"):
        assert {"tau", "verified_per_round", "speedup", "spec_tokens_per_s", "per_position"} <= set(ad[run])
    out = tmp_path / "eval"
    assert (out / "reliability.png").is_file() and (out / "acceptance.png").is_file()
    assert json.loads((out / "report.json").read_text())["calibration"] == cal
    md = (out / "report.md").read_text()
    assert "## Confidence calibration" in md and "## Adaptive verification" in md
    assert "Adaptive verification lossless: yes (identical 2/2, fp32)." in md  # the rule, then the identity count
    # Given costs: a costly verification cuts every chain to what its confidences justify.
    confident = Resolved("confident", Confident(target), target, None)
    given = evaluate(confident, tok, str(chat_jsonl), None, cfg, kernels=False, adaptive_costs=AdaptiveCosts(0.0, 0.5))
    assert given["adaptive"]["costs"] == "given" and given["adaptive"]["beta"] == 0.5
    assert given["adaptive"]["adaptive"]["verified_per_round"] < 3 and given["adaptive"]["adaptive"]["lossless"]


def test_drafters_without_confidences_get_no_new_sections(one_thread, tiny_target, chat_jsonl, tmp_path):
    target, tok = tiny_target
    ngram = Resolved("ngram", NgramProposer(), target, None)
    report = evaluate(ngram, tok, str(chat_jsonl), tmp_path / "eval", EvalConfig(k=3, num_prompts=2, max_new_tokens=8))
    assert "calibration" not in report and "adaptive" not in report
    assert not (tmp_path / "eval" / "reliability.png").exists()
    assert "calibration" not in (tmp_path / "eval" / "report.md").read_text().lower()


class Calibrated(OracleProposer):
    """A confidence head that is true by construction: draft j is the target's greedy token with
    probability c_j (uniform in [0.15, 0.85], from its own seeded stream, so a shifted copy drafts the
    same tokens) and says c_j + shift. shift 0 is calibrated; +0.1 is the planted defect."""

    drafts_confidence = True

    def __init__(self, target, shift: float = 0.0):
        super().__init__(target)
        self.shift, self.rng = shift, random.Random(0)

    def propose(self, tokens, feats, k, sampler=None):
        good = super().propose(tokens, feats, k).tokens
        c = [self.rng.uniform(0.15, 0.85) for _ in good]
        vocab = self.target.config.vocab_size
        drafts = [t if self.rng.random() < cj else (t + 1) % vocab for t, cj in zip(good, c)]
        return Draft.chain(drafts, confidence=[cj + self.shift for cj in c])


def _head_calibration(target, tok, holdout, shift: float) -> dict:
    """The eval's calibration section (eval/run.py `confidence_calibration` over the full-block rounds'
    verified drafts) for `Calibrated(shift)` on 16 holdout prompts x 64 tokens, chains of 3: ~950 drafts."""
    from draftsmith.data.load import encode_prompt, load_prompts
    from draftsmith.engine.speculative import Stats, speculative_decode
    from draftsmith.eval.run import confidence_calibration
    from draftsmith.target.load import eos_ids

    stats, head = Stats(k=3), Calibrated(target, shift)
    for p in load_prompts(holdout, 16):
        speculative_decode(target, head, encode_prompt(tok, p), 3, 64, eos_ids(target, tok), None, stats)
    return confidence_calibration(stats)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_planted_confidence_shift_raises_the_ece_by_it_and_is_flagged(one_thread, tiny_target_dir, chat_jsonl, dtype):
    """Every confidence +0.1 (one bin width, so each bin's drafts move together into the next): the
    ECE becomes 0.1 give or take the unshifted one (|acc - conf - 0.1| lies within |acc - conf| of
    0.1 in every bin) and the verdict flips, on the same drafts with the same outcomes."""
    from draftsmith.target.load import load_target

    target, tok = load_target(str(tiny_target_dir), dtype)
    clean, shifted = (_head_calibration(target, tok, str(chat_jsonl), shift) for shift in (0.0, 0.1))
    assert clean["n"] == shifted["n"] > 800
    assert [b["accuracy"] for b in clean["bins"][:-1]] == [b["accuracy"] for b in shifted["bins"][1:]]
    assert verdict(clean)["calibrated"] and clean["ece"] < verdict(clean)["ece_bound"] < 0.06
    assert abs(shifted["ece"] - 0.1) <= clean["ece"] + 1e-4 and not verdict(shifted)["calibrated"]
    assert "Verdict: calibrated" in "\n".join(_report_calibration({"calibration": clean}))
    assert "Verdict: **miscalibrated**" in "\n".join(_report_calibration({"calibration": shifted}))
