"""GRPOTrainer's step logic outside the loss, where a mutation audit found mutants the suite let through: AdamW built
from every optimizer setting of the config, each step sampling with a seed of its own, clipping by the global norm, a
reference model that stays the initial policy, and a step's loss and grad_norm as means over its optimizer updates. On
the built-in task's tiny model, fp32.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.optim import adamw_with_schedule, lr_factor
from fastgrpo.train.rollout_setup import rollout_batch
from fastgrpo.train.trainer import GRPOTrainer

SMALL = dict(batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=5, max_steps=1, export=False,
             progress_bar=False)
# Settings away from their defaults (weight_decay 0, adam_epsilon 1e-8 ...), so that one the optimizer ignored shows
ADAMW = dict(learning_rate=3e-2, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-3, weight_decay=0.25,
             warmup_steps=2, lr_scheduler="linear", seed=0)


def _trainer(tmp_path, dataset=None, **fields):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, **SMALL, "output_dir": str(tmp_path), **fields})
    dataset = default_task.build_dataset(32) if dataset is None else dataset
    return GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, dataset, config)


def test_adamw_takes_every_optimizer_setting_of_the_config():
    """adamw_with_schedule against torch.optim.AdamW built by hand from the same settings and stepped with the same
    LambdaLR factors: three updates of an fp32 model. Both are torch's fp32 AdamW (foreach, and single-tensor): the
    same operations, so a few ulps apart at most (rtol 1e-6 is ~8 ulps); an ignored setting (eps, weight decay, a
    beta) moves the weights by 1e-4 to 1e-2 of their size after one update."""
    config = SimpleNamespace(**ADAMW)
    torch.manual_seed(0)
    ours = torch.nn.Linear(5, 3)
    theirs = torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    optimizer, scheduler = adamw_with_schedule(ours, config, torch.device("cpu"), total_updates=6)
    reference = torch.optim.AdamW(theirs.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.25,
                                  foreach=False)
    for update in range(3):
        for group in reference.param_groups:
            group["lr"] = 3e-2 * lr_factor(update, total=6, warmup=2, kind="linear")
        x = torch.randn(4, 5)
        for model, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        scheduler.step()
        for got, want in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"update {update}: {m}")


def test_bf16_adamw_takes_every_optimizer_setting_of_the_config():
    optimizer, _ = adamw_with_schedule(torch.nn.Linear(5, 3).to(torch.bfloat16), SimpleNamespace(**ADAMW),
                                       torch.device("cpu"), total_updates=6)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-3, 0.25)
    assert group["lr"] == pytest.approx(3e-2 * lr_factor(0, total=6, warmup=2, kind="linear"), rel=1e-12)


def test_each_step_samples_with_a_seed_of_its_own(tmp_path):
    """Every row the same prompt: a step's samples are a function of the step (the same step twice: the same
    completions), and the next step's differ (one seed for every step draws the same noise at each position)."""
    row = default_task.build_dataset(1)[0]
    trainer = _trainer(tmp_path, dataset=[dict(row) for _ in range(8)])
    prompts, keys = [trainer.prompts[0]] * 2, [0, 1]
    texts = []
    for step in (0, 0, 1):
        trainer.step = step
        texts.append(rollout_batch(trainer, prompts, keys)["texts"])
    assert texts[0] == texts[1]
    assert texts[2] != texts[0], texts


def _grad_norm(model) -> float:
    return torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]),
                                    dtype=torch.float64).item()


def test_clipping_scales_the_whole_gradient_to_max_grad_norm(tmp_path):
    """max_grad_norm clips by the global norm (clip_grad_norm_, TRL's / HF Trainer's): the gradient the optimizer
    stepped with (left in .grad) has norm max_grad_norm * norm / (norm + 1e-6), and the logged grad_norm is the norm
    before clipping. Clipping each value instead, or not at all, leaves another norm."""
    max_norm = 1e-4
    trainer = _trainer(tmp_path, max_grad_norm=max_norm, loss_type="grpo")
    metrics = trainer.train_step()
    assert metrics["grad_norm"] > 100 * max_norm  # clipping is active
    assert _grad_norm(trainer.model) == pytest.approx(max_norm * metrics["grad_norm"] / (metrics["grad_norm"] + 1e-6),
                                                      rel=1e-5)


