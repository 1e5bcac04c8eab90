"""The trainer's step options, found by the step-logic mutation audit: the adaptive entropy coefficient's step entropy
with top_entropy_quantile (TRL's window-global mean over the tokens the policy term acts on), and the flags that
switch the truncated-completion mask and the length regrouping."""
import pytest
import torch

from fastgrpo.loss.config import GRPOLossConfig
from fastgrpo.loss.grpo import grpo_objective, loss_metrics
from fastgrpo.loss.model import grpo_loss
from fastgrpo.train import default_task, grpo_update
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loss_setup import AdaptiveEntropy, loss_config, micro_batch_scale, minibatch_config
from fastgrpo.train.trainer import GRPOTrainer


def _micro_batch(rows: int, lengths: list[int], seed: int):
    """A micro-batch of `rows` completions of the given lengths in T = 6 positions (padding after), with random
    log-probs, entropies (distinct: no ties at the quantile) and advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, 6, dtype=torch.float64)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    logps = -torch.rand(rows, 6, generator=g, dtype=torch.float64)
    entropy = torch.rand(rows, 6, generator=g, dtype=torch.float64) * 3
    return logps, mask, torch.randn(rows, generator=g, dtype=torch.float64), entropy


def test_adaptive_entropy_steps_on_the_window_mean_of_the_tokens_the_policy_term_acts_on():
    """TRL 1.16 _compute_loss: the controller's entropy is sum(entropies * effective_mask) / sum(effective_mask)
    over the accumulation window, effective_mask = mask * the micro-batch's high-entropy mask. Two micro-batches
    of unequal token counts with padding: the mean over all valid tokens, a kept share over the padded positions,
    or a count of all valid tokens each give another entropy, which the coefficient then follows."""
    quantile = 0.5
    cfg = GRPOLossConfig(top_entropy_quantile=quantile, entropy_coef=0.01)
    control = AdaptiveEntropy(GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True, top_entropy_quantile=quantile))
    total = count = 0.0
    for rows, lengths, seed in ((2, [6, 1], 0), (3, [2, 5, 3], 1)):
        logps, mask, advantages, entropy = _micro_batch(rows, lengths, seed)
        objective = grpo_objective(logps, mask, advantages, None, None, cfg, entropy=entropy)
        control.add(loss_metrics(mask, objective, entropy), mask.sum())
        # TRL's get_high_entropy_mask (one process): the valid tokens at or above the (1 - q) quantile
        threshold = torch.quantile(entropy[mask.bool()], 1 - quantile)
        effective = mask * (entropy >= threshold)
        total, count = total + float((entropy * effective).sum()), count + float(effective.sum())
    control.step()
    assert control.last_entropy == pytest.approx(total / count, rel=1e-12), (control.last_entropy, total / count)


def test_the_adaptive_bonus_applies_at_an_entropy_equal_to_the_target():
    """TRL 1.16: apply_coef = entropy_coef if _last_world_entropy <= entropy_target else 0."""
    control = AdaptiveEntropy(GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5))
    control.last_entropy = 0.5  # as the previous step measured it (or a resume restored it)
    assert control.applied() == 0.01
    control.last_entropy = 0.5000001
    assert control.applied() == 0.0


def test_the_adaptive_coefficient_stays_within_its_bounds():
    """TRL 1.16: min(coef + delta, entropy_coef_max) at or below the target, max(coef - delta, entropy_coef_min)
    above it."""
    control = AdaptiveEntropy(GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=1.0,
                                         entropy_coef_delta=0.008, entropy_coef_min=0.004, entropy_coef_max=0.015))
    coefs = []
    for entropy in (0.5, 2.0, 2.0):
        control.add({"entropy": torch.tensor(entropy)}, torch.tensor(8))
        control.step()
        coefs.append(control.coef)
    assert coefs == pytest.approx([0.015, 0.007, 0.004])


def _trainer(tmp_path, reward=default_task.repeat_letter_reward, rows=None, **fields):
    tokenizer = default_task.build_tokenizer()
    config = GRPOConfig(**{**default_task.PRESET, "output_dir": str(tmp_path), "export": False, "progress_bar": False,
                           "logging_steps": 0, "save_steps": 0, "batch_size": 8, "num_generations": 4,
                           "micro_batch_size": 8, "max_completion_length": 4, "max_steps": 1,
                           "gradient_checkpointing": False, **fields})
    rows = rows or default_task.build_dataset(16)
    return GRPOTrainer(default_task.build_model(tokenizer), tokenizer, reward, rows, config)


def test_each_optimizer_step_applies_the_coefficient_the_previous_one_left(tmp_path, monkeypatch):
    """TRL 1.16 applies "the coefficient and gating from the end of the previous optimizer step": with two updates
    in a step, the first has no previous entropy (none applied), the second the coefficient its step raised."""
    applied = []

    def spy(*args, config, **kwargs):
        applied.append(config.entropy_coef)
        return grpo_loss(*args, config=config, **kwargs)

    monkeypatch.setattr(grpo_update, "grpo_loss", spy)
    trainer = _trainer(tmp_path, num_iterations=2, entropy_coef=0.01, use_adaptive_entropy=True,
                       entropy_target=100.0, entropy_coef_delta=0.005)
    metrics = trainer.train_step()
    assert applied == pytest.approx([0.0, 0.015]) and metrics["entropy_coef"] == pytest.approx(0.02)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_entropy_bonus_is_the_mean_of_the_micro_batches_bonuses(loss_type):
    """TRL 1.16 _compute_loss: each micro-batch subtracts coef x its mean entropy / gradient_accumulation_steps,
    whatever the loss type. The trainer's micro-batch losses (minibatch_config, scaled by micro_batch_scale) with the
    bonus on minus without it: -coef x the mean over micro-batches of their mean entropies."""
    coef, micro_batches = 0.3, [_micro_batch(2, [6, 1], 0), _micro_batch(2, [2, 5], 1), _micro_batch(2, [4, 3], 2)]
    config = GRPOConfig(loss_type=loss_type, entropy_coef=coef, max_completion_length=6)
    rows = 2 * len(micro_batches)
    num_items = int(sum(mask.sum() for _, mask, _, _ in micro_batches))

    def update_loss(applied: float) -> float:
        total = 0.0
        for logps, mask, advantages, entropy in micro_batches:
            cfg = minibatch_config(config, loss_config(config, 0.0), num_items, 2 / rows, applied)
            loss = grpo_objective(logps, mask, advantages, None, None, cfg, entropy=entropy).loss
            total += float(loss) * micro_batch_scale(loss_type, 2, rows, 1)
        return total

    means = [float((entropy * mask).sum() / mask.sum()) for _, mask, _, entropy in micro_batches]
    bonus = update_loss(coef) - update_loss(0.0)
    assert bonus == pytest.approx(-coef * sum(means) / len(means), rel=1e-12), (bonus, means)


def _minibatches(tmp_path, monkeypatch, loss_type: str) -> list[frozenset]:
    """The rows (as token tuples) of each optimizer step of one train_step with two minibatches."""
    calls = []

    def spy(model, input_ids, *args, **kwargs):
        calls.append({tuple(row) for row in input_ids.tolist()})
        return grpo_loss(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(grpo_update, "grpo_loss", spy)
    rows = [{"prompt": "1 say a", "letter": "a"}, {"prompt": "1234567 say b", "letter": "b"}]  # two prompt lengths
    _trainer(tmp_path / loss_type, rows=rows, loss_type=loss_type, num_minibatches=2, micro_batch_size=4,
             max_completion_length=2).train_step()
    return [frozenset(batch) for batch in calls]  # a micro-batch is a minibatch


def test_grouping_rows_by_length_leaves_each_minibatch_its_shuffled_rows(tmp_path, monkeypatch):
    """The update may order a minibatch's rows by length (grpo) or not (bnpo: rows_may_regroup), but each optimizer
    step takes the same seeded random share of the batch either way (TRL shuffles the batch, then splits it); sorted
    before the split, the first minibatch took the shortest rows (here: the short prompt's four samples)."""
    grouped, kept_in_order = (_minibatches(tmp_path, monkeypatch, t) for t in ("grpo", "bnpo"))
    assert len(grouped) == 2 and grouped == kept_in_order


def test_without_the_flag_truncated_completions_stay_in_the_loss(tmp_path):
    """mask_truncated_completions off (TRL's default), with a KL term: every completion cut at max_completion_length
    (a random model does not stop within 4 tokens) is still trained on."""
    def distinct(prompts, completions, **kwargs):  # varies within a group: non-zero advantages
        return [float(len(set(c))) for c in completions]

    metrics = _trainer(tmp_path, distinct, beta=0.04).train_step()
    assert metrics["truncated_frac"] == 1.0 and metrics["grad_norm"] > 0
