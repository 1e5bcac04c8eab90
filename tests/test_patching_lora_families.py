"""patch_model on a PEFT LoRA model of every architecture in the table, with and without activation offload: the
log-probs and the adapters' gradients of the unpatched PEFT model. tests/test_patching.py checks LoRA on Qwen2 alone
and tests/test_patching_variants.py three variants (marked slow) and the llama-like families; Gemma 1/2/3 and
Phi-3 (a fused qkv_proj / gate_up_proj) under LoRA had no patch_model test, nor LoRA under offload with the last layer
kept (recompute_layers), where the two kinds of layer meet in one backward.

Tolerance: test_patching.assert_fp32_grads_close (a few fp32 eps of the model's largest gradient element).
"""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fastgrpo.patching import patch_model
from tests.test_patching import CONFIGS, assert_fp32_grads_close, batch, forward_logps_grads, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
OPTIONS = {"plain": {}, "offload, last layer kept": dict(offload_activations=True, recompute_layers=1)}


def lora_model(model_type: str):
    base = tiny_model(model_type)
    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[t for t in TARGETS if t in present]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: make the adapters do something
            torch.nn.init.normal_(p, 0.0, 0.1)
    return model


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_lora_model_matches_unpatched(model_type, options):
    model = lora_model(model_type)
    patched = patch_model(copy.deepcopy(model), **OPTIONS[options])
    counts = patched.get_base_model().fastgrpo_patch_summary["patched"]
    wrapped = sum(1 for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    assert counts["fused_lora"] == wrapped > 0 and counts["rope"] == model.config.num_hidden_layers
    ids, mask = batch(4)
    _, logps, grads = forward_logps_grads(model, ids, mask)
    _, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_p.keys() and grads and all("lora_" in name for name in grads)
    assert_fp32_grads_close(grads_p, grads)
