"""GRPOLossConfig: one home for the loss options, validated once; config= and keyword options are one API."""
import dataclasses
import math

import pytest
import torch

import fastgrpo
from fastgrpo import GRPOLossConfig
from fastgrpo.loss import reference
from fastgrpo.loss.fused import fused_linear_grpo_loss

BAD = [
    ("beta", -0.1), ("beta", math.inf), ("epsilon_low", -0.01), ("epsilon_low", 1.0), ("epsilon_high", -0.5),
    ("delta", 0.5), ("loss_type", "mean"), ("importance_sampling_level", "batch"), ("temperature", 0.0),
    ("max_completion_length", 0), ("max_completion_length", 2.5), ("num_items_in_batch", 0),
    ("num_items_in_batch", -3.0), ("num_items_in_batch", torch.tensor(0.0)), ("softcap", 0.0), ("softcap", True),
    ("loss_type", "gspo"), ("sapo_temperature_pos", 0.0), ("sapo_temperature_neg", -1.0), ("vespo_k_pos", -0.5),
    ("vespo_lambda_pos", math.inf), ("vespo_k_neg", math.nan), ("vespo_lambda_neg", "2"), ("top_entropy_quantile", 0.0),
    ("top_entropy_quantile", 1.5), ("off_policy_mask_threshold", math.inf), ("use_bias_correction_kl", 1),
    ("entropy_coef", math.nan),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_every_bad_value_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        GRPOLossConfig(**{field: value})


def test_dr_grpo_needs_max_completion_length_and_unknown_options_are_named():
    with pytest.raises(ValueError, match="max_completion_length: required for loss_type='dr_grpo'"):
        GRPOLossConfig(loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"unknown loss option \['epsilon'\]"):
        fused_linear_grpo_loss(*_inputs(), epsilon=0.2)


def test_the_config_is_frozen_and_public():
    cfg = GRPOLossConfig(beta=0.04)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 0.1
    assert "GRPOLossConfig" in fastgrpo.__all__


def _inputs(seed=0, B=2, T=5, H=8, V=17):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    return hidden, weight, ids, mask, torch.randn(B, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("loss", [fused_linear_grpo_loss, reference.grpo_loss])
def test_config_and_keyword_options_give_the_same_loss_and_metrics(loss):
    hidden, weight, ids, mask, adv = _inputs()
    old = torch.randn(ids.shape, dtype=torch.float64) * 0.1 - 2.0
    options = dict(beta=0.0, epsilon_low=0.1, epsilon_high=0.3, loss_type="dapo", temperature=0.7, softcap=3.0)
    by_keywords = loss(hidden, weight, ids, mask, adv, old_logps=old, **options)
    by_config = loss(hidden, weight, ids, mask, adv, old_logps=old, config=GRPOLossConfig(**options))
    on_top = loss(hidden, weight, ids, mask, adv, old_logps=old, config=GRPOLossConfig(temperature=0.7, softcap=3.0),
                  epsilon_low=0.1, epsilon_high=0.3, loss_type="dapo")
    for other in (by_config, on_top):
        assert torch.equal(other[0], by_keywords[0])
        assert other[1].keys() == by_keywords[1].keys() == {
            "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_low_min", "clip_ratio_high_max"}
        for key in other[1]:
            assert torch.equal(other[1][key], by_keywords[1][key])
    with pytest.raises(ValueError, match="config: expected a fastgrpo.GRPOLossConfig or None, got dict"):
        loss(hidden, weight, ids, mask, adv, config=options)


def test_masks_outside_zero_one_are_refused():
    hidden, weight, ids, mask, adv = _inputs()
    with pytest.raises(ValueError, match=r"completion_mask: expected a bool mask or 0/1 values"):
        fused_linear_grpo_loss(hidden, weight, ids, mask * 2, adv)
