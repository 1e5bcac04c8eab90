"""The rollout importance-sampling correction (TRL's vllm_importance_sampling_correction, for any engine's log-probs):
the weights and metrics against hand math in fp64, the weights through the fused loss against the reference in fp64,
and the trainer computing them from its old log-probs and the engine's, with the mismatch in its metrics."""
from __future__ import annotations

import math

import pytest
import torch

from fastgrpo.loss import reference
from fastgrpo.loss.correction import rollout_correction
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.rollout import BuiltinEngine
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer

f64 = torch.float64
# Two sequences; row 1's last position is padding (its huge difference must not count).
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=f64)
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, 5.0]], dtype=f64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize("mode, level, clip_min, clip_max, expected", [
    # token diffs: row 0 [0.5, -1.0, 0.0], row 1 [0.0, -1.0, (pad)]
    ("truncate", "token", None, 1.5, [[1.5, math.exp(-1), 1.0], [1.0, math.exp(-1), 1.0]]),
    ("truncate", "token", 0.5, 1.5, [[1.5, 0.5, 1.0], [1.0, 0.5, 0.5]]),
    ("mask", "token", 0.5, 1.5, [[0.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
    # sequence sums: row 0 -0.5, row 1 -1.0
    ("truncate", "sequence", None, 3.0, [[math.exp(-0.5)] * 3, [math.exp(-1.0)] * 3]),
    ("mask", "sequence", 0.5, None, [[math.exp(-0.5)] * 3, [0.0] * 3]),
    ("mask", "sequence", None, None, [[math.exp(-0.5)] * 3, [math.exp(-1.0)] * 3]),
])
def test_weights_match_hand_math(mode, level, clip_min, clip_max, expected):
    weights, metrics = rollout_correction(TRAIN, ROLLOUT, MASK, mode, level, clip_min, clip_max)
    expected = torch.tensor(expected, dtype=f64)
    valid = MASK.bool() if level == "token" else torch.ones_like(MASK, dtype=torch.bool)
    assert torch.allclose(weights[valid], expected[valid], rtol=1e-12), weights
    assert metrics["rollout_logp_diff"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.0 + 1.0) / 5, rel=1e-12)
    assert metrics["rollout_logp_diff_max"] == pytest.approx(1.0, rel=1e-12)
    counted = expected[valid] if level == "token" else expected[:, 0]
    assert metrics["rollout_is_weight_mean"] == pytest.approx(counted.mean().item(), rel=1e-12)
    raw = torch.exp((TRAIN - ROLLOUT).masked_fill(~MASK.bool(), 0.0))
    raw = raw[valid] if level == "token" else raw.prod(-1)
    share = (counted != raw).double().mean().item()
    assert metrics["rollout_truncated_frac" if mode == "truncate" else "rollout_masked_frac"] == pytest.approx(share)


def test_nan_rollout_logps_count_zero_and_bad_options_name_the_field():
    rollout = ROLLOUT.clone()
    rollout[0, 0] = float("nan")  # a token the engine could not score: ratio 1 there, left out of the diff mean
    weights, metrics = rollout_correction(TRAIN, rollout, MASK, "truncate", "token", None, 3.0)
    assert weights[0, 0] == 1.0 and metrics["rollout_logp_diff"] == pytest.approx(2.0 / 4)
    with pytest.raises(ValueError, match="rollout_correction_clip_min: expected < rollout_correction_clip_max"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "mask", "token", 3.0, 2.0)
    with pytest.raises(ValueError, match="rollout_correction_clip_max: truncate needs a bound"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "truncate", "token", None, None)
    with pytest.raises(ValueError, match="rollout_correction_level: expected one of"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "mask", "batch")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_through_the_fused_loss_match_the_reference(loss_type, level):
    """The correction as the fused loss's token_weights, against the eager reference, fp64; a masked sequence
    sends no gradient to its hidden states (except through the KL, off here)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 5, 8, 37
    hidden = torch.randn(B, T, H, generator=g, dtype=f64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=f64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    with torch.no_grad():
        old = reference.linear_logprobs(hidden, weight, targets)
    rollout = old + torch.randn(B, T, generator=g, dtype=f64) * 0.3
    rollout[1] = old[1] - 2.0  # sequence 1 is far off: masked at both levels
    token_weights, _ = rollout_correction(old, rollout, mask, "mask", level, 0.2, 3.0)
    advantages = torch.tensor([1.0, -1.0, 0.5], dtype=f64)
    kwargs = dict(old_logps=old + 0.1, token_weights=token_weights, loss_type=loss_type, num_items_in_batch=11.0)
    want, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    got, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="torch", **kwargs)
    assert abs(float(got) - float(want)) <= 1e-12 * max(1.0, abs(float(want))), (float(got), float(want))
    grads, want_grads = (torch.autograd.grad(x, (hidden, weight)) for x in (got, want))
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    if loss_type != "vespo":  # vespo folds the weights into phi instead (log 0 clamps to log 1e-8: ~0 gradient)
        assert float(grads[0][1].abs().max()) == 0.0


class OffsetEngine(BuiltinEngine):
    """The built-in engine whose reported log-probs are shifted by `offset` on the first completion of each group:
    a stand-in for an engine whose numerics differ from the trainer's."""

    offset = -0.7

    def generate(self, prompts, **kwargs):
        out = super().generate(prompts, **kwargs)
        out.logprobs[:: kwargs["num_generations"]] += self.offset * out.completion_mask[:: kwargs["num_generations"]]
        return out


def test_trainer_weights_the_loss_and_reports_the_mismatch(tmp_path):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 5, "max_steps": 1, "export": False, "progress_bar": False,
                           "output_dir": str(tmp_path), "rollout_correction": "mask",
                           "rollout_correction_level": "token", "rollout_correction_clip_max": 1.5})
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          config, engine=OffsetEngine(model, tokenizer))
    metrics = trainer.train_step()
    # 2 of 8 completions carry every token off by 0.7: exp(0.7) = 2.01 > 1.5 masks them; the rest match to fp32.
    assert 0.0 < metrics["rollout_masked_frac"] <= 0.5 and metrics["rollout_is_weight_min"] == 0.0
    assert metrics["rollout_logp_diff_max"] == pytest.approx(0.7, abs=1e-4)
    assert metrics["rollout_logp_diff"] == pytest.approx(0.7 * metrics["rollout_masked_frac"], abs=1e-4)
    assert math.isfinite(metrics["loss"])