def test_the_reference_model_stays_the_initial_policy(tmp_path):
    """Full fine-tuning with beta > 0 keeps a frozen copy of the initial policy as the reference: after two steps
    its weights are the initial ones bit for bit while the policy's moved, and the second step's KL is above 0."""
    trainer = _trainer(tmp_path, beta=0.1, learning_rate=1e-2, max_steps=2)
    initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    trainer.train_step()
    second = trainer.train_step()
    for name, value in trainer.ref_model.state_dict().items():
        assert torch.equal(value, initial[name]), f"the reference's {name} moved"
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert any(not torch.equal(value, initial[name]) for name, value in trainer.model.state_dict().items())
    assert second["kl"] > 0


def test_a_step_s_loss_and_grad_norm_are_means_over_its_updates(tmp_path, monkeypatch):
    """num_iterations 2 x num_minibatches 2 = 4 optimizer updates of 2 micro-batches each: the step's loss is the
    mean over the updates of each minibatch's loss (grpo: its micro-batches' row means weighted by their 2 of 4
    rows), its grad_norm the mean of the 4 pre-clip norms (a spy on each); a sum over the updates, or the last
    update's alone, is something else. Each iteration takes the minibatches of a shuffle of its own, and each
    micro-batch's rows carry their own advantages (spies on the rollout and on the advantages the step computed)."""
    from fastgrpo.train import grpo_update
    from fastgrpo.train import trainer as trainer_module

    trainer = _trainer(tmp_path, loss_type="grpo", num_iterations=2, num_minibatches=2, micro_batch_size=2)
    losses, norms, rows, batches, advantage_of = [], [], [], [], {}
    loss_fn, finish = grpo_update.grpo_loss, trainer.dist.finish_gradients
    rollout, advantages_fn = trainer_module.rollout_batch, trainer_module.reward_advantages

    def rollout_spy(*args, **kwargs):
        batches.append(rollout(*args, **kwargs))
        return batches[-1]

    def advantages_spy(*args, **kwargs):  # a row sampled twice in its group has its twin's reward and advantage
        advantages = advantages_fn(*args, **kwargs)
        advantage_of.update(zip(map(tuple, batches[-1]["input_ids"].tolist()), advantages.float().tolist()))
        return advantages

    def loss_spy(model, input_ids, attention_mask, completion_mask, advantages, *args, **kwargs):
        loss, metrics = loss_fn(model, input_ids, attention_mask, completion_mask, advantages, *args, **kwargs)
        losses.append(loss.item())
        rows.append(sorted(map(tuple, input_ids.tolist())))
        assert [advantage_of[row] for row in map(tuple, input_ids.tolist())] == advantages.tolist()
        return loss, metrics

    def finish_spy(params, max_norm):
        norm = finish(params, max_norm)
        norms.append(norm.item())
        return norm

    monkeypatch.setattr(grpo_update, "grpo_loss", loss_spy)
    monkeypatch.setattr(trainer_module, "rollout_batch", rollout_spy)
    monkeypatch.setattr(trainer_module, "reward_advantages", advantages_spy)
    monkeypatch.setattr(trainer.dist, "finish_gradients", finish_spy)
    metrics = trainer.train_step()
    assert len(losses) == 8 and len(norms) == 4 and len(set(advantage_of.values())) > 1
    per_update = [(losses[2 * u] + losses[2 * u + 1]) / 2 for u in range(4)]
    assert metrics["loss"] == pytest.approx(sum(per_update) / 4, rel=1e-6, abs=1e-9)
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-6)
    minibatches = [sorted(rows[2 * u] + rows[2 * u + 1]) for u in range(4)]
    assert minibatches[:2] != minibatches[2:]  # the second iteration's minibatches are not the first's
