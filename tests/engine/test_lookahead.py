"""Lookahead decoding and the lookup/model hybrid: greedy output equals target-only greedy, sampled
output keeps the target's distribution (chi-square), the Jacobi step and the n-gram pool do what the
paper says, the hybrid follows its rule and its model proposer survives the rounds it skips, and bad
arguments are one-line errors."""

from collections import Counter

import pytest
import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft, parse_tree
from draftsmith.engine.lookahead import HybridProposer, LookaheadProposer, graft, suffix_match, trie_draft
from draftsmith.engine.proposers import NgramProposer, Proposer
from draftsmith.engine.speculative import Sampler, Stats, speculative_decode, target_decode
from draftsmith.engine.verify import verify_tree_greedy
from draftsmith.models import distill, eagle
from draftsmith.target.features import target_features
from tests.conftest import make_target
from tests.engine.test_sampling import PROMPT, _collect, _reference, chi_square_p

CYCLE = list(range(10, 17))  # the bigram target below maps 10 -> 11 -> ... -> 16 -> 10


def bigram_target(cycle: list[int] = CYCLE):
    """A target whose next token depends on the last token only: x -> the next token of `cycle`
    (other tokens map to themselves). Attention and MLP outputs are zeroed, so the final hidden state
    is norm(embed(x)); the untied lm_head row of token next(x) is embed(x), and a random embedding is
    most similar to itself."""
    target = make_target(seed=0)
    succ = torch.arange(target.config.vocab_size)
    succ[cycle] = torch.tensor(cycle[1:] + cycle[:1])
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = target.get_input_embeddings().weight
        target.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        target.lm_head.weight.copy_(embed[torch.argsort(succ)])  # row v = embed of the token whose successor is v
    target.config.tie_word_embeddings = False
    return target


