"""patch_model's fused LoRA against PEFT's forward where the suite's other cases could not tell a mutant apart
(found by the patching mutation audit). fp32, real PEFT on a tiny transformers model."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fastgrpo.patching import patch_model
from tests.test_patching import assert_fp32_grads_close, batch, forward_logps_grads, tiny_model

ONLY_LORA = dict(rms_norm=False, rope=False, swiglu=False, fused_loss=False)


def two_adapter_model():
    """Two active adapters of different scalings (alpha / r: 8 / 4 = 2 and 12 / 2 = 6) on the same linears."""
    torch.manual_seed(3)
    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                           init_lora_weights=False))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=12, target_modules=["q_proj", "up_proj"],
                                           init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling == {"default": 2.0, "second": 6.0}
    return model


@pytest.mark.parametrize("lora_dtype", ["input", "adapter"])
def test_two_active_adapters_keep_their_own_scalings(lora_dtype, delta_calls):
    """Each adapter's delta is scaled by its own alpha / r: the suite's two-adapter case had equal scalings, so
    scaling every adapter by the first one's passed it."""
    model = two_adapter_model()
    patched = patch_model(copy.deepcopy(model), lora_dtype=lora_dtype, **ONLY_LORA)
    for p in list(model.parameters()) + list(patched.parameters()):
        p.requires_grad_(True)  # both adapters' weights train (set_adapter freezes the inactive ones only)
    ids, mask = batch(1)
    _, logps, grads = forward_logps_grads(model, ids, mask)
    delta_calls.clear()
    _, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    assert delta_calls, "the fused LoRA branch did not run"
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_p.keys()
    assert_fp32_grads_close(grads_p, grads)


def test_decode_weight_of_a_merged_lora_layer_adds_its_delta_once():
    """After PEFT's merge_adapter the base weight holds B A * scale already: the rollout's decode copy (dense_weight,
    and vLLM's merged LoRA sync through with_lora_deltas) is that weight, not that weight plus the delta again. A
    merge check dropped from with_lora_deltas passed the suite, which merged only through merge_and_unload."""
    from fastgrpo.hf.peft import dense_weight

    torch.manual_seed(4)
    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                           init_lora_weights=False))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        want = layer.base_layer.weight + layer.get_delta_weight("default")
        torch.testing.assert_close(dense_weight(layer)[0], want, rtol=1e-6, atol=1e-6)
        model.merge_adapter()
        assert layer.merged
        torch.testing.assert_close(dense_weight(layer)[0], want, rtol=1e-6, atol=1e-6)
