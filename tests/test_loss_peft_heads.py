"""grpo_loss / sequence_logprobs / sft_loss on PEFT models whose lm_head PEFT wraps: modules_to_save (a trained copy
of the head) and trainable_token_indices (a TrainableTokensWrapper, without .bias), against PEFT's own forward."""
import pytest
import torch

from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.loss.sft import sft_loss
from tests.test_patch_user import peft_model

IDS = torch.tensor([[5, 9, 13, 7, 22, 3, 11, 30], [0, 0, 4, 8, 15, 16, 23, 42]])
MASK = (IDS != 0).long()
COMPLETION = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]])


def hf_logps(model):
    """log p of each token under PEFT's own forward, 0 outside COMPLETION."""
    logits = model(input_ids=IDS, attention_mask=MASK).logits.double()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, IDS[:, 1:, None])[..., 0]
    return torch.cat((torch.zeros(2, 1, dtype=logps.dtype), logps), 1) * COMPLETION


def test_reference_logprobs_of_a_trained_head_copy_are_the_base_heads():
    """modules_to_save=["lm_head"]: with disable_adapter=True the reference must use the base head, not the trained
    copy (the fused head ran after the disable_adapter block had exited)."""
    model = peft_model("llama", modules_to_save=["lm_head"])
    got = sequence_logprobs(model, IDS, MASK, COMPLETION, disable_adapter=True)
    with torch.no_grad(), model.disable_adapter():
        want = hf_logps(model)
    with torch.no_grad():
        trained = hf_logps(model)
    assert (trained - want).abs().max() > 1e-3  # the copy was moved: the test can tell the heads apart
    # fp32 model, fused head against HF's logits: rounding of H = 32 sums and a 128-way softmax, ~1e-6
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type, tokens", [("gemma", [5, 9]), ("llama", {"lm_head": [5, 9]})])
def test_trainable_token_rows_of_the_head_are_read_by_every_loss(model_type, tokens):
    """trainable_token_indices wraps the lm_head in a TrainableTokensWrapper, which has no .bias: every loss raised
    AttributeError."""
    model = peft_model(model_type, trainable_token_indices=tokens)
    with torch.no_grad():
        want = hf_logps(model)
    torch.testing.assert_close(sequence_logprobs(model, IDS, MASK, COMPLETION).double(), want, rtol=0, atol=1e-5)
    loss, metrics = grpo_loss(model, IDS, MASK, COMPLETION, torch.tensor([1.0, -0.5]), return_logps=True)
    torch.testing.assert_close(metrics["logps"].double(), want, rtol=0, atol=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.any() for n, p in model.named_parameters() if "trainable_tokens" in n)
    nll, _ = sft_loss(model, IDS, MASK, COMPLETION)
    torch.testing.assert_close(nll.double(), -want.sum() / COMPLETION.sum(), rtol=0, atol=1e-5)
