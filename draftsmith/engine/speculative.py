"""Speculative decoding with KV caches for target and drafter: chains or trees, greedy or sampled.

One round: the drafter proposes a draft (a chain of K tokens or a tree, draftsmith/engine/drafts.py); the target
scores [last token, draft nodes] in one forward pass with tree attention; a verify rule keeps one
root-to-leaf path and adds one token from the target. Greedy keeps drafts equal to the target's
argmax (output identical to target-only greedy); sampling uses the Leviathan rejection rule,
sibling by sibling on trees (output distributed exactly as target-only sampling). With adaptive
verification (vLLM 0.32), a chain whose drafter gives confidences is first cut to the prefix worth
scoring (draftsmith/engine/verify.py `adaptive_prefixes`); the cut reads the drafter's outputs only, so
both guarantees hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from draftsmith.engine.cache import keep_cache_positions
from draftsmith.engine.drafts import Draft, TreeSpec
from draftsmith.engine.verify import (
    AdaptiveCosts,
    adaptive_draft,
    rule_exact,
    verification_inputs,
    verify_tree_greedy,
    verify_tree_sampled,
)
from draftsmith.target.features import target_features


@dataclass
class Stats:
    """Pooled counters over all prompts (EAGLE / Spec-Bench style)."""

    k: int
    passes: int = 0  # target verification passes (the prefill pass is not counted)
    emitted: int = 0  # tokens emitted by those passes, bonus included
    proposed: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # rounds in which draft position j was reached
    accepted_at: list[int] = field(default_factory=list)
    seconds: float = 0.0
    new_tokens: int = 0  # all generated tokens (prefill token included), for tokens/s
    rule_breaks: int = 0  # greedy rounds whose emitted tokens are not the rule's for that pass (draftsmith/engine/verify.py rule_exact)
    draft_seconds: float = 0.0  # time in `propose`: the draft cost of adaptive verification (eval/run.py)
    # (c_i, accepted) for every verified draft i of a chain with confidences whose drafts < i were all
    # accepted: the calibration data of the drafter's confidence (draftsmith/util/calibration.py).
    confidence_outcomes: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, n_draft: int, n_accepted: int, n_emitted: int, depth: int) -> None:
        """n_draft: draft nodes scored; depth: the draft's depth (= n_draft for a chain)."""
        self.passes += 1
        self.emitted += n_emitted
        self.proposed += n_draft
        self.accepted += n_accepted
        # Position (depth) j is reached iff positions 0..j-1 were all accepted. A round cut by the
        # budget or an EOS inside its accepted drafts emits no token of the target's after them
        # (n_emitted == n_accepted): the draft after them was never judged, so it is not counted.
        judged = n_accepted + 1 if n_emitted > n_accepted else n_accepted
        for j in range(min(judged, depth)):
            self.reached[j] += 1
            self.accepted_at[j] += int(j < n_accepted)

    def record_confidence(
        self, confidence: list[float] | None, n_verified: int, n_accepted: int, n_emitted: int
    ) -> None:
        """Draft j was reached (drafts < j accepted) iff j <= n_accepted; its outcome is j < n_accepted.
        Positions after the first rejection say nothing about c_j, which is conditional on reaching j;
        nor does the draft after a round cut inside its accepted drafts (`record`): the same drafts as
        `reached` counts."""
        if confidence is None:
            return
        judged = n_accepted + 1 if n_emitted > n_accepted else n_accepted
        for j in range(min(judged, n_verified)):
            self.confidence_outcomes.append((float(confidence[j]), int(j < n_accepted)))

    @property
    def tau(self) -> float:
        return self.emitted / max(self.passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]


def verification_forward(target, ids: list[int], cache, device, names=(), mask=None, positions=None):
    """Target forward over new tokens with its KV cache -> (features dict [1, T, *], logits [1, T, V]).
    mask/positions: a 4-D tree attention mask and its position ids (default: causal, consecutive)."""
    batch = {"input_ids": torch.tensor([ids], device=device), "attention_mask": mask, "position_ids": positions}
    feats = target_features(target, batch, tuple(names) + ("last_hidden",), cache=cache)
    return feats, target.get_output_embeddings()(feats["last_hidden"])


def target_decode(target, prompt: list[int], max_new: int, eos: set[int], sampler=None) -> list[int]:
    """Target-only decoding, greedy (sampler None) or sampled: the baseline, and the reference that
    speculative decoding must reproduce exactly (greedy) or in distribution.

    It is `speculative_decode` with no drafter, on purpose: the baseline and the reference are one
    computation (the same forward with the same verification mask and position ids, so the same
    kernels), so `--drafter none` is identical to the reference in bf16 too, and any mismatch an
    eval reports comes from the drafts, never from two code paths (docs/troubleshooting.md, "bf16 near-ties")."""
    return speculative_decode(target, None, prompt, 0, max_new, eos, sampler)


