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


def tiny_gemma3_with_vision():
    """Gemma3ForConditionalGeneration (what AutoModelForCausalLM loads from a Gemma-3 4B+ checkpoint): the text
    model of tests/test_patching.py's gemma3_text, a 1-layer SigLIP tower of 56 x 56 images in 14 x 14 patches, 4
    image tokens per image (id 127, between 125 and 126)."""
    import transformers

    from tests.test_patching import TINY

    text = transformers.Gemma3TextConfig(**TINY, sliding_window=4, query_pre_attn_scalar=8)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
                                       eoi_token_index=126)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def test_gemma3_with_vision_and_all_linear_lora_trains_on_images_as_unpatched():
    """PEFT's target_modules="all-linear" wraps the vision tower's linears too: patch_model fuses
    every LoRA layer it finds, those included, and a batch with images gives PEFT's loss and gradients (the vision
    adapters' as well). Keeping a text-only trainer's LoRA out of the vision tower is the LoRA config's business
    (PEFT's exclude_modules), not patch_model's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gemma3_with_vision(), LoraConfig(r=4, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, 0.0, 0.1)
    patched = patch_model(copy.deepcopy(model))
    vision_loras = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and "language_model" not in n]
    assert len(vision_loras) == 9  # the SigLIP layer's q, k, v, out_proj, fc1, fc2; its pooling head's 3
    summary = patched.get_base_model().fastgrpo_patch_summary
    assert summary["patched"]["fused_lora"] == 7 * 2 + len(vision_loras) and summary["skipped"] == {}
    ids = torch.tensor([[1, 5, 125, 127, 127, 127, 127, 126, 9, 10, 11]] * 2)
    inputs = dict(input_ids=ids, pixel_values=torch.randn(2, 3, 56, 56), token_type_ids=(ids == 127).long(),
                  labels=ids)
    loss, grads = labels_loss_and_grads(model, **inputs)
    loss_p, grads_p = labels_loss_and_grads(patched, **inputs)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_p.keys() and any("vision_tower" in name for name in grads)
    assert_fp32_grads_close(grads_p, grads)


def test_labels_loss_of_a_model_whose_lm_head_accelerate_offloads_is_the_librarys(tmp_path):
    """device_map offload (here the lm_head to disk) leaves lm_head.weight on the meta device until its accelerate hook
    loads it for the lm_head's own forward, which the fused loss never calls: the patched labels= loss read the meta
    tensor, silently giving ~1e35 for HF's 4.83 (the CPU interpreter reading memory that is not there)."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "disk"}

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, dtype=torch.float32,
                                                    offload_folder=tmp_path / "offload", attn_implementation="eager")

    model, patched = load().train(), patch_model(load()).train()  # training mode: the fused loss (eval: logits)
    assert patched.lm_head.weight.is_meta
    ids, mask = batch(1)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask, labels=ids).loss, want)
