"""serve-check's verdict on acceptance: vLLM and draftsmith judged on the same text, round by round.

vLLM serves the export greedily and reports, per request, every verification round: how many tokens
it drafted and how many it accepted (`--per-request-spec-decode-metrics detailed`). Those rounds tile
vLLM's continuation, so where each round began is known. draftsmith's engine then replays that same
continuation with the trained drafter (draftsmith/engine/replay.py): at each of vLLM's rounds it
drafts from the same prefix, on the target's features of that text, and counts the drafts the text
keeps. So every round of vLLM is paired with draftsmith's replay of the same round, and the unit of
evidence is the round, not the prompt: an export that drafts alike accepts the same count in every
round; one that is wrong on some token ids, past some position or in some contexts differs in the
rounds it touches, however few prompts hold them.

The verdict. A round whose two counts differ is a failure unless, at the first draft where the two
part, the trained drafter's logits there are a near-tie (engine/replay.py `parting_gap`): its top-1
within `tie_limit` of the token the other engine must have drafted. Two implementations of one
drafter in one precision round their logits differently, and only a near-tie can flip on that:

- fp32: the bound is `FP32_TIE_RELATIVE` of the top logit's magnitude (2^-10: some 8,000 fp32 ulps,
  far above what reordered fp32 kernels move a logit, far below a trained drafter's margins). On the
  quickstart head every fp32 round agrees (docs/verdicts.md), so the bound is never needed there.
- bf16 (or fp16): `DRAFT_TIE_STEPS` steps of the precision at the top logit's magnitude. The drafter
  reads the target's features, which vLLM and draftsmith compute with other kernels and chunking, so
  its logits could differ by more than the target's own; measured, they do not: on the quickstart
  head served by vLLM in bf16, 7 of 475 rounds differed, every one at a gap of 0 or 1 bf16 step
  (docs/verdicts.md), so the bound is the target's 4 steps (serve_check.NEAR_TIE_STEPS).

Near-tie flips are then bounded by a rate: where the drafter's margin at a draft both engines made
from the same context is within the bound, rounding picks either token, so at most half of those
drafts can flip by chance (an exact tie: one half; a wider gap: less). `scipy.stats.binomtest` of
the flips against 1/2 over those drafts fails at `FAMILY_ERROR`: an export whose differences sit at
near-ties but far more often than rounding explains fails too. Per prompt, the report lists the
rounds that differ. A proposer that shows the replay no logits (Medusa's heads take no sampler) has
no near-ties: any differing round of it fails, which in bf16 may be a rounding flip.

Beside the verdict stay the pooled figures as the summary: per-position acceptance P(draft j accepted
| drafts < j accepted) and τ of both engines on the same rounds, with the bootstrap sampling error of
draftsmith's figures over prompts (`scipy.stats.bootstrap`, 95 %): how precise the benchmark is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as scistats

from draftsmith.engine.replay import Round, inside, replay, rounds_from_steps
from draftsmith.engine.speculative import Stats

BOOTSTRAP_SAMPLES = 2000
FAMILY_ERROR = 0.05  # the near-tie flip test's level: engines differing only by rounding fail it at most 5 %
FP32_TIE_RELATIVE = 2.0**-10
DRAFT_TIE_STEPS = 4  # measured flips sat within 1 step (quickstart head in vLLM, bf16: docs/verdicts.md)
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}


def tie_limit(top_logit: float, dtype: str) -> float:
    """The largest logit gap of the drafter that counts as a near-tie in `dtype` next to a top logit of
    this size: fp32 a relative 2^-10; low precision `DRAFT_TIE_STEPS` steps (2^(e - mantissa bits) for
    |logit| in [2^e, 2^(e+1)))."""
    if dtype == "float32":
        return FP32_TIE_RELATIVE * max(abs(top_logit), 1.0)
    scale = 2.0 ** math.floor(math.log2(max(abs(top_logit), 1.0)))
    return DRAFT_TIE_STEPS * scale * 2.0 ** -MANTISSA_BITS.get(dtype, 7)


@dataclass
class Pair:
    """One of vLLM's rounds and draftsmith's replay of it (the same start and draft count)."""

    prompt: int
    theirs: Round
    ours: Round

    @property
    def differs(self) -> bool:
        return self.theirs.accepted != self.ours.accepted

    def near_tie(self, dtype: str) -> bool:
        o = self.ours
        return o.gap is not None and o.tops is not None and o.gap <= tie_limit(o.tops[o.parted_at or 0], dtype)

    def tie_drafts(self, dtype: str) -> int:
        """Drafts both engines made from the same context (up to and including the first rejection of
        either) whose margin is within the bound: where rounding alone could flip a choice."""
        o = self.ours
        if o.margins is None or o.tops is None:
            return 0
        seen = min(self.theirs.accepted, o.accepted, o.drafted - 1) + 1
        return sum(m <= tie_limit(t, dtype) for m, t in zip(o.margins[:seen], o.tops[:seen]))


def _stats(rounds: list[Round], k: int) -> Stats:
    stats = Stats(k=k)
    for r in rounds:
        stats.record(r.drafted, r.accepted, r.accepted + 1, r.drafted)
    return stats


def compare(
    verifier, proposer, prompts: list[list[int]], outputs: list[list[int]], steps: list, k: int, dtype: str = "float32"
) -> dict:
    """vLLM's rounds (`steps`: per prompt its `metrics.speculative_decoding`, None when the server
    reports none) against draftsmith's replay of them on vLLM's `outputs`, in `dtype` -> the round
    verdict (`judge`) and the pooled summary (`summary`), or {"available": False, "why": ...}."""
    if any(s is None or "per_step_accepted" not in s for s in steps):
        return {
            "available": False,
            "why": "vLLM reported no per-request rounds (serve it with --per-request-spec-decode-metrics detailed)",
        }
    pairs: list[Pair] = []
    untiled = 0
    for n, (prompt, text, s) in enumerate(zip(prompts, outputs, steps)):
        rounds = rounds_from_steps(s["per_step_drafted"], s["per_step_accepted"], len(text))
        if rounds is None:  # vLLM skipped drafting on some steps: its rounds' starts are unknown
            untiled += 1
            continue
        mine, _ = replay(verifier, proposer, prompt, text, k, rounds)
        pairs += [Pair(n, r, m) for r, m in zip(rounds, mine) if inside(r, len(text))]
    if not pairs:
        return {"available": False, "why": f"vLLM's rounds tile none of the {len(prompts)} continuations"}
    prompts_seen = len({p.prompt for p in pairs})
    return {
        "available": True,
        "prompts": prompts_seen,
        "untiled_prompts": untiled,
        **judge(pairs, dtype),
        **summary(pairs, k),
    }


def judge(pairs: list[Pair], dtype: str) -> dict:
    """The round verdict's counts: rounds compared, those whose counts differ at a gap beyond the
    near-tie bound (`clear`) and at a near-tie (`flips`), the drafts where a flip was possible, the
    binomial test of the flips against 1/2 of those, and per prompt its differing rounds."""
    differing = [p for p in pairs if p.differs]
    clear = [p for p in differing if not p.near_tie(dtype)]
    flips = len(differing) - len(clear)
    ties = sum(p.tie_drafts(dtype) for p in pairs)
    # Under rounding alone each near-tie draft flips with probability at most 1/2.
    p_value = scistats.binomtest(flips, max(ties, flips), 0.5, alternative="greater").pvalue if flips else 1.0
    by_prompt: dict[int, dict] = {}
    for p in differing:
        row = by_prompt.setdefault(p.prompt, {"prompt": p.prompt, "clear": 0, "near_tie": 0, "gaps": []})
        row["clear" if p in clear else "near_tie"] += 1
        row["gaps"].append(None if p.ours.gap is None else round(p.ours.gap, 4))
    return {
        "dtype": dtype,
        "rounds": len(pairs),
        "rounds_differing": len(differing),
        "rounds_clear": len(clear),
        "rounds_near_tie": flips,
        "tie_drafts": ties,
        "flip_p_value": round(float(p_value), 6),
        "tie_bound": f"{DRAFT_TIE_STEPS} {dtype} steps of the top logit"
        if dtype != "float32"
        else f"{FP32_TIE_RELATIVE:.3g} of the top logit",
        "differing_prompts": [by_prompt[n] for n in sorted(by_prompt)],
        "largest_clear_gaps": sorted((round(p.ours.gap, 4) for p in clear if p.ours.gap is not None), reverse=True)[:5],
    }


def _counts(stats: list[Stats]) -> np.ndarray:
    """Per prompt: [reached_1..K, accepted_1..K, passes, emitted] -> [n, 2K + 2]."""
    return np.array([[*s.reached, *s.accepted_at, s.passes, s.emitted] for s in stats], dtype=np.float64)


def _figures(pooled: np.ndarray, k: int) -> np.ndarray:
    """Pooled counts [..., 2K + 2] -> per-position acceptance and τ [..., K + 1]."""
    reached, accepted = pooled[..., :k], pooled[..., k : 2 * k]
    tau = pooled[..., 2 * k + 1] / np.maximum(pooled[..., 2 * k], 1)
    per_position = np.where(reached > 0, accepted / np.maximum(reached, 1), 0.0)
    return np.concatenate([per_position, tau[..., None]], axis=-1)


def summary(pairs: list[Pair], k: int) -> dict:
    """The pooled per-position acceptance and τ of both engines on the compared rounds, their
    differences, and the bootstrap sampling error over prompts of draftsmith's figures."""
    prompts = sorted({p.prompt for p in pairs})
    theirs = _counts([_stats([p.theirs for p in pairs if p.prompt == n], k) for n in prompts])
    ours = _counts([_stats([p.ours for p in pairs if p.prompt == n], k) for n in prompts])
    fig_theirs, fig_ours = _figures(theirs.sum(0), k), _figures(ours.sum(0), k)
    error = sampling_error(ours, k)
    r4 = lambda xs: [round(float(x), 4) for x in xs]  # noqa: E731
    return {
        "vllm_per_position": r4(fig_theirs[:k]),
        "draftsmith_per_position": r4(fig_ours[:k]),
        "vllm_tau": round(float(fig_theirs[k]), 4),
        "draftsmith_tau": round(float(fig_ours[k]), 4),
        "per_position_diff": r4((fig_theirs - fig_ours)[:k]),
        "tau_diff": round(float(fig_theirs[k] - fig_ours[k]), 4),
        "per_position_sampling_error": r4(error[:k]),
        "tau_sampling_error": round(float(error[k]), 4),
        "reached": [int(x) for x in ours[:, :k].sum(0)],
    }


