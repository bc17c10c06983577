"""serve-check's verdict on acceptance: vLLM and draftsmith judged on the same text, round by round.

vLLM serves the export greedily and reports, per request, every verification round: how many tokens
it drafted and how many it accepted (`--per-request-spec-decode-metrics detailed`). Those rounds tile
vLLM's continuation, so where each round began is known. draftsmith's engine then replays that same
continuation with the trained drafter (draftsmith/engine/replay.py): at each of vLLM's rounds it
drafts from the same prefix, on the target's features of that text, and counts the drafts the text
keeps. Both engines are thus measured on the same positions of the same text, in any precision: a
bf16 near-tie that makes vLLM's text part from draftsmith's own decode no longer changes what is
compared.

Compared: the per-position acceptance P(draft j accepted | drafts < j accepted) pooled over the rounds
whose drafts lie inside the text (`replay.inside`), and τ on those rounds. The tolerance comes from the
sampling error of the prompts. If the engines differ only by chance (bf16 kernels breaking a
drafter's near-ties each their own way), which engine's counts a prompt gives to "vLLM" and which to
"draftsmith" is a coin toss; so the pooled difference is recomputed with the two swapped on every
subset of prompts (all 2^n when n ≤ 12, else 4,096 random ones: a sign-flip randomization over
prompts), and the tolerance is the (1 − 5 %/(K + 1)) quantile of |difference| over those swaps, one
per position and one for τ (Bonferroni over the K + 1). The check fails where a difference exceeds its
tolerance: then engines that differ by chance fail at most 5 % of the time, exactly, whatever the
prompts. (A percentile bootstrap of the paired difference, the first design, failed such engines 9 %
of the time at 12 prompts: its intervals are too narrow for so few; tests/ship/test_replay_check.py.)
Where both engines draft alike every difference is 0; an export that drafts worse on every prompt
exceeds the tolerance (a head perturbed to ~10 % lower τ: tests/ship/test_serve_check.py). With fewer
than `MIN_PROMPTS` no difference can exceed it, and serve-check says so and keeps its τ tolerance.
Beside it, the bootstrap sampling error of draftsmith's own figures (the half-width of their 95 %
interval over prompts) says how precise the benchmark is.
"""

from __future__ import annotations

import itertools

import torch

from draftsmith.engine.replay import Round, inside, replay, rounds_from_steps
from draftsmith.engine.speculative import Stats

BOOTSTRAP_SAMPLES = 2000
SWAPS = 4096  # sign-flip draws when 2^n is more (all 2^n otherwise)
FAMILY_ERROR = 0.05  # the most that engines differing only by chance fail, over all K + 1 comparisons


def min_prompts(k: int) -> int:
    """The fewest prompts with which a difference can exceed its tolerance: the two swaps that give the
    largest |difference| (none, all) must be rarer than FAMILY_ERROR / (K + 1)."""
    return next(n for n in itertools.count(1) if 2 / 2**n <= FAMILY_ERROR / (k + 1))


def _stats(rounds: list[Round], k: int) -> Stats:
    stats = Stats(k=k)
    for r in rounds:
        stats.record(r.drafted, r.accepted, r.accepted + 1, r.drafted)
    return stats


def compare(verifier, proposer, prompts: list[list[int]], outputs: list[list[int]], steps: list, k: int) -> dict:
    """vLLM's rounds (`steps`: per prompt its `metrics.speculative_decoding`, None when the server
    reports none) against draftsmith's replay of them on vLLM's `outputs` -> the comparison
    (`bootstrap`), or {"available": False, "why": ...}."""
    if any(s is None or "per_step_accepted" not in s for s in steps):
        return {
            "available": False,
            "why": "vLLM reported no per-request rounds (serve it with --per-request-spec-decode-metrics detailed)",
        }
    theirs, ours, untiled = [], [], 0
    for prompt, text, s in zip(prompts, outputs, steps):
        rounds = rounds_from_steps(s["per_step_drafted"], s["per_step_accepted"], len(text))
        if rounds is None:  # vLLM skipped drafting on some steps: its rounds' starts are unknown
            untiled += 1
            continue
        mine, _ = replay(verifier, proposer, prompt, text, k, rounds)
        keep = [inside(r, len(text)) for r in rounds]
        theirs.append(_stats([r for r, y in zip(rounds, keep) if y], k))
        ours.append(_stats([m for m, y in zip(mine, keep) if y], k))
    if not theirs:
        return {"available": False, "why": f"vLLM's rounds tile none of the {len(prompts)} continuations"}
    return {"available": True, "prompts": len(theirs), "untiled_prompts": untiled, **bootstrap(theirs, ours, k)}


