"""Training-free proposers: lookahead decoding, and a hybrid of prompt lookup with a trained drafter.

Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", arXiv:2402.02057) guesses the next W tokens and refines the guess by Jacobi
iteration: one parallel pass replaces each guessed token by the target's argmax after the guesses
before it. Any fixed point is the greedy continuation, but a single window seldom converges ahead
of the verified text, so the paper harvests n-grams from the Jacobi *trajectories* into a pool and
verifies up to G pool n-grams that start with the last verified token, in the same pass.

How it maps onto this engine (draftsmith/engine/speculative.py): each round the proposer returns one Draft
(draftsmith/engine/drafts.py) that the target scores in one pass with tree attention:
  - verification branch: up to G pool n-grams keyed by the root (the last verified token), each a
    chain of N-1 tokens under the root, as the paper's verification branch;
  - lookahead branch: the current Jacobi window w_0..w_{W-1} as one chain under the root.
The branches go into one trie, so a shared prefix is one node and siblings are distinct tokens.
After verification the engine calls `observe` with the target's logits on every node; the new
window is the target's argmax at each window node's parent (Jacobi), and N-grams are collected
along the diagonal of the last N-1 windows and the new output, as the paper's lookahead branch does.

What differs from the paper:
  - The paper feeds the last N-1 trajectories together as a 2-D window under a special attention
    mask, so one pass advances every level of the window; here only the newest window is fed, as a
    plain causal chain (one Jacobi step), and the older windows are kept on the proposer side for
    n-gram collection. The n-grams are the same kind (each token is the target's
    argmax after the token before it, in consecutive iterations); the chain costs W nodes instead
    of (N-1)·W.
  - The window branch is itself verified like any guess; greedy verification accepts the longest
    matching path, whichever branch it is on. The paper's lookahead branch is never accepted.
  - The pool also holds every N-gram of the verified text, the prompt included (prompt lookup,
    Saxena 2023, is the special case of the verification branch with this pool alone).
  - The window and the n-grams are cut to the engine's depth (k for chains, the tree spec's depth),
    and a tree spec's token budget caps the node count (window first, then the n-grams in order).
  - After tokens are accepted the window slides: outputs at now-verified positions are dropped and
    the vacated tail (and the very first window) is filled with random context tokens, as the
    paper initialises its window.
  - Sampling: the Jacobi update uses the target's argmax in every case, and every node is chosen
    deterministically (qs = None, q = one-hot), so the engine's sibling-by-sibling rejection rule
    (draftsmith/engine/verify.py) keeps sampling exactly lossless; the paper gives its own sampling verification.

HybridProposer picks, round by round, prompt lookup when the context repeats itself and a trained
drafter otherwise (the rule is in its docstring).
"""

from __future__ import annotations

import copy
import random
from collections import deque

import torch

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import NgramProposer, Proposer

Run = tuple[int, list[int]]  # (absolute position of the first token, tokens at consecutive positions)


def _at(run: Run | None, position: int) -> int | None:
    """The token a run holds at an absolute position, or None outside it."""
    if run is None or not run[0] <= position < run[0] + len(run[1]):
        return None
    return run[1][position - run[0]]


def trie_draft(seqs: list[list[int]]) -> tuple[Draft, dict[tuple[int, ...], int]]:
    """Token sequences (each a path under the root) -> one Draft where a shared prefix is one node,
    and the node index of every prefix (() -> -1, the root). Nodes come in insertion order."""
    draft, node = Draft(), dict[tuple[int, ...], int]({(): -1})
    for seq in seqs:
        for d in range(1, len(seq) + 1):
            if tuple(seq[:d]) not in node:
                node[tuple(seq[:d])] = draft.add(seq[d - 1], node[tuple(seq[: d - 1])])
    return draft, node


