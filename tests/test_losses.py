import torch

from draftsmith.train.losses import (expected_acceptance, kl_divergence, smooth_l1_feature_loss, soft_cross_entropy,
                                     topk_distillation_loss)


def test_identical_distributions_have_zero_divergence_and_full_acceptance():
    logits = torch.randn(7, 50)
    mask = torch.ones(7)
    assert kl_divergence(logits, logits, mask).abs() < 1e-5
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
    assert kl_divergence(s, t, torch.ones(4)) > 0


def test_topk_distillation_is_soft_ce_over_the_teachers_top_k():
    torch.manual_seed(0)
    s, t, mask = torch.randn(6, 20), torch.randn(6, 20), torch.ones(6)
    full = soft_cross_entropy(s, t, mask)
    assert torch.allclose(topk_distillation_loss(s, t, mask, 20), full)
    part = [topk_distillation_loss(s, t, mask, k) for k in (1, 5, 10)]
    assert 0 < part[0] < part[1] < part[2] < full  # each extra token adds p(x) * -log q(x) > 0
