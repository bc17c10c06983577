"""Tree speculation: tree attention equals per-path decoding, trees are well-formed, greedy tree
decoding is lossless, a perfect tree gets full acceptance, and sampled trees keep the target's
distribution (chi-square, with a negative control)."""

import pytest
import torch
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft, grow_tree, parse_tree
from draftsmith.engine.proposers import Proposer
from draftsmith.engine.speculative import Sampler, Stats, speculative_decode, target_greedy
from draftsmith.engine.verify import verification_inputs
from draftsmith.models import eagle, eagle3
from draftsmith.target.features import target_features
from tests.engine.test_sampling import PROMPT, AcceptAll, N, _collect, _reference, chi_square_p


def _logits(target, ids, **kw):
    feats = target_features(target, {"input_ids": torch.tensor([ids]), **kw}, ("last_hidden",), cache=kw.get("cache"))
    return target.get_output_embeddings()(feats["last_hidden"])[0]


@pytest.mark.fp32_exact
def test_tree_attention_equals_decoding_each_path(tiny_target):
    target, _ = tiny_target
    prefix = [1, 7, 9, 30, 31, 7]
    # root = prefix[-1]; two branches of depth 2 and 3, siblings interleaved in the node order.
    draft = Draft(tokens=[40, 41, 42, 43, 44], parents=[-1, -1, 0, 1, 2])
    cache = DynamicCache()
    with torch.no_grad():
        _logits(target, prefix[:-1], cache=cache)
        mask, pos = verification_inputs(draft, len(prefix) - 1)
        tree = _logits(target, prefix[-1:] + draft.tokens, cache=cache, attention_mask=mask, position_ids=pos)
        for i in range(len(draft.tokens)):
            path, j = [], i
            while j >= 0:
                path, j = [draft.tokens[j]] + path, draft.parents[j]
            plain = _logits(target, prefix + path)[-1]
            assert torch.allclose(tree[i + 1], plain, atol=1e-4), f"node {i}"
        assert torch.allclose(tree[0], _logits(target, prefix)[-1], atol=1e-4)


def test_parse_tree_specs():
    spec = parse_tree("dynamic:depth=4,top_k=3,tokens=10")
    assert (spec.kind, spec.depth, spec.top_k, spec.tokens) == ("dynamic", 4, 3, 10)
    assert parse_tree("dynamic").tokens == 48
    static = parse_tree("static:[[0,0],[0],[1]]")
    assert static.paths == [(0,), (1,), (0, 0)] and static.depth == 2 and static.top_k == 2
    for bad in ("dynamic:depth=0", "dynamic:width=3", "static:[[0,1]]", "static:nonsense", "beam:3"):
        with pytest.raises(DraftsmithError, match="--tree"):
            parse_tree(bad)


def test_dynamic_tree_is_a_tree_within_budget():
    spec = parse_tree("dynamic:depth=4,top_k=3,tokens=10")
    gen = torch.Generator().manual_seed(0)
    calls = []

    def expand(draft, nodes):
        calls.append(len(nodes))
        return torch.randn(len(nodes), 50, generator=gen)

    draft = grow_tree(spec, torch.randn(50, generator=gen), expand)
    assert len(draft.tokens) == 10 and draft.max_depth <= 4
    assert calls == [3, 3, 3]  # depth-1 comes from the root; each further depth expands top_k nodes
    for i, p in enumerate(draft.parents):
        assert p < i  # topological: parents precede children
        assert len(draft.children(p)) <= 3
        siblings = [draft.tokens[c] for c in draft.children(p)]
        assert len(set(siblings)) == len(siblings)


def _drafters(target):
    torch.manual_seed(0)
    e1 = eagle.make_proposer(eagle.build(eagle.DrafterConfig(), target).eval(), target, eagle.DrafterConfig())
    cfg3 = eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40)
    d3 = eagle3.build(cfg3, target).eval()
    d3.d2t.copy_(torch.arange(40))  # draft vocab = the even target ids 0..78: target id = 2 * draft id
    d3.t2d.zero_()
    d3.t2d[0:80:2] = True
    return [e1, eagle3.make_proposer(d3, target, cfg3)]


