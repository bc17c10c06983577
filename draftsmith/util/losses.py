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


# --- DSpark (arXiv:2607.05147, "DSpark": a DFlash block drafter with a low-rank Markov head over the
# previous token and a confidence head) -----------------------------------------------------------
# Slot k's logits are l_k = z_k + W2 W1[prev_k] (the Markov correction of the block's logits z_k);
# the main loss is DFlash's token loss on l_k (TOKEN_LOSSES above). The confidence head's logit c_k
# estimates the probability that speculative sampling accepts draft k, given drafts 1..k-1 were
# accepted (vLLM's adaptive verification multiplies them into survival probabilities).


@torch.no_grad()
def soft_acceptance(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, target_logprobs: bool = False
) -> torch.Tensor:
    """DSpark's confidence target, per row: a = sum_x min(q(x), p(x)) = 1 - TV(q, p), the probability
    that speculative sampling (Leviathan et al. 2023, Corollary 3.6) accepts a token drawn from the
    drafter q = softmax(draft_logits) against the target p = softmax(target_logits), at temperature 1.

    draft_logits, target_logits: [N, V] -> a [N] in [0, 1], detached (a label, never differentiated;
    speculators' and SpecForge's DSpark compute it under no_grad as well). 1 iff q == p.
    target_logprobs: target_logits are the target's log-probabilities over a subset of its vocabulary
    (a reduced draft vocabulary, where q lives), so p = exp of them, not renormalised: the target's mass
    off the subset is never accepted, and a stays the true acceptance probability."""
    q = F.softmax(draft_logits.float(), dim=-1)
    p = target_logits.float().exp() if target_logprobs else F.softmax(target_logits.float(), dim=-1)
    return torch.minimum(q, p).sum(-1).clamp(0.0, 1.0)


def confidence_bce(confidence_logits: torch.Tensor, acceptance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DSpark's calibration loss: binary cross-entropy of sigmoid(c) against the soft acceptance a,
    sum_n mask_n * BCE(sigmoid(c_n), a_n), computed in fp32 from logits (BCEWithLogits).

    confidence_logits: [N] (the head's pre-sigmoid output); acceptance: [N] in [0, 1] (soft_acceptance,
    detached); mask: [N] (1 = counts). For each row its minimum over c is at sigmoid(c) = a (the
    derivative is sigmoid(c) - a), so the head is trained to be calibrated, not just to rank."""
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance.detach().float(), reduction="none")
    return (bce * mask).sum()


# --- DFlash2 (speculators `dflash2`, vLLM 0.32 `qwen3_dflash2.py`; z-lab's DFlash2, inco.ai/blog/dflash2):
# a DFlash block drafter whose slots keep their unary top-k candidates C_k (the target lm_head's top-k
# of slot k's logits) and a low-rank path selector scores each candidate given the token before it:
#     s_k[c] = unary_k[C_k[c]] + < P[prev_k] * (W_hp h_k), S[C_k[c]] >
# The unary logits train with DFlash's token loss (TOKEN_LOSSES above); the selector with a k-way
# cross-entropy whose label is the gold token's index in C_k, prev_k teacher-forced to the data token.


@torch.no_grad()
def selector_candidates(
    candidates: torch.Tensor, gold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash2's training candidates (speculators 0.9.0 `models/dflash2/metrics.py`
    selector_training_candidates; SpecForge PR #772 "insert the gold token when it is missing from
    the top-k"): candidates [..., k] (unary top-k ids, best first), gold [...] (the target's argmax)
    -> (ids [..., k], label [...], covered [...]). Where gold is among the candidates, ids = candidates
    and label = its index; where it is not, the last (weakest) candidate is replaced by gold and
    label = k - 1, so every slot has a k-way label. covered: gold was in the serving top-k (the
    injection is for the loss only; serving ranks the strict top-k)."""
    hit = candidates == gold[..., None]
    covered = hit.any(-1)
    label = torch.where(covered, hit.long().argmax(-1), candidates.shape[-1] - 1)
    ids = candidates.clone()
    ids[..., -1] = torch.where(covered, candidates[..., -1], gold)
    return ids, label, covered


def selector_cross_entropy(scores: torch.Tensor, label: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """DFlash2's selector loss: sum_n w_n * CE(softmax over the k candidates of scores_n, label_n)
    (speculators 0.9.0 `compute_selector_loss`: a hard CE over the candidate set, weighted per slot
    like the unary loss).

    scores: [N, k] selector scores s[c] of the candidates (fp32 on return); label: [N] in [0, k)
    (selector_candidates); weights: [N] (slot weight x trained mask). Its minimum over orderings of a
    fixed set of scores is at the gold candidate ranked first."""
    ce = F.cross_entropy(scores.float(), label, reduction="none")
    return (ce * weights.float()).sum()
