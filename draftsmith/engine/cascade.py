"""Cascades: three-level speculation (staged speculative decoding, Spector & Ré 2023, arXiv:2308.04623;
the vertical cascade of Cascade Speculative Drafting, Chen et al. 2023, arXiv:2312.11462).

A cheap proposer `low` (prompt lookup, or any token-only chain proposer) drafts for an intermediate
causal LM `mid` (a distilled student, or the target with layers skipped, draftsmith/engine/selfspec.py); the mid
runs its own greedy speculative decoding until it holds K tokens, and those K tokens are the draft
the *target* verifies through the ordinary engine (draftsmith/engine/speculative.py). One mid round:

    low proposes d_0..d_{r-1} after the mid's context c
    mid scores [pending..., d_0..d_{r-1}] in one pass with its own KV cache
    keep the longest prefix of d equal to the mid's argmax, plus the mid's own next token

so the K tokens are exactly the mid's greedy continuation of the target-verified context, whatever
`low` proposed. The cascade is a plain chain proposer for the target: greedy decoding stays
token-exact, and under target sampling the draft is deterministic given the context (q = one-hot,
verify_tree_sampled), so the Leviathan rule keeps the output distributed as the target's.

The mid's cache re-syncs each round to the target-verified tokens by longest common prefix (as
StudentProposer does) and drops rejected low drafts after every mid pass. `level_stats()` gives the
mid level's own τ and its acceptance of low drafts; the target level's come from the engine's Stats.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.engine.cache import crop_cache
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer, StudentProposer, resync
from draftsmith.engine.speculative import Stats

# Counters pooled over every round of every prompt (reset() keeps them, like the engine's Stats).
COUNTERS = ("rounds", "mid_passes", "mid_tokens", "mid_synced", "low_proposed", "low_accepted")


class CascadeProposer(Proposer):
    """Chain drafts for the target = the mid model's greedy continuation, found by speculative
    decoding of the mid with `low` as its drafter.

    low: a chain proposer reading tokens only (`propose(tokens, feats, k, sampler) -> Draft`,
    `feature_names == ()`). mid: a causal LM called as `mid(input_ids=, cache=, use_cache=True,
    logits_to_keep=n).logits` (a transformers model, or SkipLayers). mid_k: at most this many low
    drafts per mid pass (None: as many as the chain still needs)."""

    feature_names = ()  # the cascade reads tokens only

    def __init__(self, low, mid, mid_k: int | None = None):
        if mid_k is not None and mid_k < 0:
            raise DraftsmithError(f"--cascade: mid_k must be >= 0, got {mid_k}")
        self.low, self.mid, self.mid_k = low, (mid.eval() if isinstance(mid, torch.nn.Module) else mid), mid_k
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.reset()

    def reset(self):
        """A new prompt: empty the mid's cache and the low proposer's state (not the counters)."""
        self.cache, self.fed = DynamicCache(), []
        self.low.reset()

    def reset_stats(self):
        self.counts = dict.fromkeys(COUNTERS, 0)

    def stats(self) -> dict:
        return {"levels": self.level_stats()}  # τ and acceptance at each level

    def _verify(self, pending: list[int], drafts: list[int], device) -> list[int]:
        """One mid pass over [pending..., drafts...] -> the accepted drafts + the mid's own next token.
        The mid's cache keeps pending + accepted drafts; the returned last token is not fed yet."""
        ids = pending + drafts
        out = self.mid(
            input_ids=torch.tensor([ids], device=device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=len(drafts) + 1,
        )
        # The last 1+r rows: row j follows pending + d_0..d_{j-1}, so its argmax is what d_j must equal.
        preds = out.logits[0, -(len(drafts) + 1) :].argmax(-1).tolist()
        n = next((j for j, t in enumerate(drafts) if t != preds[j]), len(drafts))
        self.fed += pending + drafts[:n]
        crop_cache(self.cache, len(self.fed))  # rejected drafts leave the mid's cache
        return drafts[:n] + [preds[n]]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        """tokens [1, T]: every target-verified token (the newest not yet in the target's cache).
        The sampler is not used: the mid decodes greedily, so the draft is deterministic (q = one-hot)."""
        ids, device = tokens[0].tolist(), tokens.device
        pending, out = resync(self, ids), list[int]()  # the mid's cache on the verified tokens
        self.counts["rounds"] += 1
        self.counts["mid_synced"] += len(pending)
        while len(out) < k:
            # r drafts, all accepted, give r + 1 tokens: ask for no more than the chain still needs.
            want = k - len(out) - 1 if self.mid_k is None else min(self.mid_k, k - len(out) - 1)
            drafts = self.low.propose(torch.tensor([ids + out], device=device), {}, want).tokens[:want] if want else []
            new = self._verify(pending, drafts, device)
            self.counts["mid_passes"] += 1
            self.counts["mid_tokens"] += len(new)
            self.counts["low_proposed"] += len(drafts)
            self.counts["low_accepted"] += len(new) - 1
            out += new
            pending = new[-1:]
        return Draft.chain(out)

    def level_stats(self, target: Stats | None = None) -> dict:
        """Counters + per-level rates. mid_tau: tokens per mid pass (= 1 + accepted low drafts per pass);
        with the engine's Stats, the target level's τ and acceptance too."""
        c, rate = self.counts, (lambda a, b: round(a / b, 4) if b else 0.0)
        out = {
            **c,
            "mid_tau": rate(c["mid_tokens"], c["mid_passes"]),
            "low_acceptance_rate": rate(c["low_accepted"], c["low_proposed"]),
            "mid_passes_per_round": rate(c["mid_passes"], c["rounds"]),
        }
        if target is not None:
            out.update(target_tau=round(target.tau, 4), target_acceptance_rate=round(target.acceptance_rate, 4))
        return out


def parse_cascade(spec: str, where: str = "--cascade") -> list[str]:
    """`LOW,MID` -> [LOW, MID], e.g. `ngram,checkpoints/skip` (what each names is the CLI's to load)."""
    levels = [s.strip() for s in spec.split(",")]
    if len(levels) != 2 or not all(levels):
        raise DraftsmithError(
            f"{where}: expected two levels LOW,MID (a cheap proposer, then an intermediate model: "
            f"a distilled student or a layer-skip folder), e.g. ngram,PATH; got '{spec}'"
        )
    return levels


def _device(model, target):
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    if param is None and target is not None:  # SkipLayers owns no parameters: the target's are its
        param = next(target.parameters())
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def _vocab(model, target) -> int | None:
    """One-token forward the way CascadeProposer calls it -> the model's vocabulary size, or None
    when it does not return logits [1, 1, V] (it cannot verify drafts)."""
    try:
        out = model(
            input_ids=torch.tensor([[0]], device=_device(model, target)),
            cache=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits
    except Exception:  # not callable, other arguments, no .logits: all mean "not a causal LM"
        return None
    return logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None


def _check_low(low, name: str, target, where: str):
    """The cheap level: a token-only chain proposer, or a causal LM (drafting as a StudentProposer)."""
    if isinstance(low, Proposer):
        if tuple(low.feature_names):
            raise DraftsmithError(
                f"{where}: level 1 '{name}' reads target features, which no one computes for the "
                "intermediate's tokens; the cheap level must read tokens only (ngram, a distilled "
                "student or a layer-skip folder)"
            )
        return low
    if _vocab(low, target) is None:
        raise DraftsmithError(
            f"{where}: level 1 '{name}' cannot propose drafts; expected ngram, a distilled student "
            "or a layer-skip folder"
        )
    return StudentProposer(low)


def _check_mid(mid, name: str, target, where: str):
    """The intermediate must verify: a causal LM with a KV cache, with logits over the target's vocabulary."""
    if isinstance(mid, StudentProposer):  # a loaded student or layer-skip folder: verify with its model
        mid = mid.model
    vocab = None if isinstance(mid, Proposer) else _vocab(mid, target)
    if vocab is None:
        raise DraftsmithError(
            f"{where}: level 2 '{name}' cannot verify drafts; the intermediate must be a model "
            "(a distilled student or a layer-skip folder)"
        )
    want = target.get_output_embeddings().weight.shape[0] if target is not None else vocab
    if vocab != want:
        raise DraftsmithError(
            f"{where}: level 2 '{name}' scores {vocab} tokens but the target {want}; "
            "the intermediate must use the target's tokenizer"
        )
    return mid


def build_cascade(
    levels: list, names: list[str] | None = None, target=None, mid_k: int | None = None, where: str = "--cascade"
) -> CascadeProposer:
    """Parsed levels [low, mid] -> a CascadeProposer, or a one-line DraftsmithError.
    low: a proposer reading tokens only (NgramProposer, StudentProposer) or a causal LM;
    mid: a causal LM (student, SkipLayers) or a StudentProposer (its model is used).
    names: how the user wrote each level, for messages; target: to check the mid's vocabulary."""
    names = list(names) if names else [type(level).__name__ for level in levels]
    if len(levels) != 2:
        raise DraftsmithError(
            f"{where}: expected 2 levels (a cheap proposer, then an intermediate model), got "
            f"{len(levels)}: '{','.join(names)}'"
        )
    return CascadeProposer(
        _check_low(levels[0], names[0], target, where), _check_mid(levels[1], names[1], target, where), mid_k
    )
