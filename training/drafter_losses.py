"""Drafter losses (DeepSpec parity), all weighted means over draft positions.

Vocabulary: k = 0..γ−1 is the draft position (slot k predicts the token at anchor + k + 1); p_d the
draft distribution (Markov-corrected, teacher-forced) over the draft vocabulary (Vd ids, or all V), p_t the
target's over the same ids — log p_t normalised over the target's whole vocabulary, so it sums to 1 − m where m
is the target's mass outside the draft vocabulary (which p_d never reaches); both fp32; eval_mask[a, k] marks
the contiguous valid prefix of block a. Each term is Σ w·term / Σ w.

  dspark  0.1·CE(p_d, x*) + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(z, 1 − ½‖p_d − p_t‖₁),  w = exp(−k/4)
  dflash  CE(p_d, x*),                                                         w = exp(−k/4)
  eagle3  soft CE −Σ p_t log p_d (the target distribution as label),            w = 0.8^k
  stand-in (optional, block drafters, `--standin-weight`): Σ_k m·‖h_k − c_k‖² / ‖c_k‖², h_k the backbone's
    state at position anchor + k and c_k the context row the target's features give that position
1 − ½‖p_d − p_t‖₁ (over the whole vocabulary; ½(Σ|p_d − p_t| + m) over the draft's) is the probability that
a draft from p_d survives verification against p_t at T = 1, which is why it is both the distillation target
(as L1) and the confidence label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decay_weights(eval_mask: torch.Tensor, decay: float = 4.0) -> torch.Tensor:
    """eval_mask [A, γ] → w [A, γ] = mask · exp(−k / decay)."""
    k = torch.arange(eval_mask.shape[1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.float() * torch.exp(-k / decay)


def step_weights(eval_mask: torch.Tensor, base: float = 0.8) -> torch.Tensor:
    """EAGLE-3's step-loss decay: w [A, γ] = mask · base^k."""
    k = torch.arange(eval_mask.shape[1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.float() * base**k


def _wmean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


def acceptance(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (log p_d [A, γ, Vd], 1 − ½‖p_d − p_t‖₁ [A, γ]) in fp32; target_logp [A, γ, Vd] as the module says."""
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    p_t = target_logp.float().exp()
    outside = (1.0 - p_t.sum(-1)).clamp_min(0.0)  # m: the target's mass the draft vocabulary misses
    return log_pd, 1.0 - 0.5 * ((log_pd.exp() - p_t).abs().sum(-1) + outside)


def dspark_loss(
    draft_logits: torch.Tensor,  # [A, γ, Vd] U + B
    target_logp: torch.Tensor,  # [A, γ, Vd] log p_t
    labels: torch.Tensor,  # [A, γ] int64 data tokens x* as draft ids
    weights: torch.Tensor,  # [A, γ]
    conf_logits: torch.Tensor | None = None,  # [A, γ] z_k
    mix: tuple[float, float, float] = (0.1, 0.9, 1.0),
    labels_inside: torch.Tensor | None = None,  # [A, γ] bool: x* is in the draft vocabulary (CE only there)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_pd, accept = acceptance(draft_logits, target_logp)
    ce_weights = weights if labels_inside is None else weights * labels_inside
    ce = -log_pd.gather(-1, labels.clamp(max=log_pd.shape[-1] - 1)[..., None])[..., 0]
    terms = {"ce": _wmean(ce, ce_weights), "l1": _wmean(2.0 * (1.0 - accept), weights)}
    if conf_logits is not None:
        label = accept.detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none")
        terms["conf"] = _wmean(bce, weights)
    loss = mix[0] * terms["ce"] + mix[1] * terms["l1"] + mix[2] * terms.get("conf", 0.0)
    return loss, {**terms, "accept": accept.detach()}


def standin_loss(
    h: torch.Tensor,  # [A, γ, d] the block's states, slot k at position anchor + k
    ctx: torch.Tensor,  # [A, γ, d] the context rows of the same positions, from the target's features
    mask: torch.Tensor,  # [A, γ] slots whose position exists
) -> torch.Tensor:
    """How far the block's own states are from the context rows they stand in for when the drafter drafts ahead
    (`drafter_worker/predraft.py` projects h_0..h_ℓ to context keys and values before the target has seen those
    positions): the squared error relative to the context row, so the term is scale-free. Both sides get
    gradients, so the context projection may also move towards states the backbone can produce."""
    err = (h.float() - ctx.float()).pow(2).sum(-1) / ctx.float().pow(2).sum(-1).clamp_min(1e-6)  # [A, γ]
    return _wmean(err, mask.float())


def dflash_loss(draft_logits, target_logp, labels, weights, labels_inside=None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return dspark_loss(draft_logits, target_logp, labels, weights, None, (1.0, 0.0, 0.0), labels_inside)


def soft_ce_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_pd, accept = acceptance(draft_logits, target_logp)
    loss = _wmean(-(target_logp.float().exp() * log_pd).sum(-1), weights)
    return loss, {"soft_ce": loss, "accept": accept.detach()}
