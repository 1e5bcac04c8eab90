"""GRPO math on [B, T] tensors, in eager PyTorch: the single home of each formula.

Shapes: B sequences, T completion positions. Masks are 1 where a token counts (bool, or 0/1 integers or floats).
The reference oracle and the fused loss's autograd both call `grpo_per_token_loss` and `aggregation_weights`.
"""
from __future__ import annotations

import math
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

    grpo, sapo: mean over sequences of each sequence's masked mean; bnpo: masked mean over the batch;
    dr_grpo: masked sum / (B * max_completion_length); dapo, cispo, vespo: masked sum / num_items_in_batch (the
    active tokens of the whole accumulation window across processes; the local count when None); luspo: mean over
    sequences of each sequence's masked SUM (TRL 1.16 GRPOTrainer._compute_loss, loss_type == "luspo": longer
    sequences weigh more).
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {list(mask.shape)}")
    m = mask.to(torch.float32) if not mask.dtype.is_floating_point else mask
    if loss_type in ("grpo", "sapo"):
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * m.shape[0])
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("max_completion_length: required for loss_type='dr_grpo', got None")
        return m / (m.shape[0] * max_completion_length)
    if loss_type == "luspo":
        return m / m.shape[0]
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
    """Reduce a [B, T] per-token loss to a scalar with the normalization of `loss_type` (aggregation_weights)."""
    check_binary_mask("mask", mask, "per_token_loss", per_token_loss)
    # Weights in the loss's precision, at least fp32: a bool mask would otherwise give fp32 weights to an fp64 loss.
    counts = mask.to(torch.promote_types(per_token_loss.dtype, torch.float32))
    weights = aggregation_weights(counts, loss_type, max_completion_length, num_items_in_batch)
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()


class PerTokenTerms(NamedTuple):
    """The per-token terms of the GRPO loss, each [B, T]."""

    loss: torch.Tensor  # policy term plus beta * KL
    kl: torch.Tensor | None  # the KL term (None when beta is 0)
    low_clipped: torch.Tensor  # bool: ratio below 1 - epsilon_low with A < 0 (the clipped branch is the minimum)
    high_clipped: torch.Tensor  # bool: ratio above 1 + epsilon_high with A > 0 (cispo: above its cap)


class LossTerms(NamedTuple):
    """grpo_terms' results: the per-token loss and what the metrics need."""

    loss: torch.Tensor  # [B, T]: the policy term (after the masks and token_weights) plus beta * KL
    kl: torch.Tensor | None  # [B, T]: the KL term as it enters the loss (times the ratio with use_bias_correction_kl)
    low_clipped: torch.Tensor  # bool [B, T], or [B, 1] for sequence-level ratios
    high_clipped: torch.Tensor  # bool, as low_clipped
    entropy_mask: torch.Tensor | None  # bool [B, T]: the tokens top_entropy_quantile keeps
    phi: torch.Tensor | None  # vespo's sequence weights [B, 1]


