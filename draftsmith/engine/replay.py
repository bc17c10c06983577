"""Replay: a drafter's acceptance on a continuation that is given, not decoded (teacher forcing).

Two engines that serve one drafter can only be compared on the same text. Once a greedy decode
parts from another at a near-tie (bf16 rounds a verification pass and a one-token step differently),
each engine's τ is measured on its own continuation, and the comparison measures the texts. Replay
fixes the text: the target runs once over prompt + continuation (its features are what a speculative
decode of that text verifies), and at each round the drafter proposes from the continuation's prefix;
the round accepts the drafts that equal the continuation's next tokens.

The rounds are either given (another engine's: where each began and how many it drafted, e.g. vLLM's
per-request `per_step_drafted` / `per_step_accepted`), so both engines are judged round by round on
the same drafting positions; or the replay's own (advance past the accepted drafts and one more
token), which is the greedy engine's own loop: on the target's greedy continuation, replay gives the
engine's τ and per-position counts exactly (tests/engine/test_replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.engine.speculative import Stats
from draftsmith.target.features import target_features


@dataclass
class Round:
    """One verification round of a continuation: `start` = tokens of the continuation already
    emitted before it (the prefill pass emits the first, so rounds start at 1); `drafted`: draft
    tokens verified; `accepted`: how many of them were kept."""

    start: int
    drafted: int
    accepted: int
    # Replayed rounds only: per draft, the drafter's top logit and its margin over the runner-up
    # (None where the proposer shows no logits: Medusa's heads).
    tops: list[float] | None = None
    margins: list[float] | None = None
    # Replayed against a given round whose count differs: the drafter's logit gap at the first draft
    # where the two part (`parting_gap`), and that draft's index.
    gap: float | None = None
    parted_at: int | None = None


class _Greedy:
    """A 'sampler' for `proposer.propose` that drafts greedily (the argmax, as with no sampler) and keeps
    the logits row each draft was picked from in `Draft.qs`: every proposer that samples hands its
    sampler that row, so the replay sees the drafter's margins without a hook in each family."""

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float()

    def sample(self, q: torch.Tensor) -> int:
        return int(q.argmax())


def parting_gap(logits: torch.Tensor, accepted: int, other: int, truth: list[int]) -> float:
    """The drafter's logit gap at the first draft where a round that accepted `accepted` drafts parts
    from another engine's round that accepted `other` (draft j = min of the two), on that draft's
    logits [V]. If this drafter's draft j was rejected, the other engine drafted the text's token there:
    the gap is top-1 minus that token's logit. If it was kept, the other engine drafted anything but it:
    the gap is at least the top-1's margin over the runner-up, which is returned. A near-tie gap means
    rounding could have flipped the choice; a large one means the two drafters disagree."""
    top2 = logits.topk(2).values
    if accepted < other:
        return float(top2[0] - logits[truth[accepted]])
    return float(top2[0] - top2[1])


def rounds_from_steps(drafted: list[int], accepted: list[int], length: int) -> list[Round] | None:
    """Another engine's per-round counts (in order) on a continuation of `length` tokens -> its rounds,
    or None when they do not tile that continuation (an engine that skipped drafting on some steps:
    then where a round began is unknown). Each round emits its accepted drafts and one token more;
    the last may run past `length` (drafts accepted beyond max_tokens or an EOS, then cut)."""
    rounds, start = [], 1
    for d, a in zip(drafted, accepted):
        if start >= length:
            return None  # a round after the continuation ended
        rounds.append(Round(start, d, a))
        start += a + 1
    return rounds if start >= length or not rounds else None


def inside(r: Round, length: int) -> bool:
    """Whether a round's drafts and bonus token all lie inside a continuation of `length` tokens: only
    there is what the other engine accepted fully visible in the text (a last round cut at max_tokens
    or after an EOS may have accepted drafts that are not in it)."""
    return r.start + r.drafted + 1 <= length


@torch.no_grad()
def replay(target, proposer, prompt: list[int], continuation: list[int], k: int, rounds: list[Round] | None = None):
    """Drafts of `proposer` on `continuation` (after `prompt`) -> (the rounds replayed, each with the
    drafts this proposer got accepted, and their `Stats`). `rounds`: draft at those starts with
    those draft counts; None: the replay's own greedy rounds of chain K = `k`."""
    device = next(target.parameters()).device
    names = tuple(proposer.feature_names)
    ids = list(prompt) + list(continuation)
    batch = {"input_ids": torch.tensor([ids], device=device), "attention_mask": None}
    feats = target_features(target, batch, names) if names else {}
    proposer.reset()
    stats = Stats(k=max([k, *(r.drafted for r in rounds or [])]))

    def draft_at(start: int, want: int, other: int | None = None) -> Round:
        n = len(prompt) + start  # tokens known when the round drafts; the target verified all but the newest
        made = proposer.propose(
            torch.tensor([ids[:n]], device=device), {m: feats[m][:, : n - 1] for m in names}, want, _Greedy()
        )
        draft, rows = made.tokens, [q for q in made.qs if q is not None]
        # The continuation ends at an EOS or at the budget: a draft is kept only where the text goes on.
        truth = continuation[start : start + len(draft)]
        accepted = next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), len(truth))
        stats.record(len(draft), accepted, min(accepted + 1, len(continuation) - start), len(draft))
        done = Round(start, len(draft), accepted)
        if rows and len(rows) == len(draft):
            top2 = torch.stack([q.topk(2).values for q in rows])  # [drafts, 2]
            done.tops, done.margins = top2[:, 0].tolist(), (top2[:, 0] - top2[:, 1]).tolist()
            j = min(accepted, other if other is not None else accepted)
            if other is not None and other != accepted and j < len(truth):
                done.gap, done.parted_at = parting_gap(rows[j], accepted, other, truth), j
        return done

    if rounds is not None:
        done = [draft_at(r.start, r.drafted, r.accepted) for r in rounds]
    else:  # the greedy engine's loop: the next round starts past the accepted drafts and one more token
        done, start = [], 1
        while start < len(continuation):
            done.append(draft_at(start, k))
            start += done[-1].accepted + 1
    return done, stats