def prompts(tok) -> list[list[int]]:
    random = torch.randint(5, 90, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    repeated = tok("abcabcabcabcab")["input_ids"]
    return [tok("say 7")["input_ids"], random, repeated]


# --- lookahead: lossless, accepts on repetition -------------------------------------------------


class Recording(LookaheadProposer):
    """Keeps every draft with the depth and node budget it was asked for."""

    def reset(self):
        super().reset()
        self.drafts = getattr(self, "drafts", [])

    def _draft(self, seq, depth, budget):
        draft = super()._draft(seq, depth, budget)
        self.drafts.append((draft, depth, budget))
        return draft


@pytest.mark.parametrize("args", [{}, {"window": 2, "ngram": 2, "guesses": 1}, {"window": 7, "ngram": 4, "guesses": 5}])
def test_greedy_lookahead_equals_target_greedy(tiny_target, args):
    target, tok = tiny_target
    proposer = Recording(**args)
    for prompt in prompts(tok):
        ref = target_decode(target, prompt, 24, {2})
        stats = Stats(k=5)
        assert speculative_decode(target, proposer, prompt, 5, 24, {2}, None, stats) == ref
        assert stats.emitted == len(ref) - 1
    assert all(d.max_depth <= depth == 5 for d, depth, _ in proposer.drafts)


def test_greedy_lookahead_tree_mode_is_lossless_within_the_budget(tiny_target):
    target, tok = tiny_target
    spec = parse_tree("dynamic:depth=3,top_k=2,tokens=6")
    proposer = Recording(window=5, ngram=3, guesses=3)
    for prompt in prompts(tok):
        ref = target_decode(target, prompt, 24, {2})
        assert speculative_decode(target, proposer, prompt, 0, 24, {2}, stats=Stats(k=3), tree=spec) == ref
    drafts = [d for d, _, _ in proposer.drafts]
    assert all(len(d.tokens) <= 6 and d.max_depth <= 3 for d in drafts)
    assert any(len(d.children(-1)) > 1 for d in drafts)  # n-grams and the window branch side by side


def test_lookahead_accepts_on_a_cycle():
    """On the bigram target, every pool n-gram is true: text n-grams come from the target's own
    cycle, and Jacobi n-grams follow the target's argmax. The prompt already holds the cycle, so the
    root always keys an n-gram and every round accepts at least its N-1 tokens (the last round may be
    cut short by max_new)."""
    target = bigram_target()
    prompt = [1] + CYCLE + CYCLE[:3]
    ref = target_decode(target, prompt, 40, set())
    assert ref[:8] == [13, 14, 15, 16, 10, 11, 12, 13]  # the fixture is the cycle
    for n in (2, 3, 4):
        stats = Stats(k=5)
        assert speculative_decode(target, LookaheadProposer(ngram=n), prompt, 5, 40, set(), None, stats) == ref
        assert stats.accepted >= (n - 1) * (stats.passes - 1) and stats.tau > 1
    # Pure Jacobi (no pool, G = 0) stays lossless; it accepts nothing here, as the paper observes for
    # plain Jacobi decoding: the window slides as fast as Jacobi fixes its first position.
    stats = Stats(k=5)
    assert speculative_decode(target, LookaheadProposer(guesses=0), prompt, 5, 40, set(), None, stats) == ref


def test_lookahead_accepts_on_a_repeating_tiny_target(tiny_target):
    target, tok = tiny_target
    prompt = tok("abcabcabcabcab")["input_ids"]
    ref = target_decode(target, prompt, 40, {2})
    assert len(set(ref[10:])) < 10  # precondition: the random target repeats itself, so n-grams recur
    stats = Stats(k=5)
    assert speculative_decode(target, LookaheadProposer(), prompt, 5, 40, {2}, None, stats) == ref
    assert stats.tau > 1.5


# --- lookahead: the Jacobi step and the pool ------------------------------------------------------


def _succ(x: int) -> int:
    return (x + 1) % 50


def _round(proposer: LookaheadProposer, seq: list[int], k: int = 4) -> tuple[Draft, list[int]]:
    """One engine round against a fake bigram target (next token = x + 1 mod 50)."""
    draft = proposer.propose(torch.tensor([seq]), None, k)
    rows = [seq[-1]] + draft.tokens  # row 0 is the root, row 1+i node i
    logits = torch.nn.functional.one_hot(torch.tensor([_succ(t) for t in rows]), 50).float()
    path, new = verify_tree_greedy(draft, logits)
    proposer.observe(draft, logits, path, new)
    return draft, seq + new


def test_jacobi_step_shifts_the_window_and_harvests_diagonal_ngrams():
    proposer = LookaheadProposer(window=4, ngram=3, guesses=20)
    seq = [9, 3, 7, 1, 5]  # text n-grams here do not follow x + 1
    draft, seq = _round(proposer, seq)
    window = proposer.windows[-1][1]
    # Round 1: no pool n-gram starts with 5, so the draft is the window alone, random context tokens.
    assert draft.tokens == window and draft.parents == [-1, 0, 1, 2] and set(window) <= {9, 3, 7, 1, 5}
    assert seq == [9, 3, 7, 1, 5, 6]  # nothing accepted (no context token is 6); the target adds 6
    # Jacobi: the next window at positions 6.. is the target's output after each window token.
    _, seq = _round(proposer, seq)
    assert proposer.windows[-1] == (6, [_succ(t) for t in window])
    # After N-1 = 2 windows, the diagonal (w1[p], w2[p+1], out2[p+2]) = (a, a+1, a+2) is pooled.
    for a in window:  # the second output reaches position p + 2 for every p of the first window
        assert (_succ(a), _succ(_succ(a))) in proposer.pool[a]
    # The verified text is pooled too: every 3-gram of the prompt and of the accepted tokens.
    assert (7, 1) in proposer.pool[3] and (5, 6) in proposer.pool[1]


def test_window_slides_over_accepted_tokens():
    proposer = LookaheadProposer(window=4, ngram=2, seed=0)
    proposer.output = (10, [40, 41, 42, 43, 44])  # guesses for positions 10..14
    seq = list(range(12))  # root at position 11: positions 10 and 11 are verified now
    window = proposer._next_window(seq, 4)
    assert window[:3] == [42, 43, 44] and window[3] in seq  # positions 12..14, then a context token


def test_verification_branch_is_keyed_by_the_root_and_shares_prefixes():
    proposer = LookaheadProposer(window=3, ngram=3, guesses=2)
    seq = [4, 5, 6, 4, 5, 7, 4, 8, 9, 4]  # 4 is followed by (5, 6), (5, 7), (8, 9): the newest G = 2 kept
    draft = proposer.propose(torch.tensor([seq]), None, 5)
    assert proposer.pool[4] == [(8, 9), (5, 7)]
    under_root = {draft.tokens[c] for c in draft.children(-1)}
    assert {8, 5} <= under_root and len(under_root) == len(draft.children(-1))  # siblings are distinct
    assert draft.max_depth <= 5
    trie, index = trie_draft([[1, 2], [1, 3], [1, 2, 4]])
    assert trie.tokens == [1, 2, 3, 4] and trie.parents == [-1, 0, 0, 1] and index[(1, 2, 4)] == 3


# --- hybrid: the rule, attributes, skipped model proposers ---------------------------------------


class Recorder(Proposer):
    """A model proposer that drafts 99s and records its calls."""

    feature_names = ("last_hidden",)
    max_depth = 6

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def propose(self, tokens, feats, k, sampler=None):
        self.calls.append("propose")
        return Draft.chain([99] * k)


class TreeRecorder(Recorder):
    drafts_trees = True

    def propose_tree(self, tokens, feats, spec):
        self.calls.append("propose_tree")
        return Draft.chain([98] * spec.depth)


def test_suffix_match_is_what_ngram_lookup_proposes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seq = torch.randint(0, 4, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        n, follow = suffix_match(seq, 3, 4)
        assert follow == NgramProposer(3).propose(torch.tensor([seq]), None, 4).tokens
        assert (
            (n == 0) == (not follow)
            and n <= 3
            and (n == 0 or seq[-n:] in [seq[i : i + n] for i in range(len(seq) - n)])
        )


@pytest.mark.parametrize(
    "seq, k, min_match, source",
    [
        ([5, 6, 7, 8, 9, 5, 6, 7], 4, 3, "lookup"),  # suffix [5 6 7] recurs (n=3), 4 tokens follow
        ([5, 6, 7, 8, 9, 5, 6, 7], 4, 2, "lookup"),
        ([1, 2, 9, 3, 2, 9], 4, 3, "model"),  # only [2 9] recurs: n=2 < min_match=3
        ([1, 2, 9, 3, 2, 9], 4, 2, "lookup"),  # n=2, follow [3 2 9]: 3 >= 4/2
        ([1, 2, 3, 1, 2], 6, 2, "lookup"),  # follow [3 1 2]: 3 >= 6/2
        ([1, 2, 3, 1, 2], 7, 2, "model"),  # 3 < 7/2: too short
        ([1, 2, 3, 4, 5], 4, 1, "model"),  # nothing recurs
    ],
)
def test_hybrid_picks_lookup_or_model_by_its_rule(seq, k, min_match, source):
    model = Recorder()
    hybrid = HybridProposer(NgramProposer(3), model, min_match=min_match)
    draft = hybrid.propose(torch.tensor([seq]), {}, k)
    assert hybrid.last == source and hybrid.draft_sources[source] == 1
    if source == "lookup":
        assert (
            draft.tokens == NgramProposer(3).propose(torch.tensor([seq]), None, k).tokens
            and "propose" not in model.calls
        )
    else:
        assert draft.tokens == [99] * k and model.calls == ["propose"]


def test_hybrid_delegates_what_the_engine_reads():
    chain_only = HybridProposer(NgramProposer(), Recorder())
    assert chain_only.feature_names == ("last_hidden",) and chain_only.max_depth == 6
    assert not chain_only.drafts_trees and HybridProposer(NgramProposer(), TreeRecorder()).drafts_trees
    model = TreeRecorder()
    tree = HybridProposer(NgramProposer(), model)
    spec = parse_tree("dynamic:depth=4")
    assert tree.propose_tree(torch.tensor([[1, 2, 3, 4, 5]]), {}, spec).tokens == [98] * 4  # no match: the model's tree
    both = tree.propose_tree(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]]), {}, spec)  # a match: the lookup chain grafted on
    assert both.tokens == [98] * 4 + [8, 9, 5, 6] and both.parents == [-1, 0, 1, 2, -1, 4, 5, 6]
    assert tree.draft_sources == {"model": 1, "both": 1, "lookup": 0}
    tree.reset()
    assert model.calls == ["propose_tree", "propose_tree", "reset"]
    assert hasattr(HybridProposer(NgramProposer(), LookaheadProposer()), "observe")


