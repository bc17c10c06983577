"""Calibration of a drafter's confidences: expected calibration error and the reliability table.

A confidence head (DSpark, arXiv 2607.05147) says c_i = P(draft i accepted | drafts < i accepted),
and vLLM 0.32's adaptive verification spends its token budget on those numbers as if they were true
probabilities, so the eval stage reports how true they are (Guo et al. 2017, "On Calibration of
Modern Neural Networks", arXiv:1706.04599, section 2: reliability diagrams and ECE).
"""

from __future__ import annotations


def calibration(confidences: list[float], outcomes: list[int], n_bins: int = 10) -> dict:
    """Expected calibration error over equal-width bins of [0, 1].

    confidences [N] in [0, 1]; outcomes [N] in {0, 1} (1 = the draft was accepted). Bin b holds
    b/n_bins <= c < (b+1)/n_bins, the last bin also c = 1. With n_b pairs, mean confidence conf_b
    and accuracy acc_b (mean outcome) in bin b,
        ECE = sum_b (n_b / N) * |acc_b - conf_b|,
    so empty bins add nothing. -> {"ece": float (None when N = 0), "n": N, "bins": [{"lo", "hi",
    "n", "confidence", "accuracy"} per bin, confidence/accuracy None when the bin is empty]}.
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
    return {"ece": ece, "n": n, "bins": bins}