def suffix_match(seq: list[int], max_ngram: int, k: int) -> tuple[int, list[int]]:
    """Prompt lookup exactly as NgramProposer does it -> (n, follow): n = the longest suffix length
    (<= max_ngram) that occurs earlier in `seq`, follow = the up to k tokens after its latest earlier
    occurrence; (0, []) when not even the last token recurs."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # latest first; start + n <= len - 1 leaves a follower
            if seq[start : start + n] == tail:
                return n, seq[start + n : start + n + k]
    return 0, []


class LookaheadProposer(Proposer):
    """Lookahead decoding with window W, n-gram size N and at most G verified n-grams per round
    (module docstring: how it maps onto the paper). No training, no target features; it needs the
    engine's `observe` call after each verification to run the Jacobi iteration."""

    feature_names = ()
    drafts_trees = True

    def __init__(self, window: int = 5, ngram: int = 3, guesses: int = 3, seed: int = 0):
        for name, value, low in (("window W", window, 1), ("ngram N", ngram, 2), ("guesses G", guesses, 0)):
            if not isinstance(value, int) or value < low:
                raise DraftsmithError(f"lookahead: {name} must be an integer >= {low}, got {value!r}")
        self.window, self.ngram, self.guesses, self.seed = window, ngram, guesses, seed
        self.reset()

    @classmethod
    def from_spec(cls, text: str) -> "LookaheadProposer":
        """`lookahead` or `lookahead:W=5,N=3,G=3` (any subset of the keys)."""
        name, _, rest = text.partition(":")
        items = [item.partition("=") for item in filter(None, rest.split(","))]
        if name != "lookahead" or any(key not in ("W", "N", "G") or not value.isdigit() for key, _, value in items):
            raise DraftsmithError(f"expected 'lookahead[:W=5,N=3,G=3]' with integer values, got '{text}'")
        names = {"W": "window", "N": "ngram", "G": "guesses"}
        return cls(**{names[key]: int(value) for key, _, value in items})

    def spec(self) -> str:
        """A label in the paper's notation, parseable by `from_spec`."""
        return f"lookahead:W={self.window},N={self.ngram},G={self.guesses}"

    def reset(self) -> None:
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> continuations, newest first
        self.seen = 0  # tokens of the verified text already harvested into the pool
        self.windows: deque[Run] = deque(maxlen=self.ngram - 1)  # the last N-1 fed windows, oldest first
        self.output: Run | None = None  # the target's argmax after the root and each node of the last window
        self.pending: tuple[Run, list[int]] | None = None  # the window in the last draft and its node indices
        self.rng = random.Random(self.seed)

    def _remember(self, gram: list[int]) -> None:
        """Pool insert: the newest continuation goes first; at most G kept per first token."""
        if not self.guesses:
            return
        key, cont = gram[0], tuple(gram[1:])
        conts = self.pool.setdefault(key, [])
        if cont in conts:
            conts.remove(cont)
        conts.insert(0, cont)
        del conts[self.guesses :]

    def _harvest_text(self, seq: list[int]) -> None:
        """Pool every N-gram of the verified text that ends in a token not harvested yet: on the first
        call the whole prompt (prompt lookup as a special case), then each round's new tokens."""
        n = self.ngram
        for i in range(max(0, self.seen - n + 1), len(seq) - n + 1):  # gram seq[i:i+n] ends at i+n-1 >= seen
            self._remember(seq[i : i + n])
        self.seen = len(seq)

    def _next_window(self, seq: list[int], length: int) -> list[int]:
        """Guesses for positions R+1 .. R+length, R = len(seq) - 1 the root: the last Jacobi output
        where it reaches (its entries at positions <= R are verified now and drop out: the window
        slides by the accepted tokens), random context tokens beyond it."""
        root = len(seq) - 1
        guess = [_at(self.output, root + 1 + i) for i in range(length)]
        return [t if t is not None else self.rng.choice(seq) for t in guess]

    def _draft(self, seq: list[int], depth: int, budget: int | None) -> Draft:
        """Verification n-grams (cut to `depth`) and the window (`depth` long at most) in one trie of at
        most `budget` nodes: the window first, then the n-grams in pool order while they fit."""
        self._harvest_text(seq)
        length = min(self.window, depth, budget or depth)
        window = self._next_window(seq, length)
        grams, nodes = [], {tuple(window[:d]) for d in range(1, length + 1)}  # every prefix is one trie node
        for cont in self.pool.get(seq[-1], [])[: self.guesses]:
            gram = list(cont[:depth])
            more = {tuple(gram[:d]) for d in range(1, len(gram) + 1)} - nodes
            if budget is None or len(nodes) + len(more) <= budget:
                grams.append(gram)
                nodes |= more
        # n-grams before the window: under sampling siblings are tried in node order, and a pool n-gram
        # (seen in the text or along a Jacobi trajectory) is a better bet than a window still converging.
        draft, index = trie_draft(grams + [window])
        self.pending = ((len(seq), window), [index[tuple(window[:d])] for d in range(1, length + 1)])
        return draft

    def propose(self, tokens: torch.Tensor, feats, k: int, sampler=None) -> Draft:
        """A draft at most k deep (the engine's chain length); deterministic nodes (qs = None)."""
        return self._draft(tokens[0].tolist(), k, None)

    def propose_tree(self, tokens: torch.Tensor, feats, spec) -> Draft:
        """The same draft, at most spec.depth deep and spec.tokens nodes; top_k and shape are unused."""
        return self._draft(tokens[0].tolist(), spec.depth, spec.tokens)

    def observe(self, draft: Draft, logits: torch.Tensor, path: list[int], new: list[int]) -> None:
        """After the target scored `draft` (logits [1+n, V]: row 0 after the root, row 1+i after node
        i): one Jacobi step on the window, and the N-grams it completes go into the pool."""
        if self.pending is None:
            return
        (start, window), nodes = self.pending
        preds = logits.argmax(-1).tolist()
        # out[j] guesses position start + j: row 0 is after the root (position start - 1), row
        # 1 + nodes[j-1] after window token j-1 (position start + j - 1): each node's parent's output.
        self.windows.append((start, window))
        self.output = (start, [preds[0]] + [preds[1 + i] for i in nodes])
        self.pending = None
        self._harvest_jacobi()

    def _harvest_jacobi(self) -> None:
        """N-grams along the diagonal of the last N-1 windows and the new output: token j at position
        p + j from window j (oldest first), the last one at p + N - 1 from the output. In Jacobi each
        window token at position q + 1 is the previous iteration's output after its token at q, so
        consecutive entries of the diagonal follow each other."""
        if len(self.windows) < self.ngram - 1:
            return  # warm-up: fewer than N-1 trajectories so far
        first = self.windows[0]
        for p in range(first[0], first[0] + len(first[1])):
            gram = [_at(w, p + j) for j, w in enumerate(self.windows)] + [_at(self.output, p + self.ngram - 1)]
            if all(t is not None for t in gram):
                self._remember([t for t in gram if t is not None])