def _counts(stats: list[Stats]) -> torch.Tensor:
    """Per prompt: [reached_1..K, accepted_1..K, passes, emitted] -> [n, 2K + 2]."""
    return torch.tensor([[*s.reached, *s.accepted_at, s.passes, s.emitted] for s in stats], dtype=torch.float64)


def _figures(pooled: torch.Tensor, k: int) -> torch.Tensor:
    """Pooled counts [..., 2K + 2] -> per-position acceptance and τ [..., K + 1]."""
    reached, accepted = pooled[..., :k], pooled[..., k : 2 * k]
    tau = pooled[..., 2 * k + 1] / pooled[..., 2 * k].clamp(min=1)
    return torch.cat([torch.where(reached > 0, accepted / reached.clamp(min=1), 0.0), tau[..., None]], dim=-1)


def _swaps(n: int, gen: torch.Generator) -> torch.Tensor:
    """Which prompts swap their two engines' counts [S, n]: every subset for small n, else SWAPS random ones."""
    if 2**n <= SWAPS:
        return torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=torch.float64).reshape(-1, n)
    return torch.randint(0, 2, (SWAPS, n), generator=gen).double()


def bootstrap(theirs: list[Stats], ours: list[Stats], k: int, seed: int = 0) -> dict:
    """Per-prompt counts of both engines on the same rounds -> pooled per-position acceptance and τ of
    each, their differences with the tolerance of each (module docstring), the bootstrap sampling error
    of draftsmith's own figures, and the rounds compared."""
    n, gen = len(ours), torch.Generator().manual_seed(seed)
    a, b = _counts(theirs), _counts(ours)
    fig_theirs, fig_ours = _figures(a.sum(0), k), _figures(b.sum(0), k)
    diff = fig_theirs - fig_ours
    swap = _swaps(n, gen)  # [S, n]: 1 = prompt i's counts change sides
    as_theirs = (1 - swap) @ a + swap @ b  # [S, 2K + 2]
    as_ours = swap @ a + (1 - swap) @ b
    swapped = (_figures(as_theirs, k) - _figures(as_ours, k)).abs()  # [S, K + 1]
    tolerance = swapped.quantile(1 - FAMILY_ERROR / (k + 1), dim=0, interpolation="higher")
    # Draftsmith's own figures over prompts drawn with replacement: how precise the benchmark is.
    picks = torch.randint(0, n, (BOOTSTRAP_SAMPLES, n), generator=gen)
    own = _figures(b[picks].sum(1), k)  # [B, K + 1]
    lo, hi = own.quantile(0.025, dim=0), own.quantile(0.975, dim=0)
    r4 = lambda xs: [round(float(x), 4) for x in xs]  # noqa: E731
    return {
        "rounds": int(b[:, 2 * k].sum()),
        "vllm_per_position": r4(fig_theirs[:k]),
        "draftsmith_per_position": r4(fig_ours[:k]),
        "vllm_tau": round(float(fig_theirs[k]), 4),
        "draftsmith_tau": round(float(fig_ours[k]), 4),
        "per_position_diff": r4(diff[:k]),
        "per_position_tolerance": r4(tolerance[:k]),
        "tau_diff": round(float(diff[k]), 4),
        "tau_tolerance": round(float(tolerance[k]), 4),
        "judged": n >= min_prompts(k),
        "per_position_sampling_error": r4((hi - lo)[:k] / 2),
        "tau_sampling_error": round(float(hi[k] - lo[k]) / 2, 4),
        "reached": [int(x) for x in b[:, :k].sum(0)],
    }


def failures(r: dict) -> list[str]:
    """Why the replayed comparison fails, one clause per reason (none: it passed): each difference
    beyond its tolerance."""
    if not r.get("available") or not r["judged"]:
        return []
    rows = [
        (f"acceptance at draft position {j + 1}", v, o, d, t)
        for j, (v, o, d, t) in enumerate(
            zip(
                r["vllm_per_position"],
                r["draftsmith_per_position"],
                r["per_position_diff"],
                r["per_position_tolerance"],
            )
        )
    ]
    rows.append(("τ", r["vllm_tau"], r["draftsmith_tau"], r["tau_diff"], r["tau_tolerance"]))
    return [
        f"{what} on vLLM's own text: {v:.3f} in vLLM vs {o:.3f} in draftsmith, {abs(d):.3f} apart, more than the "
        f"{t:.3f} that chance explains over {r['prompts']} prompts"
        for what, v, o, d, t in rows
        if abs(d) > t
    ]
