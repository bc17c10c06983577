"""serve-check's round verdict (draftsmith/ship/replay_check.py): every vLLM round paired with
draftsmith's replay of it, a differing round beyond a near-tie failing the check. Planted defects are
partial, as real ones are: one prompt of twelve, 2 % of rounds, a handful of near-tie flips too many."""

import random

import pytest
import torch

from draftsmith.engine.replay import Round, replay
from draftsmith.engine.speculative import target_greedy
from draftsmith.ship import replay_check
from draftsmith.ship.replay_check import Pair, compare, failures, judge, summary, tie_limit
from tests.engine.test_replay import NoisyOracle
from tests.engine.test_speculative import OracleProposer

CLEAR, TOP = 3.0, 20.0  # a trained drafter's typical margin, at a typical top logit


def _rounds(seed: int, n: int = 12, rounds: int = 40, k: int = 3, p: float = 0.6) -> list[Pair]:
    """n prompts of chain-K rounds, each draft accepted with a prompt's own probability (p ± 0.15),
    replayed alike by both engines, every draft at a clear margin."""
    rng, out = random.Random(seed), []
    for prompt in range(n):
        q = min(max(p + rng.uniform(-0.15, 0.15), 0.0), 1.0)
        for i in range(rounds):
            a = next((j for j in range(k) if rng.random() > q), k)
            out.append(Pair(prompt, Round(i, k, a), Round(i, k, a, tops=[TOP] * k, margins=[CLEAR] * k)))
    return out


def _vllm_accepts(pair: Pair, accepted: int, gap: float = CLEAR) -> Pair:
    """The pair with vLLM's round accepting `accepted` drafts instead, the replay's gap where they part."""
    ours = pair.ours
    j = min(accepted, ours.accepted)
    replayed = Round(ours.start, ours.drafted, ours.accepted, ours.tops, ours.margins, gap, j)
    return Pair(pair.prompt, Round(pair.theirs.start, pair.theirs.drafted, accepted), replayed)


def _verdict(pairs: list[Pair], dtype: str = "float32") -> dict:
    return {"available": True, "prompts": len({p.prompt for p in pairs}), **judge(pairs, dtype), **summary(pairs, 3)}


def test_rounds_that_agree_pass_with_their_sampling_error():
    r = _verdict(_rounds(0))
    assert r["rounds"] == 480 and r["rounds_differing"] == 0 and not failures(r)
    assert r["per_position_diff"] == [0.0, 0.0, 0.0] and r["tau_diff"] == 0.0
    assert all(e > 0 for e in r["per_position_sampling_error"]) and r["tau_sampling_error"] > 0
    many = summary(_rounds(0, n=48), 3)  # more prompts: a more precise benchmark
    assert many["tau_sampling_error"] < r["tau_sampling_error"]


@pytest.mark.parametrize("m", [1, 2, 7, 12])
def test_planted_export_broken_on_m_prompts_of_twelve_fails(m):
    """The issue's shape: vLLM rejects every draft on m of 12 prompts, the others identical. The
    sign-flip test over prompts passed this for m = 1..7; round by round, one prompt is plenty."""
    pairs = [_vllm_accepts(p, 0) if p.prompt < m and p.ours.accepted > 0 else p for p in _rounds(1)]
    r = _verdict(pairs)
    why = failures(r)
    assert why and why[0].startswith(f"{r['rounds_clear']} of 480 rounds on vLLM's own text")
    assert {d["prompt"] for d in r["differing_prompts"]} == set(range(m))
    assert "on prompt 0" in why[0]


def test_planted_two_percent_of_rounds_fail_and_a_single_round_is_caught():
    base = _rounds(2)
    rng = random.Random(3)
    hit = set(rng.sample([i for i, p in enumerate(base) if p.ours.accepted > 0], int(0.02 * len(base))))
    r = _verdict([_vllm_accepts(p, p.ours.accepted - 1) if i in hit else p for i, p in enumerate(base)])
    assert r["rounds_clear"] == len(hit) == 9 and failures(r)
    # The smallest defect: one round of 480, one draft fewer.
    i = min(hit)
    one = _verdict([_vllm_accepts(p, p.ours.accepted - 1) if j == i else p for j, p in enumerate(base)])
    assert one["rounds_clear"] == 1 and failures(one)


