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


def _captured_rollout(trainer, monkeypatch) -> list[dict]:
    """The step's rollout batch, with the policy's and the reference's log-probs of it taken before the update (a spy
    on the rollout_batch the trainer calls)."""
    from fastgrpo.train import trainer as trainer_module

    seen, rollout = [], trainer_module.rollout_batch

    def spy(*args, **kwargs):
        batch = rollout(*args, **kwargs)
        rows = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        temperature = trainer.config.temperature
        seen.append({**batch, "policy": sequence_logprobs(trainer.model, *rows, temperature=temperature),
                     "reference": sequence_logprobs(trainer.ref_model, *rows, temperature=temperature)})
        return batch

    monkeypatch.setattr(trainer_module, "rollout_batch", spy)
    return seen


def test_completion_tokens_and_kl_are_the_sampled_ones(tmp_path, monkeypatch):
    """The completion mask marks the tokens the engine sampled (its log-probs are the policy's there), and the
    step's kl is the mean over them of k3 = exp(ref - logp) - (ref - logp) - 1 of the policy to the reference."""
    trainer = _trainer(tmp_path, beta=0.1)
    with torch.no_grad():  # the policy moved off the reference (its copy at construction)
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    seen = _captured_rollout(trainer, monkeypatch)
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


def test_step_clip_ratio_is_the_token_mean_whatever_the_micro_batches(tmp_path):
    """The step's clip_ratio is the share of all its tokens on the clipped branch: micro-batches of few tokens weigh
    by their tokens (as the step's entropy does). The second epoch (num_iterations=2) runs off-policy, where a narrow
    epsilon clips; stop strings make the completions' lengths, and so the micro-batches' token counts, differ."""
    runs = [_trainer(tmp_path / str(micro), batch_size=16, micro_batch_size=micro, max_completion_length=8,
                     stop=["a", "e"], num_iterations=2, epsilon_low=0.01).train_step() for micro in (16, 2)]
    whole, split = runs
    assert whole["completion_length"] == split["completion_length"] < 8
    assert whole["clip_ratio"] > 0.05
    # The same ratios either way up to fp32 rounding of the accumulated gradient (a flag flips only for a ratio within
    # ~1e-6 of a bound); a micro-batch mean moves the value by the spread of the micro-batches' shares.
    assert split["clip_ratio"] == pytest.approx(whole["clip_ratio"], rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus_accumulates_like_one_batch(tmp_path, loss_type):
    """With the entropy bonus on, four micro-batches of 2 rows give the gradient of one of 8: every completion has
    max_completion_length tokens here, so the per-micro-batch means weighted by their shares (TRL's / GA) are the
    whole batch's mean, for the token-sum types (dapo: the bonus weighted by the share) as for the others."""
    grads = []
    for micro in (8, 2):
        trainer = _trainer(tmp_path / str(micro), micro_batch_size=micro, loss_type=loss_type, entropy_coef=0.5,
                           max_grad_norm=1e9)
        metrics = trainer.train_step()
        assert metrics["truncated_frac"] == 1.0  # equal lengths: the premise of the equality
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).double())
    assert grads[0].abs().max() > 0
    # fp32 sums of the same terms in another grouping (the trainer test of plain accumulation uses the same bounds)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_token_sum_normalizer_is_the_minibatch_tokens(tmp_path):
    """dapo divides each micro-batch's token sum by the active tokens of its minibatch (the accumulation window),
    not of the whole batch: with two minibatches, each optimizer step's micro-batches carry the count of their own
    completion tokens (a spy on the instance's forward and optimizer step)."""
    trainer = _trainer(tmp_path, batch_size=16, num_minibatches=2, micro_batch_size=4, stop=["a", "e"],
                       max_completion_length=8)
    events, forward, step = [], trainer.dist.forward, trainer.optimizer.step

    def spy_forward(fn, model, input_ids, attention_mask, completion_mask, *args, **kwargs):
        if "config" in kwargs:  # the loss's forwards (not the old log-probs' pass)
            events.append((kwargs["config"].num_items_in_batch, int(completion_mask.sum())))
        return forward(fn, model, input_ids, attention_mask, completion_mask, *args, **kwargs)

    def spy_step(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    trainer.dist.forward, trainer.optimizer.step = spy_forward, spy_step
    trainer.train_step()
    windows, current = [], []
    for event in events:
        if event == "step":
            windows.append(current)
            current = []
        else:
            current.append(event)
    assert len(windows) == 2 and all(len(window) == 2 for window in windows)
    for window in windows:
        tokens = sum(count for _, count in window)
        assert [items for items, _ in window] == [tokens] * len(window), window
    assert windows[0] != windows[1]  # the two minibatches' counts differ here: the test tells them apart


def test_off_policy_mask_compares_with_the_engines_logprobs(tmp_path, monkeypatch):
    """off_policy_mask_threshold: the loss's sampler log-probs are the rollout engine's of the same rows (TRL's
    sampling_per_token_logps), not the old policy's, which see no training-inference mismatch."""
    trainer = _trainer(tmp_path, off_policy_mask_threshold=0.0, num_iterations=2)
    seen, calls, forward = _captured_rollout_only(monkeypatch), [], trainer.dist.forward

    def spy_forward(fn, model, input_ids, *args, **kwargs):
        if "config" in kwargs:  # the loss's forwards
            calls.append((input_ids, kwargs.get("sampling_logps")))
        return forward(fn, model, input_ids, *args, **kwargs)

    trainer.dist.forward = spy_forward
    trainer.train_step()
    batch = seen[0]
    assert len(calls) == 2  # one micro-batch per epoch
    for input_ids, sampling in calls:
        assert sampling is not None
        for ids, got in zip(input_ids, sampling):
            row = (batch["input_ids"] == ids).all(-1).nonzero()[0, 0]  # the batch row of these ids
            assert torch.equal(got, batch["rollout_logps"][row])


def _captured_rollout_only(monkeypatch) -> list[dict]:
    from fastgrpo.train import trainer as trainer_module

    seen, rollout = [], trainer_module.rollout_batch
    monkeypatch.setattr(trainer_module, "rollout_batch",
                        lambda *args, **kwargs: seen.append(rollout(*args, **kwargs)) or seen[-1])
    return seen
