"""The PPO clip of the GRPO loss on ratios that straddle each bound (1 - epsilon_low, 1 + epsilon_low and
1 + epsilon_high when they differ, delta), with advantages > 0, = 0 (a group of equal rewards) and < 0: the loss, its
gradient and the clip metrics against TRL 1.16 GRPOTrainer._compute_loss written out in fp64.

A mutation audit found the metrics untested where the bounds differ (a ratio in (1 + epsilon_low, 1 + epsilon_high]
counted as clipped high) and at A = 0.
"""
from __future__ import annotations

import pytest
import torch

from fastgrpo import GRPOLossConfig
from fastgrpo.loss.grpo import grpo_objective, loss_metrics

f64 = torch.float64
EPS_LOW, EPS_HIGH = 0.2, 0.28
# Each bound with a ratio 0.01 on either side (rounding moves a ratio by ~1e-16): 0.8, 1.2, 1.25 (delta), 1.28.
RATIOS = [0.7, 0.79, 0.81, 1.0, 1.19, 1.21, 1.24, 1.26, 1.27, 1.29, 1.6]


def trl_terms(logps, old, adv, mask, delta, level):
    """TRL 1.16 _compute_loss (loss_type "bnpo", beta 0) and its clip metrics, one process: the loss and
    {clip_ratio_low, clip_ratio_high, clip_ratio, clip_ratio_low_min, clip_ratio_high_max}."""
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    low = ((coef_1 < 1 - EPS_LOW) & (adv < 0)).to(f64)
    high = ((coef_1 > 1 + EPS_HIGH) & (adv > 0)).to(f64)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum()

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    metrics = {
        "clip_ratio_low": global_masked_mean(low), "clip_ratio_high": global_masked_mean(high),
        "clip_ratio": global_masked_mean(torch.maximum(low, high)),  # TRL's region_mean: low | high
        "clip_ratio_low_min": masked_seq_mean(low).nan_to_num(torch.inf).min(),  # nanmin
        "clip_ratio_high_max": masked_seq_mean(high).nan_to_num(-torch.inf).max(),  # nanmax
    }
    return loss, metrics


def problem(per_token_advantages: bool):
    """Three rows holding every ratio of RATIOS, of 11, 7 and 8 valid tokens (the means over tokens and over
    sequences differ), advantages +1, 0, -1 per row or a per-token mix of the three."""
    T = len(RATIOS)
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, T, generator=g, dtype=f64) - 1.0
    old = logps - torch.tensor(RATIOS, dtype=f64).log()
    mask = torch.ones(3, T, dtype=f64)
    mask[1, [0, 3, 6, 9]] = 0
    mask[2, [2, 5, 8]] = 0
    if per_token_advantages:
        adv = torch.tensor([[[1.0, 0.0, -1.0][(i + j) % 3] for j in range(T)] for i in range(3)], dtype=f64)
    else:
        adv = torch.tensor([[1.0], [0.0], [-1.0]], dtype=f64)
    return logps, old, adv, mask


@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("delta", [None, 1.25])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_loss_gradient_and_metrics_match_trl(level, delta, per_token_advantages):
    logps, old, adv, mask = problem(per_token_advantages)
    cfg = GRPOLossConfig(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, delta=delta, loss_type="bnpo",
                         importance_sampling_level=level)
    ours_leaf, trl_leaf = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    objective = grpo_objective(ours_leaf, mask, adv, old, None, cfg)
    metrics = loss_metrics(mask, objective)
    want_loss, want_metrics = trl_terms(trl_leaf, old, adv, mask, delta, level)
    (grad,), (want_grad,) = torch.autograd.grad(objective.loss, ours_leaf), torch.autograd.grad(want_loss, trl_leaf)
    # fp64, O(1) terms, the same operations in another order: a few ulps. The metrics are counts over counts.
    loss, want_loss = float(objective.loss.detach()), float(want_loss.detach())
    assert abs(loss - want_loss) <= 1e-13, (loss, want_loss)
    assert torch.allclose(grad * mask, want_grad * mask, rtol=0, atol=1e-14), (grad * mask, want_grad * mask)
    got = {key: float(metrics[key]) for key in want_metrics}
    want = {key: float(value) for key, value in want_metrics.items()}
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (got, want)


def test_a_row_without_valid_tokens_is_left_out_of_the_per_sequence_extremes():
    """clip_ratio_low_min / clip_ratio_high_max are over the sequences with valid tokens (TRL's nanmin / nanmax of
    per-sequence means, NaN for a row of none: a truncated completion under mask_truncated_completions). Counting
    such a row as 0 made low_min 0 whatever the other rows, and passed the suite (high_max, over shares >= 0, keeps).
    Advantages -1 on every row, so that every row with tokens has a share clipped low above 0."""
    logps, old, _, mask = problem(False)
    logps, old = torch.cat([logps, logps[:1]]), torch.cat([old, old[:1]])
    mask = torch.cat([mask, torch.zeros_like(mask[:1])])  # a fourth row: no valid token
    adv = -torch.ones(4, 1, dtype=f64)
    cfg = GRPOLossConfig(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="bnpo")
    metrics = loss_metrics(mask, grpo_objective(logps, mask, adv, old, None, cfg))
    want = trl_terms(logps, old, adv, mask, None, "token")[1]
    assert want["clip_ratio_low_min"] > 0
    assert float(metrics["clip_ratio_low_min"]) == pytest.approx(float(want["clip_ratio_low_min"]), rel=1e-12)
