"""Chain speculative decoding with KV caches for target and drafter, greedy or sampled.

One round: the drafter proposes K tokens; the target scores [last token, d_1..d_K] in one forward
pass; a verify rule keeps a prefix of the drafts and adds one token from the target. Greedy keeps
drafts equal to the target's argmax (output identical to target-only greedy); sampling uses the
Leviathan rejection rule (output distributed exactly as target-only sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from draftsmith.data.features import target_features
from draftsmith.models.common import crop_cache


@dataclass
class Stats:
    """Pooled counters over all prompts (EAGLE / Spec-Bench style)."""

    k: int
    passes: int = 0          # target verification passes (the prefill pass is not counted)
    emitted: int = 0         # tokens emitted by those passes, bonus included
    proposed: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)    # rounds in which draft position j was reached
    accepted_at: list[int] = field(default_factory=list)
    seconds: float = 0.0
    new_tokens: int = 0      # all generated tokens (prefill token included), for tokens/s

    def __post_init__(self):
        self.reached = self.reached or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, n_draft: int, n_accepted: int, n_emitted: int) -> None:
        self.passes += 1
        self.emitted += n_emitted
        self.proposed += n_draft
        self.accepted += n_accepted
        # Position j is reached iff positions 0..j-1 were all accepted.
        for j in range(min(n_accepted + 1, n_draft)):
            self.reached[j] += 1
            self.accepted_at[j] += int(j < n_accepted)

    @property
    def tau(self) -> float:
        return self.emitted / max(self.passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]


def _forward(target, ids: list[int], cache, device, names=()):
    """Target forward over new tokens with its KV cache -> (features dict [1, T, *], logits [1, T, V])."""
    x = torch.tensor([ids], device=device)
    feats = target_features(target, {"input_ids": x}, tuple(names) + ("last_hidden",), cache=cache)
    return feats, target.get_output_embeddings()(feats["last_hidden"])


@torch.no_grad()
def target_decode(target, prompt: list[int], max_new: int, eos: set[int], sampler=None) -> list[int]:
    """Plain decoding with a KV cache, greedy (sampler None) or sampled: the baseline, and the
    reference that speculative decoding must reproduce exactly (greedy) or in distribution."""
    device = next(target.parameters()).device
    cache = DynamicCache()
    pick = (lambda lg: int(lg.argmax())) if sampler is None else (lambda lg: sampler.sample(sampler.probs(lg)))
    _, logits = _forward(target, prompt, cache, device)
    out = [pick(logits[0, -1])]
    while len(out) < max_new and out[-1] not in eos:
        _, logits = _forward(target, out[-1:], cache, device)
        out.append(pick(logits[0, -1]))
    return out


def target_greedy(target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    return target_decode(target, prompt, max_new, eos)


def speculative_greedy(target, proposer, prompt: list[int], k: int, max_new: int, eos: set[int],
                       stats: Stats | None = None) -> list[int]:
    return speculative_decode(target, proposer, prompt, k, max_new, eos, None, stats)


def _truncate(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


class NgramProposer:
    """Prompt-lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n
    tokens (n = max_ngram..1) and propose the k tokens that followed it. No training, no features."""

    feature_names = ()

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def reset(self):
        pass

    def propose(self, tokens: torch.Tensor, feats, k: int, sampler=None) -> list[int]:
        # Deterministic proposals: under sampling they count as q = one-hot (see speculative_sample).
        seq = tokens[0].tolist()
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return follow
        return []


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

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> int:
        """On rejection, sample from norm(max(0, p - q)): this makes the output exactly p."""
        r = (p - q).clamp(min=0)
        return self.sample(r / r.sum() if r.sum() > 0 else p)


def target_sample(target, prompt: list[int], max_new: int, eos: set[int], sampler: "Sampler") -> list[int]:
    return target_decode(target, prompt, max_new, eos, sampler)


def speculative_sample(target, proposer, prompt: list[int], k: int, max_new: int, eos: set[int],
                       sampler: Sampler, stats: Stats | None = None) -> list[int]:
    return speculative_decode(target, proposer, prompt, k, max_new, eos, sampler, stats)


def verify_greedy(draft: list[int], logits: torch.Tensor) -> list[int]:
    """Accept the longest prefix where each draft equals the target's argmax, plus the target's
    own next token (the bonus): at temperature 0 the output is exactly target-only greedy."""
    preds = logits.argmax(-1).tolist()  # preds[j] = target's choice after draft[:j]
    a = 0
    while a < len(draft) and draft[a] == preds[a]:
        a += 1
    return draft[:a] + [preds[a]]


def verify_sampled(draft: list[int], logits: torch.Tensor, qs: list, sampler: Sampler) -> list[int]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft j is kept with
    probability min(1, p_j(x)/q_j(x)); the first rejection resamples from norm(max(0, p_j - q_j))
    and ends the round; if all K are kept, a bonus token comes from p_K. Proposers without a
    distribution (prompt lookup) count as q = one-hot on their token."""
    p = sampler.probs(logits)  # p[j]: target distribution after draft[:j]
    new = []
    for j, x in enumerate(draft):
        q = qs[j] if qs else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p)
        if not sampler.accept(float(p[j, x]), float(q[x])):
            return new + [sampler.residual(p[j], q)]
        new.append(x)
    return new + [sampler.sample(p[len(draft)])]


@torch.no_grad()
def speculative_decode(target, proposer, prompt: list[int], k: int, max_new: int, eos: set[int],
                       sampler: Sampler | None = None, stats: Stats | None = None) -> list[int]:
    """One round: the drafter proposes K tokens; the target scores [last token, d_1..d_K] in one
    forward pass; the verify rule keeps a prefix and adds one target token."""
    device = next(target.parameters()).device
    names = getattr(proposer, "feature_names", ())
    cache = DynamicCache()
    feats, logits = _forward(target, prompt, cache, device, names)
    first = logits[0, -1]
    tokens = list(prompt) + [int(first.argmax()) if sampler is None else sampler.sample(sampler.probs(first))]
    # Target features of every token the target has processed (all but the newest one).
    feats = {n: feats[n] for n in names}
    if proposer is not None:
        proposer.reset()
    while len(tokens) - len(prompt) < max_new and tokens[-1] not in eos:
        ctx = torch.tensor([tokens], device=device)
        draft = proposer.propose(ctx, feats, k, sampler) if proposer and k else []
        new_feats, logits = _forward(target, tokens[-1:] + draft, cache, device, names)
        new = (verify_greedy(draft, logits[0]) if sampler is None
               else verify_sampled(draft, logits[0], getattr(proposer, "q", []), sampler))
        a = len(new) - 1  # accepted drafts; the last token is the target's own
        # The target processed the last token and all K drafts; keep the last token + a accepted.
        crop_cache(cache, len(tokens) + a)
        feats = {n: torch.cat([feats[n], new_feats[n][:, : a + 1]], dim=1) for n in names}
        budget = max_new - (len(tokens) - len(prompt))
        new = _truncate(new[:budget], eos)
        tokens += new
        if stats is not None:
            stats.record(len(draft), min(a, len(new)), len(new))
    return tokens[len(prompt):]
