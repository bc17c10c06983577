"""Lossless speculative sampling: the output distribution equals target-only sampling.

Many short continuations (fixed seeds) are tested against the target's own conditional
distributions with the randomized probability integral transform and Pearson's chi-square test. A
negative control (a rule that accepts every draft) must fail the same test, so the test can tell a
broken rule."""

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from draftsmith.engine.proposers import NgramProposer
from draftsmith.engine.speculative import Sampler, speculative_sample, target_sample
from draftsmith.models import eagle

PROMPT = [1, 20, 21, 22, 20, 21]
NEW = 3  # each sample is the first NEW tokens after PROMPT
N = 300  # samples per check: NEW * N transformed values, 45 per bin of the test
BINS = 20


@dataclass(frozen=True)
class Reference:
    """Target-only sampling at (temperature, top_p): the distribution the samples must come from."""

    target: torch.nn.Module
    temperature: float
    top_p: float
    prompt: tuple[int, ...] = tuple(PROMPT)


def _reference(target, temperature, top_p, prompt=PROMPT) -> Reference:
    return Reference(target, temperature, top_p, tuple(prompt))


@torch.no_grad()
def chi_square_p(ref: Reference, samples: Counter) -> float:
    """p-value of the hypothesis that `samples` (continuations of `ref.prompt`, with their counts) were
    drawn by target-only sampling.

    The randomized probability integral transform (Brockwell 2007, "Universal residuals"): token x
    drawn from the warped distribution p of the target at its position, tokens ranked by descending
    p, maps to u = p(tokens ranked before x) + V * p(x), V ~ U(0, 1). Under the hypothesis the u of
    every position of every sample are independent U(0, 1) (the conditionals of a sequence compose,
    Rosenblatt 1952); a rule that draws some x from another distribution q shifts u's density to
    q(x) / p(x) on x's interval. Pearson's chi-square test over BINS equal bins of u; the p-value from
    the Wilson-Hilferty normal approximation of the chi-square tail. Unlike a test of the joint
    sequences, whose mass spreads over more sequences than any affordable sample has, this one sees
    every position's draw."""
    seqs = [list(k) for k, c in samples.items() for _ in range(c)]
    prompt = list(ref.prompt)
    ids = torch.tensor([prompt + q for q in seqs])
    # Row i of the logits predicts token i + 1: rows len(prompt)-1 .. -2 score the NEW sampled tokens.
    logits = ref.target(ids).logits[:, len(prompt) - 1 : -1]
    p = Sampler(ref.temperature, ref.top_p).probs(logits)  # [S, NEW, V]
    ranked, order = torch.sort(p, dim=-1, descending=True, stable=True)
    x = ids[:, len(prompt) :, None]
    rank = (order == x).float().argmax(-1, keepdim=True)
    before = (ranked.cumsum(-1) - ranked).gather(-1, rank)
    v = torch.rand(before.shape, generator=torch.Generator().manual_seed(0))
    u = (before + v * p.gather(-1, x)).flatten()
    counts = torch.bincount((u * BINS).long().clamp(max=BINS - 1), minlength=BINS).double()
    expected = len(u) / BINS
    stat, dof = float(((counts - expected) ** 2 / expected).sum()), BINS - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _collect(fn, n: int = N) -> Counter:
    return Counter(tuple(fn(seed)[:NEW]) for seed in range(n))


@pytest.mark.chi_square
def test_target_only_sampling_draws_from_the_targets_distribution(peaked_target):
    """The engine's target-only sampling (KV-cached, one token a step) passes the test, which scores
    its draws with one full forward per sample; a sampler that draws at another temperature fails."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        ref = _reference(peaked_target, temperature, top_p)
        samples = _collect(
            lambda s: target_sample(peaked_target, PROMPT, NEW, set(), Sampler(temperature, top_p, seed=s))
        )
        assert chi_square_p(ref, samples) > 1e-3
    hotter = _collect(lambda s: target_sample(peaked_target, PROMPT, NEW, set(), Sampler(1.3, 1.0, seed=s)), N // 2)
    assert chi_square_p(_reference(peaked_target, 1.0, 1.0), hotter) < 1e-3


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
    # half the samples (p 5e-85 at 1.0/1.0; more samples only give the test more power).
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
    from draftsmith.models.registry import drafter_family

    target = peaked_target
    torch.manual_seed(0)
    fam = drafter_family(family)
    cfg = fam.DrafterConfig(
        **(
            {"aux_layers": [0, 1, 1], "draft_vocab_size": target.config.vocab_size, "depths": 3}
            if family == "peagle"
            else {"aux_layers": [0], "block_size": 4}
        )
    )
    data = {"input_ids": [list(range(target.config.vocab_size))], "loss_mask": [[1] * target.config.vocab_size]}
    proposer = fam.make_proposer(fam.build(cfg, target, data).eval(), target, cfg)
    assert_samples_losslessly(target, proposer)