def test_graft_shares_prefixes_and_leaves_sampled_children_alone():
    tree = Draft([7, 8, 9, 5], [-1, 0, 0, 1], [None] * 4)  # 7 -> {8 -> 5, 9}
    assert graft(tree, [7, 8, 6, 1]) is tree
    assert tree.tokens == [7, 8, 9, 5, 6, 1] and tree.parents == [-1, 0, 0, 1, 1, 4]  # through 7 and 8, then new nodes
    assert graft(Draft.chain([3]), [3, 4]).parents == [-1, 0]  # a chain that the lookup extends
    sampled = Draft.chain([7, 8], qs=[torch.ones(4) / 4, torch.ones(4) / 4])
    assert graft(sampled, [7, 2, 3]).tokens == [7, 8]  # 8 was sampled: 2 may not become its sibling
    assert graft(sampled, [1]).tokens == [7, 8]


def _eagle(target):
    torch.manual_seed(0)
    return eagle.make_proposer(eagle.build(eagle.DrafterConfig(), target).eval(), target, eagle.DrafterConfig())


@pytest.mark.fp32_exact
def test_model_proposers_with_a_cache_resync_after_skipped_rounds(tiny_target):
    """What the hybrid does to a model proposer: call it, skip some rounds (the context jumps ahead,
    and the tail it was fed is not what got verified), call it again. Its draft must equal a fresh
    proposer's on the same context."""
    target, _ = tiny_target
    tokens = torch.randint(5, 90, (1, 24), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, {"input_ids": tokens}, ("last_hidden",))
    student = make_target(seed=5, vocab=target.config.vocab_size)
    for make in (lambda: distill.StudentProposer(student), lambda: _eagle(target)):
        used, fresh = make(), make()
        used.reset()
        for n in (9, 17, 23):  # jumps of 8 and 6 tokens
            ctx = tokens[:, :n]
            f = {name: feats[name][:, : n - 1] for name in used.feature_names}  # all but the newest token
            got = used.propose(ctx, f, 4)
            fresh.reset()
            assert got.tokens == fresh.propose(ctx, f, 4).tokens, (type(used).__name__, n)


