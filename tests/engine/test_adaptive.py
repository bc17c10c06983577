"""Adaptive verification (draftsmith/engine/verify.py, vLLM 0.32's rule): the budget rule on constructed
confidences, and the engine with it: greedy output token-exact, sampling keeps the target's
distribution (chi-square), low confidences verify shorter prefixes, confidences all 1 change nothing."""

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.batched import speculative_decode_batch
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.engine.speculative import Sampler, Stats, speculative_decode, target_decode, target_greedy
from draftsmith.engine.verify import AdaptiveCosts, adaptive_draft, adaptive_prefixes, survival
from tests.engine.test_sampling import PROMPT as SAMPLING_PROMPT
from tests.engine.test_sampling import N, _collect, _reference, chi_square_p
from tests.engine.test_speculative import PROMPT, OracleProposer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine (as tests/engine/test_batched.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _brute_force(confidence: list[float], costs: AdaptiveCosts) -> int:
    """The rule as written: b = argmax_b (1 + sum_{i<=b} S_i) / (draft_cost + 1 + beta*b), largest b on ties."""
    s = survival(confidence)
    scores = [(1 + sum(s[:b])) / (costs.draft_cost + 1 + costs.beta * b) for b in range(len(s) + 1)]
    return max(b for b in range(len(scores)) if scores[b] == max(scores))


def test_survival_is_the_running_product_clamped():
    assert survival([0.5, 0.5, 1.0, 0.2]) == pytest.approx([0.5, 0.25, 0.25, 0.05])
    assert survival([1.5, -0.1]) == [1.0, 0.0]
    assert survival([]) == []


@pytest.mark.parametrize(
    "confidence",
    [[1.0] * 5, [0.9, 0.8, 0.7, 0.6], [0.5] * 4, [0.99, 0.1, 0.99], [0.01, 0.9], [0.3], [], [0.0, 1.0, 1.0]],
)
@pytest.mark.parametrize("costs", [AdaptiveCosts(), AdaptiveCosts(0.0, 0.25), AdaptiveCosts(0.5, 0.3)])
def test_one_request_takes_the_budget_of_the_formula(confidence, costs):
    assert adaptive_prefixes([confidence], costs) == [_brute_force(confidence, costs)]


def test_the_stopping_rule_is_the_argmax_on_random_chains():
    """The loop stops at the first draft that does not raise the score; with survival falling, that is
    vLLM's argmax (the score rises, then falls for good), which is what makes it lossless."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        conf = torch.rand(int(torch.randint(0, 8, (1,), generator=g)), generator=g).tolist()
        costs = AdaptiveCosts(float(torch.rand((), generator=g)) * 3, float(torch.rand((), generator=g)))
        assert adaptive_prefixes([conf], costs) == [_brute_force(conf, costs)]


def test_known_budgets():
    # S = .5 .25 .125 .0625; scores b=0..4 at beta .25: 1, 1.5/1.25 = 1.2, 1.75/1.5, 1.875/1.75, 1.9375/2.
    assert adaptive_prefixes([[0.5] * 4], AdaptiveCosts(0.0, 0.25)) == [1]
    assert adaptive_prefixes([[0.5] * 4], AdaptiveCosts(0.0, 0.0)) == [4]  # free verification: every draft
    assert adaptive_prefixes([[0.01, 1.0]], AdaptiveCosts(0.0, 0.05)) == [0]  # not even the first draft
    # A costlier drafter makes each verified draft relatively cheaper: the prefix grows.
    assert adaptive_prefixes([[0.5] * 4], AdaptiveCosts(3.0, 0.25)) == [3]


@pytest.mark.parametrize("costs", [AdaptiveCosts(), AdaptiveCosts(0.0, 1.0), AdaptiveCosts(2.0, 0.9)])
def test_confidences_all_one_verify_everything(costs):
    """Whenever n * beta <= 1 + draft_cost for n requests: beta <= 1 for one, always the case."""
    assert adaptive_prefixes([[1.0] * 6], costs) == [6]
    if 2 * costs.beta <= 1 + costs.draft_cost:
        assert adaptive_prefixes([[1.0] * 6, [1.0] * 2], costs) == [6, 2]


def test_lower_confidences_never_verify_more():
    costs = AdaptiveCosts(0.2, 0.1)
    for high, low in [(0.9, 0.6), (0.6, 0.3), (0.3, 0.05)]:
        assert adaptive_prefixes([[low] * 5], costs)[0] <= adaptive_prefixes([[high] * 5], costs)[0]
    assert adaptive_prefixes([[0.05] * 5], costs)[0] < adaptive_prefixes([[0.95] * 5], costs)[0]


def test_a_batch_shares_one_budget_by_survival():
    """The global top-b slots by survival: the confident row gets the budget, each row a prefix."""
    costs = AdaptiveCosts(0.0, 0.1)
    sure, unsure = [0.95, 0.95, 0.95], [0.4, 0.4, 0.4]
    assert adaptive_prefixes([sure, unsure], costs) == [3, 1]
    assert adaptive_prefixes([unsure, sure], costs) == [1, 3]
    assert adaptive_prefixes([], costs) == []


def test_adaptive_draft_cuts_chains_only():
    chain = Draft.chain([5, 6, 7], confidence=[0.9, 0.01, 0.9])
    assert adaptive_draft(chain, AdaptiveCosts()).tokens == [5]
    assert adaptive_draft(chain, AdaptiveCosts()).confidence == [0.9]
    assert adaptive_draft(chain, None) is chain
    plain = Draft.chain([5, 6, 7])
    assert adaptive_draft(plain, AdaptiveCosts()) is plain  # no confidences: every draft
    with pytest.raises(DraftsmithError, match="2 confidences for 3 drafts"):
        adaptive_draft(Draft.chain([5, 6, 7], confidence=[0.5, 0.5]), AdaptiveCosts())


class ConfidentOracle(OracleProposer):
    """The target's own greedy continuation, wrong at a position that moves with the context length,
    with confidences from `conf(j, token)`: the drafter's own outputs only."""

    drafts_confidence = True

    def __init__(self, target, conf):
        super().__init__(target)
        self.conf = conf

    def propose(self, tokens, feats, k, sampler=None):
        good = super().propose(tokens, feats, k).tokens
        wrong_at = tokens.shape[1] % (k + 2)  # k, k+1: all right
        drafts = [(t + 1) % self.target.config.vocab_size if j == wrong_at else t for j, t in enumerate(good)]
        return Draft.chain(drafts, confidence=[self.conf(j, t) for j, t in enumerate(drafts)])


def _run(target, proposer, k, max_new, costs):
    stats = Stats(k=k)
    out = speculative_decode(target, proposer, PROMPT, k, max_new, set(), None, stats, None, costs)
    return out, stats


@pytest.mark.fp32_exact
def test_greedy_adaptive_is_token_exact_and_low_confidence_verifies_less(tiny_target):
    target, _ = tiny_target
    k, max_new = 4, 30
    ref = target_greedy(target, PROMPT, max_new, set())
    sure = ConfidentOracle(target, lambda j, t: 1.0)
    full, full_stats = _run(target, sure, k, max_new, None)
    same, same_stats = _run(target, sure, k, max_new, AdaptiveCosts())
    assert full == same == ref
    # Confidences all 1: exactly full verification, round for round.
    for name in ("passes", "emitted", "proposed", "accepted", "reached", "accepted_at"):
        assert getattr(same_stats, name) == getattr(full_stats, name), name
    # Confidences that fall along the chain (and depend on the drafted token): shorter prefixes, same output.
    falling = ConfidentOracle(target, lambda j, t: 0.9 if j == 0 else (0.5 if t % 2 else 0.2))
    out, stats = _run(target, falling, k, max_new, AdaptiveCosts(0.0, 0.1))
    assert out == ref
    assert 0 < stats.proposed < full_stats.proposed
    assert stats.proposed / stats.passes < k
    # Hopeless confidences: nothing verified, one target token per pass, still the target's output.
    hopeless = ConfidentOracle(target, lambda j, t: 0.01)
    out, stats = _run(target, hopeless, k, max_new, AdaptiveCosts())
    assert out == ref and stats.proposed == 0 and stats.tau == 1.0


def test_verified_drafts_record_their_confidence_outcomes(tiny_target):
    """Calibration data: draft j of a verified chain counts iff drafts < j were accepted; outcome = accepted."""
    target, _ = tiny_target
    proposer = ConfidentOracle(target, lambda j, t: 0.8 - 0.1 * j)
    _, stats = _run(target, proposer, 4, 30, None)
    pairs = stats.confidence_outcomes
    assert len(pairs) == sum(stats.reached) and sum(y for _, y in pairs) == sum(stats.accepted_at)
    assert {round(c, 4) for c, _ in pairs} <= {0.8, 0.7, 0.6, 0.5}
    _, plain = _run(target, OracleProposer(target), 4, 30, None)
    assert plain.confidence_outcomes == []  # a drafter without confidences records nothing


@pytest.mark.fp32_exact
def test_batched_adaptive_is_token_exact(tiny_target):
    target, _ = tiny_target
    prompts = [PROMPT, PROMPT[:3], [1, 40, 41, 42, 43]]
    refs = [target_decode(target, p, 16, set()) for p in prompts]
    stats = Stats(k=4)
    make = lambda: ConfidentOracle(target, lambda j, t: 0.9 if t % 3 else 0.3)  # noqa: E731
    out = speculative_decode_batch(target, make, prompts, 4, 16, set(), stats, 0, AdaptiveCosts(0.0, 0.1))
    assert out == refs
    assert stats.proposed < 4 * stats.passes  # some rows verified shorter prefixes


class SampledConfident(Proposer):
    """Samples each draft from q = 0.9 * the target's distribution after the context + 0.1 * uniform
    (a drafter that knows the target well) and says how sure it is. peek=False: c_i from the context
    and the drafts before i only (c_1 = 0.9, then 0.9 after an even token, 0.2 after an odd one), as a
    confidence head computes it before draft i is drawn. peek=True: c_i looks at draft i itself (1 when
    it is q's mode, else 0), which the rule must not allow."""

    drafts_confidence = True

    def __init__(self, target, peek: bool = False):
        self.target, self.peek, self.memo = target, peek, {}

    def reset(self):
        pass

    @torch.no_grad()
    def _probs(self, ids: list[int], sampler) -> torch.Tensor:
        if tuple(ids) not in self.memo:  # contexts repeat across seeds: the drafter's passes are the cost
            p = sampler.probs(self.target(torch.tensor([ids])).logits[0, -1])
            self.memo[tuple(ids)] = 0.9 * p + 0.1 / p.shape[-1]
        return self.memo[tuple(ids)]

    def propose(self, tokens, feats, k, sampler=None):
        ids, draft, conf = tokens[0].tolist(), Draft(), []
        for i in range(k):
            q = self._probs(ids, sampler)
            x = sampler.sample(q)
            if self.peek:
                conf.append(float(x == int(q.argmax())))
            else:
                conf.append(0.9 if i == 0 or ids[-1] % 2 == 0 else 0.2)
            draft.add(x, i - 1, q)
            ids.append(x)
        draft.confidence = conf
        return draft


def _adaptive_samples(target, proposer, n, stats=None):
    costs = AdaptiveCosts(0.0, 0.1)
    return _collect(
        lambda s: speculative_decode(
            target, proposer, SAMPLING_PROMPT, 3, 3, set(), Sampler(1.0, seed=s), stats, None, costs
        ),
        n,
    )


@pytest.mark.chi_square
def test_adaptive_sampling_keeps_the_target_distribution(peaked_target):
    """Lossless when each c_i is known before draft i is drawn: whether draft i is verified then depends
    on drafts < i only (for one request the budget rule is a stopping rule, see `adaptive_prefixes`), so
    a verified draft is still distributed as its q. A confidence that peeks at its own draft verifies
    only the drafts it likes, and the test notices (p 4e-10 with 300 samples)."""
    target, stats = peaked_target, Stats(k=3)
    spec = _adaptive_samples(target, SampledConfident(target), N, stats)
    assert 0 < stats.proposed < 3 * stats.passes  # the confidences did cut some chains, not all
    ref = _reference(target, 1.0, 1.0)
    assert chi_square_p(ref, spec) > 1e-3
    assert chi_square_p(ref, _adaptive_samples(target, SampledConfident(target, peek=True), N)) < 1e-3