def grpo_terms(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    *,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    **options,
) -> LossTerms:
    """The per-token GRPO loss [B, T] of every loss type and option, in the order of TRL 1.16's
    GRPOTrainer._compute_loss: ratio, KL, the loss type's policy term, x off-policy mask, x entropy mask,
    x token_weights, + beta * KL.

    old_logps=None is on-policy: the ratio is exp(logp - logp.detach()) = 1 with the policy gradient intact.
    entropy [B, T]: needed for top_entropy_quantile < 1. token_weights [B, T]: multiply the policy term (a rollout
    importance-sampling correction, TRL's inputs["importance_sampling_ratio"]); vespo folds their logs into its
    sequence weight instead. sampling_logps [B, T]: the rollout engine's log-probs, which the off-policy mask
    compares with the policy's (default: old_logps).
    """
    cfg = resolve(config, options)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # advantages: [B, 1] (or [B, T] as given)
    valid = mask.bool()
    count = mask.to(logps.dtype).sum(-1, keepdim=True).clamp(min=1.0)  # count: [B, 1]
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if cfg.importance_sampling_level == "sequence":  # GSPO: the mean log-ratio of the sequence's valid tokens
        log_weight = torch.where(valid, log_ratio, 0.0).sum(-1, keepdim=True) / count  # [B, 1]
    else:
        log_weight = log_ratio
    ratio = torch.exp(log_weight)
    kl = None
    if cfg.beta != 0.0:
        kl = kl_penalty(logps, ref_logps, "k3")
        if cfg.use_bias_correction_kl:  # TRL 1.16 _compute_loss: per_token_kl * coef_1 (the ratio before delta)
            kl = kl * ratio
    no_clip = torch.zeros(torch.broadcast_shapes(ratio.shape, advantages.shape), dtype=torch.bool,
                          device=logps.device)
    low, high, phi = no_clip, no_clip, None
    if cfg.loss_type == "cispo":
        # TRL 1.16 _compute_loss, loss_type == "cispo": -sg(min(r, epsilon_high)) A logp (epsilon_high is a cap)
        policy = -torch.clamp(ratio, max=cfg.clip_high).detach() * advantages * logps
        high = (ratio.detach() > cfg.clip_high) & (advantages > 0)
    elif cfg.loss_type == "sapo":
        # TRL 1.16 _compute_loss, loss_type == "sapo": -sigmoid(tau (r - 1)) 4 / tau A, tau by the sign of A
        tau = torch.where(advantages > 0, _full(advantages, cfg.sapo_temperature_pos, logps),
                          _full(advantages, cfg.sapo_temperature_neg, logps))
        policy = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * advantages
    elif cfg.loss_type == "vespo":
        # TRL 1.16 _compute_loss, loss_type == "vespo": -phi(w) A logp, phi from GRPOTrainer.get_gamma_weights
        phi = vespo_weights(log_ratio.detach(), valid, advantages, token_weights, cfg)
        policy = -phi * advantages * logps
    else:  # grpo, bnpo, dr_grpo, dapo, luspo: the PPO-clipped ratio
        clipped_ratio = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.clip_high)
        if cfg.delta is not None:  # two-sided clipping: the unclipped ratio is capped at delta
            ratio = torch.clamp(ratio, max=cfg.delta)
        # The min() takes the clipped branch exactly here (where the clamp also stops the gradient); with delta, of
        # the capped ratio, as TRL counts it.
        low = (ratio.detach() < 1.0 - cfg.epsilon_low) & (advantages < 0)
        high = (ratio.detach() > 1.0 + cfg.clip_high) & (advantages > 0)
        policy = -torch.min(ratio * advantages, clipped_ratio * advantages)
    policy = policy.expand_as(logps)
    if cfg.off_policy_mask_threshold is not None:
        sampler = old if sampling_logps is None else sampling_logps
        policy = policy * off_policy_mask(logps.detach(), sampler, valid, advantages, cfg.off_policy_mask_threshold)
    entropy_mask = None
    if cfg.top_entropy_quantile < 1:
        if entropy is None:
            raise ValueError("entropy: required when top_entropy_quantile < 1, got None")
        entropy_mask = high_entropy_mask(entropy.detach(), valid, 1.0 - cfg.top_entropy_quantile)
        policy = policy * entropy_mask
    if token_weights is not None and cfg.loss_type != "vespo":
        policy = policy * token_weights  # TRL 1.16 _compute_loss: per_token_loss * importance_sampling_ratio
    loss = policy if kl is None else policy + cfg.beta * kl
    return LossTerms(loss, kl, low, high, entropy_mask, phi)


def _full(like: torch.Tensor, value: float, dtype_of: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, value, dtype=dtype_of.dtype, device=like.device)


def grpo_per_token_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    **options,
) -> PerTokenTerms:
    """grpo_terms' per-token loss, KL and clip flags, each [B, T]."""
    terms = grpo_terms(logps, mask, advantages, old_logps, ref_logps, config, **options)
    shape = logps.shape
    return PerTokenTerms(terms.loss, terms.kl, terms.low_clipped.expand(shape), terms.high_clipped.expand(shape))


