"""GRPO math on [B, T] tensors, in eager PyTorch: the single home of each formula.

Shapes: B sequences, T completion positions. Masks are 1 where a token counts (bool, or 0/1 integers or floats).
The reference oracle and the fused loss's autograd both call `grpo_per_token_loss` and `aggregation_weights`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fastgrpo._checks import check_binary_mask, check_choice, check_same_shape
from fastgrpo.loss.config import LOSS_TYPES, GRPOLossConfig, resolve

KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(tensor * mask, dim) / sum(mask, dim); dim=None reduces over everything."""
    check_binary_mask("mask", mask, "tensor", tensor)
    count = mask.to(tensor.dtype)
    return _masked_sum(tensor, mask, dim) / (count.sum() if dim is None else count.sum(dim))


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> torch.Tensor:
    """sum(tensor * mask, dim) / normalize_constant; dim=None reduces over everything."""
    check_binary_mask("mask", mask, "tensor", tensor)
    return _masked_sum(tensor, mask, dim) / normalize_constant


def _masked_sum(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    # where, not tensor * mask: an inf at a masked position (e.g. a -inf log-prob of padding) would give nan.
    masked = torch.where(mask.bool(), tensor, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


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
    check_binary_mask("mask", mask, "per_token_loss", per_token_loss)
    # Weights in the loss's precision, at least fp32: a bool mask would otherwise give fp32 weights to an fp64 loss.
    counts = mask.to(torch.promote_types(per_token_loss.dtype, torch.float32))
    weights = aggregation_weights(counts, loss_type, max_completion_length, num_items_in_batch)
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()


class PerTokenTerms(NamedTuple):
    """The per-token terms of the GRPO loss, each [B, T]."""

    loss: torch.Tensor  # clipped policy-gradient loss plus beta * k3 KL
    kl: torch.Tensor | None  # k3 KL to the reference (None when beta is 0)
    low_clipped: torch.Tensor  # bool: ratio below 1 - epsilon_low with A < 0 (the clipped branch is the minimum)
    high_clipped: torch.Tensor  # bool: ratio above 1 + epsilon_high with A > 0


def grpo_per_token_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    **options,
) -> PerTokenTerms:
    """Clipped policy-gradient loss plus beta * k3 KL, per token, with the options of `config` (and `options`).

    old_logps=None is on-policy: the ratio is exp(logp - logp.detach()) = 1 with the policy gradient intact.
    With delta set, the unclipped ratio is capped at delta (two-sided clipping, as TRL does).
    """
    cfg = resolve(config, options)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if cfg.importance_sampling_level == "sequence":
        m = mask.to(logps.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.clip_high)
    # The min() takes the clipped branch exactly here (where the clamp also stops the gradient).
    low_clipped = (ratio.detach() < 1.0 - cfg.epsilon_low) & (advantages < 0)
    high_clipped = (ratio.detach() > 1.0 + cfg.clip_high) & (advantages > 0)
    if cfg.delta is not None:
        ratio = torch.clamp(ratio, max=cfg.delta)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    per_token_loss = per_token_loss.expand_as(logps)
    per_token_kl = None
    if cfg.beta != 0.0:
        per_token_kl = kl_penalty(logps, ref_logps, "k3")
        per_token_loss = per_token_loss + cfg.beta * per_token_kl
    shape = logps.shape
    return PerTokenTerms(per_token_loss, per_token_kl, low_clipped.expand(shape), high_clipped.expand(shape))


def loss_metrics(mask: torch.Tensor, terms: PerTokenTerms, entropy: torch.Tensor | None = None) -> dict:
    """The metrics of a GRPO loss, built here only: `clip_ratio_low`, `clip_ratio_high` (fractions of valid tokens
    on the clipped branch) and `clip_ratio` (their sum), `kl` (masked mean k3 KL, when beta > 0) and `entropy`
    (masked mean, when given), each a detached 0-dim tensor. mask, entropy [B, T]."""
    m = mask.to(terms.loss.dtype)
    count = m.sum().clamp(min=1.0)

    def mean(values: torch.Tensor) -> torch.Tensor:
        return (values.detach() * m).sum() / count

    metrics = {"clip_ratio_low": mean(terms.low_clipped), "clip_ratio_high": mean(terms.high_clipped)}
    metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    if terms.kl is not None:
        metrics["kl"] = mean(terms.kl)
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
    return metrics


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """rewards [N] in consecutive groups of group_size -> advantages [N]: reward - its group's mean, divided by
    (the group's std + eps) for scale "group", (the batch's std + eps) for "batch", or not at all for "none".
    Stds with Bessel's correction, as torch.std."""
    grouped = rewards.view(-1, group_size)  # grouped: [N / G, G]
    centered = grouped - grouped.mean(-1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(-1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    return centered.reshape(-1)
