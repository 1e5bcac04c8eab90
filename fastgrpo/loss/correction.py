"""The rollout importance-sampling correction: per-token weights of the policy term from the log-probs the rollout
engine sampled with and the trainer's log-probs of the same tokens, for any engine that returns log-probs.

The engine (vLLM, or fastgrpo's own bf16 decode with a KV cache) and the training forward score the same tokens a
little differently; the samples then come from a distribution pi_rollout that is not the pi_old the ratio assumes.
TRL's `vllm_importance_sampling_correction` (1.16 GRPOTrainer._generate_and_score_completions) weights the policy
term by rho = pi_old / pi_rollout, per token or per sequence (the product over its tokens), bounded by truncation
(clamp to [clip_min, clip_max]) or masking (weight 0 outside it). The weights go to the loss as `token_weights`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from fastgrpo._checks import (
    Masked,
    check_choice,
    check_mask,
    check_same_shape,
    first_nonfinite,
    masked_nonfinite,
    nonbinary,
    raise_if_masked_nonfinite,
    raise_if_nonbinary,
    read_ints,
)

ROLLOUT_CORRECTIONS = ("none", "truncate", "mask")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")


class RolloutCorrection(NamedTuple):
    """The correction's options (rollout_correction's mode, level, clip_min, clip_max), for a loss that weights
    itself (fastgrpo.loss.model.grpo_loss's rollout_correction)."""

    mode: str
    level: str = "sequence"
    clip_min: float | None = None
    clip_max: float | None = 3.0


def check_rollout_correction(mode: str, level: str, clip_min: float | None, clip_max: float | None) -> None:
    """The checks of TRL 1.16 GRPOConfig.__post_init__ for these options, each a ValueError naming the field."""
    check_choice("rollout_correction", mode, ROLLOUT_CORRECTIONS)
    check_choice("rollout_correction_level", level, ROLLOUT_CORRECTION_LEVELS)
    for name, value in (("rollout_correction_clip_min", clip_min), ("rollout_correction_clip_max", clip_max)):
        if value is not None and (isinstance(value, bool) or not 0 <= value < math.inf):
            raise ValueError(f"{name}: expected None or a finite number >= 0, got {value!r}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"rollout_correction_clip_min: expected < rollout_correction_clip_max ({clip_max}), "
                         f"got {clip_min}")
    if mode == "truncate" and clip_min is None and clip_max is None:
        raise ValueError("rollout_correction_clip_max: truncate needs a bound (clip_max, clip_min or both), got None")


def rollout_correction(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    level: str = "sequence",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(token_weights [B, T], metrics) of the correction of rollout_logps [B, T] (the engine's) towards train_logps
    [B, T] (the trainer's old log-probs) on the tokens of mask [B, T].

    rho = exp(train - rollout) per token, or exp(sum over the sequence's valid tokens) for level "sequence" (each of
    its tokens gets it); NaN differences (tokens an engine could not score) count 0. mode "truncate": clamp rho to
    [clip_min, clip_max]; "mask": rho, or 0 outside [clip_min, clip_max]; None: unbounded on that side. As TRL
    1.16 GRPOTrainer._generate_and_score_completions (`if self.use_vllm and self.vllm_importance_sampling_correction`).

    metrics: rollout_logp_diff / _max, the mean / largest |train - rollout| over the valid tokens (NaN left out);
    rollout_is_weight_mean / _min / _max, the weights over the valid tokens (or the sequences); rollout_masked_frac
    (mask) or rollout_truncated_frac (truncate), the share of tokens (or sequences) the bound changed.

    A ValueError names a NaN / inf train log-prob or an inf or positive rollout log-prob where mask is 1, and a weight
    that overflowed to inf (only with clip_max None).
    """
    check_rollout_correction(mode, level, clip_min, clip_max)
    if mode == "none":
        raise ValueError("rollout_correction: 'none' computes no weights; call this with 'truncate' or 'mask'")
    check_logps(train_logps, rollout_logps, mask)
    valid = mask.bool()
    ratio, weights = _ratio_and_weights(train_logps, rollout_logps, valid, mode, level, clip_min, clip_max)
    changed = weights != ratio
    counted = torch.ones_like(ratio, dtype=torch.bool) if level == "sequence" else valid

    delta = (train_logps - rollout_logps).abs()
    delta = delta[valid & ~torch.isnan(delta)]
    kept = weights[counted]
    metrics = {
        "rollout_logp_diff": delta.mean().item() if delta.numel() else 0.0,
        "rollout_logp_diff_max": delta.max().item() if delta.numel() else 0.0,
        "rollout_is_weight_mean": kept.mean().item() if kept.numel() else 0.0,
        "rollout_is_weight_min": kept.min().item() if kept.numel() else 0.0,
        "rollout_is_weight_max": kept.max().item() if kept.numel() else 0.0,
        f"rollout_{'truncated' if mode == 'truncate' else 'masked'}_frac":
            changed[counted].float().mean().item() if kept.numel() else 0.0,
    }
    weights = weights.expand_as(train_logps)
    if math.isinf(metrics["rollout_is_weight_max"]):  # an overflow, seen in the metrics' read: find where (a read)
        raise_if_overflowed(level, train_logps.shape, read_ints(first_nonfinite(weights, mask)[0])[0])
    return weights, metrics


def check_logps(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> None:
    """rollout_logps [B, T] of train_logps' shape and mask a 0 / 1 mask of it, with train log-probs finite and <= 0
    (up to rounding: the trainer's own, as old_logps are checked in the loss) and engine_logps where it is 1: one
    host read."""
    check_same_shape("rollout_logps", rollout_logps, "train_logps", train_logps)
    check_mask("mask", mask, "train_logps", train_logps)
    logps = {"train_logps": Masked(train_logps, logprob=True), "rollout_logps": engine_logps(rollout_logps)}
    flag, *bad = read_ints(nonbinary(mask), *masked_nonfinite(mask, logps))
    raise_if_nonbinary("mask", flag)
    raise_if_masked_nonfinite("mask", logps, bad)


def engine_logps(logps: torch.Tensor | None) -> Masked:
    """A rollout engine's log-probs of the tokens it sampled (rollout_logps, sampling_logps) for masked_nonfinite:
    finite and <= 0 (up to rounding) where the mask is 1, or NaN (a token the engine could not score, which counts 0
    as in TRL). An inf made a correction weight inf or 0, or moved the off-policy mask, silently; so did a positive
    value, which is no log-prob (a negative log-likelihood passed by mistake)."""
    return Masked(logps, nan_ok=True, logprob=True)


def raise_if_overflowed(level: str, shape: Sequence[int], index: int) -> None:
    """The error for first_nonfinite's index, read already, of the weights [B, T] where the mask is 1: a ratio
    exp(train - rollout) past the dtype's largest number is inf, and only clip_max bounds it (truncate clamps it,
    mask drops it)."""
    if index < math.prod(shape):
        row, column = divmod(index, shape[-1])
        at = f"row {row}" if level == "sequence" else f"row {row}, column {column}"
        raise ValueError(f"rollout_correction_clip_max: None leaves the importance weights unbounded, and the weight "
                         f"at {at} overflowed to inf (exp of the trainer's minus the engine's log-probs); set a "
                         "bound, e.g. 3.0")


def correction_weights(
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrection
) -> torch.Tensor:
    """rollout_correction's token_weights [B, T] alone, without its metrics: no host sync, so the loss of each
    micro-batch can weight itself from its own forward's log-probs (fastgrpo.loss.model.grpo_loss). The caller has
    checked the options (check_rollout_correction) and the shapes."""
    return _ratio_and_weights(train_logps, rollout_logps, mask.bool(), *correction)[1].expand_as(train_logps)


def _ratio_and_weights(train_logps, rollout_logps, valid, mode, level, clip_min, clip_max):
    """(rho [B, 1] per sequence or [B, T] per token, its bounded weights of the same shape)."""
    diff = torch.nan_to_num(torch.where(valid, train_logps - rollout_logps, 0.0), nan=0.0)  # diff: [B, T]
    log_ratio = diff.sum(-1, keepdim=True) if level == "sequence" else diff  # [B, 1] or [B, T]
    ratio = torch.exp(log_ratio)
    if mode == "truncate":
        return ratio, ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio, ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def logprob_gap(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's, on the tokens the engine sampled: with
    d = rollout - train per token of mask [B, T] (in fp64), mean_abs_gap / max_abs_gap: mean and largest |d|;
    kl_k1 = mean d and kl_k3 = mean (exp(-d) - 1 + d), two estimates of KL(pi_rollout || pi_train) per token from
    samples of pi_rollout (both unbiased; k3 is >= 0 token by token, so less noisy); tokens: how many counted. Tokens
    the engine could not score (NaN) are left out; a NaN / inf train log-prob or an inf or positive rollout log-prob
    where mask is 1 is a ValueError (an inf made the gap inf or NaN silently). A measure for choosing an engine (e.g.
    FP8 weights against bf16); rollout_correction is what corrects for the gap in the loss."""
    check_logps(train_logps, rollout_logps, mask)
    d = (rollout_logps.double() - train_logps.double())[mask.bool()]
    d = d[~torch.isnan(d)]
    if not d.numel():
        return {"tokens": 0, "mean_abs_gap": 0.0, "max_abs_gap": 0.0, "kl_k1": 0.0, "kl_k3": 0.0}
    return {"tokens": d.numel(), "mean_abs_gap": d.abs().mean().item(), "max_abs_gap": d.abs().max().item(),
            "kl_k1": d.mean().item(), "kl_k3": (torch.expm1(-d) + d).mean().item()}


__all__ = ["rollout_correction", "correction_weights", "RolloutCorrection", "check_rollout_correction", "logprob_gap",
           "ROLLOUT_CORRECTIONS", "ROLLOUT_CORRECTION_LEVELS"]
