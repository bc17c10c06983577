"""Drafts: what a proposer hands the verifier (draftsmith/engine/verify.py), chains and trees alike.

A chain of K drafts is the tree where node j's parent is node j-1. EAGLE-2 (Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", arXiv:2406.16858) grows
the tree dynamically: expand the `top_k` most likely nodes per depth, then keep the `tokens` nodes
with the highest path probability. Static trees (Medusa, SpecInfer) fix the shape up front as a
list of paths of child ranks, e.g. [[0], [1], [0, 0]] = top-1 and top-2 at depth 1, and the top-1
child of the top-1 node at depth 2. This module is what drafters build; the engine that verifies
a draft in one target pass lives in eval/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith import DraftsmithError


@dataclass
class Draft:
    """Nodes in topological order (a parent always precedes its children).

    parents[i] = index of node i's parent, -1 = the root (the last verified token). qs[i] = the
    drafter distribution node i's token was *sampled* from (a sampled chain), or None when the
    token was chosen deterministically (greedy drafts, top-k tree expansion, prompt lookup).

    confidence (chains, from a proposer with `drafts_confidence`): c_i = the drafter's own
    probability that draft i is accepted given drafts < i were accepted (DSpark's confidence head,
    arXiv 2607.05147; vLLM 0.32 reads it the same way). None = the drafter does not say. Adaptive
    verification cuts the chain on it (draftsmith/engine/verify.py `adaptive_prefixes`), losslessly
    because c_i is known *before draft i is drawn*: a function of the context and drafts < i only (as
    DSpark's head is: the slot's hidden state and the previous token's Markov embedding). Greedy
    verification is exact whatever the confidences; sampled verification needs that order, since a
    c_i that looks at draft i itself would verify a biased selection of drafts (tests/engine/test_adaptive.py).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)
    confidence: list[float] | None = None

    @classmethod
    def chain(cls, tokens: list[int], qs: list | None = None, confidence: list[float] | None = None) -> "Draft":
        return cls(
            list(tokens),
            list(range(-1, len(tokens) - 1)),
            list(qs) if qs else [None] * len(tokens),
            None if confidence is None else [float(c) for c in confidence],
        )

    def prefix(self, b: int) -> "Draft":
        """A chain's first b drafts, with their qs and confidences (adaptive verification)."""
        conf = None if self.confidence is None else self.confidence[:b]
        return Draft(self.tokens[:b], self.parents[:b], self.qs[:b], conf)

    def add(self, token: int, parent: int, q=None) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.qs.append(q)
        return len(self.tokens) - 1

    def depth(self, i: int) -> int:
        """Root children have depth 1."""
        d = 0
        while i >= 0:
            i, d = self.parents[i], d + 1
        return d

    def ancestors(self, i: int) -> set[int]:
        """Node i and its ancestors (the root excluded)."""
        out = set()
        while i >= 0:
            out.add(i)
            i = self.parents[i]
        return out

    def ancestor_rows(self, nodes, keys) -> torch.Tensor:
        """[len(nodes), len(keys)] bool: True where the key node is the query node or one of its
        ancestors (tree attention)."""
        rows = [[k in anc for k in keys] for anc in map(self.ancestors, nodes)]
        return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), len(keys))

    def children(self, i: int) -> list[int]:
        return [c for c, p in enumerate(self.parents) if p == i]

    @property
    def max_depth(self) -> int:
        return max((self.depth(i) for i in range(len(self.tokens))), default=0)

    def subset(self, keep: list[int]) -> "Draft":
        """The sub-tree on `keep` (which must contain every kept node's ancestors), renumbered."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        new_index[-1] = -1
        conf = None if self.confidence is None else [self.confidence[i] for i in keep]
        return Draft(
            [self.tokens[i] for i in keep],
            [new_index[self.parents[i]] for i in keep],
            [self.qs[i] for i in keep],
            conf,
        )


@dataclass
class TreeSpec:
    """`dynamic[:depth=D,top_k=K,tokens=N]` (EAGLE-2) or `static:PATHS` where PATHS is a JSON list
    of child-rank paths, inline or in a .json file."""

    kind: str
    depth: int = 5
    top_k: int = 8
    tokens: int = 48
    paths: list = field(default_factory=list)
    text: str = ""


def parse_tree(text: str, where: str = "--tree") -> TreeSpec:
    kind, _, rest = text.partition(":")
    if kind == "dynamic":
        spec = TreeSpec("dynamic", text=text)
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in ("depth", "top_k", "tokens") or not value.isdigit() or int(value) < 1:
                raise DraftsmithError(
                    f"{where}: bad item '{item}' in '{text}'; expected depth=, top_k=, tokens= "
                    "with positive integers, e.g. dynamic:depth=5,top_k=8,tokens=48"
                )
            setattr(spec, key, int(value))
        return spec
    if kind == "static":
        source = Path(rest).read_text() if rest.endswith(".json") and Path(rest).is_file() else rest
        try:
            paths = [tuple(p) for p in json.loads(source)]
        except (json.JSONDecodeError, TypeError):
            raise DraftsmithError(
                f"{where}: static tree '{rest}' is not a JSON list of paths (or a .json file "
                "holding one), e.g. static:[[0],[1],[0,0]]"
            ) from None
        ok = paths and all(p and all(isinstance(r, int) and r >= 0 for r in p) for p in paths)
        missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
        if not ok or missing:
            raise DraftsmithError(
                f"{where}: static tree paths must be non-empty lists of ranks >= 0 whose "
                f"prefixes are also paths (missing parent of {list(missing[0]) if missing else '?'})"
            )
        paths = sorted(set(paths), key=lambda p: (len(p), p))
        return TreeSpec(
            "static",
            depth=max(map(len, paths)),
            top_k=1 + max(max(p) for p in paths),
            tokens=len(paths),
            paths=paths,
            text=text,
        )
    raise DraftsmithError(f"{where}: expected 'dynamic[:depth=D,top_k=K,tokens=N]' or 'static:PATHS', got '{text}'")


def grow_tree(spec: TreeSpec, root_logits: torch.Tensor, expand) -> Draft:
    """Build a draft tree from the drafter's logits at the root [V] and `expand(draft, nodes)`,
    which feeds those nodes to the drafter and returns logits [len(nodes), V] for their children.

    static: node for path (r_1..r_d) = the rank-r_d token after its parent's path.
    dynamic (EAGLE-2): per depth, expand the top_k nodes by path log-probability (each adds its
    top_k children), then keep the `tokens` best nodes overall. Deterministic given the context, so
    sampled verification treats every node as q = one-hot (verify_tree_sampled).
    """
    draft = Draft()
    if spec.kind == "static":
        node_of = {(): -1}
        for d in range(1, spec.depth + 1):
            level = [p for p in spec.paths if len(p) == d]
            parents = sorted({node_of[p[:-1]] for p in level})
            rows = [root_logits] if d == 1 else expand(draft, parents)
            ranked = {par: row.topk(spec.top_k).indices.tolist() for par, row in zip(parents, rows)}
            for p in level:  # paths are sorted, so siblings come in rank order
                node_of[p] = draft.add(ranked[node_of[p[:-1]]][p[-1]], node_of[p[:-1]])
        return draft

    score: list[float] = []

    def add_children(parent: int, logits: torch.Tensor) -> list[int]:
        top = torch.log_softmax(logits.float(), -1).topk(spec.top_k)
        base = score[parent] if parent >= 0 else 0.0
        score.extend(base + lp for lp in top.values.tolist())
        return [draft.add(t, parent) for t in top.indices.tolist()]

    frontier = add_children(-1, root_logits)
    for _ in range(spec.depth - 1):
        rows = expand(draft, frontier)
        new = [c for parent, row in zip(frontier, rows) for c in add_children(parent, row)]
        frontier = sorted(new, key=lambda i: -score[i])[: spec.top_k]
    # Rerank: the `tokens` best nodes. A child's log-probability never exceeds its parent's, so in
    # this order (ties: shallower first) every node's parent is kept before it is considered.
    keep: set[int] = set()
    for i in sorted(range(len(draft.tokens)), key=lambda i: (-score[i], draft.depth(i))):
        if len(keep) == spec.tokens:
            break
        if draft.parents[i] < 0 or draft.parents[i] in keep:
            keep.add(i)
    return draft.subset(list(keep))
