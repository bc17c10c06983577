"""Tree verification: one target pass checks every node of a draft (draftsmith/engine/drafts.py).

The target verifies every node in one forward pass: node i sits at position (root + depth_i) and
attends to the verified prefix plus its own ancestors only (tree attention). The verify rules walk
down from the root and keep one root-to-leaf path.
"""

from __future__ import annotations

import torch

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
    node, path = -1, []
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
    node, path = -1, []
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