def target_greedy(target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    return target_decode(target, prompt, max_new, eos)


def speculative_greedy(
    target, proposer, prompt: list[int], k: int, max_new: int, eos: set[int], stats: Stats | None = None
) -> list[int]:
    return speculative_decode(target, proposer, prompt, k, max_new, eos, None, stats)


def _truncate(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


class Sampler:
    """Temperature + top-p warping shared by target and drafter, and seeded sampling.
    Speculative sampling is lossless only if both sides warp their logits identically."""

    def __init__(self, temperature: float, top_p: float = 1.0, seed: int = 0, device="cpu"):
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, idx = torch.sort(p, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            p = p.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
            p = p / p.sum(-1, keepdim=True)
        return p

    def sample(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p, 1, generator=self.generator))

    def accept(self, p_x: float, q_x: float) -> bool:
        """Leviathan et al. 2023, Algorithm 1: keep draft x with probability min(1, p(x) / q(x))."""
        u = float(torch.rand((), generator=self.generator))
        return u * q_x < p_x  # u < p/q without dividing by a zero q

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """After rejecting a draft from q: norm(max(0, p - q)), which makes the output exactly p.
        (Its mass is zero only if p == q, where rejection has probability zero.)"""
        r = (p - q).clamp(min=0)
        return r / r.sum() if r.sum() > 0 else p


def target_sample(target, prompt: list[int], max_new: int, eos: set[int], sampler: "Sampler") -> list[int]:
    return target_decode(target, prompt, max_new, eos, sampler)


def speculative_sample(
    target,
    proposer,
    prompt: list[int],
    k: int,
    max_new: int,
    eos: set[int],
    sampler: Sampler,
    stats: Stats | None = None,
) -> list[int]:
    return speculative_decode(target, proposer, prompt, k, max_new, eos, sampler, stats)


@torch.no_grad()
def speculative_decode(
    target,
    proposer,
    prompt: list[int],
    k: int,
    max_new: int,
    eos: set[int],
    sampler: Sampler | None = None,
    stats: Stats | None = None,
    tree: TreeSpec | None = None,
    adaptive: AdaptiveCosts | None = None,
) -> list[int]:
    """One round: the drafter proposes a chain of K tokens (or a tree); the target scores the last
    token and every draft node in one forward pass; the verify rule keeps one path and adds one
    target token. adaptive: verify only the prefix of a chain that the drafter's confidences make
    worth its cost (vLLM 0.32's rule, draftsmith/engine/verify.py); None = every draft."""
    device = next(target.parameters()).device
    names = () if proposer is None else proposer.feature_names
    cache = DynamicCache()
    feats, logits = verification_forward(target, prompt, cache, device, names)
    first = logits[0, -1]
    tokens = list(prompt) + [int(first.argmax()) if sampler is None else sampler.sample(sampler.probs(first))]
    # Target features of every token the target has processed (all but the newest one).
    feats = {n: feats[n] for n in names}
    if proposer is not None:
        proposer.reset()
    while len(tokens) - len(prompt) < max_new and tokens[-1] not in eos:
        if proposer is None or (tree is None and not k):
            draft = Draft()
        else:
            ctx = torch.tensor([tokens], device=device)
            start = time.perf_counter()
            draft = (
                proposer.propose(ctx, feats, k, sampler) if tree is None else proposer.propose_tree(ctx, feats, tree)
            )
            if stats is not None:
                stats.draft_seconds += time.perf_counter() - start
            # The cut reads the draft's own confidences only, before the target sees it: lossless.
            draft = adaptive_draft(draft, adaptive)
        prefix = len(tokens) - 1  # the target has cached every token but the newest (the root)
        mask, positions = verification_inputs(draft, prefix, device)
        new_feats, logits = verification_forward(
            target, tokens[-1:] + draft.tokens, cache, device, names, mask, positions
        )
        path, new = (
            verify_tree_greedy(draft, logits[0]) if sampler is None else verify_tree_sampled(draft, logits[0], sampler)
        )
        if stats is not None and sampler is None:
            stats.rule_breaks += not rule_exact(draft, logits[0], path, new)
        # Keep the root and the accepted path in the target's cache and features: rows 0 and 1+i.
        rows = [0] + [1 + i for i in path]
        keep_cache_positions(cache, prefix, [prefix + r for r in rows])
        feats = {n: torch.cat([feats[n], new_feats[n][:, rows]], dim=1) for n in names}
        budget = max_new - (len(tokens) - len(prompt))
        new = _truncate(new[:budget], eos)
        # Some training-free drafters learn from the target's outputs on their own nodes (lookahead
        # decoding's Jacobi step, draftsmith/engine/lookahead.py): logits[0] row 0 = after the root, 1+i = after node i.
        if proposer is not None:
            proposer.observe(draft, logits[0], path, new)
        tokens += new
        if stats is not None:
            accepted = min(len(path), len(new))
            stats.record(len(draft.tokens), accepted, len(new), draft.max_depth)
            stats.record_confidence(draft.confidence if tree is None else None, len(draft.tokens), accepted, len(new))
    return tokens[len(prompt) :]
