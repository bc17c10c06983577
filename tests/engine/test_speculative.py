"""Greedy chain speculative decoding: lossless, and acceptance 1.0 / τ = K+1 for a perfect drafter."""

import pytest
import torch

from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import NgramProposer, Proposer
from draftsmith.engine.speculative import Stats, speculative_greedy, target_greedy
from draftsmith.models import eagle


class OracleProposer(Proposer):
    """A "drafter" that reads the target's own greedy continuation: the ideal drafter."""

    feature_names = ()

    def __init__(self, target):
        self.target = target

    def reset(self):
        pass

    def propose(self, tokens, feats, k, sampler=None):
        return Draft.chain(target_greedy(self.target, tokens[0].tolist(), k, eos=set()))


class WrongProposer(OracleProposer):
    def propose(self, tokens, feats, k, sampler=None):
        return Draft.chain([(t + 1) % self.target.config.vocab_size for t in super().propose(tokens, feats, k).tokens])


PROMPT = [1, 7, 9, 30, 31, 7, 9, 12]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_perfect_drafter_gets_full_acceptance(tiny_target, k):
    target, _ = tiny_target
    rounds = 4
    stats = Stats(k=k)
    # The prefill pass emits 1 token; each verification round then emits K+1 when all accept.
    out = speculative_greedy(target, OracleProposer(target), PROMPT, k, 1 + rounds * (k + 1), set(), stats)
    assert out == target_greedy(target, PROMPT, 1 + rounds * (k + 1), set())
    assert stats.acceptance_rate == 1.0
    assert stats.tau == k + 1
    assert stats.per_position == [1.0] * k
    assert stats.passes == rounds


def test_always_wrong_drafter_accepts_nothing_and_stays_lossless(tiny_target):
    target, _ = tiny_target
    stats = Stats(k=4)
    out = speculative_greedy(target, WrongProposer(target), PROMPT, 4, 20, set(), stats)
    assert out == target_greedy(target, PROMPT, 20, set())
    assert stats.acceptance_rate == 0.0 and stats.tau == 1.0
    assert stats.per_position == [0.0, 0.0, 0.0, 0.0]  # position 0 reached every round, later ones never


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.fp32_exact
def test_greedy_is_lossless_with_random_eagle_and_ngram_drafters(tiny_target, seed):
    target, _ = tiny_target
    torch.manual_seed(seed)
    drafter = eagle.build(eagle.DrafterConfig(), target)
    prompt = torch.randint(5, 90, (12,)).tolist()
    ref = target_greedy(target, prompt, 40, {2})
    for proposer in (eagle.make_proposer(drafter, target, eagle.DrafterConfig()), NgramProposer(), None):
        stats = Stats(k=5)
        assert speculative_greedy(target, proposer, prompt, 5, 40, {2}, stats) == ref
        assert stats.emitted == len(ref) - 1  # every token after the prefill one came from a verification pass


def test_ngram_proposes_what_followed_the_last_match():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    assert NgramProposer().propose(tokens, None, 2).tokens == [8, 9]
    assert NgramProposer().propose(torch.tensor([[1, 2, 3]]), None, 2).tokens == []