@pytest.mark.fp32_exact
def test_static_tree_branch_equals_the_chain_despite_siblings(tiny_target):
    """Siblings fed in the same drafter pass must not see each other: the all-top-1 path of a
    static tree equals the greedy chain."""
    target, _ = tiny_target
    tokens = torch.randint(5, 90, (1, 14))
    spec = parse_tree("static:[[0],[1],[2],[0,0],[1,0],[2,0],[0,0,0],[1,0,0]]")
    for proposer in _drafters(target):
        names = proposer.feature_names
        feats = target_features(target, {"input_ids": tokens}, names)
        feats = {n: f[:, :-1] for n, f in feats.items()}
        proposer.reset()
        chain = proposer.propose(tokens, feats, 3).tokens
        proposer.reset()
        tree = proposer.propose_tree(tokens, feats, spec)
        path, node = [], -1
        for _ in range(3):
            node = tree.children(node)[0]
            path.append(tree.tokens[node])
        assert path == chain
        assert len(set(tree.tokens[c] for c in tree.children(-1))) == 3


@pytest.mark.parametrize("tree", ["dynamic:depth=4,top_k=3,tokens=12", "static:[[0],[1],[0,0],[1,0],[0,1],[0,0,0]]"])
@pytest.mark.fp32_exact
def test_greedy_tree_decoding_is_lossless(tiny_target, tree):
    target, _ = tiny_target
    prompt = torch.randint(5, 90, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = target_greedy(target, prompt, 40, {2})
    spec = parse_tree(tree)
    for proposer in _drafters(target):
        stats = Stats(k=spec.depth)
        assert speculative_decode(target, proposer, prompt, 0, 40, {2}, stats=stats, tree=spec) == ref
        assert stats.emitted == len(ref) - 1


class OracleTree(Proposer):
    """Puts the target's greedy continuation on the *second* branch under a wrong first sibling at
    every depth, so acceptance needs tree attention and non-contiguous cache selection."""

    feature_names = ()
    drafts_trees = True

    def __init__(self, target, depth):
        self.target, self.depth = target, depth

    def reset(self):
        pass

    def propose_tree(self, tokens, feats, spec):
        good = target_greedy(self.target, tokens[0].tolist(), self.depth, eos=set())
        draft, parent = Draft(), -1
        for t in good:
            draft.add((t + 1) % self.target.config.vocab_size, parent)  # decoy, explored first
            parent = draft.add(t, parent)
        return draft


def test_perfect_tree_gets_full_acceptance(tiny_target):
    target, _ = tiny_target
    prompt, depth, rounds = [1, 7, 9, 30, 31, 7, 9, 12], 4, 3
    stats = Stats(k=depth)
    out = speculative_decode(
        target,
        OracleTree(target, depth),
        prompt,
        0,
        1 + rounds * (depth + 1),
        set(),
        stats=stats,
        tree=parse_tree("dynamic"),
    )
    assert out == target_greedy(target, prompt, 1 + rounds * (depth + 1), set())
    assert stats.tau == depth + 1 and stats.per_position == [1.0] * depth
    assert stats.acceptance_rate == 0.5  # half the nodes are decoys


@pytest.mark.chi_square
def test_sampled_tree_matches_target_distribution(peaked_target):
    target = peaked_target
    torch.manual_seed(0)
    proposer = eagle.make_proposer(eagle.build(eagle.DrafterConfig(), target), target, eagle.DrafterConfig())
    spec = parse_tree("dynamic:depth=3,top_k=3,tokens=8")

    def collect(sampler_cls, n=N):
        return _collect(
            lambda s: speculative_decode(
                target, proposer, PROMPT, 0, 3, set(), sampler_cls(1.0, 1.0, seed=s), tree=spec
            ),
            n,
        )

    ref = _reference(target, 1.0, 1.0)
    assert chi_square_p(ref, collect(Sampler)) > 1e-3
    # Negative control: keeping the first child always follows the drafter's top path (a quarter of the
    # samples suffice to tell).
    assert chi_square_p(ref, collect(AcceptAll, N // 4)) < 1e-3


def test_bad_tree_in_a_recipe_fails_at_load(tmp_path):
    from draftsmith.train.config import load_config

    with pytest.raises(DraftsmithError, match="eval.tree"):
        load_config(None, ["eval.tree=dynamic:depth=x"])
