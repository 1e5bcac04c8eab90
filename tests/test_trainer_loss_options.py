"""fastgrpo train with TRL's loss options: each new loss type learns the built-in task on the CPU, and the trainer-side
options (mask_truncated_completions, multi_objective_aggregation, the adaptive entropy coefficient) do what TRL's do."""
from __future__ import annotations

import math

import pytest
import torch

from fastgrpo.loss.grpo import reward_advantages
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loss_setup import AdaptiveEntropy
from fastgrpo.train.trainer import GRPOTrainer


def _trainer(tmp_path, rewards=default_task.repeat_letter_reward, rows=512, **fields):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, "output_dir": str(tmp_path), "export": False,
                           "progress_bar": False, "logging_steps": 0, "save_steps": 0, **fields})
    return GRPOTrainer(model, tokenizer, rewards, default_task.build_dataset(rows), config)


@pytest.mark.parametrize("loss_type, fields", [
    ("cispo", dict(epsilon_high=5.0)),  # ScaleRL's cap (TRL's doc): epsilon_high is cispo's absolute cap
    ("sapo", {}),
    ("luspo", dict(importance_sampling_level="sequence")),  # the paper's setup, as TRL warns otherwise
    ("vespo", {}),
])
def test_new_loss_type_learns_the_default_task(tmp_path, loss_type, fields):
    # The default run shortened to 12 steps, two epochs per rollout so that the second is off-policy (ratio != 1,
    # where the loss types differ): the reward goes ~0.03 -> ~0.15 (a random model scores ~1/40).
    history = _trainer(tmp_path, loss_type=loss_type, max_steps=12, num_iterations=2, **fields).train()
    rewards = [m["reward"] for m in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > 2.5 * first and last > first + 0.05, rewards
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in history)


def test_mask_truncated_completions_removes_them_from_the_loss(tmp_path):
    # A random model almost never stops within 5 tokens: every completion is truncated, so nothing is trained.
    def distinct(prompts, completions, **kwargs):  # varies within a group: non-zero advantages
        return [float(len(set(c))) for c in completions]

    common = dict(rewards=distinct, batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=5,
                  max_steps=1)
    plain = _trainer(tmp_path / "plain", **common).train_step()
    masked = _trainer(tmp_path / "masked", mask_truncated_completions=True, **common).train_step()
    assert plain["truncated_frac"] == masked["truncated_frac"] == 1.0
    assert plain["grad_norm"] > 0 and masked["grad_norm"] == 0.0 and masked["loss"] == 0.0
    assert masked["completion_length"] == plain["completion_length"]  # still counted where TRL counts them


def test_normalize_then_sum_standardizes_each_reward_in_its_group():
    per_func = torch.tensor([[1.0, 10.0], [0.0, 30.0], [0.5, 20.0], [0.5, 20.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    got = reward_advantages(per_func, weights, 2, "group", 1e-4, "normalize_then_sum")
    g = per_func.view(2, 2, 2)
    z = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(4, 2)
    summed = z @ weights
    assert torch.allclose(got, (summed - summed.mean()) / (summed.std() + 1e-4), rtol=1e-12)
    # the second group's equal rewards give 0 there, however large: each function weighs by its weight, not scale
    assert got[2] == got[3]
    # sum_then_normalize (the default): the weighted sum [21, 60 | 40.5, 40.5], then standardized in its group
    sum_first = reward_advantages(per_func, weights, 2, "group", 1e-4)
    std = 39.0 / 2**0.5  # of [21, 60], Bessel-corrected
    assert torch.allclose(sum_first, torch.tensor([-19.5, 19.5, 0.0, 0.0], dtype=torch.float64) / (std + 1e-4),
                          rtol=1e-12)


def test_adaptive_entropy_follows_trl_rule():
    config = GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_delta=0.005, entropy_target=0.5,
                        entropy_coef_max=0.02)
    control = AdaptiveEntropy(config)
    assert control.applied() == 0.0  # no step yet: TRL's last entropy starts at +inf
    for entropy, coef, applied in ((0.4, 0.015, 0.015), (0.3, 0.02, 0.02), (0.9, 0.015, 0.0)):
        # two micro-batches of 10 and 30 tokens: the step's entropy is their token-weighted mean
        control.add({"entropy": torch.tensor(entropy + 0.3)}, torch.tensor(10))
        control.add({"entropy": torch.tensor(entropy - 0.1)}, torch.tensor(30))
        control.step()
        assert control.coef == pytest.approx(coef) and control.applied() == pytest.approx(applied)
    static = AdaptiveEntropy(GRPOConfig(entropy_coef=0.01))
    static.add({"entropy": torch.tensor(9.0)}, torch.tensor(4))
    static.step()
    assert static.applied() == 0.01


def test_whole_sequence_options_run_in_the_loop(tmp_path):
    def shorter(prompts, completions, **kwargs):
        return [1.0 / (1 + len(c)) for c in completions]

    history = _trainer(tmp_path, rewards=[default_task.repeat_letter_reward, shorter], rows=32, batch_size=8,
                       num_generations=4, micro_batch_size=4, max_completion_length=5, max_steps=2, num_iterations=2,
                       reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum",
                       top_entropy_quantile=0.5, off_policy_mask_threshold=0.0, entropy_coef=0.01,
                       use_adaptive_entropy=True, entropy_target=10.0, use_bias_correction_kl=True, beta=0.04,
                       loss_type="grpo").train()
    assert [m["entropy_coef"] for m in history] == pytest.approx([0.01 + 0.005 * 2, 0.01 + 0.005 * 4])
    assert all(math.isfinite(m[k]) for m in history for k in ("loss", "grad_norm", "entropy", "kl"))


def test_every_option_is_a_flag_of_fastgrpo_train():
    from fastgrpo.train.cli import build_parser
    from fastgrpo.train.commands import config_from_args

    argv = ["train", "--loss-type", "sapo", "--sapo-temperature-neg", "2", "--top-entropy-quantile", "0.2",
            "--off-policy-mask-threshold", "0.1", "--use-bias-correction-kl", "--entropy-coef", "0.01",
            "--use-adaptive-entropy", "--mask-truncated-completions", "--multi-objective-aggregation",
            "normalize_then_sum", "--rollout-correction", "truncate", "--rollout-correction-level", "token",
            "--rollout-correction-clip-max", "none", "--rollout-correction-clip-min", "0.5"]
    config = config_from_args("train", build_parser().parse_args(argv))
    assert (config.loss_type, config.sapo_temperature_neg, config.top_entropy_quantile) == ("sapo", 2.0, 0.2)
    assert config.use_bias_correction_kl and config.use_adaptive_entropy and config.mask_truncated_completions
    assert (config.rollout_correction, config.rollout_correction_clip_max, config.rollout_correction_clip_min) == (
        "truncate", None, 0.5)
    with pytest.raises(ValueError, match="^top_entropy_quantile: expected a float in"):
        config_from_args("train", build_parser().parse_args(["train", "--top-entropy-quantile", "0"]))
