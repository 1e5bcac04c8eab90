"""patch_model from a Python user's script, on PEFT set-ups beyond LoRA linears (fp32, CPU interpreter, real
transformers / PEFT classes)."""
import copy

import pytest
import torch

from fastgrpo.patching import patch_model
from tests.test_patching import assert_fp32_grads_close, batch, tiny_model
from tests.test_patch_usage import labels_loss_and_grads


def peft_model(model_type: str, **lora_options):
    """A PEFT model whose trainable parameters are all moved off their initial values (PEFT starts LoRA B and the
    trainable token rows where they change nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(4)
    model = get_peft_model(tiny_model(model_type), LoraConfig(r=4, target_modules=["q_proj"], **lora_options))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=0.3)
    return model


@pytest.mark.parametrize("model_type, tokens", [
    ("gemma", [5, 9]),  # tied embeddings: PEFT wraps the lm_head too, tied to the embedding's rows
    ("llama", {"lm_head": [5, 9]}),
])
def test_trainable_tokens_on_the_lm_head_train_through_the_fused_loss(model_type, tokens):
    """PEFT's trainable_token_indices wraps the lm_head in a TrainableTokensWrapper, whose .weight is the merged
    weight and which has no .bias: the patched labels= loss failed with "AttributeError: 'TrainableTokensWrapper'
    object has no attribute 'bias'"."""
    model = peft_model(model_type, trainable_token_indices=tokens)
    assert type(model.get_base_model().get_output_embeddings()).__name__ == "TrainableTokensWrapper"
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(1)
    loss, grads = labels_loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=ids)
    loss_p, grads_p = labels_loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_p.keys() and any("trainable_tokens_delta" in name for name in grads)
    assert_fp32_grads_close(grads_p, grads)
    with torch.no_grad(), model.disable_adapter(), patched.disable_adapter():
        base_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask, labels=ids).loss, base_loss)
    assert abs(float(base_loss - loss)) > 1e-3  # the trained token rows change the loss
