"""A LoRA run's export merges every adapter PEFT can hold on a causal LM, an embedding's too: a LoRA on
embed_tokens crashed the export ('Embedding' object has no attribute 'bias'), and its delta (PEFT keeps an
embedding's adapters in lora_embedding_A / _B, not lora_A) would have been left out of the merged weights."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from fastgrpo.train.checkpoint import export_model


@pytest.mark.parametrize("tied", [True, False])
def test_an_exported_lora_on_the_embedding_equals_peft_merge_and_unload(tmp_path, tied):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, tmp_path / "final", torch.float32))
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        # the same fp32 sum W + get_delta_weight in both: no rounding between them
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())
