"""The trainer's side of the GRPO math, where a mutation audit found mutants the suite let through: the rows the loss
reads (completion tokens, aligned with what the engine sampled), the step's KL (policy to reference, k3), the step's
clip_ratio (a mean over tokens however the micro-batches split them) and the entropy bonus under gradient
accumulation (the micro-batches' gradients add up to the whole batch's). On the built-in task's tiny model, fp32.
"""
from __future__ import annotations

import pytest
import torch

from fastgrpo.loss.model import sequence_logprobs
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer

SMALL = dict(batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=5, max_steps=1, export=False,
             progress_bar=False)


def _trainer(tmp_path, **fields):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, **SMALL, "output_dir": str(tmp_path), **fields})
    return GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(32), config)


def _captured_rollout(trainer) -> list[dict]:
    """The step's rollout batch, with the policy's and the reference's log-probs of it taken before the update (a spy
    on the instance's _rollout)."""
    seen, rollout = [], trainer._rollout

    def spy(*args, **kwargs):
        batch = rollout(*args, **kwargs)
        rows = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        temperature = trainer.config.temperature
        seen.append({**batch, "policy": sequence_logprobs(trainer.model, *rows, temperature=temperature),
                     "reference": sequence_logprobs(trainer.ref_model, *rows, temperature=temperature)})
        return batch

    trainer._rollout = spy
    return seen


def test_completion_tokens_and_kl_are_the_sampled_ones(tmp_path):
    """The completion mask marks the tokens the engine sampled (its log-probs are the policy's there), and the
    step's kl is the mean over them of k3 = exp(ref - logp) - (ref - logp) - 1 of the policy to the reference."""
    trainer = _trainer(tmp_path, beta=0.1)
    with torch.no_grad():  # the policy moved off the reference (its copy at construction)
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    seen = _captured_rollout(trainer)
    metrics = trainer.train_step()
    batch = seen[0]
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 0
    # The engine's decode and the trainer's forward: the same fp32 model, other op orders; log-probs of O(5) over a
    # 40-token vocabulary round to ~1e-6. A token off by one position is off by O(1).
    gap = (batch["rollout_logps"] - batch["policy"])[mask].abs().max().item()
    assert gap <= 1e-4, f"engine vs trainer log-probs of the completion tokens differ by up to {gap:.3g}"
    logp, ref = batch["policy"][mask].double(), batch["reference"][mask].double()
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    reverse = torch.exp(logp - ref) - (logp - ref) - 1  # KL(reference || policy)'s k3: what a swapped order gives
    # The trainer's fp32 k3 of log-probs that differ from these by ~1e-6 (above): ~1e-6 absolute per token.
    tol = 1e-5
    print(f"kl logged {metrics['kl']:.6g}, k3 {k3.mean():.6g}, reversed {reverse.mean():.6g}")
    assert abs(reverse.mean().item() - k3.mean().item()) > 10 * tol  # the test tells the two orders apart
    assert metrics["kl"] == pytest.approx(k3.mean().item(), abs=tol)
