import torch

from draftsmith.util.losses import (
    expected_acceptance,
    forward_kl,
    smooth_l1_feature_loss,
    soft_cross_entropy,
    topk_distillation_loss,
)


def test_identical_distributions_have_zero_divergence_and_full_acceptance():
    logits = torch.randn(7, 50)
    mask = torch.ones(7)
    assert forward_kl(logits, logits, mask).abs() < 1e-5
    assert torch.allclose(expected_acceptance(logits, logits, mask), torch.tensor(7.0), atol=1e-5)
    # Soft CE of identical distributions is the teacher's entropy, its minimum over students.
    p = logits.softmax(-1)
    entropy = -(p * p.log()).sum()
    assert torch.allclose(soft_cross_entropy(logits, logits, mask), entropy, atol=1e-4)
    assert soft_cross_entropy(logits + torch.randn(7, 50), logits, mask) > entropy


def test_feature_loss_zero_iff_equal_and_respects_mask():
    f = torch.randn(5, 16)
    g = f.clone()
    g[2] += 3.0
    assert smooth_l1_feature_loss(f, f, torch.ones(5)) == 0
    assert smooth_l1_feature_loss(g, f, torch.ones(5)) > 0
    masked = torch.tensor([1.0, 1, 0, 1, 1])
    assert smooth_l1_feature_loss(g, f, masked) == 0


def test_acceptance_is_one_minus_tvd_and_kl_positive():
    s, t = torch.randn(4, 30), torch.randn(4, 30)
    tvd = 0.5 * (s.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    assert torch.allclose(expected_acceptance(s, t, torch.ones(4)), (1 - tvd).sum(), atol=1e-5)
    assert forward_kl(s, t, torch.ones(4)) > 0


def test_topk_distillation_is_soft_ce_over_the_teachers_top_k():
    torch.manual_seed(0)
    s, t, mask = torch.randn(6, 20), torch.randn(6, 20), torch.ones(6)
    full = soft_cross_entropy(s, t, mask)
    assert torch.allclose(topk_distillation_loss(s, t, mask, 20), full)
    part = [topk_distillation_loss(s, t, mask, k) for k in (1, 5, 10)]
    assert 0 < part[0] < part[1] < part[2] < full  # each extra token adds p(x) * -log q(x) > 0


# --- DistillSpec divergences -----------------------------------------------------------------------
from draftsmith.util.losses import DIVERGENCES, jensen_shannon, reverse_kl, total_variation  # noqa: E402


def test_every_divergence_is_zero_for_identical_distributions_and_positive_otherwise():
    torch.manual_seed(1)
    logits, other, mask = torch.randn(5, 40), torch.randn(5, 40), torch.ones(5)
    for name, fn in DIVERGENCES.items():
        for temperature in (0.5, 1.0, 2.0):
            assert fn(logits, logits, mask, temperature=temperature).abs() < 1e-5, name
            assert fn(other, logits, mask, temperature=temperature) > 1e-3, name
        # Masked rows count for nothing.
        assert fn(other, logits, torch.zeros(5)) == 0, name


def test_tvd_is_one_minus_sum_of_min_and_one_minus_expected_acceptance():
    s, t, mask = torch.randn(6, 25), torch.randn(6, 25), torch.ones(6)
    p, q = t.softmax(-1), s.softmax(-1)
    assert torch.allclose(total_variation(s, t, mask), (1 - torch.minimum(p, q).sum(-1)).sum(), atol=1e-5)
    assert torch.allclose(total_variation(s, t, mask), mask.sum() - expected_acceptance(s, t, mask), atol=1e-5)
    assert total_variation(s, t, mask) <= 6.0


def test_forward_and_reverse_kl_differ_on_a_hand_built_pair():
    # Teacher bimodal over tokens 0 and 1; student sure of token 0. FKL punishes the student for
    # missing token 1 (log 0.5/eps: large), RKL only for the mass it puts where the teacher has some.
    teacher = torch.log(torch.tensor([[0.5, 0.5, 1e-6]]))
    student = torch.log(torch.tensor([[0.999, 1e-3, 1e-6]]))
    mask = torch.ones(1)
    fkl, rkl = DIVERGENCES["fkl"](student, teacher, mask), reverse_kl(student, teacher, mask)
    assert fkl > 2.0 and rkl < 0.7 and fkl > 3 * rkl
    # Swapping the roles swaps the two.
    assert torch.allclose(DIVERGENCES["fkl"](teacher, student, mask), rkl, atol=1e-5)


def test_jsd_is_symmetric_at_half_and_bounded_by_log_2():
    s, t, mask = torch.randn(4, 30) * 5, torch.randn(4, 30) * 5, torch.ones(4)
    assert torch.allclose(jensen_shannon(s, t, mask), jensen_shannon(t, s, mask), atol=1e-5)
    far = torch.tensor([[30.0, -30.0], [-30.0, 30.0]])
    assert jensen_shannon(far[:1], far[1:], torch.ones(1)) <= torch.log(torch.tensor(2.0)) + 1e-5
    # beta weighs the two KLs to the mixture: it differs from 0.5 for an asymmetric pair.
    assert not torch.allclose(jensen_shannon(s, t, mask, beta=0.1), jensen_shannon(s, t, mask, beta=0.5))


# --- LK losses (arXiv:2602.23881) ------------------------------------------------------------------
from draftsmith.util.losses import TOKEN_LOSSES, check_loss, lk_hybrid, negative_log_acceptance  # noqa: E402


def test_nla_is_minus_log_acceptance_and_lk_hybrid_mixes_kl_and_tvd_by_acceptance():
    torch.manual_seed(2)
    s, t, mask = torch.randn(6, 30), torch.randn(6, 30), torch.ones(6)
    alpha = torch.minimum(s.softmax(-1), t.softmax(-1)).sum(-1)
    assert torch.allclose(negative_log_acceptance(s, t, mask), -alpha.log().sum(), atol=1e-5)
    kl = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)
    lam = torch.exp(-3.0 * alpha)
    assert torch.allclose(lk_hybrid(s, t, mask), (lam * kl + (1 - lam) * (1 - alpha)).sum(), atol=1e-5)
    # eta -> infinity leaves TVD alone; eta = 0 leaves KL alone.
    assert torch.allclose(lk_hybrid(s, t, mask, eta=1e9), total_variation(s, t, mask), atol=1e-5)
    assert torch.allclose(lk_hybrid(s, t, mask, eta=0.0), forward_kl(s, t, mask), atol=1e-5)