@pytest.mark.parametrize("kind", ["student", "eagle", "eagle-tree", "lookahead"])
@pytest.mark.fp32_exact
def test_greedy_hybrid_equals_target_greedy_and_uses_both_sources(tiny_target, kind):
    """On the tiny target (which soon repeats one token) and on the bigram target (a 7-token cycle,
    which lookup predicts once the cycle has been seen)."""
    tiny, tok = tiny_target
    make = {
        "student": lambda t: distill.StudentProposer(make_target(seed=5, vocab=t.config.vocab_size)),
        "eagle": _eagle,
        "eagle-tree": _eagle,
        "lookahead": lambda t: LookaheadProposer(),
    }[kind]
    tree = parse_tree("dynamic:depth=4,top_k=3,tokens=10") if kind == "eagle-tree" else None
    rounds = Counter()
    for target, cases in ((tiny, prompts(tok)), (bigram_target(), [[1, 20, 30, 12], [1] + CYCLE + CYCLE[:3]])):
        hybrid = HybridProposer(NgramProposer(), make(target), min_match=2)
        for prompt in cases:
            ref = target_decode(target, prompt, 24, {2})
            assert speculative_decode(target, hybrid, prompt, 4, 24, {2}, None, Stats(k=4), tree) == ref
        rounds.update(hybrid.draft_sources)
    assert rounds["lookup" if tree is None else "both"] > 0 and rounds["model"] > 0


