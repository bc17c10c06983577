"""Calibration of a drafter's confidences: expected calibration error and the reliability table.

A confidence head (DSpark, arXiv 2607.05147) says c_i = P(draft i accepted | drafts < i accepted),
and vLLM 0.32's adaptive verification spends its token budget on those numbers as if they were true
probabilities, so the eval stage reports how true they are (Guo et al. 2017, "On Calibration of
Modern Neural Networks", arXiv:1706.04599, section 2: reliability diagrams and ECE). An ECE is never
0 on finitely many drafts, so beside it stands its verdict (`verdict`): the largest ECE perfectly
calibrated confidences give on the same bins, 99 times in 100.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.01  # a calibrated head is called miscalibrated 1 time in 100 (`verdict`)


def calibration(confidences: list[float], outcomes: list[int], n_bins: int = 10) -> dict:
    """Expected calibration error over equal-width bins of [0, 1].

    confidences [N] in [0, 1]; outcomes [N] in {0, 1} (1 = the draft was accepted). Bin b holds
    b/n_bins <= c < (b+1)/n_bins, the last bin also c = 1. With n_b pairs, mean confidence conf_b
    and accuracy acc_b (mean outcome) in bin b,
        ECE = sum_b (n_b / N) * |acc_b - conf_b|,
    so empty bins add nothing. -> {"ece": float (None when N = 0), "n": N, "bins": [{"lo", "hi",
    "n", "confidence", "accuracy"} per bin, confidence/accuracy None when the bin is empty], and
    `verdict`'s "ece_bound" and "calibrated"}.
    """
    if len(confidences) != len(outcomes):
        raise ValueError(f"calibration: {len(confidences)} confidences but {len(outcomes)} outcomes")
    if n_bins < 1:
        raise ValueError(f"calibration: n_bins must be >= 1, got {n_bins}")
    sums = [[0, 0.0, 0.0] for _ in range(n_bins)]  # per bin: count, sum of confidences, sum of outcomes
    for c, y in zip(confidences, outcomes):
        c = min(max(float(c), 0.0), 1.0)
        cell = sums[min(int(c * n_bins), n_bins - 1)]  # c = 1 belongs to the last bin
        cell[0] += 1
        cell[1] += c
        cell[2] += float(y)
    n = len(confidences)
    bins = [
        {
            "lo": round(b / n_bins, 6),
            "hi": round((b + 1) / n_bins, 6),
            "n": count,
            "confidence": conf / count if count else None,
            "accuracy": acc / count if count else None,
        }
        for b, (count, conf, acc) in enumerate(sums)
    ]
    ece = sum(abs(acc - conf) for _, conf, acc in sums) / n if n else None  # n_b/N * |acc_b/n_b - conf_b/n_b|
    return {"ece": ece, "n": n, "bins": bins, **verdict({"ece": ece, "n": n, "bins": bins})}


def verdict(cal: dict, level: float = LEVEL, draws: int = 4000, seed: int = 0) -> dict:
    """Is the ECE of `cal` (as `calibration` returns it, or the report's rounded copy) more than
    calibrated confidences give on as many drafts? Consistency resampling (Bröcker & Smith 2007,
    "Increasing the reliability of reliability diagrams"): bin b's accepted count is redrawn as
    Binomial(n_b, conf_b), as if every confidence were true, and the ECE recomputed,
        ECE* = sum_b |K_b - n_b conf_b| / N,
    `draws` times; "ece_bound" is its (1 - level) quantile. A bin's confidences spread around their
    mean conf_b, and the Binomial at the mean has the largest variance of any such spread, so the
    bound errs high: a calibrated head is flagged at most `level` of the time. On N drafts the bound
    is ~1.7 / sqrt(N) (0.053 on 1,000 drafts, 0.075 on 500): about the smallest shift of every
    confidence it catches (docs/verdicts.md).
    -> {"ece_bound": float, "calibrated": ece <= ece_bound}, both None when N = 0."""
    if not cal["n"]:
        return {"ece_bound": None, "calibrated": None}
    full = [b for b in cal["bins"] if b["n"]]
    n_b = np.array([b["n"] for b in full])
    conf = np.clip([b["confidence"] for b in full], 0.0, 1.0)
    k = np.random.default_rng(seed).binomial(n_b, conf, size=(draws, len(full)))
    null = np.abs(k - n_b * conf).sum(axis=1) / cal["n"]
    bound = float(np.quantile(null, 1 - level))
    return {"ece_bound": bound, "calibrated": bool(cal["ece"] <= bound)}
