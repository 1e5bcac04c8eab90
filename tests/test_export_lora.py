"""A LoRA run's export merges every adapter PEFT can hold on a causal LM, an embedding's and a head's too: a LoRA on
embed_tokens crashed the export ('Embedding' object has no attribute 'bias'), and its delta (PEFT keeps an
embedding's adapters in lora_embedding_A / _B, not lora_A) would have been left out of the merged weights.

Where the head is tied to the embedding, the trained model runs the tied weight plus each one's own delta, so the
export unties them: the embedding merged with its delta, the head with its own. PEFT's merge_and_unload adds either
delta into the one shared weight (both then carry it); the export of a LoRA on lm_head tied the head back to the
embedding and dropped the head's delta."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.train.final_export import export_model


HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["q_proj", "lm_head"], ["embed_tokens", "lm_head"]],
                         ids=["embedding", "head", "both"])
def test_an_exported_lora_on_the_embedding_or_head_is_merged_into_each_alone(tmp_path, tied, targets):
    """Each merged weight is merge_and_unload's (the same fp32 sum W + get_delta_weight: no rounding between them),
    but for a tied pair each of the two carries only its own delta, over the one weight both were trained from."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    if tied:
        shared = model.get_base_model().get_input_embeddings()
        shared = getattr(shared, "base_layer", shared).weight.detach()
        for name, target in ((HEAD, "lm_head"), (EMBEDDING, "embed_tokens")):
            want[name] = shared + _delta(model, target) if target in targets else shared
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, tmp_path / "final", torch.float32))
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())
    assert not exported.config.tie_word_embeddings  # each pair here has a delta on one side at least


def _delta(model, target: str) -> torch.Tensor:
    layer = next(m for n, m in model.named_modules() if n.endswith(target) and hasattr(m, "get_delta_weight"))
    return layer.get_delta_weight("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_export_keeps_the_base_models_dtype(tmp_path, dtype):
    """The merged weights are saved in the base's dtype, as merge_and_unload keeps it: an fp32 run (every CPU run)
    exported bf16, rounding each trained weight to 8 bits of mantissa."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=dtype),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, tmp_path / "final"), dtype="auto")
    got = exported.state_dict()
    assert {t.dtype for t in got.values()} == {dtype}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(got[name], want[name].to(dtype)), (got[name] - want[name]).abs().max().item()


def test_a_lora_export_keeps_the_base_models_generation_config(tmp_path):
    """The merged model is built from config.json, which gave it a generation_config of config.json's one EOS: the
    base's generation_config.json (a chat model's end-of-turn id in eos_token_id, its sampling defaults) was lost, so
    `fastgrpo train --model <lora sft>/final` generated past every end of turn."""
    from transformers import GenerationConfig

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    base = AutoModelForCausalLM.from_config(config)
    base.generation_config = GenerationConfig(eos_token_id=[7, 2], pad_token_id=0, do_sample=True, temperature=0.7)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    exported = GenerationConfig.from_pretrained(export_model(model, None, tmp_path / "final"))
    assert (exported.eos_token_id, exported.pad_token_id, exported.do_sample, exported.temperature) == ([7, 2], 0,
                                                                                                       True, 0.7)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("option", [{"use_dora": True}, {"lora_bias": True}], ids=["dora", "lora-bias"])
def test_a_lora_variant_or_bias_is_merged_as_peft_merges_it(tmp_path, option, arch):
    """DoRA rescales the columns of W + B A by its magnitude vector, and a LoRA bias adds lora_B's bias to the base's:
    neither is W + get_delta_weight, which the export wrote (DoRA: its logits 0.16 off the trained model's, silently).
    Merged by PEFT's own merge: merge_and_unload's weights, bitwise, on an fp32 model. Llama's q/v have no bias for
    a LoRA bias to merge into: refused in one line, no folder written."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    config = LlamaConfig(**sizes) if arch == "llama" else Qwen2Config(**sizes)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **option))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude" in name or "lora_B" in name:
                param.add_(0.3 * torch.randn_like(param))  # trained: away from their initial values
    if arch == "llama" and "lora_bias" in option:
        with pytest.raises(ValueError, match=r"^model: model\.layers\.0\.self_attn\.q_proj: .*bias.*; unsupported "
                                             r"adapter layout$"):
            export_model(model, None, tmp_path / "final", torch.float32)
        assert list(tmp_path.iterdir()) == []
        return
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, tmp_path / "final", torch.float32))
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())
    assert not any(getattr(m, "merged", False) for m in model.modules())  # the trained model stays unmerged
