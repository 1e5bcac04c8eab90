"""The trainer's side of the loss options: GRPOConfig's loss fields as a GRPOLossConfig, the truncated-completion
mask and the rollout correction applied to a rollout batch, and the adaptive entropy coefficient.

Kept out of trainer.py so that the loop reads top to bottom; each piece mirrors TRL 1.15 / 1.16's GRPOTrainer.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from fastgrpo._checks import check_choice
from fastgrpo.loss.config import GRPOLossConfig
from fastgrpo.loss.correction import RolloutCorrection, check_rollout_correction, rollout_correction
from fastgrpo.loss.grpo import MULTI_OBJECTIVE_AGGREGATIONS

# Loss types whose aggregation divides by the tokens of the whole minibatch (num_items_in_batch): their
# micro-batch losses add up; the others are per-micro-batch means, weighted by the micro-batch's share.
TOKEN_SUM_TYPES = ("dapo", "cispo", "vespo")
# The per-token inputs of the loss that prepare_loss_batch may add to a batch (fastgrpo.grpo_loss's arguments).
LOSS_EXTRAS = ("token_weights", "sampling_logps")
# GRPOConfig fields that GRPOLossConfig has under the same name.
_SHARED = ("epsilon_low", "epsilon_high", "delta", "loss_type", "importance_sampling_level", "temperature",
           "max_completion_length", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
           "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile", "off_policy_mask_threshold",
           "use_bias_correction_kl", "entropy_coef")


def loss_config(config, beta: float) -> GRPOLossConfig:
    """The GRPOLossConfig of a GRPOConfig (the loss fields share their names) at the current beta."""
    return GRPOLossConfig(beta=beta, **{name: getattr(config, name) for name in _SHARED})


def check_loss_options(config) -> None:
    """GRPOConfig's loss and trainer-side options, each a ValueError naming the field (before any model loads)."""
    loss_config(config, config.beta)
    check_choice("multi_objective_aggregation", config.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    check_rollout_correction(config.rollout_correction, config.rollout_correction_level,
                             config.rollout_correction_clip_min, config.rollout_correction_clip_max)
    correcting = config.rollout_correction != "none"
    if config.loss_type == "vespo" and correcting and config.rollout_correction_level != "token":
        raise ValueError("rollout_correction_level: vespo folds the correction into its sequence weight token by token "
                         "(TRL's rule); set 'token'")
    for name in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
        value = getattr(config, name)
        if not 0 <= value < math.inf:
            raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
    if config.entropy_coef_min > config.entropy_coef_max:
        raise ValueError(f"entropy_coef_min: expected <= entropy_coef_max ({config.entropy_coef_max}), got "
                         f"{config.entropy_coef_min}")


def correction_of(config) -> RolloutCorrection | None:
    """GRPOConfig's rollout correction options, None when it is off."""
    if config.rollout_correction == "none":
        return None
    return RolloutCorrection(config.rollout_correction, config.rollout_correction_level,
                             config.rollout_correction_clip_min, config.rollout_correction_clip_max)


def prepare_loss_batch(config, batch: dict, old_logps: torch.Tensor | None) -> tuple[dict, dict]:
    """(the batch the loss sees, metrics): completion_mask without the truncated completions when
    mask_truncated_completions (they still counted in the group statistics, as in TRL), the rollout correction's
    token_weights from old_logps (without them the loss weights itself from its own forward: grpo_loss's
    rollout_correction, reported by correction_metrics), and the engine's log-probs as sampling_logps for the
    off-policy mask. batch: the trainer's rollout batch ([N, P + L] tensors, finish_reasons)."""
    out, metrics = dict(batch), {}
    if config.mask_truncated_completions:
        device = batch["completion_mask"].device
        finished = torch.tensor([reason != "length" for reason in batch["finish_reasons"]], device=device)
        out["completion_mask"] = batch["completion_mask"] * finished[:, None]
    if config.rollout_correction != "none" and old_logps is not None:
        out["token_weights"], metrics = correction_metrics(config, out, old_logps)
    if config.off_policy_mask_threshold is not None:
        out["sampling_logps"] = batch["rollout_logps"]
    return out, metrics


def correction_metrics(config, loss_batch: dict, old_logps: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(token_weights, metrics) of the rollout correction of loss_batch's rollout_logps towards old_logps [N, P + L]
    on its completion tokens (fastgrpo.loss.correction.rollout_correction)."""
    return rollout_correction(old_logps, loss_batch["rollout_logps"], loss_batch["completion_mask"],
                              *correction_of(config))


def micro_batch_scale(loss_type: str, rows: int, minibatch_rows: int, world_size: int) -> float:
    """What a micro-batch's loss is multiplied by before its backward: token-sum types by the process count (their
    divisor counts every process's tokens, and DDP / FSDP2 average over processes), the per-micro-batch means by the
    micro-batch's share of the minibatch's rows."""
    return float(world_size) if loss_type in TOKEN_SUM_TYPES else rows / minibatch_rows


# Loss types whose scaled micro-batch losses add up to the same minibatch loss whichever rows share a micro-batch
# (per-row terms, or sums over the minibatch's tokens); bnpo divides by each micro-batch's own tokens.
ROW_ADDITIVE_TYPES = ("grpo", "sapo", "dr_grpo", "luspo", *TOKEN_SUM_TYPES)


def rows_may_regroup(config) -> bool:
    """Whether the update may group a minibatch's rows into micro-batches by length (short rows together, which the
    backbone then runs only to their longest) without changing the loss or its gradient. Not with bnpo, nor with
    top_entropy_quantile < 1 (a micro-batch's entropy quantile picks the tokens) or an entropy bonus (a
    micro-batch's mean)."""
    return (config.loss_type in ROW_ADDITIVE_TYPES and config.top_entropy_quantile == 1.0
            and config.entropy_coef == 0.0 and not config.use_adaptive_entropy)


def minibatch_config(config, base: GRPOLossConfig, num_items: int, share: float, entropy_coef: float) -> GRPOLossConfig:
    """The loss config of one micro-batch: token-sum types divide by the minibatch's tokens; the entropy bonus is a
    per-micro-batch mean weighted by the micro-batch's share of the minibatch whatever the loss type (TRL: / GA)."""
    token_sum = config.loss_type in TOKEN_SUM_TYPES
    return dataclasses.replace(base, num_items_in_batch=max(num_items, 1) if token_sum else None,
                               entropy_coef=entropy_coef * share if token_sum else entropy_coef)


class AdaptiveEntropy:
    """The entropy coefficient of TRL 1.16's use_adaptive_entropy (GRPOTrainer._compute_loss): the bonus applies
    the coefficient while the previous optimizer step's entropy is <= entropy_target (none before the first step);
    after each step the coefficient rises by entropy_coef_delta (entropy at or below target) or falls by it, within
    [entropy_coef_min, entropy_coef_max]. The step's entropy is the token-weighted mean over the tokens the policy
    term acts on. Static (use_adaptive_entropy off): entropy_coef always."""

    def __init__(self, config) -> None:
        self.config = config
        self.coef = config.entropy_coef
        self.last_entropy = math.inf
        self._sums = None  # [entropy sum, token count] of the current optimizer step

    def applied(self) -> float:
        if not self.config.use_adaptive_entropy:
            return self.coef
        return self.coef if self.last_entropy <= self.config.entropy_target else 0.0

    def add(self, metrics: dict, valid_tokens: torch.Tensor) -> None:
        """One micro-batch's loss metrics (with entropy) and its count of valid tokens."""
        if not self.config.use_adaptive_entropy:
            return
        count = valid_tokens * metrics.get("entropy_mask_ratio", 1.0)
        mean = metrics.get("entropy_kept", metrics["entropy"])
        sums = torch.stack([torch.as_tensor(mean * count).double(), torch.as_tensor(count).double()])
        self._sums = sums if self._sums is None else self._sums + sums

    def step(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda sums: sums) -> None:
        """At an optimizer step: move the coefficient by the step's entropy (one host sync). all_reduce_sum sums the
        [entropy, tokens] sums over the processes of a distributed run, so every rank moves the same coefficient."""
        if not self.config.use_adaptive_entropy or self._sums is None:
            return
        total, count = all_reduce_sum(self._sums).tolist()
        self._sums = None
        entropy = total / max(count, 1.0)
        cfg = self.config
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = entropy