def sampling_error(counts: np.ndarray, k: int) -> np.ndarray:
    """Half-widths of the 95 % percentile bootstrap intervals over prompts (rows of `counts`) of the
    pooled per-position acceptance and τ [K + 1]; 0 with a single prompt (nothing to resample)."""
    if len(counts) < 2:
        return np.zeros(k + 1)
    got = scistats.bootstrap(
        (np.arange(len(counts)),),
        lambda i, axis=-1: _pooled(counts, i, k),
        n_resamples=BOOTSTRAP_SAMPLES,
        method="percentile",
        random_state=np.random.default_rng(0),
        vectorized=True,
    ).confidence_interval
    return np.nan_to_num((np.asarray(got.high) - np.asarray(got.low)) / 2)


def _pooled(counts: np.ndarray, idx: np.ndarray, k: int) -> np.ndarray:
    """The figures [K + 1, ...] of resampled prompt indices `idx` [..., n] (scipy moves the statistic's
    outputs to the first axis)."""
    figures = _figures(counts[idx.astype(int)].sum(axis=-2), k)  # [..., K + 1]
    return np.moveaxis(figures, -1, 0)


def failures(r: dict) -> list[str]:
    """Why the round verdict fails, one clause per reason (none: it passed)."""
    if not r.get("available"):
        return []
    why = []
    if r["rounds_clear"]:
        where = ", ".join(f"{d['clear']} on prompt {d['prompt']}" for d in r["differing_prompts"] if d["clear"])
        why.append(
            f"{r['rounds_clear']} of {r['rounds']} rounds on vLLM's own text accepted another count in vLLM than in "
            f"draftsmith's replay where the drafter's logits are no near-tie ({where}; largest gaps "
            f"{', '.join(f'{g:.3g}' for g in r['largest_clear_gaps'])}; bound {r['tie_bound']})"
        )
    if r["rounds_near_tie"] and r["flip_p_value"] < FAMILY_ERROR:
        why.append(
            f"{r['rounds_near_tie']} rounds flipped at near-ties of {r['tie_drafts']} drafts where rounding could flip one: "
            f"more than half (binomial p = {r['flip_p_value']:.2g} < {FAMILY_ERROR})"
        )
    return why