def test_lk_hybrid_weight_is_not_differentiated():
    """lam = exp(-eta sg(alpha)): the gradient is lam * dKL + (1 - lam) * dTVD, with no d(lam) term."""
    torch.manual_seed(3)
    t, mask = torch.randn(4, 12), torch.ones(4)
    s = torch.randn(4, 12, requires_grad=True)
    (g,) = torch.autograd.grad(lk_hybrid(s, t, mask), s)
    alpha = torch.minimum(s.softmax(-1), t.softmax(-1)).sum(-1).detach()
    lam = torch.exp(-3.0 * alpha)[:, None]
    (g_kl,) = torch.autograd.grad(forward_kl(s, t, mask), s)
    (g_tv,) = torch.autograd.grad(total_variation(s, t, mask), s)
    assert torch.allclose(g, lam * g_kl + (1 - lam) * g_tv, atol=1e-6)


def test_every_token_loss_is_minimal_at_the_target_and_an_unknown_name_lists_the_valid_ones():
    torch.manual_seed(4)
    logits, mask = torch.randn(5, 40), torch.ones(5)
    for name, fn in TOKEN_LOSSES.items():
        at_target = fn(logits, logits, mask)
        assert at_target <= fn(logits + torch.randn(5, 40), logits, mask), name
        assert fn(logits, logits, torch.zeros(5)) == 0, name
    import pytest

    from draftsmith import DraftsmithError

    with pytest.raises(DraftsmithError, match=r"drafter.loss: unknown loss 'kl' \(valid: ce, tvd, nla, lk_hybrid\)"):
        check_loss("kl", "drafter.loss", TOKEN_LOSSES)


