"""Proposers: what a speculative round asks for a draft. Every drafter, trained or training-free,
has this shape (`Proposer`); the generic ones live here, a family's own in its module."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.engine.cache import crop_cache
from draftsmith.engine.drafts import Draft, grow_tree
from draftsmith.target.features import draft_embeddings
from draftsmith.util.masks import causal_mask


@runtime_checkable
class Proposer(Protocol):
    """What the engine asks of every drafter, trained (a family's `make_proposer`) or training-free
    (n-gram, lookahead, layer-skip, cascade, hybrid). A proposer class subclasses this protocol and
    inherits the defaults of the optional parts, so the engine never probes for them:

    - `feature_names`: the target features `propose` reads (draftsmith/target/features.py); () = tokens only.
    - `max_depth`: the most draft tokens it proposes per round (Medusa: one per head; a block drafter:
      its block), None = any.
    - `drafts_trees`: `propose_tree` may be called (`--tree`).
    - `drafts_confidence`: every chain `propose` returns carries `draft.confidence` (c_i = P(draft i
      accepted | drafts < i accepted), DSpark's confidence head, computed before draft i is drawn:
      from the context and drafts < i only; see `Draft`), so the engine may verify only the prefix it
      trusts (adaptive verification, draftsmith/engine/verify.py) and the eval stage reports its calibration.
    - `reset()`: a new prompt. `propose(tokens [1, n], feats, k, sampler)`: a chain Draft of at most k
      tokens. `propose_tree(tokens, feats, spec)`: a tree Draft, when `drafts_trees`.
    - `observe(draft, logits, path, new)`: the target's logits on the draft's nodes after each round
      (lookahead's Jacobi step learns from them).
    - `reset_stats()` and `stats()`: the proposer's own counters (a cascade's levels, a hybrid's draft
      sources), started after the eval's warm-up and added to its report.

    A trained drafter's proposer also has `logits`: the function its drafting passes go through to
    become vocabulary logits, which `export --verify` taps to compare a drafter with its export.
    """

    feature_names: tuple[str, ...] = ()
    max_depth: int | None = None
    drafts_trees: bool = False
    drafts_confidence: bool = False

    def reset(self) -> None: ...

    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft: ...

    def propose_tree(self, tokens: torch.Tensor, feats: dict, spec) -> Draft:
        raise DraftsmithError("--tree: this drafter proposes chains only")

    def observe(self, draft: Draft, logits: torch.Tensor, path: list[int], new: list[int]) -> None:
        return None

    def reset_stats(self) -> None:
        return None

    def stats(self) -> dict:
        return {}


def proposer_modules(proposer) -> list[torch.nn.Module]:
    """The modules a proposer decodes with (its drafter, heads or student, and those of the proposers
    it combines: hybrid, cascade), for `packed_linears`."""
    found = []
    for value in vars(proposer).values() if proposer is not None else ():
        if isinstance(value, torch.nn.Module):
            found.append(value)
        elif isinstance(value, Proposer):
            found += proposer_modules(value)
    return found


class NgramProposer(Proposer):
    """Prompt-lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n
    tokens (n = max_ngram..1) and propose the k tokens that followed it. No training, no features."""

    feature_names = ()

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def reset(self):
        pass

    def propose(self, tokens: torch.Tensor, feats, k: int, sampler=None) -> Draft:
        # Deterministic proposals: under sampling they count as q = one-hot (see verify_tree_sampled).
        seq = tokens[0].tolist()
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + k]
                    if follow:
                        return Draft.chain(follow)
        return Draft()


class FeatureProposer(Proposer):
    """Chain and tree drafting for feature-space drafters (EAGLE-1, EAGLE-3), with the drafter's KV cache.

    The engine passes all tokens x_0..x_{n-1} and the target features of x_0..x_{n-2} (everything
    the target has verified). Pair i = (hidden from target features at i, token x_{i+1}) is *real*
    for i <= n-2 and stays cached across rounds. A draft node is fed as the pair (the drafter's own
    output at the node's parent, the node's token) at position n-2 + depth, attending to the real
    cache and its own fed ancestors only; draft pairs are cropped away before the next round, when
    real features replace them.

    to_hidden(feats) -> [1, t, H] drafter input from target features; step(hidden, embeds, pos,
    mask, cache) -> out [1, t, H]; logits(out [1, t, H]) -> [1, t, V] over the *target* vocabulary.
    With a `sampler` (temperature > 0), chain drafts are sampled and keep their distribution q for
    the rejection rule; otherwise drafts are the argmax (chains) or top-k expansions (trees).
    """

    drafts_trees = True

    def __init__(self, drafter, target, feature_names, to_hidden, step, logits):
        self.drafter = drafter.eval()
        self.feature_names = tuple(feature_names)
        self.embed = draft_embeddings(target)
        self.to_hidden, self.step, self.logits = to_hidden, step, logits
        self.reset()

    def reset(self):
        self.cache, self.n_real = DynamicCache(), 0

    def _prefill(self, tokens: torch.Tensor, feats: dict) -> torch.Tensor:
        """Feed the real pairs not cached yet -> logits [V] for the first draft position."""
        crop_cache(self.cache, self.n_real)
        n_feats = next(iter(feats.values())).shape[1]
        new = {name: f[:, self.n_real :] for name, f in feats.items()}
        t, device = n_feats - self.n_real, tokens.device
        pos = torch.arange(self.n_real, n_feats, device=device)[None]
        out = self.step(
            self.to_hidden(new),
            self.embed(tokens[:, self.n_real + 1 : n_feats + 1]),
            pos,
            causal_mask(t, n_feats, device=device),
            self.cache,
        )
        self.n_real, self.fed, self.outs = n_feats, list[int](), {-1: out[:, -1:]}
        return self.logits(out[:, -1:])[0, 0]

    def expand(self, draft, nodes: list[int]) -> torch.Tensor:
        """Feed draft `nodes` (whose parents were fed before) in one drafter pass -> logits [n, V]
        for their children."""
        device = self.outs[-1].device
        hidden = torch.cat([self.outs[draft.parents[i]] for i in nodes], dim=1)
        ids = torch.tensor([[draft.tokens[i] for i in nodes]], device=device)
        # Pair (parent output, node token) predicts the node's children: position n_real - 1 + depth.
        pos = torch.tensor([[self.n_real - 1 + draft.depth(i) for i in nodes]], device=device)
        keys = self.fed + nodes  # the drafter cache holds real pairs, then fed nodes in this order
        tree = draft.ancestor_rows(nodes, keys).to(device)
        mask = torch.cat([torch.ones(len(nodes), self.n_real, dtype=torch.bool, device=device), tree], dim=1)
        out = self.step(hidden, self.embed(ids), pos, mask[None, None], self.cache)
        self.fed += nodes
        self.outs.update({i: out[:, j : j + 1] for j, i in enumerate(nodes)})
        return self.logits(out)[0]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None):
        logits, draft = self._prefill(tokens, feats), Draft()
        for i in range(k):
            q = None if sampler is None else sampler.probs(logits)
            node = draft.add(int(logits.argmax()) if q is None else sampler.sample(q), i - 1, q)
            if i + 1 < k:
                logits = self.expand(draft, [node])[0]
        return draft

    @torch.no_grad()
    def propose_tree(self, tokens: torch.Tensor, feats: dict, spec):
        return grow_tree(spec, self._prefill(tokens, feats), self.expand)


def resync(proposer, ids: list[int]) -> list[int]:
    """Keep a proposer's own KV cache (`proposer.cache`, `proposer.fed`) on the longest prefix of `ids`
    it has fed -> the tokens still to feed, at least the newest one (its logits start the draft)."""
    fed = proposer.fed
    same = next((i for i, (a, b) in enumerate(zip(fed, ids)) if a != b), min(len(fed), len(ids)))
    same = min(same, len(ids) - 1)
    crop_cache(proposer.cache, same)
    proposer.fed = fed[:same]
    return ids[same:]


class StudentProposer(Proposer):
    """Chain drafting by a causal LM (a distilled student, the target with layers skipped) with its
    own KV cache. Each round the cache keeps the longest prefix of what it was fed that the accepted
    tokens still agree with; the rest is fed in one pass."""

    feature_names = ()  # the student reads tokens only

    def __init__(self, model):
        self.model = model.eval()
        self.logits = lambda out: out  # [1, L, V]: what the model computed (a tap for `export --verify`)
        self.reset()

    def reset(self):
        self.cache, self.fed = DynamicCache(), []

    def _feed(self, ids: list[int], device) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids], device=device), cache=self.cache, use_cache=True)
        self.fed += ids
        return self.logits(out.logits)[0, -1]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        ids, device = tokens[0].tolist(), tokens.device
        logits, draft = self._feed(resync(self, ids), device), Draft()
        for i in range(k):
            q = None if sampler is None else sampler.probs(logits)
            token = int(logits.argmax()) if q is None else sampler.sample(q)
            draft.add(token, i - 1, q)
            if i + 1 < k:
                logits = self._feed([token], device)
        return draft
