"""Cascades (draftsmith/engine/cascade.py): the draft is exactly the intermediate's greedy continuation, greedy
decoding stays token-exact and sampling stays distributed as the target's, the per-level counters
add up, and cascades whose intermediate cannot verify are one-line errors."""

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.cascade import CascadeProposer, build_cascade, parse_cascade
from draftsmith.engine.proposers import NgramProposer
from draftsmith.engine.selfspec import SkipLayers
from draftsmith.engine.speculative import Sampler, Stats, speculative_decode, target_decode
from draftsmith.models import eagle
from draftsmith.models.distill import StudentProposer
from tests.conftest import make_target, make_tokenizer
from tests.engine.test_sampling import PROMPT, AcceptAll, N, _collect, _reference, chi_square_p

TEXTS = ["abcabcabcabc say 9", "def f(x): return x\ndef f(y): return"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core machine the thread pool's
    spinning made the chi-square test ~10x slower (as in tests/engine/test_batched.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lively(seed: int, layers: int, vocab: int):
    """A tiny random target with larger weights (as in tests/engine/test_batched.py): the default init mostly
    repeats one token forever, which would hide a stale cache; std 0.2 continues with varied tokens and
    some repetition (prompt-lookup hits)."""
    model = make_target(seed=seed, vocab=vocab, layers=layers).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    target = lively(0, 4, len(tok))
    other = lively(5, 1, len(tok))  # a distinct "student"
    tiny = lively(6, 1, len(tok))  # a drafting model for level 1
    return tok, target, other, tiny


def plain_greedy(model, ids: list[int], k: int) -> list[int]:
    """Reference: k greedy tokens, each from a full forward over the whole sequence (no cache)."""
    out = []
    for _ in range(k):
        out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("mid_kind", ["student", "skip"])
@pytest.mark.parametrize("mid_k", [None, 1])
def test_the_draft_is_the_mids_greedy_continuation_whatever_its_cache_held(models, mid_kind, mid_k):
    tok, target, other, _ = models
    mid = other if mid_kind == "student" else SkipLayers(target, [2])
    cascade, k = CascadeProposer(NgramProposer(), mid, mid_k=mid_k), 5
    p = tok(TEXTS[0])["input_ids"]
    d1 = cascade.propose(torch.tensor([p]), {}, k).tokens
    assert d1 == plain_greedy(mid, p, k)
    # The target kept two drafts and chose another third token; then all drafts and a bonus; then a
    # shorter, earlier context: the mid's cache must follow by longest common prefix every time.
    contexts = [p + d1[:2] + [(d1[2] + 1) % len(tok)]]
    contexts.append(contexts[0] + plain_greedy(mid, contexts[0], k) + [7])
    contexts.append(p[:4])
    for ctx in contexts:
        assert cascade.propose(torch.tensor([ctx]), {}, k).tokens == plain_greedy(mid, ctx, k)
    assert len(target.get_decoder().layers) == 4  # SkipLayers gave the target its layers back


def _levels(kind, target, other, tiny):
    """(low, mid) for one cascade under test."""
    return {
        "ngram+student": (NgramProposer(), other),
        "ngram+skip": (NgramProposer(), SkipLayers(target, [1, 2])),
        "student+skip": (StudentProposer(tiny), SkipLayers(target, [2])),
        "ngram+target": (NgramProposer(), target),
    }[kind]


@pytest.mark.parametrize("kind", ["ngram+student", "ngram+skip", "student+skip", "ngram+target"])
def test_greedy_cascade_is_token_exact_and_its_level_counts_add_up(models, kind):
    tok, target, other, tiny = models
    # k = 4 and 1 + 5 * 5 new tokens: every round emits 5 and none is cut by the budget.
    cascade, k, max_new, stats = CascadeProposer(*_levels(kind, target, other, tiny)), 4, 26, Stats(k=4)
    for text in TEXTS:
        prompt = tok(text)["input_ids"]
        assert speculative_decode(target, cascade, prompt, k, max_new, set(), None, stats) == target_decode(
            target, prompt, max_new, set()
        )
    s = cascade.level_stats(stats)
    assert s["rounds"] == stats.passes and stats.proposed == k * s["rounds"]
    assert s["mid_tokens"] == k * s["rounds"]  # each round drafts exactly k tokens
    assert s["mid_tokens"] == s["mid_passes"] + s["low_accepted"]  # a mid pass emits its accepted drafts + 1
    assert 0 <= s["low_accepted"] <= s["low_proposed"] and s["mid_synced"] >= s["rounds"]
    assert 1 <= s["mid_tau"] <= k and 1 <= s["mid_passes_per_round"] <= k
    assert s["target_tau"] == round(stats.tau, 4)
    if kind == "ngram+target":  # the mid *is* the target: every draft is accepted
        assert stats.acceptance_rate == 1.0 and s["target_tau"] == k + 1
        assert s["low_accepted"] > 0  # repetitive output: prompt lookup drafts for the mid too


@pytest.mark.chi_square
def test_cascade_sampling_matches_target_distribution(peaked_target):
    target, k = peaked_target, 3
    cascade = CascadeProposer(NgramProposer(), SkipLayers(target, [1]))
    ref = _reference(target, 1.0, 1.0)
    spec = _collect(lambda s: speculative_decode(target, cascade, PROMPT, k, 3, set(), Sampler(1.0, 1.0, seed=s)))
    assert chi_square_p(ref, spec) > 1e-3
    s = cascade.level_stats()
    assert s["rounds"] > 0 and s["low_accepted"] > 0  # sampled contexts re-sync the mid's cache every round
    # Negative control: accepting every draft emits the mid's greedy tokens, and the test notices
    # (with a quarter of the samples: the deterministic drafts are far from the target's distribution).
    broken = _collect(
        lambda s: speculative_decode(target, cascade, PROMPT, k, 3, set(), AcceptAll(1.0, 1.0, seed=s)), N // 4
    )
    assert chi_square_p(ref, broken) < 1e-3


def test_bad_cascades_are_one_line_errors(models):
    tok, target, other, tiny = models

    class NoLogits(torch.nn.Module):
        def forward(self, input_ids, **_):
            return input_ids.float()

    cfg = eagle.DrafterConfig()
    feature_drafter = eagle.make_proposer(eagle.build(cfg, target), target, cfg)
    wrong_vocab = make_target(seed=7, vocab=64, layers=1)
    cases = [
        (
            [NgramProposer(), NgramProposer()],
            ["ngram", "ngram"],
            r"^--cascade: level 2 'ngram' cannot verify drafts; the intermediate must be a model \(a distilled student",
        ),
        ([NgramProposer(), object()], ["ngram", "thing"], "level 2 'thing' cannot verify drafts"),
        ([NgramProposer(), NoLogits()], ["ngram", "nologits"], "level 2 'nologits' cannot verify drafts"),
        ([NgramProposer(), feature_drafter], ["ngram", "eagle"], "level 2 'eagle' cannot verify drafts"),
        ([NgramProposer(), wrong_vocab], ["ngram", "other"], "scores 64 tokens but the target"),
        ([feature_drafter, other], ["eagle", "student"], "level 1 'eagle' reads target features"),
        ([object(), other], ["thing", "student"], "level 1 'thing' cannot propose drafts"),
        ([NgramProposer()], ["ngram"], "expected 2 levels"),
        ([NgramProposer(), other, target], ["ngram", "a", "b"], "expected 2 levels"),
    ]
    for levels, names, message in cases:
        with pytest.raises(DraftsmithError, match=message) as err:
            build_cascade(levels, names, target=target)
        assert "\n" not in str(err.value)
    for spec in ["", "ngram", "ngram,", ",x", "a,b,c"]:
        with pytest.raises(DraftsmithError, match="expected two levels LOW,MID") as err:
            parse_cascade(spec)
        assert "\n" not in str(err.value)
    assert parse_cascade("ngram, checkpoints/skip") == ["ngram", "checkpoints/skip"]
    # What the CLI loads: a layer-skip or student folder is a StudentProposer; its model verifies.
    built = build_cascade([NgramProposer(), StudentProposer(SkipLayers(target, [1]))], ["ngram", "skip"], target=target)
    assert isinstance(built.mid, SkipLayers) and isinstance(built.low, NgramProposer)
    built = build_cascade([tiny, other], target=target)  # a bare model as level 1 drafts as a student
    assert isinstance(built.low, StudentProposer) and built.mid is other
