"""Replay (draftsmith/engine/replay.py): a drafter's acceptance on a given continuation. On the target's
own greedy text it is the greedy engine's count, round for round; on another text it judges the drafts
against that text; given rounds are followed as they are."""

import pytest
import torch

from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import NgramProposer
from draftsmith.engine.replay import Round, inside, replay, rounds_from_steps
from draftsmith.engine.speculative import Stats, speculative_greedy, target_greedy
from draftsmith.models import eagle3
from tests.engine.test_speculative import OracleProposer

EOS = {2}


class NoisyOracle(OracleProposer):
    """The target's own continuation, wrong wherever (context length + draft index) % 3 == 2: rounds
    accept 0, 1 or 2 drafts, so every position is reached and some rounds stop early."""

    def propose(self, tokens, feats, k, sampler=None):
        n, right = tokens.shape[1], super().propose(tokens, feats, k).tokens
        return Draft.chain([t if (n + i) % 3 != 2 else (t + 1) % 128 for i, t in enumerate(right)])


def _proposers(target):
    torch.manual_seed(0)
    cfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1])  # a 2-layer target
    return {
        "noisy-oracle": NoisyOracle(target),
        "ngram": NgramProposer(),
        "eagle3": eagle3.make_proposer(eagle3.build(cfg, target), target, cfg),  # reads target features
    }


def _counts(s: Stats) -> tuple:
    return s.passes, s.emitted, s.proposed, s.accepted, s.reached, s.accepted_at


@pytest.mark.fp32_exact
@pytest.mark.parametrize("name", ["noisy-oracle", "ngram", "eagle3"])
@pytest.mark.parametrize("max_new", [23, 40])  # a budget that cuts a round, and one the EOS may end
def test_replay_of_the_greedy_text_is_the_engines_own_count(tiny_target, name, max_new):
    target, _ = tiny_target
    proposer, k = _proposers(target)[name], 3
    prompt = [1, 7, 9, 30, 31, 7, 9, 12, 30, 31]
    engine = Stats(k=k)
    text = speculative_greedy(target, proposer, prompt, k, max_new, EOS, engine)
    assert text == target_greedy(target, prompt, max_new, EOS)
    rounds, replayed = replay(target, proposer, prompt, text, k)
    assert _counts(replayed) == _counts(engine)
    assert engine.passes > 3 and (name != "noisy-oracle" or 0 < engine.accepted < engine.proposed)
    # The rounds tile the text: each starts where the last one's accepted drafts and bonus token end.
    assert [r.start for r in rounds] == [1] + [r.start + r.accepted + 1 for r in rounds[:-1]]


@pytest.mark.fp32_exact
def test_given_rounds_are_followed_and_drafts_judged_against_the_given_text(tiny_target):
    target, _ = tiny_target
    proposer, k, prompt = NoisyOracle(target), 3, [1, 7, 9, 30, 31, 7, 9, 12]
    text = target_greedy(target, prompt, 30, set())
    own, _ = replay(target, proposer, prompt, text, k)
    steps = rounds_from_steps([r.drafted for r in own], [r.accepted for r in own], len(text))
    again, stats = replay(target, proposer, prompt, text, k, steps)
    assert again == own and stats.passes == len(own)
    # Another engine's text, one token changed: the oracle drafts the target's argmax, which the given
    # text no longer has at that position, so the round that reaches it stops there.
    other = list(text)
    other[10] = (other[10] + 5) % 128
    first = next(r for r in own if r.start <= 10 < r.start + r.drafted)  # a round drafting position 10
    got, _ = replay(target, proposer, prompt, other, k, [Round(first.start, first.drafted, 0)])
    assert got[0].accepted == min(first.accepted, 10 - first.start)


def test_rounds_that_do_not_tile_the_text_are_refused():
    assert rounds_from_steps([3, 3, 3], [1, 3, 0], 8) == [Round(1, 3, 1), Round(3, 3, 3), Round(7, 3, 0)]
    assert rounds_from_steps([3, 3], [3, 3], 8) is not None  # the last round may run past the text (cut)
    assert rounds_from_steps([3, 3], [0, 0], 10) is None  # steps without drafts in between: starts unknown
    assert rounds_from_steps([3, 3, 3], [3, 3, 3], 6) is None  # a round after the text ended
    assert inside(Round(5, 3, 3), 9) and not inside(Round(6, 3, 3), 9)  # drafts 6-8 and the bonus at 9