# --- DFlash per-slot weights ---------------------------------------------------------------------------
from draftsmith.util.losses import decay_position_weights, dpace_position_weights  # noqa: E402


def test_decay_weights_skip_the_bonus_slot_and_start_at_one():
    w = decay_position_weights(5, 4.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(4.0) / 4.0))
    assert (w[2:] < w[1:-1]).all()  # strictly decreasing after slot 1


def test_dpace_weights_are_suffix_counts_when_confident_and_shrink_with_doubt():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    ones = dpace_position_weights(torch.ones(2, 4), mask)
    assert ones.tolist() == [[0, 3, 2, 1], [0, 2, 1, 0]]  # every later trained slot counts once
    assert torch.equal(dpace_position_weights(torch.zeros(2, 4), mask, alpha=1.0), ones)
    # q = 0 with alpha 0.5: s = 0.5 per slot, P = 0.5, 0.25, 0.125 -> suffix sums.
    half = dpace_position_weights(torch.zeros(1, 4), mask[:1], alpha=0.5)
    assert torch.allclose(half, torch.tensor([[0, 0.875, 0.375, 0.125]]))
    assert (dpace_position_weights(torch.rand(2, 4), mask) <= ones).all()


# --- DSpark: soft acceptance and the confidence BCE --------------------------------------------------
from draftsmith.util.losses import confidence_bce, soft_acceptance  # noqa: E402


def test_a_drafter_equal_to_the_target_has_zero_main_loss_and_acceptance_one():
    torch.manual_seed(0)
    logits, mask = torch.randn(6, 40), torch.ones(6)
    assert torch.allclose(soft_acceptance(logits, logits), torch.ones(6), atol=1e-6)
    for name in ("tvd", "nla", "lk_hybrid"):  # the soft token losses DSpark's main term may use
        assert TOKEN_LOSSES[name](logits, logits, mask).abs() < 1e-5, name
    # ce trains on the target's argmax: a drafter as certain as a one-hot target has zero loss.
    peaked = torch.nn.functional.one_hot(logits.argmax(-1), 40).float() * 60.0
    assert TOKEN_LOSSES["ce"](peaked, peaked, mask) < 1e-6
    other = torch.randn(6, 40)
    a = soft_acceptance(other, logits)
    tvd = 0.5 * (other.softmax(-1) - logits.softmax(-1)).abs().sum(-1)
    assert torch.allclose(a, 1 - tvd, atol=1e-5) and ((a > 0) & (a < 1)).all()
    assert not a.requires_grad and not soft_acceptance(other.requires_grad_(), logits).requires_grad


def test_acceptance_on_a_reduced_vocabulary_never_counts_the_targets_mass_off_it():
    """A drafter on draft tokens D proposes nothing else: a = sum_{x in D} min(q(x), p(x)) with the
    target's own p, so target log-probabilities over D give exactly that (a renormalised p over D
    would overstate it), and a drafter equal to p on D is accepted with probability p(D)."""
    torch.manual_seed(0)
    target, keep = torch.randn(5, 40), torch.arange(40) % 3 == 0
    p, q_logits = target.softmax(-1), torch.randn(5, int(keep.sum()))
    logp = target.log_softmax(-1)[:, keep]
    a = soft_acceptance(q_logits, logp, target_logprobs=True)
    assert torch.allclose(a, torch.minimum(q_logits.softmax(-1), p[:, keep]).sum(-1), atol=1e-6)
    assert (a < soft_acceptance(q_logits, logp)).all()  # the renormalised reading overstates it
    assert torch.allclose(soft_acceptance(logp, logp, target_logprobs=True), p[:, keep].sum(-1), atol=1e-6)


