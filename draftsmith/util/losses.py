"""Losses as pure functions. Each returns a *sum* over masked tokens; the loop divides by the
global token count so that 1 and N processes give the same gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from draftsmith import DraftsmithError


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


def topk_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, k: int
) -> torch.Tensor:
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


def expected_acceptance(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked rows of sum_x min(p(x), q(x)) = 1 - TVD(p, q): the probability that
    speculative sampling accepts a draft token (Leviathan et al. 2023, Corollary 3.6)."""
    p = F.softmax(teacher_logits.float(), dim=-1)
    q = F.softmax(student_logits.float(), dim=-1)
    return (torch.minimum(p, q).sum(-1) * mask).sum()


# --- DistillSpec divergences (Zhou et al. 2024, "DistillSpec", arXiv:2310.08461) --------------------
# Each takes student and teacher logits [N, V] over the full vocabulary and a mask [N], softens both
# at `temperature`, and returns the sum over masked rows. All are 0 iff the distributions match.


def _log_probs(student_logits, teacher_logits, temperature: float):
    return (
        F.log_softmax(student_logits.float() / temperature, dim=-1),
        F.log_softmax(teacher_logits.float() / temperature, dim=-1),
    )


def forward_kl(student_logits, teacher_logits, mask, temperature: float = 1.0) -> torch.Tensor:
    """FKL = KL(p || q) = sum_x p(x) log(p(x)/q(x)), p the teacher: mass-covering (the student
    spreads over every token the teacher might pick)."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum()


def reverse_kl(student_logits, teacher_logits, mask, temperature: float = 1.0) -> torch.Tensor:
    """RKL = KL(q || p): mode-seeking (the student concentrates on the teacher's likeliest tokens)."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return ((log_q.exp() * (log_q - log_p)).sum(-1) * mask).sum()


def jensen_shannon(student_logits, teacher_logits, mask, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Generalized JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
    (DistillSpec/GKD's definition), 0 < beta < 1; beta = 0.5 is the symmetric Jensen-Shannon
    divergence, bounded by log 2 per row."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return ((beta * kl_p + (1 - beta) * kl_q) * mask).sum()


def total_variation(student_logits, teacher_logits, mask, temperature: float = 1.0) -> torch.Tensor:
    """TVD(p, q) = 1/2 sum_x |p(x) - q(x)| = 1 - sum_x min(p, q): exactly one minus the probability
    that speculative sampling accepts the student's token (DistillSpec's motivation for it)."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return ((0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)) * mask).sum()


# --- LK losses (arXiv:2602.23881, "acceptance-targeting" objectives) ----------------------------------
# With alpha = sum_x min(p(x), q(x)), the probability that speculative sampling accepts a draft token
# (p the target, q the drafter), they train the acceptance itself rather than a proxy divergence.


def _acceptance(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)  # [N]


def negative_log_acceptance(student_logits, teacher_logits, mask, temperature: float = 1.0) -> torch.Tensor:
    """NLA = -log alpha: 0 iff p == q; unlike TVD = 1 - alpha its gradient grows as alpha -> 0, so
    rows the drafter gets badly wrong are not ignored (alpha clamped at 1e-6 against log 0)."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return (-_acceptance(log_q, log_p).clamp_min(1e-6).log() * mask).sum()


def lk_hybrid(student_logits, teacher_logits, mask, temperature: float = 1.0, eta: float = 3.0) -> torch.Tensor:
    """LK hybrid = lam * KL(p || q) + (1 - lam) * TVD(p, q), lam = exp(-eta * sg(alpha)), eta = 3:
    KL's dense gradient while the drafter is far from the target (alpha small, lam near 1), the
    acceptance itself (TVD = 1 - alpha) once it is close. lam is a per-row weight, not differentiated
    (sg = stop-gradient). 0 iff p == q."""
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    alpha = _acceptance(log_q, log_p)
    lam = torch.exp(-eta * alpha.detach())
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return ((lam * kl + (1 - lam) * (1 - alpha)) * mask).sum()


DIVERGENCES = {
    "fkl": forward_kl,
    "rkl": reverse_kl,
    "jsd": jensen_shannon,
    "tvd": total_variation,
    "nla": negative_log_acceptance,
    "lk_hybrid": lk_hybrid,
}


def draft_ce(student_logits, teacher_logits, mask, temperature: float = 1.0) -> torch.Tensor:
    """EAGLE's token loss: soft cross-entropy against the target's distribution (temperature 1)."""
    return soft_cross_entropy(student_logits, teacher_logits, mask)


# The token losses a feature-space or block drafter may train on (`drafter.loss`): (student, teacher, mask).
TOKEN_LOSSES = {"ce": draft_ce, "tvd": total_variation, "nla": negative_log_acceptance, "lk_hybrid": lk_hybrid}


def check_loss(name: str, field: str, table: dict) -> str:
    """A loss name from a config, or the one-line error naming the valid ones."""
    if name not in table:
        raise DraftsmithError(f"{field}: unknown loss '{name}' (valid: {', '.join(table)})")
    return name


# --- DFlash per-slot weights (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash Speculative
# Decoding", arXiv:2602.06036) ------------------------------------------------------------------------
# A DFlash block is [bonus, mask x (B-1)]: slot k (1 <= k < B) drafts the k-th token after the bonus;
# slot 0 is the bonus itself and is never trained. Draft k is only useful if drafts 1..k-1 were
# accepted, so early slots weigh more. Both functions return weights to multiply per-slot losses by.


def decay_position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """DFlash's fixed decay: w [block_size] with w_0 = 0 (the bonus slot) and w_k = exp(-(k-1)/gamma)
    for k >= 1, so slot 1 has weight 1 (speculators `losses/utils.py`, dflash_decay_gamma = 4.0;
    SpecForge's DFlash recipes use gamma = 7 with B = 16)."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def dpace_position_weights(confidence: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights (speculators `losses/utils.py` and SpecForge `dflash_family_model.py`): the
    expected number of drafts a slot's acceptance unlocks.

    confidence: q_j [N, B], the drafter's probability of slot j's label (exp(-CE_j), detached);
    mask: [N, B] (1 = slot trained; slot 0 is 0). With s_j = (1 - alpha) q_j + alpha on trained
    slots and 1 elsewhere, P_j = prod_{i <= j} s_i (the chance that drafts up to j are accepted),
    w_k = mask_k * sum_{j >= k} P_j mask_j. Returns w [N, B], detached. All q = 1 gives suffix
    counts of the trained slots; alpha = 1 ignores confidence the same way."""
    q, m = confidence.detach().float(), mask.float()
    s = torch.where(m > 0, (1 - alpha) * q + alpha, torch.ones_like(q))
    p = s.cumprod(-1) * m
    return p.flip(-1).cumsum(-1).flip(-1) * m