@pytest.mark.fp32_exact
def test_batched_rows_get_their_own_model_proposer(tiny_target):
    """Batched decoding copies the proposer per row; a shared FeatureProposer cache would mix rows."""
    from draftsmith.engine.batched import speculative_decode_batch
    from draftsmith.eval.run import fresh_copies

    target, tok = tiny_target
    hybrid = HybridProposer(NgramProposer(), _eagle(target))
    make = fresh_copies(hybrid)
    a, b = make(), make()
    assert a.model is not b.model and a.model.cache is not b.model.cache and a.model.drafter is b.model.drafter
    cases = prompts(tok)
    refs = [target_decode(target, p, 20, {2}) for p in cases]
    assert speculative_decode_batch(target, make, cases, 3, 20, {2}) == refs


# --- sampling ------------------------------------------------------------------------------------


@pytest.mark.chi_square
def test_sampled_lookahead_matches_target_distribution(peaked_target):
    """The chi-square test's power against a wrong rule is shown in tests/engine/test_sampling.py; here its
    drafts must really be judged: some are accepted."""
    target, stats = peaked_target, Stats(k=3)
    spec = _collect(
        lambda s: speculative_decode(
            target, LookaheadProposer(window=3, ngram=2), PROMPT, 3, 3, set(), Sampler(1.0, 1.0, seed=s), stats
        )
    )
    assert chi_square_p(_reference(target, 1.0, 1.0), spec) > 1e-3
    assert 0 < stats.accepted < stats.proposed


@pytest.mark.chi_square
def test_sampled_hybrid_matches_target_distribution(peaked_target):
    target = peaked_target
    torch.manual_seed(0)
    hybrid = HybridProposer(
        NgramProposer(), eagle.make_proposer(eagle.build(eagle.DrafterConfig(), target), target, eagle.DrafterConfig())
    )
    # The prompt, then the target's greedy continuation, then the prompt again: wherever the first
    # sampled token is the greedy one, its last 3 tokens recur and the lookup drafts; otherwise the model.
    prompt = PROMPT + target_decode(target, PROMPT, 8, set()) + PROMPT
    spec = _collect(lambda s: speculative_decode(target, hybrid, prompt, 3, 3, set(), Sampler(1.0, 1.0, seed=s)))
    assert chi_square_p(_reference(target, 1.0, 1.0, prompt), spec) > 1e-3
    assert hybrid.draft_sources["lookup"] > 0 and hybrid.draft_sources["model"] > 0


# --- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LookaheadProposer(window=0), "window W must be an integer >= 1"),
        (lambda: LookaheadProposer(ngram=1), "ngram N must be an integer >= 2"),
        (lambda: LookaheadProposer(guesses=-1), "guesses G must be an integer >= 0"),
        (lambda: LookaheadProposer(window=2.5), "window W must be an integer"),
        (lambda: LookaheadProposer.from_spec("lookahead:W=x"), "lookahead\\[:W=5,N=3,G=3\\]"),
        (lambda: LookaheadProposer.from_spec("lookahead:K=3"), "lookahead\\[:W=5,N=3,G=3\\]"),
        (lambda: LookaheadProposer.from_spec("lookahed"), "lookahead\\[:W=5,N=3,G=3\\]"),
        (lambda: LookaheadProposer.from_spec("lookahead:N=1"), "ngram N must be"),
        (lambda: HybridProposer(NgramProposer(3), Recorder(), min_match=0), "min_match must be an integer in 1..3"),
        (lambda: HybridProposer(NgramProposer(3), Recorder(), min_match=4), "min_match must be an integer in 1..3"),
    ],
)
def test_bad_arguments_are_one_line_errors(make, match):
    with pytest.raises(DraftsmithError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


def test_spec_round_trips():
    proposer = LookaheadProposer.from_spec("lookahead:W=7,N=4")
    assert (proposer.window, proposer.ngram, proposer.guesses) == (7, 4, 3)
    assert proposer.spec() == "lookahead:W=7,N=4,G=3"
    assert LookaheadProposer.from_spec(proposer.spec()).spec() == proposer.spec()
    assert LookaheadProposer.from_spec("lookahead").spec() == "lookahead:W=5,N=3,G=3"
