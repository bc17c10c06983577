"""Tree verification: one target pass checks every node of a draft (draftsmith/engine/drafts.py).

The target verifies every node in one forward pass: node i sits at position (root + depth_i) and
attends to the verified prefix plus its own ancestors only (tree attention). The verify rules walk
down from the root and keep one root-to-leaf path. Adaptive verification (vLLM 0.32) first cuts a
chain to the prefix its drafter's confidences make worth scoring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft


def verification_inputs(draft: Draft, prefix: int, device=None):
    """Mask [1, 1, 1+n, prefix+1+n] and position ids [1, 1+n] for the target pass over
    [root, node_0 .. node_{n-1}]; the root is the last verified token at position `prefix`.
    An empty draft gives (None, None): a lone root attends to the whole prefix, so the pass is the
    plain one-token decode step, the one target-only decoding (the engine with no drafter) takes."""
    n = len(draft.tokens)
    if not n:
        return None, None
    tree = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
    tree[:, 0] = True  # the root (row/column 0) sees itself, and every node descends from it
    tree[1:, 1:] = draft.ancestor_rows(range(n), range(n))
    mask = torch.cat([torch.ones(1 + n, prefix, dtype=torch.bool), tree], dim=1)
    depth = torch.tensor([0] + [draft.depth(i) for i in range(n)])
    return mask[None, None].to(device), (prefix + depth)[None].to(device)


def verify_tree_greedy(draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """logits [1+n, V]: row 0 = the target after the root, row i+1 = after node i.
    Walk from the root while some child equals the target's argmax -> (accepted node path, emitted
    tokens = the path's tokens + the target's own next token). Identical to target-only greedy."""
    preds = logits.argmax(-1).tolist()
    node, path = -1, list[int]()
    while True:
        want = preds[node + 1]
        match = [c for c in draft.children(node) if draft.tokens[c] == want]
        if not match:
            return path, [draft.tokens[c] for c in path] + [want]
        node = match[0]
        path.append(node)


def rule_exact(draft: Draft, logits: torch.Tensor, path: list[int], emitted: list[int]) -> bool:
    """Did one greedy round emit exactly what the verification rule gives for the verifier's own
    logits of that pass? Checked from the rule's definition, apart from `verify_tree_greedy`: each
    accepted node hangs from the previous one and is the argmax after its parent, the emitted tokens
    are the path's plus the argmax after its last node, and no child of that node is that argmax
    (the path is as long as the rule allows). This is what makes speculation lossless; a separately
    run target-only decode can still differ where bf16 kernels of other shapes break a near-tie."""
    preds, parent = logits.argmax(-1).tolist(), -1
    for node in path:
        if draft.parents[node] != parent or draft.tokens[node] != preds[parent + 1]:
            return False
        parent = node
    bonus = preds[parent + 1]
    return emitted == [draft.tokens[n] for n in path] + [bonus] and all(
        draft.tokens[c] != bonus for c in draft.children(parent)
    )


def verify_tree_sampled(draft: Draft, logits: torch.Tensor, sampler) -> tuple[list[int], list[int]]:
    """Lossless speculative sampling on a tree, sibling by sibling (SpecInfer, Miao et al. 2024;
    EAGLE-2): at a node with target distribution p, try its children in order; child x drafted from
    q is kept with probability min(1, p(x)/q(x)); after a rejection p becomes norm(max(0, p - q)) and
    the next sibling is tried against that residual. If no child is kept, the token is sampled from
    the last residual. Deterministic children (top-k expansion) have q = one-hot(x): keep x with
    probability p(x), else drop x from p. For a chain this is exactly Leviathan et al.'s rule.
    Sampled children must be only children (chains): siblings sampled from one q would need
    without-replacement corrections that no proposer here needs."""
    p_all = sampler.probs(logits)
    node, path = -1, list[int]()
    while True:
        p = p_all[node + 1]
        for c in draft.children(node):
            x = draft.tokens[c]
            q = draft.qs[c]
            q = q if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p)
            if sampler.accept(float(p[x]), float(q[x])):
                break
            p = sampler.residual(p, q)
        else:
            return path, [draft.tokens[c] for c in path] + [sampler.sample(p)]
        node = c
        path.append(node)


# --- adaptive verification ------------------------------------------------------------------------


@dataclass(frozen=True)
class AdaptiveCosts:
    """The cost model of adaptive verification, in units of one target pass over the roots alone (at
    batch size 1: the plain one-token decode step): a round that verifies b drafts costs
        draft_cost + verify_cost(b),   verify_cost(b) = 1 + beta * b.
    vLLM 0.32 profiles whole step-time curves (adaptive_verification.py:188-254). A line is what such
    a curve is on a weight-bound target, where each extra scored token adds a small, steady share of
    the pass, and its two numbers can be measured in the run itself (eval/run.py `measure_costs`:
    draft seconds per round and target passes over 1 and 1+K tokens). The defaults are for direct
    callers: a drafter much cheaper than the target (draft_cost 0) and 5% of a pass per verified
    draft, roughly a small target at batch size 1.
    draft_cost >= 0; beta in [0, 1] (scoring b tokens in one pass never costs more than b passes)."""

    draft_cost: float = 0.0
    beta: float = 0.05


def survival(confidence: list[float]) -> list[float]:
    """S_i = prod_{j<=i} c_j, the drafter's probability that drafts 0..i are all accepted, from its
    conditional confidences c_j (vLLM 0.32 adaptive_verification.py:64). Each c_j is clamped to
    [0, 1], so S never increases along a chain."""
    out, s = [], 1.0
    for c in confidence:
        s *= min(max(float(c), 0.0), 1.0)
        out.append(s)
    return out


def adaptive_prefixes(confidences: list[list[float]], costs: AdaptiveCosts) -> list[int]:
    """How many drafts each of n requests verifies this round (vLLM 0.32 adaptive_verification.py
    `get_num_tokens` and `_assign_draft_token_budget`). The budget b maximizes the expected tokens
    emitted per cost,
        b = argmax_b (n + sum of the b largest S_{r,i}) / (draft_cost + 1 + beta * b),
    since every request emits one token from the target whatever it verifies (the n) and a verified
    draft i of request r is accepted with probability S_{r,i}; the b slots of largest survival are
    admitted. S falls along each chain, so every request gets a prefix of its drafts: a stable sort
    keeps ties in (request, draft) order, and between budgets of equal score the larger wins, so
    confidences all 1 verify every draft whenever n * beta <= 1 + draft_cost (one request: always,
    as beta <= 1).

    Lossless: the prefixes read the drafter's confidences only, never the target, so greedy output is
    the target's whatever they are. Sampling needs one more thing, which `Draft.confidence` asks of a
    drafter: c_i is known before draft i is drawn. Then this rule is a stopping rule: with S falling,
    the score rises while S_{b+1} >= beta * score(b) and falls for good after (score(b+1) lies between
    score(b) and S_{b+1}/beta), so draft i is verified iff every j <= i passed that test, which reads
    S_1..S_i, i.e. drafts < i; a verified draft is then still distributed as its q, and the rejection
    rule keeps the target's distribution. (In a batch, the other rows' drafts join the test; they are
    independent of this row's.) The loop below is that stopping rule, so it holds in floating point too;
    tests/engine/test_adaptive.py checks it against the argmax as written."""
    slots = sorted(((s, r) for r, conf in enumerate(confidences) for s in survival(conf)), key=lambda slot: -slot[0])
    n, fixed = len(confidences), costs.draft_cost + 1.0
    best, best_b, gained = n / fixed, 0, 0.0
    for b, (s, _) in enumerate(slots, 1):
        gained += s
        score = (n + gained) / (fixed + costs.beta * b)
        if score < best:
            break  # past the peak: the score only falls from here
        best, best_b = score, b
    out = [0] * n
    for _, r in slots[:best_b]:
        out[r] += 1
    return out


def adaptive_draft(draft: Draft, costs: AdaptiveCosts | None) -> Draft:
    """The prefix of a chain draft that adaptive verification verifies (one request); the draft
    itself when adaptive verification is off or the drafter gave no confidences."""
    if costs is None or draft.confidence is None or draft.parents != list(range(-1, len(draft.tokens) - 1)):
        return draft  # off, no confidences, or a tree (confidences are per chain position)
    if len(draft.confidence) != len(draft.tokens):
        raise DraftsmithError(
            f"adaptive verification: the drafter gave {len(draft.confidence)} confidences for "
            f"{len(draft.tokens)} drafts (one per draft expected)"
        )
    return draft.prefix(adaptive_prefixes([draft.confidence], costs)[0])
