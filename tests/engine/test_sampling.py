"""Lossless speculative sampling: the output distribution equals target-only sampling.

A two-sample chi-square test over many short continuations, with fixed seeds. A negative control
(a rule that accepts every draft) must fail the same test, so the test can tell a broken rule."""

import functools
import math
from collections import Counter

import pytest
import torch

from draftsmith.engine.proposers import NgramProposer
from draftsmith.engine.speculative import Sampler, speculative_sample, target_sample
from draftsmith.models import eagle

PROMPT = [1, 20, 21, 22, 20, 21]
N = 800


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square homogeneity test; categories with few counts are pooled.
    p-value from the Wilson-Hilferty normal approximation of the chi-square tail."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 10:
            cells.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest) > 0:
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _collect(fn, n: int = N):
    return Counter(tuple(fn(seed)[:3]) for seed in range(n))


@functools.cache  # one target-only sample per (target, temperature, top_p), shared by the tests that compare with it
def _reference(target, temperature, top_p):
    return _collect(lambda s: target_sample(target, PROMPT, 3, set(), Sampler(temperature, top_p, seed=10_000 + s)))


class AcceptAll(Sampler):
    def accept(self, p_x, q_x):
        return True


def assert_samples_losslessly(target, proposer):
    """Speculative sampling with `proposer` (K=3, temperature 1) keeps target-only sampling's
    distribution; accepting every draft, with half the samples, does not (the negative control)."""
    ref = _reference(target, 1.0, 1.0)
    spec = _collect(lambda s: speculative_sample(target, proposer, PROMPT, 3, 3, set(), Sampler(1.0, 1.0, seed=s)))
    assert chi_square_p(ref, spec) > 1e-3
    broken = _collect(
        lambda s: speculative_sample(target, proposer, PROMPT, 3, 3, set(), AcceptAll(1.0, 1.0, seed=s)), N // 2
    )
    assert chi_square_p(ref, broken) < 1e-3


@pytest.mark.chi_square
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_matches_target_distribution(peaked_target, temperature, top_p):
    target = peaked_target
    torch.manual_seed(0)
    proposer = eagle.make_proposer(eagle.build(eagle.DrafterConfig(), target), target, eagle.DrafterConfig())
    ref = _reference(target, temperature, top_p)
    spec = _collect(
        lambda s: speculative_sample(target, proposer, PROMPT, 3, 3, set(), Sampler(temperature, top_p, seed=s))
    )
    assert chi_square_p(ref, spec) > 1e-3
    ngram = _collect(
        lambda s: speculative_sample(target, NgramProposer(), PROMPT, 3, 3, set(), Sampler(temperature, top_p, seed=s))
    )
    assert chi_square_p(ref, ngram) > 1e-3
    # Negative control: accepting every draft samples from the drafter, and the test notices, even with
    # half the samples (p 6e-7 at 1.0/1.0; more samples only give the test more power).
    broken = _collect(
        lambda s: speculative_sample(target, proposer, PROMPT, 3, 3, set(), AcceptAll(temperature, top_p, seed=s)),
        N // 2,
    )
    assert chi_square_p(ref, broken) < 1e-3


def test_top_p_keeps_the_smallest_mass_prefix():
    s = Sampler(1.0, top_p=0.7)
    p = s.probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.chi_square
@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_block_drafters_sample_losslessly(peaked_target, family):
    """One drafter pass samples every slot from its own distribution q (independent of the slots
    before it, which the rule allows: q only has to be known); the rule keeps the target's
    distribution, and accepting every draft does not."""
    from draftsmith.models.registry import drafter_module

    target = peaked_target
    torch.manual_seed(0)
    module = drafter_module(family)
    cfg = module.DrafterConfig(
        **(
            {"aux_layers": [0, 1, 1], "draft_vocab_size": target.config.vocab_size, "depths": 3}
            if family == "peagle"
            else {"aux_layers": [0], "block_size": 4}
        )
    )
    data = {"input_ids": [list(range(target.config.vocab_size))], "loss_mask": [[1] * target.config.vocab_size]}
    proposer = module.make_proposer(module.build(cfg, target, data).eval(), target, cfg)
    assert_samples_losslessly(target, proposer)