def test_confidence_bce_is_minimal_where_confidence_equals_acceptance():
    a = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.999])
    mask = torch.ones(5)
    calibrated = torch.logit(a)
    best = confidence_bce(calibrated, a, mask)
    for shift in (-1.0, -0.1, 0.1, 1.0):
        assert confidence_bce(calibrated + shift, a, mask) > best
    c = calibrated.clone().requires_grad_()
    confidence_bce(c, a, mask).backward()
    assert c.grad.abs().max() < 1e-6  # d BCE / d c = sigmoid(c) - a = 0
    # Masked rows do not count; the sum is over rows (the loop divides by its count).
    assert confidence_bce(calibrated + 5.0, a, torch.zeros(5)) == 0
    assert torch.allclose(
        confidence_bce(calibrated, a, mask),
        sum(confidence_bce(calibrated[i : i + 1], a[i : i + 1], mask[:1]) for i in range(5)),
    )


# --- DFlash2: the selector's training candidates and its cross-entropy --------------------------------
import itertools  # noqa: E402

from draftsmith.util.losses import selector_candidates, selector_cross_entropy  # noqa: E402


def test_selector_candidates_inject_a_missing_gold_at_the_last_rank_only():
    cand = torch.tensor([[7, 3, 9, 1], [7, 3, 9, 1], [4, 5, 6, 8]])
    gold = torch.tensor([9, 2, 4])
    ids, label, covered = selector_candidates(cand, gold)
    assert ids.tolist() == [[7, 3, 9, 1], [7, 3, 9, 2], [4, 5, 6, 8]]  # row 1: 2 replaces the weakest
    assert label.tolist() == [2, 3, 0] and covered.tolist() == [True, False, True]
    assert (ids.gather(-1, label[:, None])[:, 0] == gold).all()  # the label always points at the gold
    assert cand.tolist()[1] == [7, 3, 9, 1]  # the serving candidates are left as they were


def test_selector_loss_is_minimal_when_the_gold_candidate_ranks_first():
    torch.manual_seed(0)
    values = torch.tensor([3.0, 1.5, 0.2, -1.0])  # one fixed set of scores, dealt in every order
    label, w = torch.tensor([1]), torch.ones(1)
    losses = {
        perm: selector_cross_entropy(values[list(perm)][None], label, w).item()
        for perm in itertools.permutations(range(4))
    }
    best = min(losses, key=losses.get)
    assert values[list(best)].argmax() == 1  # the gold (index 1) holds the highest score
    for perm, loss in losses.items():  # CE depends on the gold's score only (the set is fixed)
        assert (abs(loss - losses[best]) < 1e-6) == bool(values[list(perm)][1] == values.max())
    # Weighted sum over rows; a confident, right selector and a trained-out row give zero.
    scores = torch.randn(5, 4)
    labels = torch.randint(4, (5,))
    per_row = torch.nn.functional.cross_entropy(scores, labels, reduction="none")
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0])
    assert torch.allclose(selector_cross_entropy(scores, labels, weights), (per_row * weights).sum())
    sure = torch.nn.functional.one_hot(labels, 4).float() * 60.0
    assert selector_cross_entropy(sure, labels, torch.ones(5)) < 1e-6


def test_a_dflash2_drafter_equal_to_the_target_gets_zero_unary_loss_and_its_gold_ranks_first():
    torch.manual_seed(0)
    logits, mask = torch.randn(6, 40), torch.ones(6)
    for name in ("tvd", "nla", "lk_hybrid"):  # the soft unary losses
        assert TOKEN_LOSSES[name](logits, logits, mask).abs() < 1e-5, name
    peaked = torch.nn.functional.one_hot(logits.argmax(-1), 40).float() * 60.0
    assert TOKEN_LOSSES["ce"](peaked, peaked, mask) < 1e-6
    # Its unary top-k always holds the target's argmax, first: label 0, nothing injected.
    ids, label, covered = selector_candidates(logits.topk(5).indices, logits.argmax(-1))
    assert (label == 0).all() and covered.all() and torch.equal(ids, logits.topk(5).indices)