@torch.no_grad()
def vespo_weights(log_ratio, valid, advantages, token_weights, cfg: GRPOLossConfig) -> torch.Tensor:
    """VESPO's phi(w) = exp(lambda + k log w - lambda w) [B, 1] of the sequence ratio w = exp(sum of the valid
    tokens' log-ratios), with (k, lambda) by the sign of A; a gradient scale, detached. As TRL 1.16
    GRPOTrainer.get_gamma_weights (its clamps included); the logs of token_weights add to log w, over the valid
    tokens here (TRL sums every position, where a rollout correction leaves a ratio of 1, log 0)."""
    lower = math.log(1e-8)
    seq = torch.where(valid, log_ratio.clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
    if token_weights is not None:
        log_is = torch.log(token_weights).clamp(lower, 20.0)
        seq = seq + torch.where(valid, log_is, 0.0).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, _full(advantages, cfg.vespo_k_pos, log_w), _full(advantages, cfg.vespo_k_neg, log_w))
    lam = torch.where(nonneg, _full(advantages, cfg.vespo_lambda_pos, log_w),
                      _full(advantages, cfg.vespo_lambda_neg, log_w)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(logps, sampling_logps, valid, advantages, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL 1.16 GRPOTrainer.get_off_policy_mask), bool [B, 1]: keep a
    sequence when A >= 0 or the mean over its valid tokens of log pi_sampler - log pi is <= threshold (NaN
    sampler log-probs count 0)."""
    drift = torch.nan_to_num(sampling_logps - logps, nan=0.0)
    count = valid.to(drift.dtype).sum(-1, keepdim=True).clamp(min=1.0)
    mean_drift = torch.where(valid, drift, 0.0).sum(-1, keepdim=True) / count
    return (advantages >= 0) | (mean_drift <= threshold)


def high_entropy_mask(entropy: torch.Tensor, valid: torch.Tensor, quantile: float) -> torch.Tensor:
    """bool [B, T]: the valid tokens whose entropy is >= the `quantile` quantile (linear interpolation) of the
    valid tokens' entropies (TRL 1.16 GRPOTrainer.get_high_entropy_mask, one process); none when none is valid."""
    values = entropy[valid]
    if values.numel() == 0:
        return torch.zeros_like(valid)
    if values.numel() <= _QUANTILE_MAX:
        threshold = torch.quantile(values, quantile)  # TRL's call: same interpolation, same rounding of q
    else:  # torch.quantile refuses more elements; the same linear interpolation over the sorted values
        ordered = values.sort().values
        position = quantile * (values.numel() - 1)
        below = int(position)
        above = min(below + 1, values.numel() - 1)
        threshold = torch.lerp(ordered[below], ordered[above], position - below)
    return valid & (entropy >= threshold)


_QUANTILE_MAX = 1 << 24  # torch.quantile's input-size limit


def entropy_weights(mask: torch.Tensor, entropy_mask: torch.Tensor | None = None) -> torch.Tensor:
    """w [B, T] with the entropy bonus = sum(w * entropy): the mean entropy of the tokens the policy term acts on
    (mask, times the top-entropy mask), however the loss type aggregates (TRL 1.16 _compute_loss, entropy bonus)."""
    m = mask if entropy_mask is None else mask * entropy_mask
    return m / m.sum().clamp(min=1.0)


class Objective(NamedTuple):
    loss: torch.Tensor  # 0-dim: policy_loss - entropy_coef * entropy_bonus
    policy_loss: torch.Tensor  # 0-dim: the aggregated per-token loss
    entropy_bonus: torch.Tensor | None  # 0-dim: the entropy mean the coefficient multiplies (entropy_coef != 0)
    terms: LossTerms


def grpo_objective(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    cfg: GRPOLossConfig,
    *,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    bonus_weights: torch.Tensor | None = None,
) -> Objective:
    """The scalar GRPO loss: sum(weights * grpo_terms(...).loss) - entropy_coef * sum(bonus_weights * entropy).

    mask [B, T] in the loss's dtype. weights / bonus_weights: aggregation_weights / entropy_weights of the whole
    batch, for a caller that evaluates a slice of it (the fused loss's chunks); computed here when None.
    """
    terms = grpo_terms(logps, mask, advantages, old_logps, ref_logps, cfg, entropy=entropy,
                       token_weights=token_weights, sampling_logps=sampling_logps)
    if weights is None:
        weights = aggregation_weights(mask, cfg.loss_type, cfg.max_completion_length, cfg.num_items_in_batch)
    policy_loss = (torch.where(mask.bool(), terms.loss, 0.0) * weights).sum()
    if cfg.entropy_coef == 0:
        return Objective(policy_loss, policy_loss, None, terms)
    if bonus_weights is None:
        bonus_weights = entropy_weights(mask, terms.entropy_mask)
    bonus = (torch.where(mask.bool(), entropy, 0.0) * bonus_weights).sum()
    return Objective(policy_loss - cfg.entropy_coef * bonus, policy_loss, bonus, terms)


def loss_metrics(mask: torch.Tensor, objective: Objective, entropy: torch.Tensor | None = None) -> dict:
    """The metrics of a GRPO loss, built here only, each a detached 0-dim tensor. mask, entropy [B, T].

    clip_ratio_low / clip_ratio_high: the share of valid tokens on the clipped branch (cispo: capped; sapo, vespo:
    0), or of sequences for sequence-level ratios, and clip_ratio their sum; clip_ratio_low_min /
    clip_ratio_high_max: the extremes over sequences of their per-sequence shares (0 without a valid token). kl
    (beta > 0): the mean KL term; entropy (when given): the mean entropy; vespo_phi: the mean sequence weight;
    entropy_mask_ratio (top_entropy_quantile < 1): the share of valid tokens kept, and entropy_kept (with entropy)
    their mean entropy (what the entropy bonus averages); policy_loss (entropy_coef != 0): the loss before the
    bonus. The means follow TRL 1.16's global_masked_mean (one process).
    """
    terms = objective.terms
    m = mask.to(terms.loss.dtype)
    count = m.sum().clamp(min=1.0)

    def per_sequence(values: torch.Tensor) -> bool:
        return values.shape[-1] == 1 and m.shape[-1] != 1

    def mean(values: torch.Tensor) -> torch.Tensor:
        values = values.detach().to(m.dtype)
        if per_sequence(values):  # one value per sequence: the mean over the sequences
            return values.mean()
        return torch.where(m.bool(), values, 0.0).sum() / count

    def extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
        values = values.detach().to(m.dtype)
        if per_sequence(values):
            shares, has = values[:, 0], torch.ones_like(values[:, 0], dtype=torch.bool)
        else:
            shares, has = (values * m).sum(-1) / m.sum(-1).clamp(min=1.0), m.sum(-1) > 0
        fill = torch.full((1,), -math.inf if largest else math.inf, dtype=m.dtype, device=m.device)
        candidates = torch.cat([torch.where(has, shares, fill), fill])
        found = candidates.amax() if largest else candidates.amin()
        return torch.where(has.any(), found, 0.0)

    metrics = {"clip_ratio_low": mean(terms.low_clipped), "clip_ratio_high": mean(terms.high_clipped)}
    metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    metrics["clip_ratio_low_min"] = extreme(terms.low_clipped, largest=False)
    metrics["clip_ratio_high_max"] = extreme(terms.high_clipped, largest=True)
    if terms.kl is not None:
        metrics["kl"] = mean(terms.kl)
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
    if terms.phi is not None:
        metrics["vespo_phi"] = mean(terms.phi)
    if terms.entropy_mask is not None:
        kept = terms.entropy_mask.to(m.dtype)
        metrics["entropy_mask_ratio"] = mean(kept)
        if entropy is not None:
            metrics["entropy_kept"] = torch.where(kept.bool(), entropy.detach(), 0.0).sum() / kept.sum().clamp(min=1.0)
    if objective.entropy_bonus is not None:
        metrics["policy_loss"] = objective.policy_loss.detach()
    return metrics


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """per_func [N, F] -> rewards [N]: the weighted sum over the functions that scored each row, NaN entries (a
    reward function's None: it does not apply) left out as TRL's nansum does; NaN where no function applied."""
    summed = (per_func * weights.to(per_func.dtype)).nansum(-1)
    return summed.masked_fill(per_func.isnan().all(-1), math.nan)


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """torch.std (Bessel's correction) over the non-NaN entries; NaN where fewer than two."""
    count = (~x.isnan()).sum(dim, keepdim=keepdim)
    square = (x - x.nanmean(dim, keepdim=True)).square().nan_to_num(0.0)
    return (square.sum(dim, keepdim=keepdim) / (count - 1)).sqrt()  # one entry: 0 / 0 = NaN


def _zero_nan(advantages: torch.Tensor) -> torch.Tensor:
    # A NaN reward (no function applied: they all returned None) carries no signal: advantage 0, as in TRL.
    return advantages.masked_fill(advantages.isnan(), 0.0)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """rewards [N] in consecutive groups of group_size -> advantages [N]: reward - its group's mean, divided by
    (the group's std + eps) for scale "group", (the batch's std + eps) for "batch", or not at all for "none".
    Stds with Bessel's correction, as torch.std. NaN rewards are left out of the means and stds and get
    advantage 0 (as do the rows of a group with one scored row under scale "group")."""
    grouped = rewards.view(-1, group_size)  # grouped: [N / G, G]
    centered = grouped - grouped.nanmean(-1, keepdim=True)
    if scale == "group":
        centered = centered / (_nanstd(grouped, -1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (_nanstd(rewards) + eps)
    return _zero_nan(centered.reshape(-1))


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def reward_advantages(per_func: torch.Tensor, weights: torch.Tensor, group_size: int, scale: str, eps: float,
                      aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """per_func [N, F] rewards of F functions -> advantages [N]. sum_then_normalize: group_advantages of the
    weighted sum. normalize_then_sum (GDPO, TRL 1.16 GRPOTrainer._generate_and_score_completions): each function's
    rewards are standardized within their group ((r - mean) / (std + eps)), weighted and summed, and that sum is
    standardized over the batch; `scale` does not apply. NaN rewards (None: the function does not apply) are left
    out of the sums, means and stds, as TRL's nansum / nanmean; a row no function applied to gets advantage 0."""
    check_choice("multi_objective_aggregation", aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    weights = weights.to(per_func.dtype)
    if aggregation == "sum_then_normalize":
        return group_advantages(weighted_rewards(per_func, weights), group_size, scale, eps)
    grouped = per_func.view(-1, group_size, per_func.shape[-1])  # grouped: [N / G, G, F]
    standardized = (grouped - grouped.nanmean(1, keepdim=True)) / (_nanstd(grouped, 1, keepdim=True) + eps)
    summed = (standardized.reshape(per_func.shape) * weights).nansum(-1)  # summed: [N]
    summed = summed.masked_fill(per_func.isnan().all(-1), math.nan)  # as TRL: only rows no function scored
    return _zero_nan((summed - summed.nanmean()) / (_nanstd(summed) + eps))
