"""The patched labels= loss against HF's where the suite's other cases could not tell a mutant apart (found by the
patching mutation audit). fp32, tiny real transformers models, training mode."""
import copy

import torch
from torch import nn

from fastgrpo.patching import patch_model
from tests.test_patching import batch, tiny_model


def test_labels_loss_adds_the_lm_heads_bias():
    """An lm_head with a bias (a user's head, or one a conversion left biased): HF's logits add it, and so does the
    fused loss; no model in the patch table has one, so a loss that dropped it passed every other test. The bias
    (std 1, against logits of std ~0.1) moves the loss by far more than fp32 rounding."""
    model = tiny_model("llama")
    torch.manual_seed(5)
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    nn.init.normal_(head.bias, 0.0, 1.0)
    model.lm_head = head
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(2)
    labels = ids.masked_fill(mask == 0, -100)
    out, out_p = (m(input_ids=ids, attention_mask=mask, labels=labels) for m in (model, patched))
    assert out_p.logits is None  # the fused loss ran
    torch.testing.assert_close(out_p.loss, out.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    out_p.loss.backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(patched.lm_head, name).grad, getattr(model.lm_head, name).grad,
                                   rtol=1e-4, atol=1e-6)
