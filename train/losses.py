"""Losses as pure functions. Each returns a *sum* over masked tokens; the loop divides by the
global token count so that 1 and N processes give the same gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def smooth_l1_feature_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EAGLE-1 feature regression (Li et al. 2024, "EAGLE", eq. for L_reg).

    pred, target: [N, H] predicted / true target features; mask: [N] (1 = counts).
    Returns sum over masked rows of the per-row mean SmoothL1 (beta 1). Zero iff pred == target on masked rows.
    """
    per_row = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    return (per_row * mask).sum()


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's full distribution (EAGLE-1 L_cls).

    student_logits, teacher_logits: [N, V]; mask: [N]. Returns sum_n mask_n * H(p_teacher, p_student).
    Minimised (at the teacher's entropy) when the distributions match.
    """
    p_teacher = F.softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (-(p_teacher * log_q).sum(-1) * mask).sum()


def topk_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                           k: int) -> torch.Tensor:
    """HASS harmonized objective distillation (Zhang et al. 2024, "Learning Harmonized
    Representations for Speculative Sampling", arXiv:2408.15766): the cross-entropy restricted to
    the teacher's top-k tokens, -sum_{x in topk(p)} p(x) log q(x), so training spends its capacity
    on the tokens a draft tree actually proposes.

    student_logits, teacher_logits: [N, V]; mask: [N]. Returns the sum over masked rows. With
    k = V it equals soft_cross_entropy; for k < V it is between 0 and soft_cross_entropy.
    """
    p = F.softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    top_p, idx = p.topk(min(k, p.shape[-1]), dim=-1)
    return (-(top_p * log_q.gather(-1, idx)).sum(-1) * mask).sum()


def kl_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_teacher || q_student) summed over masked rows; [N, V] logits, [N] mask.

    Equals soft_cross_entropy minus the teacher entropy, so it is exactly 0 for identical logits.
    """
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum()


def expected_acceptance(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked rows of sum_x min(p(x), q(x)) = 1 - TVD(p, q): the probability that
    speculative sampling accepts a draft token (Leviathan et al. 2023, Corollary 3.6)."""
    p = F.softmax(teacher_logits.float(), dim=-1)
    q = F.softmax(student_logits.float(), dim=-1)
    return (torch.minimum(p, q).sum(-1) * mask).sum()
