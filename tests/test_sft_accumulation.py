"""`fastgrpo sft`'s loss as TRL's SFTTrainer users expect it: the per-token mean of -log p over the step's response
tokens (HF's labels loss of the whole batch), whatever the micro-batching and padding; the logged loss is that."""
from __future__ import annotations

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import collate

# rows of very different lengths, so micro-batches of 2 pad differently from one batch of 4
ROWS = [{"prompt": p, "response": r} for p, r in
        [("1 say a", "a"), ("22 say b", "bbbbbbbbbbbb"), ("333 say c", "ccc"), ("4 say d", "dddddddddddddddd")]]


def _trainer(tmp_path, micro_batch_size):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=3)
    config = SFTConfig(prompt_format="raw", max_seq_length=48, batch_size=4, micro_batch_size=micro_batch_size,
                       learning_rate=0.0, max_grad_norm=1e9, output_dir=str(tmp_path), max_steps=1)
    return SFTTrainer(model, tokenizer, ROWS, config)


def _hf_loss_and_grads(trainer):
    """HF's labels loss of the 4 rows in one padded batch (TRL's default: the mean over the batch's completion
    tokens) and its gradients."""
    model = trainer.model
    batch = collate(trainer.examples, trainer.tokenizer.pad_token_id, "cpu")
    labels = torch.where(batch["response_mask"].bool(), batch["input_ids"], -100)
    model.zero_grad()
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_a_step_is_the_whole_batch_mean_whatever_the_micro_batches(tmp_path, micro_batch_size):
    trainer = _trainer(tmp_path, micro_batch_size)
    expected_loss, expected_grads = _hf_loss_and_grads(trainer)
    metrics = trainer.train_step()  # learning_rate 0: the weights stay, the step's gradients stay in .grad
    assert metrics["micro_batches"] == 4 // micro_batch_size and metrics["rows"] == 4
    assert metrics["response_tokens"] == sum(len(e.response_ids) for e in trainer.examples)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
