"""Offload checkpointing's recompute in the backward, where the suite's other cases could not tell a mutant apart
(found by the offload mutation audit). CPU offloader, tiny real transformers models."""
import torch

from fastgrpo.offload import ActivationOffloader, enable_offload_checkpointing
from tests.test_offload import assert_grads_equal, batches, decoder, hf_checkpointing, tiny_model


def autocast_forward_then_backward(model, data):
    """HF's Trainer (accelerate) runs the forward under autocast and the backward after it, outside."""
    model.zero_grad(set_to_none=True)
    for ids, mask in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = decoder(model)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            loss = (hidden.float().square().mean(-1) * mask).sum() / len(data)
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_recompute_in_the_backward_runs_under_the_forwards_autocast():
    """The layer run again in the backward casts as its forward did (bf16 GEMMs) though the backward runs outside
    autocast: bitwise HF's non-reentrant checkpointing. The suite's autocast case called backward inside the
    autocast block, where a recompute that dropped the saved autocast state casts alike, and passed."""
    model = tiny_model("qwen2", layers=2)
    data = batches(n=2)
    hf_checkpointing(model, True)
    want = autocast_forward_then_backward(model, data)
    hf_checkpointing(model, False)
    enable_offload_checkpointing(decoder(model).layers, offloader=ActivationOffloader("cpu"))
    got = autocast_forward_then_backward(model, data)
    assert_grads_equal(got, want)
