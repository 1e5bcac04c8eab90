"""Mutation audit of the export (final_export, export_command, the LoRA merge): each test here failed on a small
realistic bug that the rest of the suite let through; the merged weights are checked against PEFT's own
merge_and_unload, bit for bit (the same fp32 sums on both sides)."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from fastgrpo.train.final_export import export_model


def _llama(tied: bool = False):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied))


def _assert_exports_as_merge_and_unload(model, folder) -> None:
    want_model = copy.deepcopy(model).merge_and_unload()
    want = want_model.state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, folder, torch.float32))
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())
    ids = torch.tensor([[3, 7, 11, 5]])
    with torch.no_grad():  # the tying too: a head tied back to the embedding holds other weights than the trained one
        assert torch.equal(exported(ids).logits, want_model(ids).logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_trained_copy_of_modules_to_save_is_exported_as_merge_and_unload_keeps_it(tmp_path, tied):
    """modules_to_save=["lm_head"] trains a copy of the head (fastgrpo's loss reads it: test_model_loss); the export
    refused the run at its end ('merged weights lack lm_head.weight'), and with the head tied to the embedding it
    would re-tie the base's embedding over the trained copy."""
    model = get_peft_model(_llama(tied), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head", "norm"],
                                                    init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param))  # trained: unlike the original
    _assert_exports_as_merge_and_unload(model, tmp_path / "final")


def test_every_active_adapter_is_merged(tmp_path):
    """Two adapters active at once (set_adapter on the LoRA model): merge_and_unload merges both."""
    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    torch.manual_seed(1)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    assert model.get_base_model().model.layers[0].self_attn.q_proj.active_adapters == ["default", "second"]
    _assert_exports_as_merge_and_unload(model, tmp_path / "final")


def test_an_adapter_layout_the_merge_cannot_hold_is_refused_and_writes_nothing(tmp_path):
    """trainable_token_indices wraps the embedding in a TrainableTokensWrapper, whose weights the merge does not
    name as the model's: one line naming the weight it lacks, and no folder (nor a hidden partial one) left."""
    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5]))
    with pytest.raises(ValueError, match=r"^model: merged weights lack \['model.embed_tokens.weight'\]; unsupported "
                                         r"adapter layout$"):
        export_model(model, None, tmp_path / "final", torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_a_step_trained_again_is_exported_again(tmp_path):
    """final/ of step 2 is kept by a resume that trains nothing; a resume that trained step 2 again (its checkpoint-2
    was damaged or deleted: it went on from checkpoint-1) has other weights than final/'s, which it replaces."""
    from fastgrpo.train import default_task
    from fastgrpo.train.final_export import export_due

    tokenizer = default_task.build_tokenizer()
    export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final", step=2)
    assert export_due(tmp_path, 2, trained=False) is False
    assert export_due(tmp_path, 2, trained=True) is True
    assert export_due(tmp_path, 3, trained=False) is True