class HybridProposer(Proposer):
    """Prompt lookup and a trained drafter: either one, or both judged in one verification pass.

    Each round, with d = the draft depth (k for chains, spec.depth for trees): take the longest
    suffix of the context (at most lookup.max_ngram tokens) that occurs earlier, and the up to d
    tokens that followed its latest earlier occurrence (prompt lookup, as NgramProposer). The lookup
    has a *match* when that suffix is at least `min_match` tokens long and at least ceil(d/2) tokens
    follow it.
      - No match: the model's draft (`propose` chain or `propose_tree` tree), alone ("model").
      - A match, chain drafts: the lookup chain alone ("lookup"); the model is not called. Chains
        stay chains (batched decoding verifies chains only, draftsmith/engine/batched.py), and a sampled model
        chain could not share a draft anyway: a sampled child must be an only child for the
        sibling-by-sibling rule (draftsmith/engine/verify.py `verify_tree_sampled`).
      - A match, tree drafts: the lookup chain is grafted onto the model's tree as one more root
        path (`graft`; tree nodes are deterministic top-k picks), so the target judges both guesses
        in one pass and keeps the longer accepted one ("both"). Greedy acceptance along the merged
        tree is at least that of either part alone; the price is up to d more nodes to verify.
    The choice reads the verified context only, so greedy and sampled decoding stay lossless.

    The model proposer is not called in "lookup" rounds; proposers with a KV cache resynchronise on
    their next call (StudentProposer keeps the longest common prefix of what it was fed;
    FeatureProposer feeds every real feature row it has not cached, and drops its draft pairs).
    """

    def __init__(self, lookup: NgramProposer, model, min_match: int = 2):
        if not isinstance(min_match, int) or not 1 <= min_match <= lookup.max_ngram:
            raise DraftsmithError(
                f"hybrid: min_match must be an integer in 1..{lookup.max_ngram} (the lookup's "
                f"max_ngram), got {min_match!r}"
            )
        self.lookup, self.model, self.min_match = lookup, model, min_match
        self.feature_names = tuple(model.feature_names)  # the engine passes these target features
        self.max_depth = model.max_depth  # e.g. Medusa: at most one draft per head
        self.drafts_trees = model.drafts_trees  # only then may the engine ask for trees
        self.last = ""  # "model", "both" or "lookup": what the latest draft holds
        self.draft_sources = {"model": 0, "both": 0, "lookup": 0}  # drafts of each kind, over all prompts

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def reset_stats(self) -> None:
        self.draft_sources = dict.fromkeys(self.draft_sources, 0)

    def stats(self) -> dict:
        return {"draft_sources": dict(self.draft_sources)}  # how many drafts came from each source

    def __copy__(self) -> "HybridProposer":
        """Batched decoding makes one proposer per row by copy + reset (eval/run.py `fresh_copies`): each
        copy needs its own model proposer (own KV cache), sharing only the weights."""
        return HybridProposer(copy.copy(self.lookup), copy.copy(self.model), self.min_match)

    def choose(self, seq: list[int], depth: int) -> list[int] | None:
        """The lookup chain if the lookup has a match (see the class docstring), else None."""
        n, follow = suffix_match(seq, self.lookup.max_ngram, depth)
        return follow if n >= self.min_match and 2 * len(follow) >= depth else None

    def _pick(self, source: str, draft: Draft) -> Draft:
        self.last = source
        self.draft_sources[source] += 1
        return draft

    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        chain = self.choose(tokens[0].tolist(), k)
        if chain is None:
            return self._pick("model", self.model.propose(tokens, feats, k, sampler))
        return self._pick("lookup", Draft.chain(chain))

    def propose_tree(self, tokens: torch.Tensor, feats: dict, spec) -> Draft:
        chain = self.choose(tokens[0].tolist(), spec.depth)
        draft = self.model.propose_tree(tokens, feats, spec)
        return self._pick("model", draft) if chain is None else self._pick("both", graft(draft, chain))

    def observe(self, draft: Draft, logits: torch.Tensor, path: list[int], new: list[int]) -> None:
        """Forward the target's verdict to a model proposer that learns from it, on its own drafts only."""
        if self.last != "lookup":  # grafted nodes come after the model's own, whose indices are unchanged
            self.model.observe(draft, logits, path, new)


def graft(draft: Draft, chain: list[int]) -> Draft:
    """`draft` plus `chain` as a path from the root, in place: where the draft already has the next
    chain token as a child, the path goes through that node; otherwise a deterministic node (q = None)
    is appended (parents still precede children). Grafting stops under a node whose children were
    sampled: those must stay only children (draftsmith/engine/verify.py `verify_tree_sampled`)."""
    node = -1
    for x in chain:
        kids = draft.children(node)
        same = [c for c in kids if draft.tokens[c] == x]
        if same:
            node = same[0]
        elif any(draft.qs[c] is not None for c in kids):
            break
        else:
            node = draft.add(x, node)
    return draft
