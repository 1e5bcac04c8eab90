"""GRPO / SFT math on [B, T] tensors, in eager PyTorch.

Shapes: B sequences, T completion positions. Masks are 1 where a token counts. Every function here is
differentiable where it makes sense and is the single home of its formula: the reference oracle and the fused
kernels' autograd both call `grpo_per_token_loss` and `aggregation_weights`.
"""
from __future__ import annotations

import torch

from fastgrpo._checks import check_choice, check_mask, check_same_shape

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(tensor * mask, dim) / sum(mask, dim); dim=None reduces over everything."""
    check_mask("mask", mask, "tensor", tensor)
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim) / mask.sum(dim)


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> torch.Tensor:
    """sum(tensor * mask, dim) / normalize_constant; dim=None reduces over everything."""
    check_mask("mask", mask, "tensor", tensor)
    masked = tensor * mask.to(tensor.dtype)
    summed = masked.sum() if dim is None else masked.sum(dim)
    return summed / normalize_constant


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token's log-probs."""
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0  # k3 = exp(ref - logp) - (ref - logp) - 1 >= 0


def aggregation_weights(
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights w [B, T] with loss = sum(w * per_token_loss) for each aggregation.

    grpo: mean over sequences of each sequence's masked mean; bnpo: masked mean over the batch;
    dr_grpo: masked sum / (B * max_completion_length); dapo: masked sum / num_items_in_batch (the active tokens of
    the whole accumulation window across processes; the local count when None).
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {list(mask.shape)}")
    m = mask.to(torch.float32) if not mask.dtype.is_floating_point else mask
    if loss_type == "grpo":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * m.shape[0])
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("max_completion_length: required for loss_type='dr_grpo', got None")
        return m / (m.shape[0] * max_completion_length)
    if num_items_in_batch is None:
        return m / m.sum().clamp(min=1.0)
    return m / num_items_in_batch


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar with the grpo / bnpo / dr_grpo / dapo normalization."""
    check_mask("mask", mask, "per_token_loss", per_token_loss)
    weights = aggregation_weights(mask, loss_type, max_completion_length, num_items_in_batch)
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()


def grpo_per_token_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Clipped policy-gradient loss plus beta * k3 KL, per token.

    Returns (per_token_loss [B, T], per_token_kl [B, T] or None, low_clipped [B, T] bool, high_clipped [B, T] bool).
    old_logps=None is on-policy: the ratio is exp(logp - logp.detach()) = 1 with the policy gradient intact.
    With delta set, the unclipped ratio is capped at delta (two-sided clipping, as TRL does).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        m = mask.to(logps.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    # The min() takes the clipped branch exactly here (where the clamp also stops the gradient).
    low_clipped = (ratio.detach() < 1.0 - epsilon_low) & (advantages < 0)
    high_clipped = (ratio.detach() > 1.0 + epsilon_high) & (advantages > 0)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    per_token_loss = per_token_loss.expand_as(logps)
    per_token_kl = None
    if beta != 0.0:
        per_token_kl = kl_penalty(logps, ref_logps, "k3")
        per_token_loss = per_token_loss + beta * per_token_kl
    shape = logps.shape
    return per_token_loss, per_token_kl, low_clipped.expand(shape), high_clipped.expand(shape)