def test_near_tie_flips_pass_at_a_rounding_rate_and_fail_far_above_it():
    """Drafts whose margin is within the bound can flip by rounding, at most half of them by chance;
    a flip beyond it, or many more flips than half the near-tie drafts, fails."""
    limit = tie_limit(TOP, "bfloat16")
    base = _rounds(4)
    tied = [i for i, p in enumerate(base) if p.ours.accepted > 0][:40]  # 40 rounds with a near-tie first draft
    for i in tied:
        p = base[i]
        base[i] = Pair(
            p.prompt, p.theirs, Round(p.ours.start, 3, p.ours.accepted, [TOP] * 3, [limit / 2, CLEAR, CLEAR])
        )
    flipped = [_vllm_accepts(base[i], 0, limit / 2) if n < 12 else base[i] for n, i in enumerate(tied)]  # 12 of 40
    pairs = list(base)
    for i, p in zip(tied, flipped):
        pairs[i] = p
    r = _verdict(pairs, "bfloat16")
    assert r["rounds_near_tie"] == 12 and r["rounds_clear"] == 0 and r["tie_drafts"] == 40 and not failures(r)
    # The same flips beyond the bound: each one fails. In fp32 the bound is far tighter: they all do.
    assert _verdict(pairs, "float32")["rounds_clear"] == 12 and failures(_verdict(pairs, "float32"))
    # 31 of 40 near-tie drafts flipped: more than rounding explains (binomial p < 5 %).
    many = list(base)
    for n, i in enumerate(tied[:31]):
        many[i] = _vllm_accepts(base[i], 0, limit / 2)
    r = _verdict(many, "bfloat16")
    assert r["rounds_clear"] == 0 and r["flip_p_value"] < 0.05 and "more than half" in failures(r)[0]


def test_near_tie_bounds_scale_with_the_logit_and_the_precision():
    assert tie_limit(20.0, "float32") == pytest.approx(20 * 2**-10)
    assert tie_limit(20.0, "bfloat16") == pytest.approx(replay_check.DRAFT_TIE_STEPS * 16 * 2**-7)
    assert tie_limit(40.0, "bfloat16") == 2 * tie_limit(20.0, "bfloat16")
    assert tie_limit(0.1, "bfloat16") == tie_limit(1.0, "bfloat16")  # small logits: the step at 1


@pytest.mark.fp32_exact
def test_planted_one_prompt_of_twelve_through_the_real_replay(tiny_target):
    """compare() end to end on the replay engine: 'vLLM's' rounds are a drafter's own greedy rounds on
    the target's text; on one prompt of twelve they come from a drafter wrong at every third draft."""
    target, _ = tiny_target
    ours, k = OracleProposer(target), 3
    prompts = [[1, 7 + n, 9, 30, 31, 7, 9, 12 + n] for n in range(12)]
    texts = [target_greedy(target, p, 24, set()) for p in prompts]

    def steps(proposer, prompt, text):
        rounds, _ = replay(target, proposer, prompt, text, k)
        return {"per_step_drafted": [r.drafted for r in rounds], "per_step_accepted": [r.accepted for r in rounds]}

    clean = [steps(ours, p, t) for p, t in zip(prompts, texts)]
    r = compare(target, ours, prompts, texts, clean, k)
    assert r["available"] and r["prompts"] == 12 and r["rounds_differing"] == 0 and not failures(r)
    broken = [
        steps(NoisyOracle(target), p, t) if n == 5 else s for n, (p, t, s) in enumerate(zip(prompts, texts, clean))
    ]
    r = compare(target, ours, prompts, texts, broken, k)
    assert [d["prompt"] for d in r["differing_prompts"]] == [5] and r["rounds_clear"] > 0
    assert failures(r) and "on prompt 5" in failures(r)[0]


@pytest.mark.fp32_exact
def test_the_replay_records_the_drafters_margins_and_the_gap_where_rounds_part(tiny_target):
    """A drafter whose proposer hands its logits to a sampler (EAGLE-3 here) gets its top logit, margins
    and, against a round it parts from, the gap at the first parting draft."""
    from draftsmith.models import eagle3

    target, _ = tiny_target
    torch.manual_seed(0)
    cfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1])
    proposer = eagle3.make_proposer(eagle3.build(cfg, target), target, cfg)
    prompt = [1, 7, 9, 30, 31, 7, 9, 12, 30, 31]
    text = target_greedy(target, prompt, 20, set())
    own, _ = replay(target, proposer, prompt, text, 3)
    assert all(len(r.margins) == r.drafted == 3 and all(m >= 0 for m in r.margins) for r in own)
    # Given rounds that claim one draft more than the replay keeps: a gap at the replay's first rejection.
    given = [Round(r.start, r.drafted, min(r.accepted + 1, r.drafted)) for r in own]
    again, _ = replay(target, proposer, prompt, text, 3, given)
    parted = [r for r, g in zip(again, given) if g.accepted != r.accepted]
    assert parted and all(r.parted_at == r.accepted and r.gap is not None and r.gap >= 0 for r in parted)


def test_without_per_request_rounds_the_comparison_is_not_made():
    r = compare(None, None, [[1, 2]], [[3, 4]], [None], 3)
    assert not r["available"] and "--per-request-spec-decode-metrics detailed" in r["why"] and not failures(r)
    assert replay_check.BOOTSTRAP_SAMPLES >= 1000
